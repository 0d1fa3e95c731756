"""`kdcache onpolicy`: rounds of the student's own completions, scored by the teacher, trained on with one
schedule; a loop killed in round 2 and rerun equals one that ran through."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest

from kdcache.cache_format import open_cache, verify_cache
from kdcache.cache_format.manifest import load_manifest
from kdcache.common.errors import ConfigError, KdcacheError
from tests.helpers.cli import on_shared_ray, user_env, user_project, write_jsonl

pytestmark = [pytest.mark.ray, pytest.mark.deepspeed, pytest.mark.slow]

ROUNDS, PROMPTS, STEPS = 2, 4, 6


def _command(tmp, tiny, stopping, out, offpolicy=None, stages="auto"):
    data = write_jsonl(tmp / "prompts.jsonl", tiny["train"][:6])
    mix = ["--offpolicy-cache", offpolicy, "--lambda", 0.5] if offpolicy else []
    args = [*mix, "--stages", stages, "--teacher", stopping["sampled"], "--student", tiny["teacher"], "--data", data,
            "--out", out,
            "--rounds", ROUNDS, "--prompts-per-round", PROMPTS, "--steps-per-round", STEPS, "--batch-size", 2,
            "--gen-max-new-tokens", 10, "--gen-temperature", 0, "--top-k", 8, "--logprob-dtype", "float32",
            "--backend", "hf", "--shard-size", 2, "--save-every", 1, "--warmup-steps", 2, "--no-progress",
            "--worker-cpus", "0.5"]
    args, env = on_shared_ray(args, user_env(RAY_ADDRESS=""))
    return [sys.executable, "-m", "kdcache", "onpolicy", *map(str, args)], env


def _run(cmd, env, timeout=600):
    return subprocess.run(cmd, cwd=user_project(), env=env, capture_output=True, text=True, timeout=timeout)


def _summary(out):
    with open(os.path.join(out, "summary.json")) as f:
        return json.load(f)


def _metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def straight(tiny, stopping, tmp_path_factory):
    """One loop that ran through with each stage a command of its own (--stages fresh), half its micro-batches
    from an off-policy cache (the prompts' own completions, scored by the teacher): (out, tmp dir, off-policy
    cache)."""
    from tests.helpers.cli import precompute
    tmp = tmp_path_factory.mktemp("onpolicy")
    data = write_jsonl(tmp / "offpolicy.jsonl", tiny["train"][6:14])
    res = precompute("--teacher", stopping["sampled"], "--data", data, "--out", tmp / "offpolicy", "--backend", "hf",
                     "--top-k", 8, shared_ray=True)
    assert res.returncode == 0, res.stderr[-3000:]
    out = str(tmp / "run")
    cmd, env = _command(tmp, tiny, stopping, out, offpolicy=tmp / "offpolicy", stages="fresh")
    res = _run(cmd, env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "on-policy summary" in res.stdout and "stages: fresh" in res.stdout
    return out, tmp, str(tmp / "offpolicy")


def test_rounds_train_on_the_students_own_completions_with_one_schedule(straight, tiny):
    from kdcache.pipeline.teacher_hf import HFTeacher
    from kdcache.train.config import TrainConfig
    from kdcache.train.trainer import lr_lambda
    out, tmp, _ = straight
    s = _summary(out)
    assert [e["round"] for e in s["rounds"]] == [1, 2] and all(e["done"] for e in s["rounds"])
    assert [e["steps"] for e in s["rounds"]] == [[1, STEPS], [STEPS + 1, 2 * STEPS]]
    caches = [e["cache"] for e in s["rounds"]]
    assert all(c.startswith(os.path.join(out, "store")) for c in caches) and len(set(caches)) == 2
    for e in s["rounds"]:
        assert verify_cache(e["cache"]).ok
        assert e["teacher_tokens"] == load_manifest(e["cache"])["counts"]["tokens"] > 0
    # the prompt list cycles: round 2 completes records 4, 5, 0, 1 of the six
    lines = open(tmp / "prompts.jsonl").read().splitlines()
    assert open(os.path.join(out, "rounds", "round-0002", "prompts.jsonl")).read().splitlines() == \
        [lines[4], lines[5], lines[0], lines[1]]
    # round 1's completions are the initial student's own greedy ones; round 2's come from another model
    first, second = open_cache(caches[0]), open_cache(caches[1])
    assert first.manifest["meta"]["generator"]["model"] == os.path.basename(tiny["teacher"])
    assert second.manifest["meta"]["generator"]["model"] == "final"
    student, eos = HFTeacher(tiny["teacher"], dtype="float32"), set(first.eos_token_ids)
    recs = list(first)
    assert len(recs) == PROMPTS
    for r in recs:
        prompt = r.input_ids[:r.positions[0] + 1]
        new, ended, _ = student.generate([prompt], max_new_tokens=[10], temperature=0.0, top_p=1.0, seeds=[0],
                                         turn_ends=eos, logprobs=True)[0]
        assert r.input_ids[len(prompt):].tolist() == new and r.truncated == (not ended)
        assert r.behavior_logprobs is not None
    gen = [m["fingerprint_parts"]["capture"]["generator"] for m in (first.manifest, second.manifest)]
    assert gen[0] != gen[1]
    # one optimizer step count and one learning-rate schedule over both rounds (not restarted in round 2)
    rows = _metrics(out)
    assert [r["step"] for r in rows] == list(range(1, 2 * STEPS + 1))
    mixed = [r["mixed_batches"] for r in rows]              # one micro-batch a step: from either cache (lambda 0.5)
    assert set(mixed) == {0, 1} and 3 <= sum(mixed) <= 9, mixed
    assert sum(r["positions"] for r, m in zip(rows, mixed) if m) > 0
    f = lr_lambda(TrainConfig(cache="-", student="-", out="-", warmup_steps=2), 2 * STEPS)
    np.testing.assert_allclose([r["lr"] for r in rows], [5e-4 * f(r["step"]) for r in rows], rtol=1e-6)
    final = os.path.join(out, "final")
    assert os.path.isfile(os.path.join(final, "config.json"))
    gen_cfg = json.load(open(os.path.join(final, "generation_config.json")))
    assert sorted(np.atleast_1d(gen_cfg["eos_token_id"]).tolist()) == sorted(eos)


def _wait(predicate, proc, what, timeout=300):
    deadline = time.time() + timeout
    while not (value := predicate()):
        assert proc.poll() is None, f"the loop ended (exit {proc.returncode}) before {what}"
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


def _held_worker(loop, round2_location, held=None):
    """The loop, its processes and those of this test process's Ray head (its workers: the head's, or its fork
    server's) that stopped themselves (KDCACHE_STOP_AT): the teacher worker that holds round 2's second shard is
    returned, any other (the loop, or its worker on an earlier shard) is let go on. With `held` (that worker, found
    already) every other stopped process is let go on: the loop may stop at its own fourth publish after the worker
    did."""
    from tests.helpers.raycluster import shared_head
    head = shared_head()
    roots = (loop.pid, head.proc.pid) + ((head.forks.pid,) if head.forks else ())
    for root in roots:
        for p in [psutil.Process(root)] * (root == loop.pid) + psutil.Process(root).children(recursive=True):
            try:
                if p.status() != psutil.STATUS_STOPPED or (held is not None and p.pid == held.pid):
                    continue
                if held is None and "TeacherWorker" in " ".join(p.cmdline()) and os.path.isfile(round2_location):
                    return p
                p.resume()
            except psutil.NoSuchProcess:
                pass
    return None


def _pending(pid):
    """The signals sent to process pid and not yet delivered (it is stopped): /proc's ShdPnd mask."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1], 16) for line in f if line.startswith("ShdPnd:"))


