"""`kdcache onpolicy --teacher math=A --teacher code=B --route-field domain` (issue 45): each prompt's field picks
its teacher, a round writes one cache per teacher it used and trains on all of them; summary.json lists each
teacher's cache and tokens per round; an --offpolicy-cache is mixed in beside them (the round's caches share
--lambda by their positions); a prompt whose field names no teacher is refused by its line; a loop killed with
kill -9 mid-rollout and rerun gives the per-step losses of one that ran through."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from kdcache.cache_format.manifest import load_manifest
from tests.helpers.cli import on_shared_ray, precompute, user_env, user_project, write_jsonl

pytestmark = [pytest.mark.ray, pytest.mark.deepspeed, pytest.mark.slow]

ROUNDS, PROMPTS, STEPS, LAMBDA = 2, 4, 3, 0.6


def _prompts(tmp, tiny, domains):
    return write_jsonl(tmp / "prompts.jsonl", [dict(r, domain=d) for r, d in zip(tiny["train"], domains)])


def _command(tmp, tiny, stopping, out, data, stages="kept", offpolicy=None):
    mix = ["--offpolicy-cache", offpolicy, "--lambda", LAMBDA] if offpolicy else []
    args = [*mix, "--teacher", f"math={stopping['sampled']}", "--teacher", f"code={stopping['greedy']}",
            "--route-field", "domain", "--stages", stages, "--student", tiny["teacher"], "--data", data,
            "--out", out, "--rounds", ROUNDS, "--prompts-per-round", PROMPTS, "--steps-per-round", STEPS,
            "--batch-size", 1, "--gen-max-new-tokens", 8, "--gen-temperature", 0, "--top-k", 8,
            "--logprob-dtype", "float32", "--backend", "hf", "--shard-size", 2, "--save-every", 1,
            "--no-progress", "--worker-cpus", "0.5"]
    args, env = on_shared_ray(args, user_env(RAY_ADDRESS=""))
    return [sys.executable, "-m", "kdcache", "onpolicy", *map(str, args)], env


def _summary(out):
    with open(os.path.join(out, "summary.json")) as f:
        return json.load(f)


def _metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def straight(tiny, stopping, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("routed")
    data = _prompts(tmp, tiny, ["math", "code", "code", "math", "math", "code", "code", "math"])
    offpolicy = str(tmp / "offpolicy")
    res = precompute("--teacher", stopping["sampled"], "--data", write_jsonl(tmp / "off.jsonl", tiny["train"][8:12]),
                     "--out", offpolicy, "--backend", "hf", "--top-k", 8, "--logprob-dtype", "float32",
                     "--shard-size", 2, shared_ray=True)
    assert res.returncode == 0, res.stderr[-3000:]
    out = str(tmp / "run")
    cmd, env = _command(tmp, tiny, stopping, out, data, offpolicy=offpolicy)
    res = subprocess.run(cmd, cwd=user_project(), env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return out, tmp, data, offpolicy


def test_each_round_scores_each_prompt_with_its_teacher_and_trains_on_both_caches(straight, stopping):
    import yaml
    out, _, _, offpolicy = straight
    rounds = _summary(out)["rounds"]
    assert [e["stage"] for e in rounds] == ["trained", "trained"]
    for e in rounds:
        assert set(e["teachers"]) == {"math", "code"} and e["cache"] == [e["teachers"]["math"]["cache"],
                                                                           e["teachers"]["code"]["cache"]]
        assert sum(t["prompts"] for t in e["teachers"].values()) == PROMPTS
        assert e["teacher_tokens"] == sum(t["teacher_tokens"] for t in e["teachers"].values()) > 0
        for name, teacher in (("math", stopping["sampled"]), ("code", stopping["greedy"])):
            m = load_manifest(e["teachers"][name]["cache"])
            assert m.counts["samples"] == e["teachers"][name]["prompts"]
            assert m.counts["tokens"] == e["teachers"][name]["teacher_tokens"]
            assert m.meta["teacher"] == os.path.basename(str(teacher)), m.meta          # its own teacher
        # the off-policy cache beside them: the round's caches share --lambda by the positions each holds
        stage = yaml.safe_load(open(os.path.join(out, "rounds", f"round-{e['round']:04d}", "train.yaml")))
        assert stage["cache"] == e["cache"] + [offpolicy]
        tokens = [e["teachers"][n]["teacher_tokens"] for n in ("math", "code")]
        want = [LAMBDA * t / sum(tokens) for t in tokens] + [1 - LAMBDA]
        assert [float(w) for w in stage["cache_weights"].split(",")] == pytest.approx(want, rel=1e-5)
    rows = _metrics(out)
    assert [r["step"] for r in rows] == list(range(1, ROUNDS * STEPS + 1))
    for r, e in ((rows[0], rounds[0]), (rows[-1], rounds[1])):        # each round trains on its own two caches
        assert set(r["by_cache"]) == set(e["cache"]) | {offpolicy}
    assert sum(r["by_cache"][c]["batches"] for r in rows[STEPS:] for c in rounds[1]["cache"] + [offpolicy]) == STEPS
    assert sum(r["by_cache"][offpolicy]["batches"] for r in rows) > 0


def test_a_prompt_whose_field_names_no_teacher_is_refused_by_its_line(tiny, stopping, tmp_path):
    data = _prompts(tmp_path, tiny, ["math", "code", "bio", "math"])
    cmd, env = _command(tmp_path, tiny, stopping, str(tmp_path / "run"), data)
    res = subprocess.run(cmd, cwd=user_project(), env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode != 0 and f"{data}:3" in res.stderr and "names no teacher" in res.stderr, res.stderr[-2000:]
    assert not os.path.isdir(tmp_path / "run" / "rounds")                 # refused before any work
    bad = [c for c in cmd]
    bad[bad.index("--route-field"):bad.index("--route-field") + 2] = []
    res = subprocess.run(bad, cwd=user_project(), env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and "route_field" in res.stderr, res.stderr[-2000:]


def test_a_routed_loop_killed_mid_rollout_and_rerun_equals_one_that_ran_through(straight, tiny, stopping):
    ref, tmp, data, offpolicy = straight
    out = str(tmp / "killed")
    cmd, env = _command(tmp, tiny, stopping, out, data, stages="fresh", offpolicy=offpolicy)
    second = os.path.join(out, "rounds", "round-0002", "cache-math.txt")   # round 2's first teacher job has begun
    proc = subprocess.Popen(cmd, cwd=user_project(), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    t0 = time.time()
    while not os.path.isfile(second):
        assert proc.poll() is None and time.time() - t0 < 400, "the loop ended before round 2's rollout"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert [e["stage"] for e in _summary(out)["rounds"]] == ["trained", "new"]     # the fault landed mid-rollout
    res = subprocess.run(cmd, cwd=user_project(), env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    want, got = _metrics(ref), _metrics(out)
    assert [r["step"] for r in got] == [r["step"] for r in want]
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=1e-6, abs=1e-7)
    def drawn(rows):     # the caches' paths differ between the runs; what each step drew from them must not
        return [sorted((v["batches"], v["positions"]) for v in r["by_cache"].values()) for r in rows]
    assert drawn(got) == drawn(want)
