"""Storage fidelity: bytes per trained position against the KL divergence each storage mode costs.

    .venv/bin/python bench/fidelity.py [--chats 271] [--backends arrow,zarr]

The teacher is bench/realistic.py's (a small LM trained here on the Python standard library, scored on
held-out chats cut from it), not the demo teacher, which is almost deterministic on its task. For every
trained position of every chat the teacher's full distribution is computed once (transformers, float32);
each storage mode then writes the same records with the real writer and reads them back with the real
reader. Per mode:
  B/pos        every byte of the shards (ids, log-probs, tail mass, target log-probs, input ids, offsets,
               metadata) over trained positions
  KL top-k     KL(exact top-k || stored), both renormalised over the exact top-k ids (an id dropped by
               top-p gets an equal share of the stored tail mass): mean and max over positions
  KL full      KL(full teacher distribution || what the loss sees): the stored entries, the target token's
               own log-prob where it is not among them, and the rest of the mass spread evenly
  entries      mean entries stored per position
  write, read  positions per second through write_cache and a streamed read of every record (shard files on
               disk, best of 5 reads; run it under `taskset -c 0` for per-core figures)
The exact mode is float32 at the same k; float16 is kdcache's default.
"""
import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from kdcache.cache_format import Record, open_cache, write_cache  # noqa: E402
from kdcache.cache_format.compact import kl_to_exact  # noqa: E402
from kdcache.cache_format.manifest import cache_stats  # noqa: E402

READS = 5
MODES = [("float32", None), ("float16", None), ("sqrt8", None), ("float16", 0.9999), ("sqrt8", 0.9999),
         ("sqrt8", 0.999), ("sqrt8", 0.99)]


