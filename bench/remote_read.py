"""Training-read throughput from an S3-compatible server (moto, on 127.0.0.1) against local disk.

    .venv/bin/python bench/remote_read.py [--samples 1200] [--k 64] [--shard-size 100]

Reads one epoch of the same cache through the trainer's reader (train.data.CacheStream:
shuffled shard order, checksum, decode, prefetch) from a local directory and from s3://, cold
(every shard downloaded during the epoch), with and without read-ahead. Prints tokens/s and the
ratio remote / local. moto is a Python server: real S3 has more latency and more bandwidth.
"""
import argparse
import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from storage import build  # noqa: E402

from cache_format import write_cache  # noqa: E402
from tests.helpers.s3server import S3Server, upload_dir  # noqa: E402


def read_epoch(where, readahead, prefetch=2):
    from train.data import CacheStream
    s = CacheStream(where, seed=0, epochs=1, readahead=readahead, prefetch=prefetch)
    t0 = time.perf_counter()
    tokens = samples = 0
    for rec, _ in s.samples():
        tokens += len(rec.input_ids)
        samples += 1
    dt = time.perf_counter() - t0
    fetched = s.cache._fetcher.downloaded_bytes if s.cache._fetcher else 0
    s.close()
    return dt, tokens, samples, fetched


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--samples", type=int, default=1200)
    p.add_argument("--k", type=int, default=64)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--shard-size", type=int, default=100)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()

    tmp = tempfile.mkdtemp(prefix="kdcache-bench-remote-")
    server = S3Server().start()
    os.environ.update(server.env())
    try:
        t0 = time.perf_counter()
        recs = build(args.samples, args.k, args.vocab)
        local = os.path.join(tmp, "cache")
        m = write_cache(local, recs, shard_size=args.shard_size, backend="arrow", top_k=args.k,
                        vocab_size=args.vocab, eos_token_ids=[2], fingerprint_parts={"bench": "remote"})
        url = upload_dir(local, server.make_bucket("bench") + "/cache")
        mb = m["counts"]["bytes"] / 1e6
        print(f"cache: {m['counts']['samples']} samples, {m['counts']['tokens']:,} tokens, {len(m['shards'])} arrow "
              f"shards, {mb:.1f} MB (built in {time.perf_counter() - t0:.0f} s)\n")

        rows = []
        for name, where, ra in (("local disk", local, 4), ("s3 (moto), read-ahead 4", url, 4),
                                ("s3 (moto), no read-ahead", url, 0)):
            best = None
            for _ in range(args.repeats):
                dt, tokens, samples, fetched = read_epoch(where, ra)
                best = dt if best is None else min(best, dt)
            rows.append((name, best, tokens, fetched))
        base = rows[0][1]
        print("| read path | s/epoch | tokens/s | MB downloaded | vs local |")
        print("|---|---|---|---|---|")
        for name, dt, tokens, fetched in rows:
            print(f"| {name} | {dt:.2f} | {tokens / dt:,.0f} | {fetched / 1e6:.1f} | {base / dt:.2f} |")
        print(f"\nratio s3 (read-ahead) / local throughput: {base / rows[1][1]:.2f}")
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
