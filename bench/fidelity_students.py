"""The effect that matters: does a student distilled from a compact cache behave like one from an exact cache?

    .venv/bin/python bench/fidelity_students.py [--seeds 0,1] [--compact sqrt8:0.999] [--root runs/demo]

Uses the demo's task, teacher and student recipe (`make demo` builds them in runs/demo; this script builds
what is missing). Two caches of the same teacher at k=64: exact float16 (kdcache's default) and the
compact mode given (log-prob dtype and top-p). One student per cache and seed, trained with the demo's
settings; every student is evaluated on the held-out split (stop rate, exact match, label F1, KL from the
teacher). Prints one row per student, then mean and spread per cache, and the bytes each cache took.
"""
import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from kdcache.demo import run as demo  # noqa: E402


def kdcache(*args):
    subprocess.run([sys.executable, "-m", "kdcache", *map(str, args)], cwd=ROOT, check=True)


def cache(root, name, dtype, top_p, backend):
    out = os.path.join(root, "fidelity", f"cache-{name}")
    args = ["precompute", "--teacher", os.path.join(root, "teacher"), "--data",
            os.path.join(root, "data", "train.jsonl"), "--out", out, "--top-k", 64, "--shard-size", 500,
            "--backend", backend, "--max-length", 256, "--logprob-dtype", dtype, "--no-progress"]
    kdcache(*args, *(["--top-p", top_p] if top_p else []))
    return out


def student(root, cache_dir, name, seed, p):
    out = os.path.join(root, "fidelity", f"student-{name}-{seed}")
    summary = os.path.join(out, "train_summary.json")
    if not (os.path.isfile(summary) and json.load(open(summary)).get("reason") == "finished"):
        kdcache("train", "--cache", cache_dir, "--student", os.path.join(root, "student_init"), "--out", out,
                "--max-steps", p["student_steps"], "--batch-size", p["student_batch"], "--lr", p["student_lr"],
                "--warmup-steps", 20, "--sft-alpha", 0, "--beta", 0, "--save-every", 0, "--seed", seed,
                "--no-progress")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=os.path.join(ROOT, "runs", "demo"))
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--compact", default="sqrt8:0.999", help="DTYPE[:TOP_P] of the compact cache")
    ap.add_argument("--backend", default="hf")
    args = ap.parse_args()
    p = demo.FULL
    if not os.path.isdir(os.path.join(args.root, "student_init")):
        demo.main(["--root", args.root, "--stage", "train", "--no-control"])
    dtype, _, top_p = args.compact.partition(":")
    caches = {"exact": cache(args.root, "exact", "float16", None, args.backend),
              "compact": cache(args.root, "compact", dtype, top_p or None, args.backend)}
    seeds = [int(s) for s in args.seeds.split(",")]
    runs = {f"{c}-{s}": student(args.root, caches[c], c, s, p) for c in caches for s in seeds}
    report = os.path.join(args.root, "fidelity", "report")
    ev = ["eval", "--data", os.path.join(args.root, "data", "heldout.jsonl"), "--out", report, "--reference",
          "teacher", "--model", f"teacher={os.path.join(args.root, 'teacher')}", "--max-new-tokens",
          p["max_new_tokens"], "--title", "kdcache: students from an exact and a compact cache"]
    for name, d in runs.items():
        ev += ["--model", f"{name}={os.path.join(d, 'final')}"]
    kdcache(*ev)
    res = demo.add_label_f1(report, os.path.join(args.root, "data", "heldout.jsonl"))
    print(f"\n{'student':<14}{'stop rate':>10}{'exact':>8}{'label F1':>10}{'KL from teacher':>17}")
    for name in runs:
        r = res[name]
        print(f"{name:<14}{r['stop_rate']:>10.3f}{r['exact_match']:>8.3f}{r['label_f1']:>10.3f}"
              f"{r['kl_from_reference']:>17.4f}")
    for c, d in caches.items():
        m = json.load(open(os.path.join(d, "manifest.json")))
        vals = {k: [res[f"{c}-{s}"][k] for s in seeds] for k in ("stop_rate", "label_f1", "kl_from_reference")}
        spread = ", ".join(f"{k} {sum(v) / len(v):.3f} (range {min(v):.3f}-{max(v):.3f})" for k, v in vals.items())
        print(f"{c:<8} {m['logprob_dtype']}{' top-p ' + str(m['top_p']) if m.get('top_p') else ''}: "
              f"{m['counts']['bytes'] / m['counts']['positions']:.1f} B/position; {len(seeds)} students: {spread}")


if __name__ == "__main__":
    main()
