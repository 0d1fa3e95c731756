"""`kdcache onpolicy --lora-r R --teacher base`: every round trains the same adapter on, the round's generator is
the merged student, and the base weights (the adapter disabled) score every round; two rounds, and a loop killed
(-9) in round 2's training and rerun equals one that ran through."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from kdcache.cache_format import open_cache
from tests.helpers.cli import on_shared_ray, user_env, user_project, write_jsonl

pytestmark = [pytest.mark.ray, pytest.mark.deepspeed, pytest.mark.slow]

ROUNDS, PROMPTS, STEPS = 2, 4, 4


def _command(tmp, tiny, out):
    # --sft-alpha: at the start the student is its base, so the KD term alone is 0 and would move nothing
    data = write_jsonl(tmp / "prompts.jsonl", tiny["train"][:6])
    args = ["--teacher", "base", "--lora-r", 4, "--sft-alpha", 0.5, "--student", tiny["teacher"], "--data", data,
            "--out", out, "--rounds", ROUNDS, "--prompts-per-round", PROMPTS, "--steps-per-round", STEPS,
            "--batch-size", 2, "--gen-max-new-tokens", 10, "--gen-temperature", 0, "--top-k", 8,
            "--logprob-dtype", "float32", "--backend", "hf", "--shard-size", 2, "--save-every", 1,
            "--warmup-steps", 2, "--lr", 1e-2, "--no-shuffle", "--no-progress", "--worker-cpus", "0.5"]
    args, env = on_shared_ray(args, user_env(RAY_ADDRESS=""))
    return [sys.executable, "-m", "kdcache", "onpolicy", *map(str, args)], env


def _metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _weights(path):
    from safetensors.torch import load_file
    return load_file(os.path.join(path, "model.safetensors"))


@pytest.fixture(scope="module")
def straight(tiny, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("onpolicy-lora")
    cmd, env = _command(tmp, tiny, str(tmp / "run"))
    res = subprocess.run(cmd, cwd=user_project(), env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "(the base weights, adapter disabled)" in res.stdout
    return str(tmp / "run"), tmp


def test_the_base_scores_every_round_and_one_adapter_trains_on(straight, tiny):
    from transformers import AutoModelForCausalLM
    out, _ = straight
    s = json.load(open(os.path.join(out, "summary.json")))
    assert [e["done"] for e in s["rounds"]] == [True, True]
    rows = _metrics(out)
    assert [r["step"] for r in rows] == list(range(1, ROUNDS * STEPS + 1))
    assert abs(rows[0]["kd"]) < 1e-6                  # step 1: the student is its base, the teacher that base
    assert min(r["kd"] for r in rows[STEPS:]) > 1e-5   # round 2: the trained student is not
    train_summary = json.load(open(os.path.join(out, "train_summary.json")))
    assert train_summary["lora"]["r"] == 4
    base, final = _weights(tiny["teacher"]), _weights(os.path.join(out, "final"))
    assert all(torch.equal(base[k], final[k]) for k in base if "embed" in k or "norm" in k)
    assert any(not torch.equal(base[k], final[k]) for k in base if "proj" in k)
    assert os.path.isfile(os.path.join(out, "final", "adapter", "adapter_config.json"))
    # round 2's cache: written by the merged student (OUT/final), scored by the base, not by the student
    cache = open_cache(s["rounds"][1]["cache"])
    assert cache.manifest["meta"]["generator"]["model"] == "final"
    models = [AutoModelForCausalLM.from_pretrained(m, dtype=torch.float32).eval()
              for m in (tiny["teacher"], os.path.join(out, "final"))]
    off = 0.0
    for r in cache:
        x = torch.tensor(r.input_ids[None].astype(np.int64))
        with torch.no_grad():
            lp = [torch.log_softmax(m(input_ids=x).logits[0], -1)[r.positions].numpy() for m in models]
        base_lp, final_lp = (np.take_along_axis(a, r.topk_ids.astype(np.int64), 1) for a in lp)
        np.testing.assert_allclose(r.topk_logprobs, base_lp, atol=2e-5)
        off = max(off, float(np.abs(r.topk_logprobs - final_lp).max()))
    assert off > 1e-3, off


def test_a_loop_killed_in_round_two_resumes_to_the_same_losses_and_adapter(straight, tiny):
    ref, tmp = straight
    out = str(tmp / "killed")
    cmd, env = _command(tmp, tiny, out)
    proc = subprocess.Popen(cmd, cwd=user_project(), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    metrics = os.path.join(out, "metrics.jsonl")
    deadline = time.time() + 400
    while time.time() < deadline and proc.poll() is None:
        if os.path.isfile(metrics) and len(_metrics(out)) >= STEPS + 1:
            break
        time.sleep(0.02)
    assert proc.poll() is None, proc.communicate()[0][-3000:]
    os.killpg(proc.pid, signal.SIGSTOP)          # held where it is, so the count below is where the kill lands
    done = len(_metrics(out))
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    assert STEPS < done < ROUNDS * STEPS, done                # the fault landed in round 2's training
    res = subprocess.run(cmd, cwd=user_project(), env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    want, got = _metrics(ref), _metrics(out)
    assert [r["step"] for r in got] == [r["step"] for r in want]
    assert [(r["loss"], r["kd"]) for r in got] == [(r["loss"], r["kd"]) for r in want]
    a, b = _weights(os.path.join(ref, "final")), _weights(os.path.join(out, "final"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    from safetensors.torch import load_file
    a, b = (load_file(os.path.join(o, "final", "adapter", "adapter_model.safetensors")) for o in (ref, out))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_teacher_base_without_lora_is_refused(tiny, tmp_path):
    from kdcache.common.errors import ConfigError
    from kdcache.onpolicy import parse
    with pytest.raises(ConfigError, match="teacher: `base` is the base weights under a LoRA student"):
        parse(["--teacher", "base", "--student", tiny["teacher"], "--data", "x.jsonl", "--out", str(tmp_path),
               "--prompts-per-round", "2", "--steps-per-round", "2"])


def test_self_distillation_with_privileged_context_scores_the_students_completions_in_the_teachers_view(
        tiny, tmp_path):
    """OPSD from a cache: the prompts carry teacher_messages (a hint in a system prompt); the student generates from
    its own prompt and the base, adapter disabled, scores each completion after the hinted prompt."""
    from transformers import AutoModelForCausalLM

    from kdcache.pipeline.data import parse_row
    from kdcache.pipeline.encode import Encoder
    hint = [{"role": "system", "content": "Hint: the skills are listed in the posting."}]
    recs = [dict(r, teacher_messages=hint + r["messages"]) for r in tiny["train"][:2]]
    data = write_jsonl(tmp_path / "hinted.jsonl", recs)
    out = str(tmp_path / "opsd")
    args = ["--teacher", "base", "--lora-r", 4, "--sft-alpha", 0.5, "--student", tiny["teacher"], "--data", data,
            "--out", out, "--rounds", 1, "--prompts-per-round", 2, "--steps-per-round", 2, "--batch-size", 2,
            "--gen-max-new-tokens", 8, "--gen-temperature", 0, "--top-k", 8, "--logprob-dtype", "float32",
            "--backend", "hf", "--no-progress", "--worker-cpus", "0.5"]
    args, env = on_shared_ray(args, user_env(RAY_ADDRESS=""))
    res = subprocess.run([sys.executable, "-m", "kdcache", "onpolicy", *map(str, args)], cwd=user_project(), env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = _metrics(out)
    # the hint makes the base another teacher: without one, step 1's kd is below 1e-6 (the test above)
    assert [r["step"] for r in rows] == [1, 2] and rows[0]["kd"] > 5e-6, rows
    cache = open_cache(json.load(open(os.path.join(out, "summary.json")))["rounds"][0]["cache"])
    base = AutoModelForCausalLM.from_pretrained(tiny["teacher"], dtype=torch.float32).eval()
    enc = Encoder(tiny["tok"])
    for r, rec in zip(cache, recs):
        p = enc.encode_prompt(parse_row(rec))
        assert r.input_ids[:len(p.input_ids)].tolist() == p.input_ids.tolist()
        assert r.teacher_input_ids[:len(p.teacher_ids)].tolist() == p.teacher_ids.tolist()
        assert r.teacher_input_ids[len(p.teacher_ids):].tolist() == r.input_ids[len(p.input_ids):].tolist()
        with torch.no_grad():
            lp = torch.log_softmax(base(input_ids=torch.tensor([r.teacher_input_ids.tolist()])).logits[0], -1)
        want = np.take_along_axis(lp[torch.as_tensor(r.teacher_positions, dtype=torch.long)].numpy(),
                                  r.topk_ids.astype(np.int64), 1)
        np.testing.assert_allclose(r.topk_logprobs, want, atol=2e-5)
