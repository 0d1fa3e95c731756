"""Distil a student from a kdcache cache in a plain PyTorch loop.

    python examples/plain_loop.py --cache CACHE --student STUDENT_DIR --out OUT [--steps 20] [--lora-r R]

With --lora-r R the trained model in STUDENT_DIR gets LoRA adapters (PEFT): only they train, OUT is the adapter and
OUT/merged the merged model.
"""
import torch
from common import lora_config, parse_args, save_merged, student

import kdcache


def main():
    args = parse_args(__doc__)
    model, tok, vocab = student(args)
    if args.lora_r:
        from peft import get_peft_model
        model = get_peft_model(model, lora_config(args))
    inner = model.get_base_model() if args.lora_r else model     # the causal LM, adapters in place
    data = torch.utils.data.DataLoader(
        kdcache.CacheDataset(args.cache, shuffle=args.shuffle, seed=0, epochs=None), batch_size=args.batch_size,
        collate_fn=lambda records: kdcache.collate(records, pad_id=tok.pad_token_id or 0, student_vocab=vocab))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)

    model.train()
    for step, batch in zip(range(1, args.steps + 1), data):
        hidden = inner.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
        loss = kdcache.kd_loss_chunked(hidden, inner.lm_head, batch, beta=0.5)   # never all [T, V] logits at once
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        print(f"step {step} loss {loss.item():.5f}", flush=True)
    model.save_pretrained(args.out)
    tok.save_pretrained(args.out)
    if args.lora_r:
        save_merged(model, tok, args.out)


if __name__ == "__main__":
    main()
