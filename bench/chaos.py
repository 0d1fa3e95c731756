"""Fault injection: kill precompute and training at random and at chosen moments; count what is lost.

    .venv/bin/python bench/chaos.py [--trials N per kind] [--kinds K,...] [--seed S]     (or: make chaos)
    .venv/bin/python bench/chaos.py --s3 --kinds precompute     (precompute into an S3-compatible server)

Every moment (kill times, crash-point counts, steps, shard sizes, rank counts) is drawn from one seed, printed at
the start: --seed S reruns the same trials.

Precompute: an uninterrupted reference run, then trials (each with its own --shard-size) that kill -9
the whole process tree at a random moment, send SIGTERM or SIGHUP to the whole process group (a
batch scheduler, a closed terminal), or SIGKILL a process exactly at a crash point (a worker just before it renames a
finished shard into place, or uploads it with --s3; the driver just before it replaces
manifest.json), or kill -9 a served teacher (`vllm serve`) mid-job and start it again (the job rides the
outage out or gives up and is rerun), then rerun the same command until it completes. With --s3 the caches are written
to an S3-compatible server (moto) started on 127.0.0.1. Each final cache is verified and compared
with the reference sample by sample: samples lost, samples duplicated, values different.

Training: an uninterrupted reference run per world size, then trials with 1 or 2 ranks (kdcache train
--nproc-per-node) that send SIGTERM, SIGHUP or SIGKILL at a random step, to the process or to the
whole process group, or SIGKILL exactly while a checkpoint is being committed, or SIGKILL to the
`--nproc-per-node` launcher alone (its ranks must stop, not train on as orphans), or start a second
trainer into the same --out (it must be refused while the first trains on), then rerun until
finished. The per-step losses must equal the reference's exactly.

On-policy: `kdcache onpolicy` (2 rounds) killed at a moment drawn within one of its four stages (round 1 or 2,
rollout and scoring or training; the stage drawn first, then a point in the reference run's time for it, counted
from when the trial's summary shows the stage begun): kill -9 of the loop and every process under it, SIGTERM to
the loop, or SIGHUP to its process group; rerun until done. Per-step losses and each round's cache must equal the
reference's. (With the stages kept up in the loop, round 1's rollout holds most of a short run's time: Ray, the
teacher worker and the trainer start there. Moments drawn over the whole run landed there 15 times in 15.)

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


def _terminal_default():
    """In the child: SIGHUP as a terminal's job has it, even when chaos itself runs under nohup (which would make
    every SIGHUP trial a no-op that cannot count)."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def start(cmd, env=None):
    return subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, preexec_fn=_terminal_default)


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


def _session(sid):
    """Live pids in session `sid` (a job started with start_new_session): what is left of it."""
    left = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[3]) == sid and fields[0] != "Z":
                left.append(int(pid))
        except (OSError, ValueError, IndexError):
            continue
    return left


def _interrupt_precompute(cmd, out, how):
    """Run cmd and interrupt it as `how` says: ("crash", point), ("kill9", delay) to the process tree,
    ("kill9-driver", delay) to the driver alone, or (signal, delay) to the whole process group. Returns
    (landed: the job stopped before finishing, orphans: processes of the job alive 20 s after a driver kill)."""
    kind, value = how
    if kind == "crash":
        first = run(cmd, env=dict(os.environ, KDCACHE_CRASH_AT=value))
        return first.returncode != 0 and not _complete(out), 0
    proc = start(cmd)
    while proc.poll() is None and not _committed(out):
        time.sleep(0.05)
    time.sleep(value)
    if proc.poll() is not None:
        return False, 0                  # finished before the kill: this trial cannot count
    orphans = 0
    if kind == "kill9-driver":
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.time() + 20
        while _session(proc.pid) and time.time() < deadline:
            time.sleep(0.2)
        left = _session(proc.pid)
        orphans = len(left)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    else:
        os.killpg(proc.pid, signal.SIGKILL if kind == "kill9" else kind)
        proc.wait()
    return not _complete(out), orphans


def _complete(out):
    try:
        return bool(Location(out).read_json("manifest.json")["complete"])
    except (OSError, ValueError):
        return False


PRECOMPUTE_KINDS = ("worker-crash", "driver-crash", "sigterm", "sighup", "kill9-tree", "kill9-driver",
                    "served-restart")
