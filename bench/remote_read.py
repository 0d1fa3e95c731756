"""Training-read throughput from an S3-compatible server (moto, on 127.0.0.1) against local disk.

    .venv/bin/python bench/remote_read.py [--samples 1200] [--k 64] [--shard-size 100]

Reads one epoch of the same cache through the trainer's reader (train.data.CacheStream:
shuffled shard order, checksum, decode, prefetch) from a local directory and from s3://, cold
(every shard downloaded during the epoch), with and without read-ahead: once as fast as the
reader goes, once consumed at a trainer's pace (--pace tokens/s, default 200k, a fast GPU
student). Prints tokens/s and the ratio remote / local. moto is a Python server: real S3 has
more latency and more bandwidth.
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

from kdcache.cache_format import write_cache  # noqa: E402
from tests.helpers.s3server import S3Server, upload_dir  # noqa: E402


def read_epoch(where, readahead, pace=0, prefetch=2):
    """One epoch through the trainer's reader. pace > 0: consume like a trainer taking tokens at that rate."""
    from kdcache.train.data import CacheStream
    t0 = time.perf_counter()
    s = CacheStream(where, seed=0, epochs=1, readahead=readahead, prefetch=prefetch)
    tokens, first = 0, None
    for rec, _ in s.samples():
        if first is None:
            first = time.perf_counter() - t0
            t0 += first            # steady-state rate: time from the first sample on
        tokens += len(rec.input_ids)
        if pace:
            lag = t0 + tokens / pace - time.perf_counter()
            if lag > 0:
                time.sleep(lag)
    dt = time.perf_counter() - t0
    fetched = s.cache._fetcher.downloaded_bytes if s.cache._fetcher else 0
    s.close()
    return dt, tokens, first, fetched


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--samples", type=int, default=1200)
    p.add_argument("--k", type=int, default=64)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--shard-size", type=int, default=100)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--pace", type=int, default=200_000, help="tokens/s of the simulated trainer")
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

        paths = (("local disk", local, 4), ("s3, read-ahead 4 shards", url, 4), ("s3, no read-ahead", url, 0))
        print("| reader | consumer | first sample s | tokens/s after it | MB downloaded | vs local |")
        print("|---|---|---|---|---|---|")
        for pace in (0, args.pace):
            rows = []
            for name, where, ra in paths:
                runs = [read_epoch(where, ra, pace) for _ in range(args.repeats)]
                dt, tokens, first, fetched = min(runs)
                rows.append((name, dt, tokens, first, fetched))
            base = rows[0][1]
            who = "as fast as it reads" if not pace else f"trainer at {pace:,} tok/s"
            for name, dt, tokens, first, fetched in rows:
                print(f"| {name} | {who} | {first:.3f} | {tokens / dt:,.0f} | {fetched / 1e6:.1f} | {base / dt:.2f} |")
            print(f"ratio s3 (read-ahead) / local, {who}: {base / rows[1][1]:.2f}", file=sys.stderr)
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
