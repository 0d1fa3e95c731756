"""What the read path's value checks cost: records/s with them on and off (cache_format/values.py, issue 42).

    .venv/bin/python bench/read_checks.py [--samples 2000] [--k 64] [--vocab 151936] [--repeats 5]

Builds caches with the project's writer (teacher-like rows: a peaked top-k of distinct ids over a Qwen-sized
vocabulary, target log-probs consistent with them, the target ranked first at about half the positions), then
reads every shard the way `kdcache train`'s loader does (list(cache.iter_shard(j)) per shard, in order) with
open_cache(check_values=True) and False, alternating, best of --repeats each. Prints records/s, positions/s and
the ratio for each storage configuration.
"""
import argparse
import os
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kdcache.cache_format import Record, Storage, open_cache, write_cache  # noqa: E402

CONFIGS = {                     # name -> Storage keywords (top_k filled in from --k)
    "arrow/float16": dict(format="arrow", logprob_dtype="float16"),
    "arrow/sqrt8": dict(format="arrow", logprob_dtype="sqrt8"),
    "zarr/float16": dict(format="zarr", logprob_dtype="float16"),
    "arrow/float16/top_p": dict(format="arrow", logprob_dtype="float16", top_p=0.95),
}


def teacher_rows(rng, P, k, vocab):
    """(ids int32 [P, k] distinct per row, log-probs float32 [P, k] descending, tail float64 [P])."""
    steps = rng.geometric(0.02, size=(P, k))                      # small ids common, as in LM output
    ids = rng.permuted(np.minimum(np.cumsum(steps, axis=1), vocab - 1), axis=1)
    dup = np.sort(ids, axis=1)
    if (dup[:, 1:] == dup[:, :-1]).any():                          # clipped at the vocabulary's end: spread them
        ids = rng.permuted(np.cumsum(np.ones((P, k), np.int64), axis=1) + rng.integers(0, vocab - k, (P, 1)), axis=1)
    top1 = rng.beta(2.0, 1.2, size=P)
    rest = np.exp(-np.cumsum(rng.exponential(0.35, size=(P, k - 1)), axis=1))
    rest = rest / rest.sum(1, keepdims=True) * (1 - top1)[:, None] * rng.uniform(0.6, 0.99, (P, 1))
    probs = np.concatenate([top1[:, None], rest], axis=1)
    probs = -np.sort(-probs, axis=1)
    return ids.astype(np.int32), np.log(probs).astype(np.float32), 1 - probs.sum(1)


def build(n, k, vocab, seed=0):
    rng = np.random.default_rng(seed)
    recs = []
    for i in range(n):
        T = int(rng.integers(64, 384))
        P = int(T * rng.uniform(0.3, 0.8))
        pos = np.arange(T - 1 - P, T - 1, dtype=np.int32)
        tid, tlp, tail = teacher_rows(rng, P, k, vocab)
        ids = rng.integers(k * 60, vocab, T).astype(np.int32)      # mostly outside any row's top-k
        first = rng.random(P) < 0.5                                 # the target ranked first at half the positions
        ids[pos[first] + 1] = tid[first, 0]
        ids[-1] = 2
        inside = (tid == ids[pos + 1][:, None]).any(axis=1)
        cap = np.minimum(np.exp(tlp[:, -1].astype(np.float64)), tail)
        target = np.where(inside, tlp[np.arange(P), np.argmax(tid == ids[pos + 1][:, None], axis=1)],
                          np.log(cap * rng.uniform(0.01, 1.0, P)))
        recs.append(Record(i, ids, pos, tid, tlp, None, False, target.astype(np.float32)))
    return recs


def read_all(d, check):
    """(seconds, records, positions) of one sequential pass over every shard."""
    cache = open_cache(d, check_values=check)
    t0 = time.perf_counter()
    n = positions = 0
    for j in range(cache.num_shards):
        recs = list(cache.iter_shard(j))
        n += len(recs)
        positions += sum(len(r.positions) for r in recs)
    dt = time.perf_counter() - t0
    cache.close()
    return dt, n, positions


def measure(recs, name, k, vocab, shard_size, repeats):
    d = tempfile.mkdtemp(prefix="kdbench-checks-")
    try:
        t0 = time.perf_counter()
        write_cache(d, recs, shard_size=shard_size, storage=Storage(top_k=k, **CONFIGS[name]), vocab_size=vocab,
                    eos_token_ids=[2], fingerprint_parts={"bench": "read_checks"})
        t_write = time.perf_counter() - t0
        read_all(d, True)                                           # warm the page cache and imports
        best = {True: float("inf"), False: float("inf")}
        for _ in range(repeats):
            for check in (False, True):
                dt, n, positions = read_all(d, check)
                best[check] = min(best[check], dt)
        return dict(name=name, n=n, positions=positions, write_s=t_write,
                    on=n / best[True], off=n / best[False], pos_on=positions / best[True],
                    pos_off=positions / best[False])
    finally:
        shutil.rmtree(d, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--k", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--shard-size", type=int, default=500)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    args = ap.parse_args()
    t0 = time.perf_counter()
    recs = build(args.samples, args.k, args.vocab)
    P = sum(len(r.positions) for r in recs)
    print(f"{args.samples} samples, {P} positions, k={args.k}, vocab {args.vocab} (built in "
          f"{time.perf_counter() - t0:.1f} s); best of {args.repeats} sequential reads each way, "
          f"{os.cpu_count()} CPUs\n")
    print("| storage | records/s, checks off | records/s, checks on | positions/s, on | on / off |")
    print("|---|---|---|---|---|")
    for name in args.configs.split(","):
        r = measure(recs, name, args.k, args.vocab, args.shard_size, args.repeats)
        print(f"| {name} | {r['off']:,.0f} | {r['on']:,.0f} | {r['pos_on']:,.0f} | {r['on'] / r['off']:.2f} |",
              flush=True)


if __name__ == "__main__":
    main()
