"""Precompute overhead: the whole pipeline against the raw teacher backend, steady state and whole process.

    .venv/bin/python bench/precompute.py [--samples 2000] [--k 64] [--backend vllm] [--shard-size 500]
                                         [--repeat 1] [--warmup] [--no-steady] [--teacher DIR] [--long]
                                         [--batch-tokens B]

--long: token-id records of 150-310 random ids each (about 230 tokens a sample, the shape of the outside
review's 2,000-chat, 461,676-token check) instead of the demo's short chats; --max-length 512 then.
--batch-tokens: 0 (the default) leaves each side at its own default, as a user would run it: kdcache's
--batch-tokens default, and vLLM's own engine step in the minimal script; B > 0 gives both sides B.

Same teacher (the demo's, built under runs/demo if missing), same token ids and positions, same k.

- Steady state: "raw" calls the backend's score() directly in this process on the same per-shard batches;
  "pipeline" is `kdcache precompute` (tokenizing, Ray, one worker, writing and committing shards), timed from
  the first shard submitted to the last shard committed, so engine start-up is excluded from both.
  Overhead = pipeline time / raw time - 1 (goal: under 10%).
- Whole process, start-up included (vLLM only): the wall time of `kdcache precompute --backend vllm` end to end
  (a subprocess, fresh output directory) against a minimal script (also a subprocess, timed end to end, Python
  and vLLM imports included) that loads the same vLLM engine (dtype float32, max_model_len, max_logprobs, batch
  tokens) and scores the same token ids with prompt_logprobs in one call, writing nothing.
  Ratio = minimal / kdcache (goal: >= 0.95). --repeat N alternates the two N times and reports medians.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MAX_LENGTH = 256          # 512 with --long

# The minimal script: what a user would write to get the same numbers out of vLLM, nothing else. Its engine
# settings are pipeline.teacher_vllm.VLLMTeacher's for this bench's job.
MINIMAL = r'''
import json, os, sys, time
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
from vllm import LLM, SamplingParams, TokensPrompt


def main():
    teacher, ids_path, k, max_len, batch_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), \
        int(sys.argv[5])
    seqs = json.load(open(ids_path))
    step = {} if batch_tokens == 0 else {"max_num_batched_tokens": max(batch_tokens, max_len)}
    llm = LLM(model=teacher, tokenizer=teacher, dtype="float32", max_model_len=max_len, max_logprobs=k + 1, seed=0,
              gpu_memory_utilization=0.85, skip_tokenizer_init=False, enable_prefix_caching=False, **step)
    sc = llm.llm_engine.vllm_config.scheduler_config
    t0 = time.perf_counter()
    sp = SamplingParams(max_tokens=1, prompt_logprobs=k, detokenize=False, flat_logprobs=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=s) for s in seqs], sp, use_tqdm=False)
    n = sum(len(o.prompt_logprobs.start_indices) for o in outs)
    print(json.dumps({"sequences": len(outs), "positions": n, "score_s": time.perf_counter() - t0,
                      "step": int(sc.max_num_batched_tokens)}), flush=True)


if __name__ == "__main__":     # vLLM starts its engine process with spawn
    main()
'''


def ensure_teacher():
    teacher = os.path.join(ROOT, "runs", "demo", "teacher")
    if not os.path.isfile(os.path.join(teacher, "teacher_training.json")):
        subprocess.run([sys.executable, "-m", "kdcache", "demo", "--stage", "teacher"], cwd=ROOT, check=True)
    return teacher


def run_kdcache(args, teacher, data, out):
    """`kdcache precompute` in a subprocess into a fresh directory: (wall seconds, summary.json)."""
    shutil.rmtree(out, ignore_errors=True)
    env = dict(os.environ, RAY_ADDRESS="")
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "kdcache", "precompute", "--teacher", teacher, "--data", data,
                          "--out", out, "--backend", args.backend, "--top-k", str(args.k), "--shard-size",
                          str(args.shard_size), "--max-length", str(args.max_length), "--worker-cpus", "0.5",
                          "--no-progress", *(["--batch-tokens", str(args.batch_tokens)] if args.batch_tokens else [])],
                         cwd=ROOT, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if res.returncode:
        sys.exit(res.stderr[-3000:])
    return wall, json.load(open(os.path.join(out, "report", "summary.json")))


def run_minimal(args, teacher, ids_path, work):
    """The minimal vLLM script in a subprocess: (wall seconds, what it printed)."""
    script = os.path.join(work, "minimal.py")
    with open(script, "w") as f:
        f.write(MINIMAL)
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, script, teacher, ids_path, str(args.k), str(args.max_length),
                          str(args.batch_tokens)], cwd=work, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    lines = res.stdout.strip().splitlines()
    if not lines or not lines[-1].startswith("{"):
        sys.exit(res.stderr[-3000:])
    if res.returncode:       # vllm-cpu 0.32 can abort in interpreter teardown ("terminate called ..."), work done
        print(f"  (the minimal script exited {res.returncode} after printing its result: vLLM's teardown)")
    return wall, json.loads(lines[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", "--records", dest="records", type=int, default=2000,
                    help="chats in the dataset (2,000 is the reference size of the whole-process figure)")
    ap.add_argument("--k", type=int, default=64)
    from kdcache.pipeline.teacher import TEACHERS
    ap.add_argument("--backend", default="vllm", choices=tuple(TEACHERS))
    ap.add_argument("--shard-size", type=int, default=500)
    ap.add_argument("--repeat", type=int, default=1, help="whole-process runs of each side (medians reported)")
    ap.add_argument("--warmup", action="store_true", help="one untimed run of the minimal script first (file cache)")
    ap.add_argument("--no-steady", action="store_true", help="skip the in-process steady-state comparison")
    ap.add_argument("--teacher", default=None, help="teacher directory (default: the demo's, trained if missing)")
    ap.add_argument("--long", action="store_true", help="token-id records of 150-310 random ids (see above)")
    ap.add_argument("--batch-tokens", type=int, default=0, help="0: each side's own default (see above)")
    args = ap.parse_args()
    args.max_length = 512 if args.long else MAX_LENGTH
    teacher = args.teacher or ensure_teacher()
    work = tempfile.mkdtemp(prefix="kdbench-pre-")
    try:
        from kdcache.demo.task import make_splits, write_jsonl
        if args.long:
            import numpy as np
            rng = np.random.default_rng(1)
            vocab = json.load(open(os.path.join(teacher, "config.json")))["vocab_size"]
            train = [{"input_ids": rng.integers(1, min(vocab, 4000), int(rng.integers(150, 311))).tolist()}
                     for _ in range(args.records)]
        else:
            train, _ = make_splits(args.records, 0, seed=1)
        data = os.path.join(work, "data.jsonl")
        write_jsonl(train, data)

        # The exact work units the pipeline will run.
        from transformers import AutoTokenizer

        from kdcache.pipeline.data import iter_rows, parse_row
        from kdcache.pipeline.encode import Encoder
        tok = AutoTokenizer.from_pretrained(teacher)
        enc = Encoder(tok, max_length=args.max_length)
        items = [enc.encode(parse_row(r.data)) for r in iter_rows(data)]
        tokens = sum(len(e.input_ids) for e in items)
        shards = [items[i:i + args.shard_size] for i in range(0, len(items), args.shard_size)]
        ids_path = os.path.join(work, "ids.json")
        with open(ids_path, "w") as f:
            json.dump([e.input_ids.tolist() for e in items], f)
        out = os.path.join(work, "cache")
        print(f"{args.records} records, {tokens:,} tokens, {len(shards)} shards, k={args.k}, backend {args.backend}, "
              f"{os.cpu_count()} CPUs (load average {os.getloadavg()[0]:.1f} at the start)", flush=True)

        # Whole process: alternate the two sides so drifting load on the machine hits both alike.
        walls, minimal, summary = [], [], None
        if args.warmup and args.backend == "vllm":
            run_minimal(args, teacher, ids_path, work)
        for i in range(args.repeat if args.backend == "vllm" else 0):
            m_wall, m_out = run_minimal(args, teacher, ids_path, work)
            assert m_out["sequences"] == len(items), m_out
            k_wall, summary = run_kdcache(args, teacher, data, out)
            minimal.append(m_wall)
            walls.append(k_wall)
            step = (summary.get("teacher_engine") or {}).get("max_num_batched_tokens", "?")
            print(f"  run {i + 1}: minimal vLLM script {m_wall:.1f} s (of which scoring {m_out['score_s']:.1f} s, "
                  f"{m_out['step']} tokens per step), kdcache precompute {k_wall:.1f} s (first shard submitted at "
                  f"{summary.get('startup', {}).get('first_submit_s', '?')} s, {step} tokens per step)", flush=True)
        if summary is None:
            k_wall, summary = run_kdcache(args, teacher, data, out)
            walls.append(k_wall)

        if not args.no_steady:
            from kdcache.pipeline.teacher import make_teacher
            backend = make_teacher(args.backend, teacher, dtype="float32", max_length=args.max_length,
                                   max_top_k=args.k, batch_tokens=args.batch_tokens)
            backend.score([shards[0][0].input_ids], [shards[0][0].positions], args.k)       # warm-up
            t0 = time.perf_counter()
            for sh in shards:
                backend.score([e.input_ids for e in sh], [e.positions for e in sh], args.k)
            raw = time.perf_counter() - t0
            del backend
            pipe = summary["loop_s"]
            print(f"{'steady state':<34}{'seconds':>9}{'tokens/s':>11}")
            print(f"{'raw backend score()':<34}{raw:>9.2f}{tokens / raw:>11,.0f}")
            print(f"{'pipeline (Ray, write, commit)':<34}{pipe:>9.2f}{tokens / pipe:>11,.0f}")
            print(f"overhead: {pipe / raw - 1:+.1%}   ({summary['bytes_per_position']} B/position)")
        if minimal:
            m, w = statistics.median(minimal), statistics.median(walls)
            print(f"{'whole process, start-up included':<34}{'seconds':>9}")
            print(f"{'minimal vLLM script':<34}{m:>9.1f}")
            print(f"{'kdcache precompute --backend vllm':<34}{w:>9.1f}")
            print(f"ratio minimal / kdcache: {m / w:.3f}   (goal >= 0.95; kdcache at most {m / 0.95:.1f} s)"
                  + (f"; medians of {len(minimal)}" if len(minimal) > 1 else ""))
        else:
            print(f"kdcache precompute wall time, start-up included: {walls[0]:.1f} s")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
