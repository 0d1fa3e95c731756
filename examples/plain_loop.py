"""Distil a student from a kdcache cache in a plain PyTorch loop.

    python examples/plain_loop.py --cache CACHE --student STUDENT_DIR --out OUT [--steps 20]

STUDENT_DIR holds a config.json (a fresh student) or weights, and the teacher's tokenizer.
"""
import argparse

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import kdcache


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cache", required=True)
    p.add_argument("--student", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    args = p.parse_args()

    tok = AutoTokenizer.from_pretrained(args.student)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.student), dtype=torch.float32)
    vocab = model.get_input_embeddings().weight.shape[0]
    data = torch.utils.data.DataLoader(
        kdcache.CacheDataset(args.cache, shuffle=True, seed=0, epochs=None), batch_size=args.batch_size,
        collate_fn=lambda records: kdcache.collate(records, pad_id=tok.pad_token_id or 0, student_vocab=vocab))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    model.train()
    for step, batch in zip(range(1, args.steps + 1), data):
        hidden = model.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
        loss = kdcache.kd_loss_chunked(hidden, model.lm_head, batch, beta=0.5)   # never all [T, V] logits at once
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        print(f"step {step} loss {loss.item():.5f}", flush=True)
    model.save_pretrained(args.out)
    tok.save_pretrained(args.out)


if __name__ == "__main__":
    main()
