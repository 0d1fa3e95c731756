"""Storage benchmark: bytes per scored token and write/read throughput per backend and codec.

    .venv/bin/python bench/storage.py [--k 64] [--samples 200] [--vocab 151936]

Synthetic but teacher-like positions: top-k ids drawn from a Zipf law over a
Qwen-sized vocabulary (common tokens recur, as in real LM output), log-probs
of a peaked, heavy-tailed distribution (top-1 probability ~ Beta(2, 1.2)).
Raw size is int32 id + float16 logprob = 6 B per entry (384 B/token at k=64).
"""
import argparse
import os
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kdcache.cache_format import Record, open_cache, tail_mass_from_logprobs, write_cache  # noqa: E402


def teacher_like(rng, n_pos, k, vocab):
    ids = np.empty((n_pos, k), dtype=np.int32)
    for p in range(n_pos):                       # distinct ids per row, Zipf-distributed
        cand = np.unique(np.minimum(rng.zipf(1.2, size=4 * k), vocab) - 1)
        while len(cand) < k:
            cand = np.unique(np.concatenate([cand, rng.integers(0, vocab, k)]))
        ids[p] = rng.permutation(cand)[:k]
    top1 = rng.beta(2.0, 1.2, size=n_pos)
    decay = np.cumsum(rng.exponential(0.35, size=(n_pos, k - 1)), axis=1)
    rest = np.exp(-decay)
    rest = rest / rest.sum(1, keepdims=True) * (1 - top1)[:, None] * rng.uniform(0.6, 0.99, (n_pos, 1))
    probs = np.concatenate([top1[:, None], rest], axis=1)
    lp = np.sort(np.log(np.maximum(probs, 1e-30)), axis=1)[:, ::-1]
    return ids, lp


def build(n, k, vocab, seed=0):
    rng = np.random.default_rng(seed)
    recs = []
    for i in range(n):
        T = int(rng.integers(200, 600))
        P = int(T * rng.uniform(0.3, 0.8))
        ids = rng.integers(0, vocab, T).astype(np.int32)
        ids[-1] = 2
        pos = np.arange(T - 1 - P, T - 1, dtype=np.int32)
        tid, tlp = teacher_like(rng, P, k, vocab)
        recs.append(Record(i, ids, pos, tid, tlp, tail_mass_from_logprobs(tlp), False))
    return recs


def run(recs, backend, codec, dtype, k, vocab, shard_size):
    d = tempfile.mkdtemp(prefix="kdbench-")
    try:
        positions = sum(len(r.positions) for r in recs)
        t0 = time.perf_counter()
        m = write_cache(d, recs, shard_size=shard_size, backend=backend, codec=codec, top_k=k,
                        vocab_size=vocab, eos_token_ids=[2], logprob_dtype=dtype,
                        fingerprint_parts={"bench": 1})
        t_write = time.perf_counter() - t0
        cache = open_cache(d)
        t0 = time.perf_counter()
        n = sum(len(r.positions) for j in range(cache.num_shards) for r in cache.iter_shard(j))
        t_read = time.perf_counter() - t0
        assert n == positions
        order = np.random.default_rng(1).permutation(len(cache))[:200]
        cache = open_cache(d)
        t0 = time.perf_counter()
        for i in order:
            cache[int(i)]
        t_rand = time.perf_counter() - t0
        return dict(bpt=m["counts"]["bytes"] / positions, write=positions / t_write, read=positions / t_read,
                    rand=len(order) / t_rand)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=64)
    ap.add_argument("--samples", type=int, default=200)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--shard-size", type=int, default=100)
    args = ap.parse_args()
    recs = build(args.samples, args.k, args.vocab)
    positions = sum(len(r.positions) for r in recs)
    raw = args.k * 6
    print(f"{args.samples} samples, {positions:,} scored tokens, k={args.k}, vocab={args.vocab}; "
          f"raw int32+float16 = {raw} B/token")
    print(f"{'backend':<8}{'codec':<12}{'logprobs':<10}{'B/token':>9}{'vs raw':>8}"
          f"{'write tok/s':>13}{'read tok/s':>13}{'random rec/s':>14}")
    combos = [("arrow", "lz4", "float16"), ("arrow", "zstd", "float16"), ("arrow", "none", "float16"),
              ("zarr", "zstd", "float16"), ("zarr", "blosc-zstd", "float16"), ("zarr", "none", "float16"),
              ("arrow", "lz4", "float32"), ("zarr", "zstd", "float32"),
              ("arrow", "zstd", "sqrt8"), ("zarr", "blosc-zstd", "sqrt8")]
    for backend, codec, dtype in combos:
        r = run(recs, backend, codec, dtype, args.k, args.vocab, args.shard_size)
        print(f"{backend:<8}{codec:<12}{dtype:<10}{r['bpt']:>9.1f}{r['bpt'] / raw:>8.2f}"
              f"{r['write']:>13,.0f}{r['read']:>13,.0f}{r['rand']:>14,.0f}")


if __name__ == "__main__":
    main()