def _stopped(pid):
    """Every thread of process pid is stopped (SIGSTOP has landed, not only been sent)."""
    states = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        except OSError:
            pass                                   # a thread that ended meanwhile
    return bool(states) and all(s in "Tt" for s in states)


def _committed(path_file):
    try:
        with open(path_file) as f:
            return len(load_manifest(f.read().strip()).shards)
    except (OSError, KdcacheError):       # not written yet
        return 0


def test_kept_stages_carry_the_trainer_across_rounds_as_fresh_stages_train(straight, tiny, stopping):
    """Uninterrupted, --stages kept: round 2 trains in the trainer kept from round 1 (trainer.next_cache, the
    off-policy stream reading on), and every per-step loss and source equals the fresh-stage run's."""
    ref_out, tmp, offpolicy = straight
    out = str(tmp / "kept")
    cmd, env = _command(tmp, tiny, stopping, out, offpolicy=offpolicy, stages="kept")
    res = _run(cmd, env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "stages: kept" in res.stdout
    want, got = _metrics(ref_out), _metrics(out)
    assert [r["step"] for r in got] == [r["step"] for r in want] and len(got) == ROUNDS * STEPS
    assert [(r["loss"], r["kd"], r["mixed_batches"]) for r in got] == \
        [(r["loss"], r["kd"], r["mixed_batches"]) for r in want]


def test_a_loop_killed_in_round_two_and_rerun_equals_one_that_ran_through(straight, tiny, stopping):
    """kill -9 of the loop (its stages kept up in it: Ray's teacher worker and the trainer) mid-rollout of round 2,
    then a hang-up mid-training of round 2, then a rerun: every per-step loss and source (round or off-policy
    cache), each round cache and the final weights equal those of the uninterrupted run, whose stages were
    commands of their own."""
    ref_out, tmp, offpolicy = straight
    out = str(tmp / "killed")
    cmd, env = _command(tmp, tiny, stopping, out, offpolicy=offpolicy, stages="kept")
    round2 = os.path.join(out, "rounds", "round-0002")
    # 1. kill -9 while round 2's cache has one of its two shards. The teacher worker, kept from round 1, writes
    # shards 1-2 of round 1 then 1-2 of round 2: it stops itself before its fourth (KDCACHE_STOP_AT), and holds
    # round 2's second shard while the driver commits the first (however fast the shards are made, the kill lands
    # between them). The loop stops itself at its own fourth publish too, and is let go on.
    proc = subprocess.Popen(cmd, cwd=user_project(), env=dict(env, KDCACHE_STOP_AT="before-publish@4"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    worker = _wait(lambda: _held_worker(proc, os.path.join(round2, "cache.txt")), proc, "round 2's second shard")
    _wait(lambda: _held_worker(proc, os.path.join(round2, "cache.txt"), held=worker) is None
          and _committed(os.path.join(round2, "cache.txt")) >= 1, proc, "round 2's first shard")
    stages = psutil.Process(proc.pid).children(recursive=True)
    proc.kill()
    for st in stages:                       # none where the stages are kept up in the loop
        try:
            st.kill()
        except psutil.NoSuchProcess:
            pass
    worker.kill()
    proc.wait()
    assert _committed(os.path.join(round2, "cache.txt")) == 1               # the fault landed mid-rollout
    assert [e["stage"] for e in _summary(out)["rounds"]] == ["trained", "new"]
    # 2. rerun as from a terminal (hang-ups not ignored, even when the suite runs under nohup); a hang-up once
    # round 2 has trained its first step. The loop, which trains in its own process, is frozen as the hang-up is
    # sent, so that it lands mid-training however fast the remaining steps are.
    proc = subprocess.Popen(cmd, cwd=user_project(), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
    _wait(lambda: os.path.isfile(os.path.join(out, "metrics.jsonl"))
          and any(r["step"] > STEPS for r in _metrics(out)), proc, "round 2's first step")
    proc.send_signal(signal.SIGSTOP)
    try:
        # Stopped before the hang-up is sent: sent together, the two are both pending and the kernel delivers the
        # lower-numbered SIGHUP first, so it never shows as pending (the suite once waited 300 s on that).
        _wait(lambda: _stopped(proc.pid), proc, "the loop to stop")
        assert max(r["step"] for r in _metrics(out)) < 2 * STEPS, "round 2 trained to its end before the fault"
        proc.send_signal(signal.SIGHUP)
        _wait(lambda: _pending(proc.pid) & (1 << (signal.SIGHUP - 1)), proc, "the hang-up to reach the loop")
    finally:
        proc.send_signal(signal.SIGCONT)
    text, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, text[-3000:]
    assert "stopped by SIGHUP in round 2 (training)" in text, text[-3000:]
    assert [e["stage"] for e in _summary(out)["rounds"]] == ["trained", "scored"]   # landed mid-training
    assert max(r["step"] for r in _metrics(out)) < 2 * STEPS
    # 3. rerun to the end
    res = _run(cmd, env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    want, got = _metrics(ref_out), _metrics(out)
    assert [r["step"] for r in got] == [r["step"] for r in want]
    assert [(r["loss"], r["kd"], r["mixed_batches"]) for r in got] == \
        [(r["loss"], r["kd"], r["mixed_batches"]) for r in want]
    fps = [[load_manifest(e["cache"]).fingerprint for e in _summary(o)["rounds"]] for o in (ref_out, out)]
    assert fps[0] == fps[1]
    from safetensors.numpy import load_file
    a, b = (load_file(os.path.join(o, "final", "model.safetensors")) for o in (ref_out, out))
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_a_rerun_with_other_settings_or_a_bad_student_is_refused(tiny, tmp_path):
    from kdcache import onpolicy
    data = write_jsonl(tmp_path / "p.jsonl", tiny["train"][:2])
    base = ["--teacher", tiny["teacher"], "--student", tiny["teacher"], "--data", data, "--out", str(tmp_path / "o"),
            "--prompts-per-round", "2", "--steps-per-round", "2"]
    cfg, pre, train = onpolicy.parse(base + ["--beta", "0.5", "--top-k", "8"])
    assert pre == {"top_k": 8} and train == {"beta": 0.5}
    os.makedirs(cfg.out)
    onpolicy.check_same_run(*onpolicy.parse(base + ["--beta", "0.9"]))     # a first run that did no work...
    onpolicy.check_same_run(cfg, pre, train)                               # ...does not lock its settings in
    onpolicy.save_summary(cfg.out, {"rounds": [{"round": 1, "stage": "scored", "cache": "c"}]})   # work done
    onpolicy.check_same_run(*onpolicy.parse(base + ["--beta", "0.5", "--top-k", "8", "--no-progress"]))
    with pytest.raises(ConfigError, match=r"train\.beta: 0\.5 then, 0\.0 now"):
        onpolicy.check_same_run(*onpolicy.parse(base + ["--beta", "0", "--top-k", "8"]))
    # an explicit default and a relative --out are the same run (issue 42, item 12)
    onpolicy.check_same_run(*onpolicy.parse(base + ["--beta", "0.5", "--top-k", "8", "--seed", "0", "--lr",
                                                     "0.0005", "--gen-temperature", "1.0"]))
    here = os.getcwd()
    os.chdir(tmp_path)
    try:
        rel = base[:base.index("--out") + 1] + ["o"] + base[base.index("--out") + 2:]
        onpolicy.check_same_run(*onpolicy.parse(rel + ["--beta", "0.5", "--top-k", "8"]))
    finally:
        os.chdir(here)
    with open(data, "a") as f:                                              # the prompts edited at the same path
        f.write(json.dumps(tiny["train"][5]) + "\n")
    with pytest.raises(ConfigError, match=r"onpolicy\.data_sha256: '[0-9a-f]+' then"):
        onpolicy.check_same_run(*onpolicy.parse(base + ["--beta", "0.5", "--top-k", "8"]))
    with pytest.raises(ConfigError, match="beta"):
        onpolicy.parse(base + ["--beta", "2"])              # the stage's own checks run before any stage starts
    with pytest.raises(SystemExit):
        onpolicy.parse(base + ["--max-steps", "9"])         # the loop sets it: no such flag
    with pytest.raises(ConfigError, match="token-rkl on greedy rollouts"):
        onpolicy.parse(base + ["--objective", "token-rkl", "--gen-temperature", "0"])
    with pytest.raises(ConfigError, match="beta: 1.0 with --objective token-rkl and no --offpolicy-cache"):
        onpolicy.parse(base + ["--objective", "token-rkl", "--beta", "1"])
    onpolicy.parse(base + ["--objective", "token-rkl", "--beta", "1", "--offpolicy-cache", str(tmp_path)])
    with pytest.raises(ConfigError, match="not a model directory"):
        onpolicy.main(base[:2] + ["--student", str(tmp_path)] + base[4:])


def test_a_sampled_round_with_no_top_k_trains_token_rkl_from_the_target_and_behaviour_logprobs(tiny, stopping,
                                                                                                 tmp_path):
    """--top-k 0 --objective token-rkl at temperature 1, under nohup and hung up mid-round: the loop goes on; the
    round cache holds no entries, each target's teacher log-prob (equal to the teacher's forward pass) and the
    student's sampling log-prob (equal to its own softmax); the first step, where the student is still the
    behaviour policy, has the mean log-ratio log S(y) - log T(y) as its loss."""
    import torch
    from transformers import AutoModelForCausalLM
    cmd, env = _command(tmp_path, tiny, stopping, str(tmp_path / "run"))
    for flag, value in (("--rounds", "1"), ("--steps-per-round", "1"), ("--gen-temperature", "1"),
                        ("--top-k", "0"), ("--batch-size", str(PROMPTS))):
        cmd[cmd.index(flag) + 1] = value
    # started as `nohup` starts it (SIGHUP ignored), and hung up once its first shard is in: it goes on to the end
    proc = subprocess.Popen(cmd + ["--objective", "token-rkl", "--no-shuffle"], cwd=user_project(), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    _wait(lambda: _committed(str(tmp_path / "run" / "rounds" / "round-0001" / "cache.txt")) >= 1, proc,
          "the round's first shard")
    os.killpg(proc.pid, signal.SIGHUP)
    text, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0 and "stopped" not in text, text[-3000:]
    assert _summary(str(tmp_path / "run"))["rounds"][0]["done"]
    cache = open_cache(_summary(str(tmp_path / "run"))["rounds"][0]["cache"])
    assert cache.manifest["top_k"] == 0
    student, teacher = (AutoModelForCausalLM.from_pretrained(m, dtype=torch.float32)
                        for m in (tiny["teacher"], stopping["sampled"]))
    total, n = 0.0, 0
    for r in cache:
        assert r.topk_ids.shape == (len(r.positions), 0)
        x = torch.tensor(r.input_ids[None].astype(np.int64))
        at = (torch.tensor(r.positions), torch.tensor(r.targets))
        with torch.no_grad():
            s_lp, t_lp = (torch.log_softmax(m(input_ids=x).logits[0], -1)[at].numpy() for m in (student, teacher))
        np.testing.assert_allclose(r.target_logprobs, t_lp, atol=2e-5)
        np.testing.assert_allclose(r.behavior_logprobs, s_lp, atol=2e-5)
        total += float((s_lp - t_lp).sum())
        n += len(r.positions)
    row = _metrics(str(tmp_path / "run"))[0]
    assert row["positions"] == n
    assert row["loss"] == pytest.approx(total / n, rel=1e-4, abs=1e-5)
