"""Fault injection: kill precompute and training at random and at chosen moments; count what is lost.

    .venv/bin/python bench/chaos.py [--trials 6] [--train-trials 6] [--seed 0]     (or: make chaos)
    .venv/bin/python bench/chaos.py --s3 --train-trials 0     (precompute into an S3-compatible server)

Precompute: an uninterrupted reference run, then trials that kill -9 the whole process tree at a
random moment, or SIGKILL a process exactly at a crash point (a worker just before it renames a
finished shard into place, or uploads it with --s3; the driver just before it replaces
manifest.json), then rerun the same command until it completes. With --s3 the caches are written
to an S3-compatible server (moto) started on 127.0.0.1. Each final cache is verified and compared
with the reference sample by sample: samples lost, samples duplicated, values different.

Training: an uninterrupted reference run, then trials that send SIGTERM, SIGHUP or SIGKILL at a
random step, or SIGKILL exactly while a checkpoint is being committed, then rerun until finished.
The per-step losses must equal the reference's exactly.
"""
import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from cache_format import open_cache, verify_cache  # noqa: E402
from cache_format.location import Location  # noqa: E402


def kdcache_cmd(*args):
    return [sys.executable, "-m", "kdcache", *map(str, args)]


def run(cmd, env=None, timeout=900):
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def start(cmd, env=None):
    return subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def compare_caches(ref_dir, out_dir):
    ref, got = open_cache(ref_dir), open_cache(out_dir)
    ref_ids = [r.sample_id for r in ref]
    got_ids = [r.sample_id for r in got]
    lost = len(set(ref_ids) - set(got_ids))
    dup = len(got_ids) - len(set(got_ids))
    by_id = {r.sample_id: r for r in ref}
    differ = 0
    for r in got:
        want = by_id.get(r.sample_id)
        if want is None or not all(np.array_equal(getattr(r, f), getattr(want, f)) for f in
                                   ("input_ids", "positions", "topk_ids", "topk_logprobs", "tail_mass")):
            differ += 1
    return lost, dup, differ


def _committed(out):
    """Shards listed in the manifest at `out` (a directory or URL); 0 without one."""
    try:
        return len(Location(out).read_json("manifest.json")["shards"])
    except (OSError, ValueError):
        return 0


def precompute_trials(args, work, teacher, rng, root):
    from kdcache.demo.task import make_splits, write_jsonl
    data = os.path.join(work, "data.jsonl")
    write_jsonl(make_splits(args.records, 0, seed=3)[0], data)
    common = ["precompute", "--teacher", teacher, "--data", data, "--backend", "hf", "--top-k", 16,
              "--shard-size", 10, "--no-progress", "--worker-cpus", 0.5]
    ref = f"{root}/pre-ref"
    t0 = time.time()
    proc = start(kdcache_cmd(*common, "--out", ref))
    first = last = None
    while proc.poll() is None:          # the commit window: first shard committed -> last shard committed
        n = _committed(ref)
        if n and first is None:
            first = time.time()
        if n == args.records // 10 and last is None:
            last = time.time()
        time.sleep(0.02)
    if proc.returncode or first is None:
        sys.exit(f"the reference precompute failed (exit {proc.returncode})")
    duration = time.time() - t0
    window = (last or time.time()) - first
    plans = [("crash point: worker, before a shard upload", "before-upload@3") if root.startswith("s3://") else
             ("crash point: worker, before a shard rename", "before-publish@3"),
             ("crash point: driver, before manifest.json replace", "before-replace-manifest.json@5")]
    plans += [(f"kill -9 tree {t:.2f} s after the first commit", t) for t in
              sorted(rng.uniform(0, window) for _ in range(max(0, args.trials - len(plans))))]
    rows = []
    for i, (label, how) in enumerate(plans):
        out = f"{root}/pre-{i}"
        env = dict(os.environ)
        if isinstance(how, str):
            env["KDCACHE_CRASH_AT"] = how
            first = run(kdcache_cmd(*common, "--out", out), env=env)
            interrupted = first.returncode != 0
        else:
            proc = start(kdcache_cmd(*common, "--out", out))
            while proc.poll() is None and not _committed(out):
                time.sleep(0.05)
            time.sleep(how)
            interrupted = proc.poll() is None
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        committed = _committed(out)
        sound_after_kill = verify_cache(out).ok if committed else True
        for _ in range(3):
            res = run(kdcache_cmd(*common, "--out", out))
            if res.returncode == 0:
                break
        rep = verify_cache(out)
        lost, dup, differ = compare_caches(ref, out)
        rows.append({"trial": label, "interrupted": interrupted, "shards_at_kill": committed,
                     "sound_after_kill": sound_after_kill, "resumed_ok": res.returncode == 0, "verify": rep.ok,
                     "lost": lost, "duplicated": dup, "different": differ})
    return rows, duration, window


