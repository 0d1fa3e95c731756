"""What the recipes share: their command line and the student they start from."""
import argparse

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
    return p.parse_args()


def fresh_student(path):
    """(model, tokenizer, vocabulary rows): the same initial student as `kdcache train --seed 0`."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.float32)
    return model, AutoTokenizer.from_pretrained(path), model.get_input_embeddings().weight.shape[0]


def to_inputs(batch):
    """What a Trainer sees: input_ids (Accelerate sizes and shards batches by their first tensor; tensors of
    another length, like the N trained positions, would be cut) and the whole kdcache.Batch as one object."""
    return {"input_ids": batch.input_ids, "batch": batch}
