"""`kdcache train` end to end under DeepSpeed (CPU, gloo): signals, kill -9, resume, checkpoints, launcher and ranks.

A module of its own so that it runs beside test_trainer.py (the suite spreads test files over its workers)."""
import json
import os
import signal
import subprocess
import time

import pytest

from tests.helpers.cli import user_env, user_project
from tests.train.common import (
    first_shards,
    kill9_mid_run,
    launched_two_ranks,
    losses,
    make_setup,
    pids_training_into,
    reference_run,
    run,
    signal_group_mid_run,
    train_cmd,
)

pytestmark = [pytest.mark.deepspeed, pytest.mark.slow]


@pytest.fixture(scope="module")
def setup(tiny, tmp_path_factory):
    return make_setup(tiny, tmp_path_factory)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_signal_mid_run_then_resume_gives_identical_losses(setup, tmp_path, sig):
    steps = 12                                   # the reference the kill -9 test uses too
    ref_out = reference_run(setup, steps)
    out = tmp_path / "o"
    env = user_env()
    # A run started from a terminal, not under nohup (which the suite itself may run under): SIGHUP not ignored.
    proc = subprocess.Popen(train_cmd(setup, out, "--max-steps", steps, "--batch-size", 2, "--save-every", 0),
                            cwd=user_project(), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
    deadline = time.time() + 300
    while time.time() < deadline:
        if (out / "metrics.jsonl").exists() and len(open(out / "metrics.jsonl").readlines()) >= 3:
            break
        time.sleep(0.02)
    proc.send_signal(sig)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output[-3000:]
    assert f"stopped by {sig.name}" in output and "Resume with" in output
    stopped_at = len(losses(out))
    assert 3 <= stopped_at < steps, "the signal arrived after the run finished; make the run longer"
    res = run(train_cmd(setup, out, "--max-steps", steps, "--batch-size", 2, "--save-every", 0))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resumed from" in res.stdout
    got, want = losses(out), losses(ref_out)
    assert [r["step"] for r in got] == list(range(1, steps + 1))
    assert [r["loss"] for r in got] == [r["loss"] for r in want]      # bit-identical on CPU


def test_kill9_mid_checkpoint_and_mid_step_then_resume_gives_identical_losses(setup, tmp_path):
    """kill -9 of `kdcache train` (README: rule 3) while it commits its second checkpoint (a crash point), and at
    a moment mid-run (SIGKILL to the group): each resume redoes the steps since the last complete checkpoint
    with the reference run's losses."""
    want = [r["loss"] for r in losses(reference_run(setup, 12))]
    out = tmp_path / "o"
    cmd = train_cmd(setup, out, "--max-steps", 12, "--batch-size", 2, "--save-every", 2)
    env = dict(user_env(), KDCACHE_CRASH_AT="before-replace-complete.json@2")
    first = subprocess.run(cmd, cwd=user_project(), env=env, capture_output=True, text=True, timeout=400)
    assert first.returncode == -signal.SIGKILL, first.stderr[-2000:]           # the fault landed, at step 4
    ck = out / "checkpoints"
    assert (ck / "step-00000002" / "complete.json").exists() and not (ck / "step-00000004").exists()
    assert len(losses(out)) == 4
    output = kill9_mid_run(cmd, out, 7)
    assert "resumed from" in output and "step-00000002" in output
    assert 7 <= len(losses(out)) < 12
    res = run(cmd)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resumed from" in res.stdout
    got = losses(out)
    assert [r["step"] for r in got] == list(range(1, 13))
    assert [r["loss"] for r in got] == want[:12]                      # bit-identical on CPU


def test_resume_from_a_path_continues_and_resume_never_starts_over(setup, tmp_path):
    """--resume PATH: a new --out continues from that checkpoint (steps 3-6 as the first run's); --resume never
    into an --out with checkpoints trains from step 1 again, the old run's checkpoints kept."""
    a = tmp_path / "a"
    res = run(train_cmd(setup, a, "--max-steps", 6, "--batch-size", 2, "--save-every", 2, "--keep-checkpoints", 3))
    assert res.returncode == 0, res.stderr[-3000:]
    want = [r["loss"] for r in losses(a)]
    path = a / "checkpoints" / "step-00000002"
    b = tmp_path / "b"
    res = run(train_cmd(setup, b, "--max-steps", 6, "--batch-size", 2, "--save-every", 0, "--resume", path))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resumed from" in res.stdout and "step-00000002" in res.stdout
    got = losses(b)
    assert [r["step"] for r in got] == [3, 4, 5, 6] and [r["loss"] for r in got] == want[2:6]
    # 3 steps: the warm-up's 2 and a third at the full rate, as in the 6-step run
    res = run(train_cmd(setup, a, "--max-steps", 3, "--batch-size", 2, "--save-every", 0, "--resume", "never"))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resumed from" not in res.stdout
    assert [r["loss"] for r in losses(a)][-3:] == want[:3]          # a new run from the initial weights
    assert (a / "checkpoints" / "step-00000006" / "complete.json").exists()


def test_half_written_checkpoint_is_never_picked(setup, tmp_path):
    out = tmp_path / "o"
    res = run(train_cmd(setup, out, "--max-steps", 4, "--batch-size", 2, "--save-every", 2))
    assert res.returncode == 0, res.stderr[-3000:]
    ck = out / "checkpoints"
    os.rename(ck / "step-00000004", ck / ".tmp-step-00000004")     # as if a crash hit the save
    (ck / "step-00000009").mkdir()                                   # a directory without complete.json
    from kdcache.train.checkpoint import resolve_resume
    assert resolve_resume(str(out), "auto").endswith("step-00000002")
    res = run(train_cmd(setup, out, "--max-steps", 5, "--batch-size", 2, "--save-every", 0))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resumed from" in res.stdout and "step-00000002" in res.stdout


def test_two_ranks_under_nohup_survive_a_hangup_of_the_whole_group(setup, tmp_path):
    out, steps = tmp_path / "o", 12
    proc = launched_two_ranks(setup, out, steps)
    output = signal_group_mid_run(proc, out, signal.SIGHUP, steps)
    assert proc.returncode == 0, output[-3000:]
    assert [r["step"] for r in losses(out)] == list(range(1, steps + 1))   # every step, nothing stopped
    assert "stopped by" not in output and (out / "final" / "config.json").exists()


def test_two_ranks_finish_their_checkpoint_on_sigterm_and_the_hint_relaunches_them(setup, tmp_path):
    out, steps = tmp_path / "o", 12
    proc = launched_two_ranks(setup, out, steps)
    output = signal_group_mid_run(proc, out, signal.SIGTERM, steps)
    assert proc.returncode == 0, output[-3000:]
    assert "stopped by SIGTERM" in output and "--nproc-per-node 2" in output.split("Resume with:")[1]
    stopped_at = len(losses(out))
    assert 2 <= stopped_at < steps, "the signal arrived after the run finished"
    ck = out / "checkpoints" / f"step-{stopped_at:08d}"
    assert json.load(open(ck / "complete.json"))["world_size"] == 2        # both ranks' state, complete
    res = run(train_cmd(setup, out, "--max-steps", steps, "--batch-size", 2, "--save-every", 0, "--threads", 1,
                        "--nproc-per-node", 2))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert [r["step"] for r in losses(out)] == list(range(1, steps + 1))


def test_resume_against_another_cache_is_refused(setup, tmp_path):
    """The reported loss: the cache grew under a run's --out; the resumed epoch read samples twice or never."""
    import shutil
    cache = first_shards(setup, tmp_path / "cache", 4)                       # the cache at first
    out = tmp_path / "o"
    first = run(train_cmd(dict(setup, cache=cache), out, "--max-steps", 6, "--batch-size", 2, "--save-every", 2,
                          "--stop-after", 2))
    assert first.returncode == 0 and "stopped by stop_after" in first.stdout, first.stderr[-3000:]
    shutil.copy(setup["cache"] / "manifest.json", cache / "manifest.json")          # it grew: 6 shards now
    res = run(train_cmd(dict(setup, cache=cache), out, "--max-steps", 6, "--batch-size", 2, "--save-every", 2))
    assert res.returncode == 2, res.stdout[-2000:]
    assert "num_shards: 4 in the checkpoint, 6 now" in res.stderr and "--out" in res.stderr


def test_a_one_shard_cache_trains_on_two_ranks(setup, tmp_path):
    """Ranks split each epoch at sample granularity, so a cache with fewer shards than ranks still trains."""
    cache = first_shards(setup, tmp_path / "cache", 1)
    out = tmp_path / "o"
    res = run(train_cmd(dict(setup, cache=cache), out, "--epochs", 1, "--batch-size", 2, "--save-every", 0,
                        "--threads", 1, "--nproc-per-node", 2))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    rows = losses(out)
    assert [r["step"] for r in rows] == [1, 2] and all(r["positions"] > 0 for r in rows)   # 8 samples: 4 + 4


def test_ranks_die_with_their_launcher_and_a_second_trainer_is_refused(setup, tmp_path):
    """kill -9 of the `--nproc-per-node` launcher used to leave both ranks training, and a rerun trained beside
    them (issue 23, item 9). Now the ranks get SIGTERM when it dies, and a lock on --out refuses a second run."""
    out = tmp_path / "o"
    proc = launched_two_ranks(setup, out, 400)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None and not (
            (out / "metrics.jsonl").exists() and open(out / "metrics.jsonl").read().count("\n") >= 1):
        time.sleep(0.05)                                                # a step logged: the ranks are training
    ranks = pids_training_into(out)
    assert proc.poll() is None and len(ranks) == 2, (ranks, proc.poll())
    second = run(train_cmd(setup, out, "--max-steps", 3, "--batch-size", 2, "--save-every", 0), timeout=300)
    assert second.returncode == 2 and "Another `kdcache train` is training into this --out" in second.stderr, \
        second.stderr[-2000:]
    os.kill(proc.pid, signal.SIGKILL)                                   # the launcher alone, not its group
    proc.wait(timeout=30)
    deadline = time.time() + 240
    while time.time() < deadline and pids_training_into(out):
        time.sleep(0.2)
    assert not pids_training_into(out), "ranks kept training after their launcher was killed"
    # They stopped as on SIGTERM: a checkpoint of the step they were at, so the same command resumes.
    ranks_said = proc.stdout.read()
    assert (out / "checkpoints").is_dir() and any(n.startswith("step-") for n in os.listdir(out / "checkpoints")), \
        ranks_said[-4000:]


def test_a_launched_run_refused_on_a_locked_out_ends_every_rank_at_once(setup, tmp_path):
    """A second `kdcache train --nproc-per-node 2` on a busy --out: rank 0 used to refuse alone while rank 1
    waited 600 s for a rendezvous that never came (issue 42, item 8). The launcher now takes the lock before any
    rank starts: the refusal is the job's exit, and no rank is left."""
    from kdcache.cache_format.lock import DirLock
    from kdcache.train.out_lock import OUT_LOCK
    out = tmp_path / "o"
    out.mkdir()
    with DirLock(str(out), OUT_LOCK):
        t0 = time.time()
        res = run(train_cmd(setup, out, "--max-steps", 3, "--batch-size", 2, "--nproc-per-node", 2), timeout=120)
        took = time.time() - t0
    assert res.returncode == 2 and "Another `kdcache train` is training into this --out" in res.stderr, \
        res.stderr[-2000:]
    assert took < 15, took          # before any rank started: no rank start-up (8 s each here), no grace
    assert not pids_training_into(out)


def test_a_sigterm_during_a_periodic_checkpoint_stops_right_after_it(setup, tmp_path):
    """The signal lands while checkpoint 2 (step 4) is being committed: the run stops at step 4, its checkpoint
    whole, instead of training step 5 and saving a second time (issue 23, item 14)."""
    out = tmp_path / "o"
    env = user_env(KDCACHE_SIGTERM_AT="before-replace-complete.json@2")
    res = run(train_cmd(setup, out, "--max-steps", 12, "--batch-size", 2, "--save-every", 2), env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "stopped by SIGTERM at step 4" in res.stdout, res.stdout[-2000:]
    assert [r["step"] for r in losses(out)] == [1, 2, 3, 4]
    assert sorted(n for n in os.listdir(out / "checkpoints") if n.startswith("step-")) == \
        ["step-00000002", "step-00000004"]


def test_a_sigterm_during_start_up_stops_both_ranks_before_a_step_and_the_rerun_trains_all(setup, tmp_path):
    """A signal while the ranks start (DeepSpeed's start-up can take a minute) used to kill the rank by its default
    action, and its peer failed in the next collective. Now it is kept: both ranks stop before step 1 (the signal
    reaches rank 0 only, at its last start-up write), save, exit 0, and the same command trains every step."""
    out = tmp_path / "o"
    cmd = train_cmd(setup, out, "--max-steps", 4, "--batch-size", 2, "--save-every", 0, "--threads", 1,
                    "--nproc-per-node", 2)
    res = run(cmd, env=user_env(KDCACHE_SIGTERM_AT="before-replace-train_config.yaml@1"))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "stopped by SIGTERM at step 0" in res.stdout, res.stdout[-2000:]
    assert losses(out) == [] and "step-00000000" in " ".join(os.listdir(out / "checkpoints"))
    res = run(cmd)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert [r["step"] for r in losses(out)] == [1, 2, 3, 4]
