"""What the recipes share: their command line, the student they start from, and a LoRA student's outputs."""
import argparse
import os

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer


def parse_args(doc):
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--cache", required=True, help="a kdcache cache (directory or URL)")
    p.add_argument("--student", required=True, help="a directory with a config.json and the teacher's tokenizer")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--no-shuffle", dest="shuffle", action="store_false")
    p.add_argument("--save-every", type=int, default=0, help="save a checkpoint every N steps (0: none)")
    p.add_argument("--resume", help="a checkpoint-N directory of an earlier run to continue from")
    p.add_argument("--lora-r", type=int, default=0, help="train LoRA adapters of this rank through PEFT on the "
                   "weights in --student (0: every weight of a fresh student)")
    return p.parse_args()


def fresh_student(path):
    """(model, tokenizer, vocabulary rows): the same initial student as `kdcache train --seed 0`."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.float32)
    return model, AutoTokenizer.from_pretrained(path), model.get_input_embeddings().weight.shape[0]


def student(args):
    """(model, tokenizer, vocabulary rows): a fresh student, or with --lora-r the trained model in --student (an
    adapter adapts weights; a random start has nothing to adapt)."""
    if not args.lora_r:
        return fresh_student(args.student)
    if not any(f.endswith(".safetensors") for f in os.listdir(args.student)):
        raise SystemExit(f"--lora-r: {args.student} has no weights (*.safetensors) to put adapters on")
    model = AutoModelForCausalLM.from_pretrained(args.student, dtype=torch.float32)
    return model, AutoTokenizer.from_pretrained(args.student), model.get_input_embeddings().weight.shape[0]


def lora_config(args):
    """PEFT's LoraConfig for --lora-r (None without it): every linear layer but the output head, alpha 2r."""
    if not args.lora_r:
        return None
    from peft import LoraConfig
    torch.manual_seed(0)                        # lora_A's random start, as kdcache train --seed 0
    return LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, target_modules="all-linear", task_type="CAUSAL_LM")


def save_merged(model, tok, out):
    """A PEFT student's adapters folded into its weights, at OUT/merged: what generate(), vLLM and `kdcache eval`
    load. (OUT itself holds the adapter, as the Trainer saves a PEFT model.)"""
    merged = model.merge_and_unload()
    merged.save_pretrained(os.path.join(out, "merged"))
    tok.save_pretrained(os.path.join(out, "merged"))


def to_inputs(batch):
    """What a Trainer sees: input_ids (Accelerate sizes and shards batches by their first tensor; tensors of
    another length, like the N trained positions, would be cut) and the whole kdcache.Batch as one object."""
    return {"input_ids": batch.input_ids, "batch": batch}
