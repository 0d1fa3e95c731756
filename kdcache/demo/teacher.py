"""Train the demo teacher on the task with plain supervised learning (CPU, minutes).

This is the demo's own setup step, not part of the product: the product never
trains a teacher. Loss on assistant tokens only, end-of-turn included, so the
teacher answers and then stops.
"""
import json
import math
import os
import random
import time

import numpy as np
import torch

from kdcache.pipeline.data import parse_row
from kdcache.pipeline.encode import Encoder

from .models import make_model, save


def encode_sft(encoder, record):
    """(ids, labels): labels are -100 except at the targets precompute trains (the answer through <|im_end|>)."""
    s = encoder.encode(parse_row(record))
    labels = np.full(len(s.input_ids), -100, dtype=np.int64)
    labels[s.positions + 1] = s.input_ids[s.positions + 1]
    return s.input_ids.tolist(), labels.tolist()


def train_teacher(tok, train_records, out_dir, *, size="teacher", steps=1200, batch=32, lr=2e-3, seed=0,
                  log=print):
    torch.manual_seed(seed)
    rng = random.Random(seed)
    model = make_model(tok, size, seed=seed)
    encoder = Encoder(tok, max_length=160)
    data = [encode_sft(encoder, r) for r in train_records]
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    warm = 50
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps)))))
    pad = tok.pad_token_id
    model.train()
    t0 = time.time()
    for step in range(1, steps + 1):
        rows = rng.sample(data, batch)
        T = max(len(r[0]) for r in rows)
        ids = torch.full((batch, T), pad)
        labels = torch.full((batch, T), -100)
        mask = torch.zeros((batch, T), dtype=torch.long)
        for i, (x, y) in enumerate(rows):
            ids[i, :len(x)], labels[i, :len(y)], mask[i, :len(x)] = torch.tensor(x), torch.tensor(y), 1
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 100 == 0 or step == 1:
            log(f"  teacher step {step}/{steps}  loss {loss.item():.4f}  ({time.time() - t0:.0f} s)")
    model.eval()
    save(model, tok, out_dir)
    with open(os.path.join(out_dir, "teacher_training.json"), "w") as f:
        json.dump({"steps": steps, "batch": batch, "lr": lr, "seed": seed, "final_loss": loss.item(),
                   "seconds": round(time.time() - t0, 1)}, f)
    return model
