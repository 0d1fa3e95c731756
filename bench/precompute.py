"""Precompute overhead: the whole pipeline against the raw teacher backend, in one run.

    .venv/bin/python bench/precompute.py [--records 6000] [--k 64] [--backend vllm] [--shard-size 500]

Same teacher (the demo's, built under runs/demo if missing), same token ids and positions, same k,
same per-shard batches. "raw" calls the backend's score() directly in this process; "pipeline" is
`kdcache precompute` (tokenizing, Ray, one worker, writing and committing shards), timed from the
first shard submitted to the last shard committed, so engine start-up is excluded from both.
Overhead = pipeline time / raw time - 1 (goal: under 10%).
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def ensure_teacher():
    teacher = os.path.join(ROOT, "runs", "demo", "teacher")
    if not os.path.isfile(os.path.join(teacher, "teacher_training.json")):
        subprocess.run([sys.executable, "-m", "kdcache", "demo", "--stage", "teacher"], cwd=ROOT, check=True)
    return teacher


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=6000)
    ap.add_argument("--k", type=int, default=64)
    from pipeline.teacher import TEACHERS
    ap.add_argument("--backend", default="vllm", choices=tuple(TEACHERS))
    ap.add_argument("--shard-size", type=int, default=500)
    args = ap.parse_args()
    teacher = ensure_teacher()
    work = tempfile.mkdtemp(prefix="kdbench-pre-")
    try:
        from kdcache.demo.task import make_splits, write_jsonl
        train, _ = make_splits(args.records, 0, seed=1)
        data = os.path.join(work, "data.jsonl")
        write_jsonl(train, data)

        # The exact work units the pipeline will run.
        from transformers import AutoTokenizer

        from pipeline.data import iter_records, parse_record
        from pipeline.encode import Encoder
        tok = AutoTokenizer.from_pretrained(teacher)
        enc = Encoder(tok, max_length=256)
        items = [enc.encode(parse_record(r.data)) for r in iter_records(data)]
        tokens = sum(len(e.input_ids) for e in items)
        shards = [items[i:i + args.shard_size] for i in range(0, len(items), args.shard_size)]

        from pipeline.teacher import make_teacher
        backend = make_teacher(args.backend, teacher, dtype="float32", max_length=256, max_top_k=args.k,
                               batch_tokens=8192)
        backend.score([shards[0][0].input_ids], [shards[0][0].positions], args.k)       # warm-up
        t0 = time.perf_counter()
        for sh in shards:
            backend.score([e.input_ids for e in sh], [e.positions for e in sh], args.k)
        raw = time.perf_counter() - t0
        del backend

        out = os.path.join(work, "cache")
        res = subprocess.run([sys.executable, "-m", "kdcache", "precompute", "--teacher", teacher, "--data", data,
                              "--out", out, "--backend", args.backend, "--top-k", str(args.k), "--shard-size",
                              str(args.shard_size), "--max-length", "256", "--worker-cpus", "0.5", "--no-progress"],
                             cwd=ROOT, capture_output=True, text=True)
        if res.returncode:
            sys.exit(res.stderr[-3000:])
        summary = json.load(open(os.path.join(out, "report", "summary.json")))
        pipe = summary["loop_s"]
        print(f"{args.records} records, {tokens:,} tokens, {len(shards)} shards, k={args.k}, backend {args.backend}")
        print(f"{'':<28}{'seconds':>9}{'tokens/s':>11}")
        print(f"{'raw backend score()':<28}{raw:>9.2f}{tokens / raw:>11,.0f}")
        print(f"{'pipeline (Ray, write, commit)':<28}{pipe:>9.2f}{tokens / pipe:>11,.0f}")
        print(f"overhead: {pipe / raw - 1:+.1%}   (pipeline wall time incl. startup: {summary['wall_s']} s; "
              f"{summary['bytes_per_position']} B/position)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
