"""bench/chaos.py's on-policy trials: `kdcache onpolicy` killed within one of its stages, then rerun."""
import json
import os
import signal
import sys
import time

from chaos_common import ROOT, compare_caches, kdcache_cmd, keep_row, run, start, verify_cache

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
            keep_row(rows, row, out, args)
    return rows
