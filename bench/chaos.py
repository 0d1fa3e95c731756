"""Fault injection: kill precompute and training at random and at chosen moments; count what is lost.

    .venv/bin/python bench/chaos.py [--trials 6] [--train-trials 6] [--seed 0]     (or: make chaos)
    .venv/bin/python bench/chaos.py --s3 --train-trials 0     (precompute into an S3-compatible server)

Precompute: an uninterrupted reference run, then trials (each with its own --shard-size) that kill -9
the whole process tree at a random moment, send SIGTERM or SIGHUP to the whole process group (a
batch scheduler, a closed terminal), or SIGKILL a process exactly at a crash point (a worker just before it renames a
finished shard into place, or uploads it with --s3; the driver just before it replaces
manifest.json), then rerun the same command until it completes. With --s3 the caches are written
to an S3-compatible server (moto) started on 127.0.0.1. Each final cache is verified and compared
with the reference sample by sample: samples lost, samples duplicated, values different.

Training: an uninterrupted reference run per world size, then trials with 1 or 2 ranks (kdcache train
--nproc-per-node) that send SIGTERM, SIGHUP or SIGKILL at a random step, to the process or to the
whole process group, or SIGKILL exactly while a checkpoint is being committed, or SIGKILL to the
`--nproc-per-node` launcher alone (its ranks must stop, not train on as orphans), or start a second
trainer into the same --out (it must be refused while the first trains on), then rerun until
finished. The per-step losses must equal the reference's exactly.

A trial is counted only if the fault interrupted the job (the cache was incomplete, or training had
steps left, when the first run ended); the tables say which were.
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
from kdcache.cache_format import open_cache, verify_cache  # noqa: E402
from kdcache.cache_format.location import Location  # noqa: E402


def kdcache_cmd(*args):
    return [sys.executable, "-m", "kdcache", *map(str, args)]


def run(cmd, env=None, timeout=900):
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def start(cmd, env=None):
    return subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


LP_TOL = 1e-2   # float16 storage, and the teacher's batches differ when a trial uses another --shard-size


def same_record(a, b):
    """Token ids and positions exactly; teacher top-k within LP_TOL, ranks swapped only between near-ties."""
    if not (np.array_equal(a.input_ids, b.input_ids) and np.array_equal(a.positions, b.positions)):
        return False
    if not (np.allclose(a.topk_logprobs, b.topk_logprobs, rtol=2e-3, atol=LP_TOL)     # float16 ulps grow with |lp|
            and np.allclose(a.tail_mass, b.tail_mass, atol=LP_TOL)):
        return False
    rows, cols = np.nonzero(a.topk_ids != b.topk_ids)
    lp = a.topk_logprobs
    return all(any(abs(lp[r, c] - lp[r, n]) <= LP_TOL for n in (c - 1, c + 1) if 0 <= n < lp.shape[1])
               for r, c in zip(rows, cols))


def compare_caches(ref_dir, out_dir):
    ref, got = open_cache(ref_dir), open_cache(out_dir)
    ref_ids = [r.sample_id for r in ref]
    got_ids = [r.sample_id for r in got]
    lost = len(set(ref_ids) - set(got_ids))
    dup = len(got_ids) - len(set(got_ids))
    by_id = {r.sample_id: r for r in ref}
    differ = sum(by_id.get(r.sample_id) is None or not same_record(r, by_id[r.sample_id]) for r in got)
    return lost, dup, differ


def _committed(out):
    """Shards listed in the manifest at `out` (a directory or URL); 0 without one."""
    try:
        return len(Location(out).read_json("manifest.json")["shards"])
    except (OSError, ValueError):
        return 0


SHARD_SIZES = (7, 10, 13, 25)      # each trial draws one: resume must be exact under every plan


def _reference_precompute(args, common, ref):
    """The uninterrupted run; returns (duration, commit window in seconds)."""
    t0 = time.time()
    proc = start(kdcache_cmd(*common, "--shard-size", 10, "--out", ref))
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
    return time.time() - t0, (last or time.time()) - first


def _interrupt_precompute(cmd, out, how):
    """Run cmd and interrupt it as `how` says: ("crash", point), ("kill9", delay) or (signal, delay) to the
    whole process group. Returns True if the interruption landed (the job stopped before finishing)."""
    kind, value = how
    if kind == "crash":
        first = run(cmd, env=dict(os.environ, KDCACHE_CRASH_AT=value))
        return first.returncode != 0 and not _complete(out)
    proc = start(cmd)
    while proc.poll() is None and not _committed(out):
        time.sleep(0.05)
    time.sleep(value)
    if proc.poll() is not None:
        return False                     # finished before the kill: this trial cannot count
    os.killpg(proc.pid, signal.SIGKILL if kind == "kill9" else kind)
    proc.wait()
    return not _complete(out)


def _complete(out):
    try:
        return bool(Location(out).read_json("manifest.json")["complete"])
    except (OSError, ValueError):
        return False


def precompute_trials(args, work, teacher, rng, root):
    from kdcache.demo.task import make_splits, write_jsonl
    data = os.path.join(work, "data.jsonl")
    write_jsonl(make_splits(args.records, 0, seed=3)[0], data)
    common = ["precompute", "--teacher", teacher, "--data", data, "--backend", "hf", "--top-k", 16,
              "--no-progress", "--worker-cpus", 0.5]
    ref = f"{root}/pre-ref"
    duration, window = _reference_precompute(args, common, ref)
    plans = [("crash point: worker, before a shard upload", ("crash", "before-upload@3")) if root.startswith("s3://")
             else ("crash point: worker, before a shard rename", ("crash", "before-publish@3")),
             ("crash point: driver, before manifest.json replace", ("crash", "before-replace-manifest.json@5"))]
    plans += [(f"{sig.name} to the group {t:.2f} s after the first commit", (sig, t)) for sig, t in
              ((signal.SIGTERM, rng.uniform(0, window / 2)), (signal.SIGHUP, rng.uniform(0, window / 2)))]
    plans += [(f"kill -9 tree {t:.2f} s after the first commit", ("kill9", t)) for t in
              sorted(rng.uniform(0, window) for _ in range(max(0, args.trials - len(plans))))]
    rows = []
    for i, (label, how) in enumerate(plans):
        out, size = f"{root}/pre-{i}", int(rng.choice(SHARD_SIZES))
        cmd = kdcache_cmd(*common, "--shard-size", size, "--out", out)
        interrupted = _interrupt_precompute(cmd, out, how)
        committed = _committed(out)
        sound_after_kill = verify_cache(out).ok if committed else True
        for _ in range(3):
            res = run(cmd)
            if res.returncode == 0:
                break
        rep = verify_cache(out)
        lost, dup, differ = compare_caches(ref, out)
        rows.append({"trial": f"{label}, shards of {size}", "interrupted": interrupted, "shards_at_kill": committed,
                     "sound_after_kill": sound_after_kill, "resumed_ok": res.returncode == 0, "verify": rep.ok,
                     "lost": lost, "duplicated": dup, "different": differ})
    return rows, duration, window


def _train_plans(args, rng):
    """(label, crash point or (signal, step, to the group?), ranks) for each training trial."""
    steps = args.steps
    sigs = [signal.SIGTERM, signal.SIGHUP, signal.SIGKILL]
    plans = [("SIGKILL while committing checkpoint 2", "before-replace-complete.json@2", 1)]
    for i in range(max(0, args.train_trials - 1)):
        sig, at, ranks = sigs[i % 3], int(rng.integers(3, steps - 3)), 2 if i % 2 else 1
        group = ranks == 2 or sig == signal.SIGKILL
        where = "the group of" if group else "the process of"
        plans.append((f"{sig.name} to {where} {ranks} rank(s) at step {at}", (sig, at, group), ranks))
    at = int(rng.integers(3, steps - 3))
    plans.append((f"SIGKILL to the launcher alone of 2 ranks at step {at}", (signal.SIGKILL, at, "launcher"), 2))
    at = int(rng.integers(3, steps - 3))
    plans.append((f"a second trainer into the same --out at step {at}", ("second", at, None), 1))
    return plans


def _out_free(out, timeout=300):
    """Wait until no trainer holds --out's lock (the kernel drops it when the last holder exits)."""
    import fcntl
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            fd = os.open(os.path.join(out, ".train.lock"), os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            time.sleep(0.2)
        finally:
            os.close(fd)
    return False


def _interrupt_training(cmd, out, how):
    """Returns the first run's exit status (after a crash point, or the signal at a step)."""
    if isinstance(how, str):
        return run(cmd, env=dict(os.environ, KDCACHE_CRASH_AT=how)).returncode
    sig, at, group = how
    proc = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    metrics = os.path.join(out, "metrics.jsonl")
    while proc.poll() is None:
        if os.path.exists(metrics) and len(open(metrics).readlines()) >= at:
            break
        time.sleep(0.01)
    if sig == "second":                  # another trainer into the same --out: refused, the first goes on
        os.killpg(proc.pid, signal.SIGSTOP)  # held at this step, so that it still trains when the second starts
        try:
            second = run(cmd)
        finally:
            os.killpg(proc.pid, signal.SIGCONT)
        code = proc.wait()
        return code if second.returncode == 2 and "Another `kdcache train`" in second.stderr else -999
    if group == "launcher":              # the launcher alone: its ranks must stop (and free --out), not orphan
        proc.send_signal(sig)
        code = proc.wait()
        return code if _out_free(out) else -998
    os.killpg(proc.pid, sig) if group else proc.send_signal(sig)
    return proc.wait()


def train_trials(args, work, cache, student, rng):
    steps = args.steps
    common = ["train", "--cache", cache, "--student", student, "--max-steps", steps, "--batch-size", 4,
              "--save-every", 5, "--no-progress", "--lr", "3e-3", "--threads", 1]
    want = {}
    rows = []
    for i, (label, how, ranks) in enumerate(_train_plans(args, rng)):
        launch = ["--nproc-per-node", ranks]
        if ranks not in want:           # one uninterrupted reference per world size
            ref = os.path.join(work, f"train-ref-{ranks}")
            res = run(kdcache_cmd(*common, *launch, "--out", ref))
            if res.returncode:
                sys.exit(res.stderr[-3000:])
            want[ranks] = [json.loads(x)["loss"] for x in open(os.path.join(ref, "metrics.jsonl"))]
        out = os.path.join(work, f"train-{i}")
        cmd = kdcache_cmd(*common, *launch, "--out", out)
        exit_code = _interrupt_training(cmd, out, how)
        stopped_at = len(open(os.path.join(out, "metrics.jsonl")).readlines())
        res = run(cmd)
        got = [json.loads(x)["loss"] for x in open(os.path.join(out, "metrics.jsonl"))]
        half = [d for d in os.listdir(os.path.join(out, "checkpoints")) if d.startswith(".tmp")] \
            if os.path.isdir(os.path.join(out, "checkpoints")) else []
        # -999: the second trainer was not refused; -998: the launcher's ranks kept --out locked (orphans).
        second = isinstance(how, tuple) and how[0] == "second"
        rows.append({"trial": label, "first_exit": exit_code, "steps_logged_at_stop": stopped_at,
                     "interrupted": exit_code != -999 if second else stopped_at < steps,
                     "resumed_ok": res.returncode == 0 and exit_code not in (-999, -998),
                     "losses_equal": got == want[ranks], "steps": len(got), "half_checkpoints_left": len(half)})
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
        print(f"{'trial':<66}{'counted':>8}{'shards':>7}{'verify':>8}{'lost':>6}{'dup':>5}{'diff':>6}")
        for r in rows:
            ok = "ok" if r["verify"] and r["sound_after_kill"] else "FAIL"
            print(f"{r['trial']:<66}{'yes' if r['interrupted'] else 'no':>8}{r['shards_at_kill']:>7}{ok:>8}"
                  f"{r['lost']:>6}{r['duplicated']:>5}{r['different']:>6}")
        init = os.path.join(ROOT, "runs", "demo", "student_init")
        if not os.path.isfile(os.path.join(init, "config.json")):
            from kdcache.demo.run import FULL, student_config
            student_config(os.path.join(ROOT, "runs", "demo"), teacher, FULL)
        trows = train_trials(args, work, f"{root}/pre-ref", init, rng) if args.train_trials else []
        print(f"\ntraining: {args.steps} steps, checkpoint every 5; 1 and 2 ranks (kdcache train --nproc-per-node)")
        print(f"{'trial':<50}{'counted':>8}{'exit':>6}{'logged':>8}{'resumed':>9}{'losses equal':>14}{'.tmp left':>10}")
        for r in trows:
            ok = "ok" if r["resumed_ok"] else "FAIL"
            print(f"{r['trial']:<50}{'yes' if r['interrupted'] else 'no':>8}{r['first_exit']:>6}"
                  f"{r['steps_logged_at_stop']:>8}{ok:>9}{str(r['losses_equal']):>14}{r['half_checkpoints_left']:>10}")
        bad = [not (r["verify"] and r["sound_after_kill"] and r["resumed_ok"]) or r["lost"] or r["duplicated"]
               or r["different"] for r in rows]
        failures = sum(map(bool, bad)) + sum(not (r["resumed_ok"] and r["losses_equal"]) for r in trows)
        counted = sum(r["interrupted"] for r in rows) + sum(r["interrupted"] for r in trows)
        print(f"\n{len(rows) + len(trows)} trials, {counted} counted (the fault interrupted the job), {failures} "
              f"failures, {sum(r['lost'] for r in rows)} samples lost, {sum(r['duplicated'] for r in rows)} duplicated")
        return 1 if failures else 0
    finally:
        if server is not None:
            server.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
