"""What the `kdcache train` end-to-end tests share: a peaked teacher's cache and a fresh student (make_setup, one
per test module), the command line, and the runs' metrics."""
import json
import os
import subprocess
import sys
import time

import torch

from tests.helpers import cli
from tests.helpers.cli import precompute, user_env, user_project, write_jsonl


def make_setup(tiny, tmp_path_factory):
    """A peaked teacher's cache over 48 demo records (6 shards) and a fresh student config."""
    from kdcache.demo.models import make_model, save
    d = tmp_path_factory.mktemp("trainer")
    teacher = make_model(tiny["tok"], "test", seed=11)
    with torch.no_grad():
        teacher.model.norm.weight.mul_(6.0)        # sharper distributions: a KL worth reducing
    save(teacher, tiny["tok"], str(d / "teacher"))
    data = write_jsonl(d / "d.jsonl", tiny["train"][:48])
    res = precompute("--teacher", d / "teacher", "--data", data, "--out", d / "cache", "--backend", "hf",
                     "--top-k", 32, "--shard-size", 8, shared_ray=True)
    assert res.returncode == 0, res.stderr
    student = make_model(tiny["tok"], "test", seed=5)
    student.config.save_pretrained(str(d / "student"))
    tiny["tok"].save_pretrained(str(d / "student"))
    return {"cache": d / "cache", "student": d / "student", "dir": d, "records": tiny["train"]}


def train_cmd(setup, out, *extra):
    return [sys.executable, "-m", "kdcache", "train", "--cache", str(setup["cache"]), "--student",
            str(setup["student"]), "--out", str(out), "--no-progress", "--lr", "3e-3", "--warmup-steps", "2",
            *map(str, extra)]


def run(cmd, timeout=400, env=None):
    env = dict(user_env() if env is None else env)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return cli.run(cmd, env, timeout)


def losses(out):
    return [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]


def reference_run(setup, steps=12):
    """`steps` uninterrupted steps of batch 2 (the schedule's length is part of it): what an interrupted run of as
    many steps must reproduce."""
    ref_out = setup["dir"] / f"ref-run-{steps}"
    if not (ref_out / "train_summary.json").exists():
        ref = run(train_cmd(setup, ref_out, "--max-steps", steps, "--batch-size", 2, "--save-every", 0))
        assert ref.returncode == 0, ref.stderr[-3000:]
    return ref_out


def two_process_run(setup, out, stage, deepspeed=None):
    """deepspeed: a JSON config for this ZeRO stage (default: --deepspeed STAGE)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(29517 + stage),
           "-m", "kdcache", *train_cmd(setup, out, "--max-steps", 4, "--batch-size", 2, "--save-every", 2,
                                       "--threads", 1, "--deepspeed", deepspeed or stage, "--no-shuffle")[3:]]
    res = run(cmd)
    assert res.returncode == 0, (res.stdout[-2000:], res.stderr[-3000:])
    return losses(out)


def launched_two_ranks(setup, out, steps, *extra):
    """`setsid nohup kdcache train --nproc-per-node 2 ...`: a 2-rank run in its own process group, as a user
    starts a long job they mean to leave running."""
    cmd = ["setsid", "nohup", *train_cmd(setup, out, "--max-steps", steps, "--batch-size", 2, "--save-every", 0,
                                         "--threads", 1, "--nproc-per-node", 2, *extra)]
    env = user_env()
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return subprocess.Popen(cmd, cwd=user_project(), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def signal_group_mid_run(proc, out, sig, steps):
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if (out / "metrics.jsonl").exists() and len(open(out / "metrics.jsonl").readlines()) >= 2:
            break
        time.sleep(0.02)
    assert proc.poll() is None, proc.communicate()[0][-3000:]
    os.killpg(proc.pid, sig)                                           # the whole group: launcher and ranks
    output, _ = proc.communicate(timeout=400)
    return output


def signal_mid_run(cmd, out, steps, sig=None):
    """Start `kdcache train` cmd in its own session (hang-ups not ignored, even when the suite runs under nohup)
    and send `sig` (default SIGKILL) to the whole group once out's metrics hold `steps` rows: the group is frozen
    first, so the fault lands at that count, or the assertion says it could not. Returns (output, rows logged
    when the signal was sent)."""
    import signal
    sig = signal.SIGKILL if sig is None else sig
    proc = subprocess.Popen(cmd, cwd=user_project(), env=user_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
    def logged():
        return len(losses(out)) if os.path.exists(os.path.join(out, "metrics.jsonl")) else 0
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None and logged() < steps:
        time.sleep(0.02)
    assert proc.poll() is None, "the run finished before the signal could be sent"
    os.killpg(proc.pid, signal.SIGSTOP)
    at = logged()
    os.killpg(proc.pid, sig)
    os.killpg(proc.pid, signal.SIGCONT)
    output, _ = proc.communicate(timeout=300)
    return output, at


def kill9_mid_run(cmd, out, steps):
    """signal_mid_run with SIGKILL; returns the run's output."""
    return signal_mid_run(cmd, out, steps)[0]


def first_shards(setup, where, n):
    """A copy of the setup cache cut to its first n shards (8 records each), as a complete cache."""
    import shutil
    shutil.copytree(setup["cache"], where)
    m = json.load(open(where / "manifest.json"))
    m["shards"], m["num_shards_planned"], m["complete"] = m["shards"][:n], n, True
    if m.get("source"):                              # its conversations too (SPEC.md 4.6)
        m["source"]["chats"] = [c for c in m["source"]["chats"] if c["index"] < n]
    m["plan"] = dict(m["plan"], records=8 * n)
    m["counts"] = {k: sum(s["num_" + k] if k != "bytes" else s["bytes"] for s in m["shards"])
                   for k in ("samples", "tokens", "positions", "bytes")}
    (where / "manifest.json").write_text(json.dumps(m))
    return where


def pids_training_into(out):
    """Processes whose command line trains into `out`, the launcher (--nproc-per-node) left out."""
    pids = []
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
            with open(f"/proc/{d}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue                                    # a zombie has exited
        except OSError:
            continue
        if str(out).encode() in cmd and b"kdcache" in cmd and b"--nproc-per-node" not in cmd:
            pids.append(int(d))
    return pids
