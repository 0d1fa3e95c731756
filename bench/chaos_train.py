"""bench/chaos.py's training trials: signals at a step to 1 or 2 ranks, a crash mid-checkpoint, the launcher
killed alone, and a second trainer into the same --out."""
import json
import os
import signal
import subprocess
import sys
import time

from chaos_common import ROOT, _terminal_default, kdcache_cmd, keep_row, run

TRAIN_KINDS = ("checkpoint-crash", "sigterm", "sighup", "sigkill", "launcher-kill9", "second-trainer")

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
              "--save-every", 5, "--no-progress", "--lr", "3e-3", "--threads", 1,
              *(["--lora-r", args.lora_r] if args.lora_r else [])]
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
        keep_row(rows, row, out, args)
    return rows