TRAIN_KINDS = ("checkpoint-crash", "sigterm", "sighup", "sigkill", "launcher-kill9", "second-trainer")


def _precompute_plans(args, rng, window, s3, kinds):
    """(kind, label, how, shard size): args.trials of each of `kinds`, moments drawn from rng."""
    plans = []
    for _ in range(args.trials):                      # round robin: a run cut short still covers every kind
        for kind in kinds:
            size = int(rng.choice(SHARD_SIZES))
            shards = -(-args.records // size)
            if kind == "worker-crash":
                n = int(rng.integers(1, shards))
                point = f"before-upload@{n}" if s3 else f"before-publish@{n}"
                label, how = f"crash point: worker, before shard {n}'s {'upload' if s3 else 'rename'}", ("crash", point)
            elif kind == "driver-crash":
                n = int(rng.integers(2, shards + 1))
                label, how = f"crash point: driver, before manifest.json replace {n}", \
                    ("crash", f"before-replace-manifest.json@{n}")
            elif kind in ("sigterm", "sighup"):
                sig, t = getattr(signal, kind.upper()), float(rng.uniform(0, window))
                label, how = f"{sig.name} to the group {t:.2f} s after the first commit", (sig, t)
            elif kind == "served-restart":
                t, down = float(rng.uniform(0, window)), float(rng.choice([0.0, rng.uniform(0, 20)]))
                label = f"served teacher kill -9 {t:.2f} s after the first commit, restarted {down:.1f} s later"
                how = ("served-restart", (t, down))
            else:
                t = float(rng.uniform(0, window))
                alone = kind == "kill9-driver"
                label = f"kill -9 {'driver alone' if alone else 'tree'} {t:.2f} s after the first commit"
                how = ("kill9-driver" if alone else "kill9", t)
            plans.append((f"precompute:{kind}", f"{label}, shards of {size}", how, size))
    return plans


def precompute_trials(args, work, teacher, rng, root):
    """The in-process trials (hf teacher) and, for the served-restart kind, trials against a real `vllm serve` of the
    same teacher. Returns (rows, reference duration, commit window)."""
    from kdcache.demo.task import make_splits, write_jsonl
    data = os.path.join(work, "data.jsonl")
    write_jsonl(make_splits(args.records, 0, seed=3)[0], data)
    common = ["precompute", "--teacher", teacher, "--data", data, "--backend", "hf", "--top-k", 16,
              "--no-progress", "--worker-cpus", 0.5]
    s3 = root.startswith("s3://")
    local = [k for k in PRECOMPUTE_KINDS if f"precompute:{k}" in args.kinds and k != "served-restart"]
    rows, duration, window = [], None, None
    if local or any(k.startswith("train:") for k in args.kinds):     # the training trials read this cache
        duration, window = _reference_precompute(args, common, f"{root}/pre-ref")
    if local:
        plans = _precompute_plans(args, rng, window, s3, local)
        rows += _run_precompute_trials(args, common, f"{root}/pre-ref", root, "pre", plans)
    if "precompute:served-restart" in args.kinds:
        from tests.helpers.vllm_server import VLLMServer
        server = VLLMServer(teacher, max_logprobs=16, log_path=os.path.join(work, "vllm.log")).start()
        try:
            common_s = ["precompute", "--teacher", server.url, "--tokenizer", teacher, "--data", data, "--top-k", 16,
                        "--no-progress", "--worker-cpus", 0.5, "--requests-in-flight", 2]
            d, w = _reference_precompute(args, common_s, f"{root}/served-ref")
            print(f"served teacher (vllm serve): reference run {d:.1f} s, {w:.1f} s from its first shard commit to "
                  "its last", flush=True)
            duration, window = duration or d, window or w
            plans = _precompute_plans(args, rng, w, s3, ["served-restart"])
            rows += _run_precompute_trials(args, common_s, f"{root}/served-ref", root, "served", plans, server)
        finally:
            server.stop()
    return rows, duration, window


def _run_precompute_trials(args, common, ref, root, prefix, plans, server=None):
    rows = []
    for i, (kind, label, how, size) in enumerate(plans):
        out = f"{root}/{prefix}-{i}"
        cmd = kdcache_cmd(*common, "--shard-size", size, "--out", out)
        if how[0] == "served-restart":
            interrupted, orphans = _restart_server_mid_job(cmd, out, server, *how[1])
        else:
            interrupted, orphans = _interrupt_precompute(cmd, out, how)
        committed = _committed(out)
        sound_after_kill = verify_cache(out).ok if committed else True
        for _ in range(3):
            res = run(cmd)
            if res.returncode == 0:
                break
        rep = verify_cache(out)
        lost, dup, differ = compare_caches(ref, out)
        ok = rep.ok and sound_after_kill and res.returncode == 0 and not (lost or dup or differ or orphans)
        rows.append({"kind": kind, "trial": label, "interrupted": interrupted, "shards_at_kill": committed,
                     "sound_after_kill": sound_after_kill, "resumed_ok": res.returncode == 0, "verify": rep.ok,
                     "lost": lost, "duplicated": dup, "different": differ, "orphans": orphans, "ok": ok})
        print(f"  {kind}: {label}: {'ok' if ok else 'FAIL'}{'' if interrupted else ' (not counted)'}", flush=True)
        if not args.keep and not root.startswith("s3://"):
            shutil.rmtree(out, ignore_errors=True)
    return rows


SERVED_RETRY_S = 30    # a restart takes 20-60 s here: some trials ride the outage out, others give up and resume


def _restart_server_mid_job(cmd, out, server, t, down):
    """kill -9 the served teacher (its whole process group) t s after the job's first commit, start it again on the
    same port `down` s later. The job rides the outage out if the server is back within KDCACHE_SERVED_RETRY_S,
    else it gives up and the rerun resumes. Returns (landed: the cache was incomplete at the kill, 0)."""
    proc = start(cmd, env=dict(os.environ, KDCACHE_SERVED_RETRY_S=str(SERVED_RETRY_S)))
    while proc.poll() is None and not _committed(out):
        time.sleep(0.05)
    time.sleep(t)
    if proc.poll() is not None:
        return False, 0
    landed = not _complete(out)
    t0 = time.time()
    server.kill()
    time.sleep(down)
    server.start()
    proc.wait()
    print(f"    the server was down {time.time() - t0:.0f} s: the job "
          f"{'rode it out' if proc.returncode == 0 else f'gave up (exit {proc.returncode}); the rerun resumes'}",
          flush=True)
    return landed, 0


def _train_plans(args, rng):
    """(kind, label, crash point or (signal, step, to whom), ranks): args.trials of each kind in args.kinds."""
    steps, plans = args.steps, []
    for _ in range(args.trials):                      # round robin, as the precompute plans
        for kind in [k for k in TRAIN_KINDS if f"train:{k}" in args.kinds]:
            at, ranks = int(rng.integers(3, steps - 2)), int(rng.choice([1, 2]))
            if kind == "checkpoint-crash":
                n = int(rng.integers(1, max(2, steps // 5)))
                plans.append((f"train:{kind}", f"SIGKILL while committing checkpoint {n} of {ranks} rank(s)",
                              f"before-replace-complete.json@{n}", ranks))
            elif kind in ("sigterm", "sighup", "sigkill"):
                sig = getattr(signal, kind.upper())
                group = ranks == 2 or sig == signal.SIGKILL
                where = "the group of" if group else "the process of"
                plans.append((f"train:{kind}", f"{sig.name} to {where} {ranks} rank(s) at step {at}",
                              (sig, at, group), ranks))
            elif kind == "launcher-kill9":
                plans.append((f"train:{kind}", f"SIGKILL to the launcher alone of 2 ranks at step {at}",
                              (signal.SIGKILL, at, "launcher"), 2))
            else:
                plans.append((f"train:{kind}", f"a second trainer into the same --out at step {at}",
                              ("second", at, None), 1))
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
                            stderr=subprocess.DEVNULL, preexec_fn=_terminal_default)
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
    for i, (kind, label, how, ranks) in enumerate(_train_plans(args, rng)):
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
        row = {"kind": kind, "trial": label, "first_exit": exit_code, "steps_logged_at_stop": stopped_at,
               "interrupted": exit_code != -999 if second else stopped_at < steps,
               "resumed_ok": res.returncode == 0 and exit_code not in (-999, -998),
               "losses_equal": got == want[ranks], "steps": len(got), "half_checkpoints_left": len(half)}
        row["ok"] = row["resumed_ok"] and row["losses_equal"]
        _keep_row(rows, row, out, args)
    return rows


def _keep_row(rows, row, out, args):
    """Record a trial's row, print its line, and remove its work directory (unless --keep)."""
    rows.append(row)
    print(f"  {row['kind']}: {row['trial']}: {'ok' if row['ok'] else 'FAIL'}"
          f"{'' if row['interrupted'] else ' (not counted)'}", flush=True)
    if not args.keep:
        shutil.rmtree(out, ignore_errors=True)


ONPOLICY_KINDS = ("kill9", "sigterm", "sighup")


def _onpolicy_student(work, init):
    """A student model directory (weights) from the demo's student config: round 1's completions are its own."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    out = os.path.join(work, "onpolicy-student")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(init)).save_pretrained(out)
    AutoTokenizer.from_pretrained(init).save_pretrained(out)
    return out


def _onpolicy_result(out):
    """(per-step losses, round caches, all rounds done) of an on-policy run directory."""
    try:
        rounds = json.load(open(os.path.join(out, "summary.json")))["rounds"]
    except (OSError, ValueError):
        rounds = []
    metrics = os.path.join(out, "metrics.jsonl")
    losses = [(r["step"], r["loss"]) for r in map(json.loads, open(metrics))] if os.path.exists(metrics) else []
    return losses, [r["cache"] for r in rounds], len(rounds) == 2 and all(r["done"] for r in rounds)


def _stage_stage(out):
    """Where the run stood: each round's stage, from summary.json."""
    try:
        return "/".join(r["stage"] for r in json.load(open(os.path.join(out, "summary.json")))["rounds"])
    except (OSError, ValueError):
        return "-"


# A round's stage in summary.json while it runs: "new" during rollout and scoring, "scored" during training.
_RUNNING = {"rollout": "new", "training": "scored"}


def _onpolicy_stages(out):
    """[(round, part, reference seconds)] of a finished run, part "rollout" or "training"."""
    rounds = json.load(open(os.path.join(out, "summary.json")))["rounds"]
    return [(r["round"], part, r["seconds"][part]) for r in rounds for part in ("rollout", "training")]


def _reached(out, rnd, part):
    """The run has begun round rnd's part (or is past it)."""
    try:
        rounds = json.load(open(os.path.join(out, "summary.json")))["rounds"]
    except (OSError, ValueError):
        return False
    if len(rounds) != rnd:
        return len(rounds) > rnd
    return part == "rollout" or rounds[-1]["stage"] != _RUNNING["rollout"]


def onpolicy_trials(args, work, teacher, rng):
    """kdcache onpolicy (2 rounds) killed at a moment drawn within one of its stages: kill -9 of the loop
    and every process under it, SIGTERM to the loop, or SIGHUP to its process group (a closed terminal); then
    the same command until it completes. Losses per step, round caches and orphans against the reference."""
    import psutil
    init = args.student or os.path.join(ROOT, "runs", "demo", "student_init")
    if not args.student and not os.path.isfile(os.path.join(init, "config.json")):
        from kdcache.demo.run import FULL, student_config
        student_config(os.path.join(ROOT, "runs", "demo"), teacher, FULL)
    student = init if os.path.exists(os.path.join(init, "model.safetensors")) else _onpolicy_student(work, init)
    data = os.path.join(work, "prompts.jsonl")
    with open(os.path.join(ROOT, "runs", "demo", "data", "train.jsonl")) as src, open(data, "w") as dst:
        dst.writelines(line for _, line in zip(range(48), src))
    def cmd(out):
        return kdcache_cmd("onpolicy", "--teacher", teacher, "--student", student, "--data", data, "--out", out,
                           "--rounds", 2, "--prompts-per-round", 24, "--steps-per-round", 8, "--batch-size", 4,
                           "--gen-max-new-tokens", 24, "--top-k", 16, "--backend", "hf", "--shard-size", 6,
                           "--save-every", 2, "--no-progress", "--threads", 1, "--worker-cpus", 0.5)
    ref = os.path.join(work, "onpolicy-ref")
    t0 = time.time()
    res = run(cmd(ref))
    duration = time.time() - t0
    want, ref_caches, done = _onpolicy_result(ref)
    if res.returncode or not done:
        sys.exit(f"the reference on-policy run failed (exit {res.returncode}): {res.stdout[-2000:]}"
                 f"{res.stderr[-2000:]}")
    stages = _onpolicy_stages(ref)
    print(f"on-policy reference run: 2 rounds of 24 prompts and 8 steps, {duration:.1f} s; its stages (kill moments "
          "are drawn in them): " + ", ".join(f"round {r} {part} {secs:.1f} s" for r, part, secs in stages), flush=True)
    rows = []
    for i in range(args.trials):
        for kind in [k for k in ONPOLICY_KINDS if f"onpolicy:{k}" in args.kinds]:
            rnd, part, secs = stages[int(rng.integers(len(stages)))]
            t = float(rng.uniform(0.03, 0.97)) * secs
            out = os.path.join(work, f"onpolicy-{kind}-{i}")
            proc = start(cmd(out))
            while proc.poll() is None and not _reached(out, rnd, part):
                time.sleep(0.02)
            time.sleep(t)
            under = [] if proc.poll() is not None else psutil.Process(proc.pid).children(recursive=True)
            if proc.poll() is None:
                if kind == "kill9":
                    for p in [psutil.Process(proc.pid), *under]:
                        try:
                            p.kill()
                        except psutil.NoSuchProcess:
                            pass
                elif kind == "sigterm":
                    proc.send_signal(signal.SIGTERM)
                else:
                    os.killpg(proc.pid, signal.SIGHUP)
            proc.wait()
            at_stop = _stage_stage(out)
            interrupted = not _onpolicy_result(out)[2]
            deadline = time.time() + 20
            while any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in under) and \
                    time.time() < deadline and kind != "kill9":
                time.sleep(0.2)
            orphans = sum(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in under) if kind != "kill9" \
                else 0
            for _ in range(3):
                res = run(cmd(out))
                if res.returncode == 0 and _onpolicy_result(out)[2]:
                    break
            got, caches, done = _onpolicy_result(out)
            lost = dup = diff = 0
            for a, b in zip(ref_caches, caches):
                la, da, fa = compare_caches(a, b)
                lost, dup, diff = lost + la, dup + da, diff + fa
            label = f"{kind} {t:.1f} s into round {rnd}'s {part} ({secs:.1f} s) (stopped at {at_stop})"
            row = {"kind": f"onpolicy:{kind}", "trial": label, "interrupted": interrupted, "done": done,
                   "losses_equal": got == want, "lost": lost, "duplicated": dup, "different": diff,
                   "orphans": orphans, "verify": all(verify_cache(c).ok for c in caches)}
            row["ok"] = done and row["losses_equal"] and not (lost or dup or diff or orphans) and row["verify"]
            _keep_row(rows, row, out, args)
    return rows


def by_kind(rows):
    """{kind: (trials, counted, failures among counted ones or not)}"""
    out = {}
    for r in rows:
        n, c, f = out.get(r["kind"], (0, 0, 0))
        out[r["kind"]] = (n + 1, c + bool(r["interrupted"]), f + (not r["ok"]))
    return out


def print_precompute(args, rows, duration, window):
    print(f"precompute into {'an S3-compatible server' if args.s3 else 'local disk'}: {args.records} records; "
          f"reference run {duration:.1f} s, {window:.1f} s from its first shard commit to its last (kill times "
          "are drawn in that window)")
    print(f"{'trial':<72}{'counted':>8}{'shards':>7}{'verify':>8}{'lost':>6}{'dup':>5}{'diff':>6}{'orphans':>8}")
    for r in rows:
        ok = "ok" if r["verify"] and r["sound_after_kill"] else "FAIL"
        print(f"{r['trial']:<72}{'yes' if r['interrupted'] else 'no':>8}{r['shards_at_kill']:>7}{ok:>8}"
              f"{r['lost']:>6}{r['duplicated']:>5}{r['different']:>6}{r['orphans']:>8}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=2, help="trials per kind")
    ap.add_argument("--kinds", default="all", help="comma-separated kinds (default all): "
                    + ", ".join([f"precompute:{k}" for k in PRECOMPUTE_KINDS] + [f"train:{k}" for k in TRAIN_KINDS]
                                + [f"onpolicy:{k}" for k in ONPOLICY_KINDS])
                    + "; or precompute, train, onpolicy")
    ap.add_argument("--records", type=int, default=400)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seed", type=int, default=None, help="seed of every drawn moment (default: a fresh one, printed)")
    ap.add_argument("--json", default=None, help="also write every trial's row to this file")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--teacher", default=None, help="teacher directory (default: the demo's, trained if missing)")
    ap.add_argument("--student", default=None, help="student directory for the training trials (default: the demo's)")
    ap.add_argument("--s3", action="store_true", help="precompute into an S3-compatible server (moto) on 127.0.0.1")
    args = ap.parse_args()
    every = [f"precompute:{k}" for k in PRECOMPUTE_KINDS] + [f"train:{k}" for k in TRAIN_KINDS] + \
        [f"onpolicy:{k}" for k in ONPOLICY_KINDS]
    wanted = set()
    for k in args.kinds.split(","):
        k = k.strip()
        wanted |= set(every) if k == "all" else {e for e in every if e.split(":")[0] == k} if ":" not in k else {k}
    unknown = wanted - set(every)
    if unknown:
        sys.exit(f"unknown kinds: {sorted(unknown)}; known: {every}")
    args.kinds = wanted
    if args.seed is None:
        args.seed = int.from_bytes(os.urandom(4), "little")
    print(f"chaos: seed {args.seed} (rerun these moments with --seed {args.seed}), {args.trials} trial(s) per kind",
          flush=True)
    rng = np.random.default_rng(args.seed)
    random.seed(args.seed)
    teacher = args.teacher or os.path.join(ROOT, "runs", "demo", "teacher")
    if not args.teacher and not os.path.isfile(os.path.join(teacher, "teacher_training.json")):
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
        if duration is not None:
            print_precompute(args, rows, duration, window)
        trows = []
        if any(k.startswith("train:") for k in args.kinds):
            init = args.student or os.path.join(ROOT, "runs", "demo", "student_init")
            if not args.student and not os.path.isfile(os.path.join(init, "config.json")):
                from kdcache.demo.run import FULL, student_config
                student_config(os.path.join(ROOT, "runs", "demo"), teacher, FULL)
            trows = train_trials(args, work, f"{root}/pre-ref", init, rng)
            print(f"\ntraining: {args.steps} steps, checkpoint every 5; 1 and 2 ranks (kdcache train --nproc-per-node)")
            print(f"{'trial':<58}{'counted':>8}{'exit':>6}{'logged':>8}{'resumed':>9}{'losses equal':>14}"
                  f"{'.tmp left':>10}")
            for r in trows:
                ok = "ok" if r["resumed_ok"] else "FAIL"
                print(f"{r['trial']:<58}{'yes' if r['interrupted'] else 'no':>8}{r['first_exit']:>6}"
                      f"{r['steps_logged_at_stop']:>8}{ok:>9}{str(r['losses_equal']):>14}"
                      f"{r['half_checkpoints_left']:>10}")
        orows = onpolicy_trials(args, work, teacher, rng) if any(k.startswith("onpolicy:") for k in args.kinds) \
            else []
        if orows:
            print(f"\non-policy: {'trial':<66}{'counted':>8}{'done':>6}{'losses equal':>14}{'lost':>6}{'dup':>5}"
                  f"{'diff':>6}{'orphans':>8}")
            for r in orows:
                print(f"{r['trial']:<76}{'yes' if r['interrupted'] else 'no':>8}{str(r['done']):>6}"
                      f"{str(r['losses_equal']):>14}{r['lost']:>6}{r['duplicated']:>5}{r['different']:>6}"
                      f"{r['orphans']:>8}")
        every_row = rows + trows + orows
        print(f"\n{'kind':<28}{'trials':>8}{'counted':>9}{'failures':>10}")
        for kind, (n, c, f) in by_kind(every_row).items():
            print(f"{kind:<28}{n:>8}{c:>9}{f:>10}")
        failures = sum(not r["ok"] for r in every_row)
        counted = sum(bool(r["interrupted"]) for r in every_row)
        print(f"\n{len(every_row)} trials, {counted} counted (the fault interrupted the job), {failures} failures, "
              f"{sum(r['lost'] for r in rows + orows)} samples lost, "
              f"{sum(r['duplicated'] for r in rows + orows)} duplicated "
              f"(seed {args.seed})")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"seed": args.seed, "trials_per_kind": args.trials, "records": args.records,
                           "steps": args.steps, "rows": every_row}, f, indent=1)
        return 1 if failures else 0
    finally:
        if server is not None:
            server.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