def train_trials(args, work, cache, student, rng):
    steps = args.steps
    common = ["train", "--cache", cache, "--student", student, "--max-steps", steps, "--batch-size", 4,
              "--save-every", 5, "--no-progress", "--lr", "3e-3"]
    ref = os.path.join(work, "train-ref")
    res = run(kdcache_cmd(*common, "--out", ref))
    if res.returncode:
        sys.exit(res.stderr[-3000:])
    want = [json.loads(x)["loss"] for x in open(os.path.join(ref, "metrics.jsonl"))]
    sigs = [signal.SIGTERM, signal.SIGHUP, signal.SIGKILL]
    plans = [("SIGKILL while committing checkpoint 2", "before-replace-complete.json@2")]
    plans += [(sigs[i % 3], int(rng.integers(3, steps - 3))) for i in range(max(0, args.train_trials - 1))]
    rows = []
    for i, (sig, at) in enumerate(plans):
        out = os.path.join(work, f"train-{i}")
        env = dict(os.environ)
        if isinstance(at, str):
            env["KDCACHE_CRASH_AT"] = at
            first = run(kdcache_cmd(*common, "--out", out), env=env)
            label, exit_code = sig, first.returncode
        else:
            proc = subprocess.Popen(kdcache_cmd(*common, "--out", out), cwd=ROOT, env=env, start_new_session=True,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            metrics = os.path.join(out, "metrics.jsonl")
            while proc.poll() is None:
                if os.path.exists(metrics) and len(open(metrics).readlines()) >= at:
                    break
                time.sleep(0.01)
            (os.killpg(proc.pid, sig) if sig == signal.SIGKILL else proc.send_signal(sig))
            exit_code = proc.wait()
            label = f"{sig.name} at step {at}"
        stopped_at = len(open(os.path.join(out, "metrics.jsonl")).readlines())
        res = run(kdcache_cmd(*common, "--out", out))
        got = [json.loads(x)["loss"] for x in open(os.path.join(out, "metrics.jsonl"))]
        half = [d for d in os.listdir(os.path.join(out, "checkpoints")) if d.startswith(".tmp")] \
            if os.path.isdir(os.path.join(out, "checkpoints")) else []
        rows.append({"trial": label, "first_exit": exit_code, "steps_logged_at_stop": stopped_at,
                     "resumed_ok": res.returncode == 0, "losses_equal": got == want,
                     "steps": len(got), "half_checkpoints_left": len(half)})
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=8, help="precompute trials")
    ap.add_argument("--train-trials", type=int, default=6)
    ap.add_argument("--records", type=int, default=400)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--s3", action="store_true", help="precompute into an S3-compatible server (moto) on 127.0.0.1")
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    random.seed(args.seed)
    teacher = os.path.join(ROOT, "runs", "demo", "teacher")
    if not os.path.isfile(os.path.join(teacher, "teacher_training.json")):
        subprocess.run(kdcache_cmd("demo", "--stage", "teacher"), cwd=ROOT, check=True)
    work = tempfile.mkdtemp(prefix="kdchaos-")
    server = None
    try:
        root = work
        if args.s3:
            from tests.helpers.s3server import S3Server
            server = S3Server().start()
            os.environ.update(server.env())
            root = server.make_bucket("chaos")
        rows, duration, window = precompute_trials(args, work, teacher, rng, root)
        print(f"precompute into {'an S3-compatible server' if args.s3 else 'local disk'}: {args.records} records, "
              f"{args.records // 10} shards; reference run {duration:.1f} s, {window:.1f} s from its first "
              "shard commit to its last (kill times are drawn in that window)")
        print(f"{'trial':<52}{'killed':>7}{'shards':>7}{'verify':>8}{'lost':>6}{'dup':>5}{'diff':>6}")
        for r in rows:
            ok = "ok" if r["verify"] and r["sound_after_kill"] else "FAIL"
            print(f"{r['trial']:<52}{'yes' if r['interrupted'] else 'late':>7}{r['shards_at_kill']:>7}{ok:>8}"
                  f"{r['lost']:>6}{r['duplicated']:>5}{r['different']:>6}")
        init = os.path.join(ROOT, "runs", "demo", "student_init")
        if not os.path.isfile(os.path.join(init, "config.json")):
            from kdcache.demo.run import FULL, student_config
            student_config(os.path.join(ROOT, "runs", "demo"), teacher, FULL)
        trows = train_trials(args, work, f"{root}/pre-ref", init, rng) if args.train_trials else []
        print(f"\ntraining: {args.steps} steps, checkpoint every 5")
        print(f"{'trial':<40}{'exit':>6}{'logged':>8}{'resumed':>9}{'losses equal':>14}{'.tmp left':>10}")
        for r in trows:
            ok = "ok" if r["resumed_ok"] else "FAIL"
            print(f"{r['trial']:<40}{r['first_exit']:>6}{r['steps_logged_at_stop']:>8}{ok:>9}"
                  f"{str(r['losses_equal']):>14}{r['half_checkpoints_left']:>10}")
        bad = [not (r["verify"] and r["sound_after_kill"] and r["resumed_ok"]) or r["lost"] or r["duplicated"]
               or r["different"] for r in rows]
        failures = sum(map(bool, bad)) + sum(not (r["resumed_ok"] and r["losses_equal"]) for r in trows)
        print(f"\n{len(rows) + len(trows)} trials, {failures} failures, "
              f"{sum(r['lost'] for r in rows)} samples lost, {sum(r['duplicated'] for r in rows)} duplicated")
        return 1 if failures else 0
    finally:
        if server is not None:
            server.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