def teacher_scores(teacher_dir, chats_path, limit, temperature=1.0):
    """Per chat: (input_ids, positions, full log-softmax float32 [P, V]) at the positions kdcache trains;
    logits divided by temperature first (T < 1: a more confident teacher)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kdcache.pipeline.data import parse_row
    from kdcache.pipeline.encode import Encoder, end_of_turn_ids
    tok = AutoTokenizer.from_pretrained(teacher_dir)
    model = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()
    enc = Encoder(tok, template="chat", max_length=1024, turn_ends=end_of_turn_ids(tok))
    rows = [json.loads(line) for line in open(chats_path)][:limit]
    out = []
    with torch.no_grad():
        for i, row in enumerate(rows):
            s = enc.encode(parse_row(row), i)
            logits = model(input_ids=torch.from_numpy(s.input_ids.astype(np.int64))[None]).logits[0]
            lp = torch.log_softmax(logits[torch.from_numpy(s.positions.astype(np.int64))].float() / temperature, -1)
            out.append((s.input_ids, s.positions, lp.numpy()))
    return out, len(tok)


def exact_records(scored, k):
    recs = []
    for i, (ids, pos, lp) in enumerate(scored):
        top = np.argsort(-lp, axis=1, kind="stable")[:, :k]
        targets = ids[pos + 1]
        recs.append(Record(i, ids, pos, top.astype(np.int32), np.take_along_axis(lp, top, 1),
                           target_logprobs=lp[np.arange(len(pos)), targets]))
    return recs


def kl_topk(exact, got, vocab):
    """KL(exact top-k || stored) per position, from the records a reader returned (entries in any order)."""
    out = []
    for e, g in zip(exact, got):
        stored = np.full(e.topk_ids.shape, -np.inf, np.float32)
        for p in range(len(e.positions)):                    # map each exact id to what was stored for it
            have = dict(zip(g.topk_ids[p].tolist(), g.topk_logprobs[p].tolist()))
            stored[p] = [have.get(t, -np.inf) for t in e.topk_ids[p].tolist()]
        out.append(kl_to_exact(e.topk_logprobs, stored, g.tail_mass, vocab))
    return np.concatenate(out)


def kl_full(scored, got, vocab):
    """KL(full teacher || what the loss sees) per position."""
    out = []
    for (ids, pos, lp), g in zip(scored, got):
        P = len(pos)
        q = np.zeros((P, vocab))
        known = np.zeros((P, vocab), bool)
        rows, cols = np.nonzero(g.topk_ids >= 0)
        q[rows, g.topk_ids[rows, cols]] = np.exp(g.topk_logprobs[rows, cols].astype(np.float64))
        known[rows, g.topk_ids[rows, cols]] = True
        rest = g.tail_mass.astype(np.float64).copy()
        if g.target_logprobs is not None:                    # the target's own log-prob, as collate adds it
            t = ids[pos + 1]
            add = ~known[np.arange(P), t]
            q[np.arange(P)[add], t[add]] = np.exp(g.target_logprobs[add].astype(np.float64))
            rest[add] -= q[np.arange(P)[add], t[add]]
            known[np.arange(P)[add], t[add]] = True
        share = np.maximum(rest, 1e-30) / np.maximum(vocab - known.sum(1), 1)
        q = np.where(known, q, share[:, None])
        q /= q.sum(1, keepdims=True)
        p = np.exp(lp.astype(np.float64))
        out.append((p * (lp - np.log(np.maximum(q, 1e-300)))).sum(1))
    return np.concatenate(out)


def run_mode(scored, exact, vocab, k, dtype, top_p, backend):
    d = tempfile.mkdtemp(prefix="kdfid-")
    try:
        positions = sum(len(r.positions) for r in exact)
        t0 = time.perf_counter()
        m = write_cache(d, exact, shard_size=100, backend=backend, top_k=k, vocab_size=vocab,
                        eos_token_ids=[vocab - 1], logprob_dtype=dtype, top_p=top_p, fingerprint_parts={"bench": 1})
        t_write = time.perf_counter() - t0
        t_read = float("inf")
        for _ in range(READS):                                      # best of a few: one read takes ~50 ms
            t0 = time.perf_counter()
            streamed = sum(len(r.positions) for r in open_cache(d))  # as a trainer reads: record by record
            t_read = min(t_read, time.perf_counter() - t0)
            assert streamed == positions
        got = list(open_cache(d))
        kt = kl_topk(exact, got, vocab)
        kf = kl_full(scored, got, vocab)
        entries = np.mean(np.concatenate([r.topk_counts for r in got]))
        return dict(bpp=m["counts"]["bytes"] / positions, kl_mean=kt.mean(), kl_max=kt.max(), full=kf.mean(),
                    entries=entries, write=positions / t_write, read=positions / t_read,
                    recorded=cache_stats(m)["kl_mean"])
    finally:
        shutil.rmtree(d, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default=os.path.join(ROOT, "bench", "work", "realistic"))
    ap.add_argument("--chats", type=int, default=1000, help="at most this many chats")
    ap.add_argument("--ks", default="64,128")
    ap.add_argument("--backends", default="arrow,zarr")
    ap.add_argument("--temperature", type=float, default=1.0,
                    help="divide the teacher's logits by T (T < 1 emulates a more confident teacher)")
    args = ap.parse_args()
    import realistic
    built = realistic.build(args.workdir)
    scored, vocab = teacher_scores(built["teacher"], built["chats"], args.chats, args.temperature)
    positions = sum(len(s[1]) for s in scored)
    rep = built["report"]
    print(f"teacher: {rep['parameters'] / 1e6:.1f}M parameters, vocab {vocab}, held-out perplexity "
          f"{rep['perplexity']:.1f}, entropy {rep['entropy_nats']:.2f} nats; {len(scored)} chats, "
          f"{positions:,} trained positions")
    if args.temperature != 1.0:
        ent = np.mean(np.concatenate([-(np.exp(lp) * lp).sum(1) for _, _, lp in scored]))
        print(f"logits / {args.temperature}: mean entropy {ent:.2f} nats on the trained positions")
    print(f"{'k':>4} {'backend':<7} {'log-probs':<9} {'top-p':<7}{'B/pos':>7}{'entries':>8}{'KL top-k':>10}"
          f"{'max':>9}{'KL full':>9}{'write pos/s':>12}{'read pos/s':>12}")
    for k in map(int, args.ks.split(",")):
        exact = exact_records(scored, k)
        for backend in args.backends.split(","):
            for dtype, top_p in MODES:
                r = run_mode(scored, exact, vocab, k, dtype, top_p, backend)
                assert abs(r["recorded"] - r["kl_mean"]) <= 1e-6 + 1e-3 * r["kl_mean"], r   # the writer's own figure
                print(f"{k:>4} {backend:<7} {dtype:<9} {str(top_p or '-'):<7}{r['bpp']:>7.1f}{r['entries']:>8.1f}"
                      f"{r['kl_mean']:>10.2e}{r['kl_max']:>9.1e}{r['full']:>9.4f}{r['write']:>12,.0f}"
                      f"{r['read']:>12,.0f}", flush=True)


if __name__ == "__main__":
    main()
