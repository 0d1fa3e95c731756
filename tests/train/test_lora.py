"""`kdcache train --lora-r R`: a LoRA student through PEFT. Only the adapters train; OUT/final is the merged model
and OUT/final/adapter the adapter; checkpoints hold the adapters only; resume is exact; bad settings are refused."""
import json
import os

import numpy as np
import pytest
import torch

from kdcache.cache_format import open_cache
from tests.train.common import losses, make_setup, run, signal_mid_run, train_cmd

pytestmark = [pytest.mark.deepspeed, pytest.mark.slow]


@pytest.fixture(scope="module")
def setup(tiny, tmp_path_factory):
    """The trainer tests' cache, and a pretrained student (weights on disk): LoRA adapts frozen weights."""
    from kdcache.demo.models import make_model, save
    s = make_setup(tiny, tmp_path_factory)
    save(make_model(tiny["tok"], "test", seed=5), tiny["tok"], str(s["dir"] / "pretrained"))
    return dict(s, student=s["dir"] / "pretrained")


LORA = ("--lora-r", 4, "--batch-size", 2, "--no-shuffle")


def second_cache(setup):
    """The same teacher over 16 other records: a cache to mix in (a cache mixed with itself is refused)."""
    from tests.helpers.cli import precompute, write_jsonl
    out = setup["dir"] / "cache-mix"
    if not (out / "manifest.json").exists():
        data = write_jsonl(setup["dir"] / "d-mix.jsonl", setup["records"][48:64])
        res = precompute("--teacher", setup["dir"] / "teacher", "--data", data, "--out", out, "--backend", "hf",
                         "--top-k", 32, "--shard-size", 8, shared_ray=True)
        assert res.returncode == 0, res.stderr
    return out


def weights(path):
    from safetensors.torch import load_file
    return load_file(os.path.join(path, "model.safetensors"))


def straight(setup, steps=8):
    out = setup["dir"] / f"lora-straight-{steps}"
    if not (out / "train_summary.json").exists():
        res = run(train_cmd(setup, out, "--max-steps", steps, *LORA, "--save-every", 0))
        assert res.returncode == 0, res.stderr[-3000:]
    return out


def test_only_the_adapters_train_and_final_is_base_plus_adapter(setup):
    out = straight(setup)
    summary = json.load(open(out / "train_summary.json"))
    p = summary["parameters"]
    assert 0 < p["trainable"] < 0.2 * p["total"], p
    assert summary["lora"] == {"r": 4, "alpha": 8.0, "dropout": 0.0, "targets": "default"}
    assert summary["loss_path"].startswith("fused head")                  # the head frozen, still fused
    base, final = weights(setup["student"]), weights(out / "final")
    assert base.keys() == final.keys()                                    # the merged model: stock names, no lora_*
    moved = {k for k in base if not torch.equal(base[k], final[k])}
    assert moved and all(any(t in k for t in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                              "down_proj")) for k in moved), moved
    untouched = [k for k in base if "embed" in k or "norm" in k]
    assert untouched and all(torch.equal(base[k], final[k]) for k in untouched)   # bit-equal to the base
    # PEFT's own loading of the adapter onto the base gives final's logits; final stops like the teacher
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    merged = AutoModelForCausalLM.from_pretrained(out / "final").eval()
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(setup["student"]),
                                        out / "final" / "adapter").eval()
    ids = torch.tensor([[5, 17, 33, 2, 9, 41, 7, 3]])
    with torch.no_grad():
        torch.testing.assert_close(adapted(input_ids=ids).logits, merged(input_ids=ids).logits, atol=1e-5,
                                   rtol=1e-5)
    cache_eos = json.load(open(setup["cache"] / "manifest.json"))["eos_token_ids"]
    assert sorted(merged.generation_config.eos_token_id) == sorted(cache_eos)


def test_checkpoints_hold_the_adapters_not_the_base(setup, tmp_path):
    out = tmp_path / "o"
    res = run(train_cmd(setup, out, "--max-steps", 2, *LORA, "--save-every", 2))
    assert res.returncode == 0, res.stderr[-3000:]
    full = tmp_path / "full"
    res = run(train_cmd(setup, full, "--max-steps", 2, "--batch-size", 2, "--no-shuffle", "--save-every", 2))
    assert res.returncode == 0, res.stderr[-3000:]

    def size(d):
        return sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
    lora_bytes, full_bytes = size(out / "checkpoints"), size(full / "checkpoints")
    assert lora_bytes < 0.3 * full_bytes, (lora_bytes, full_bytes)
    states = list((out / "checkpoints").rglob("mp_rank_00_model_states.pt"))
    assert len(states) == 1
    module = torch.load(states[0], map_location="cpu", weights_only=False)["module"]
    assert module and all("lora_" in k for k in module), [k for k in module if "lora_" not in k][:5]


def test_sigterm_sighup_and_kill9_then_resume_give_the_straight_runs_losses(setup, tmp_path):
    """A SIGTERM (a batch scheduler), a hang-up (a closed terminal) and a kill -9, each at a logged step of the
    same run, each followed by a rerun: the per-step losses and the adapter are the straight run's."""
    import signal

    from safetensors.torch import load_file
    ref = straight(setup)
    want = [r["loss"] for r in losses(ref)]
    out = tmp_path / "o"
    cmd = train_cmd(setup, out, "--max-steps", 8, *LORA, "--save-every", 2)
    for sig, at in ((signal.SIGTERM, 2), (signal.SIGHUP, 4), (signal.SIGKILL, 6)):
        output, sent = signal_mid_run(cmd, out, at, sig)
        assert sent < 8 and len(losses(out)) < 8, (sig, sent)            # each fault landed mid-run
        if sig != signal.SIGKILL:
            assert f"stopped by {sig.name}" in output, output[-3000:]
        if at > 2:
            assert "resumed from" in output, output[-3000:]
    res = run(cmd)
    assert res.returncode == 0 and "resumed from" in res.stdout, res.stderr[-3000:]
    got = losses(out)
    assert [r["step"] for r in got] == list(range(1, 9))
    assert [r["loss"] for r in got] == pytest.approx(want, rel=1e-6, abs=1e-7)
    a, b = (load_file(o / "final" / "adapter" / "adapter_model.safetensors") for o in (ref, out))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-7)


def test_a_changed_lora_setting_is_refused_on_resume(setup, tmp_path):
    out = tmp_path / "o"
    res = run(train_cmd(setup, out, "--max-steps", 4, *LORA, "--save-every", 2, "--stop-after", 2))
    assert res.returncode == 0, res.stderr[-3000:]
    again = run(train_cmd(setup, out, "--max-steps", 4, "--lora-r", 8, "--batch-size", 2, "--no-shuffle"))
    assert again.returncode != 0 and "r 4 there, 8 here" in again.stderr, again.stderr[-2000:]
    full = run(train_cmd(setup, out, "--max-steps", 4, "--batch-size", 2, "--no-shuffle"))
    assert full.returncode != 0 and "full fine-tuning" in full.stderr, full.stderr[-2000:]


def test_bad_lora_settings_are_refused_by_name(setup, tmp_path):
    res = run(train_cmd(setup, tmp_path / "a", "--max-steps", 2, *LORA, "--lora-targets", "q_proj,qkv"))
    assert res.returncode != 0 and "['qkv'] match no linear module" in res.stderr and "'v_proj'" in res.stderr, \
        res.stderr[-2000:]
    adapter = straight(setup) / "final" / "adapter"
    res = run(train_cmd(dict(setup, student=adapter), tmp_path / "b", "--max-steps", 2, *LORA))
    assert res.returncode != 0 and "is a PEFT adapter" in res.stderr, res.stderr[-2000:]
    fresh = dict(setup, student=setup["dir"] / "student")                     # a config, no weights
    res = run(train_cmd(fresh, tmp_path / "c", "--max-steps", 2, *LORA))
    assert res.returncode != 0 and "has no weights" in res.stderr, res.stderr[-2000:]


def test_peft_missing_or_too_old_is_refused_naming_the_version(monkeypatch):
    import sys
    import types

    from kdcache.common.errors import ConfigError
    from kdcache.train import lora
    monkeypatch.setitem(sys.modules, "peft", types.SimpleNamespace(__version__="0.10.0"))
    with pytest.raises(ConfigError, match=r"PEFT >= 0\.13; this is 0\.10\.0"):
        lora.check_peft()
    monkeypatch.setitem(sys.modules, "peft", None)                     # import peft raises ImportError
    with pytest.raises(ConfigError, match="not installed"):
        lora.check_peft()


def test_two_ranks_under_zero_2_and_3_train_the_same_adapters(setup, tmp_path):
    # LoRA under DeepSpeed's sharded optimizers, two processes (torchrun): the frozen base is never in the
    # optimizer, ZeRO-3 partitions it all the same; both stages give ZeRO-2's losses and adapters.
    import sys

    from tests.helpers.cli import user_env as env_of

    def two(stage, out):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(29537 + stage), "-m", "kdcache", *train_cmd(setup, out, "--max-steps", 3, *LORA, "--save-every",
                                                               0, "--threads", 1, "--deepspeed", stage)[3:]]
        res = run(cmd, env=env_of())
        assert res.returncode == 0, res.stderr[-3000:]
        return [r["loss"] for r in losses(out)]
    a, b = two(2, tmp_path / "z2"), two(3, tmp_path / "z3")
    assert a == pytest.approx(b, rel=1e-4)
    wa, wb = weights(tmp_path / "z2" / "final"), weights(tmp_path / "z3" / "final")
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=1e-4, rtol=1e-3)
    assert (tmp_path / "z3" / "final" / "adapter" / "adapter_model.safetensors").stat().st_size > 0


@pytest.mark.parametrize("extra", [("--pack", "--max-tokens", 128), ("--max-tokens", 96), ("--objective", "sft"),
                                   ("--sft-alpha", 0.5, "--grad-accum", 2), ("--nproc-per-node", 2, "--threads", 1),
                                   ("--mix-cache", "CACHE", "--mix-lambda", 0.5), ("--deepspeed", 1)],
                         ids=["pack", "max-tokens", "sft", "sft-term-accum", "two-ranks", "mix-cache", "zero-1"])
def test_lora_runs_with_the_trainers_other_settings(setup, tmp_path, extra):
    extra = [second_cache(setup) if x == "CACHE" else x for x in extra]
    out = tmp_path / "o"
    res = run(train_cmd(setup, out, "--max-steps", 3, *LORA, "--save-every", 0, *extra))
    assert res.returncode == 0, res.stderr[-3000:]
    assert len(losses(out)) == 3
    summary = json.load(open(out / "train_summary.json"))
    assert summary["lora"]["r"] == 4 and summary["parameters"]["trainable"] < summary["parameters"]["total"]
    base, final = weights(setup["student"]), weights(out / "final")
    assert any(not torch.equal(base[k], final[k]) for k in base if "proj" in k)
    assert all(torch.equal(base[k], final[k]) for k in base if "embed" in k or "norm" in k)


@pytest.fixture(scope="module")
def policy_caches(setup, tiny):
    """Two caches the other objectives need, from the setup's teacher over 8 chats: one of draws from the teacher
    (--sample 8: the sampled forward KL) and one of completions the LoRA student's base sampled at temperature 1,
    scored by the teacher (generate mode with --generator: token-rkl)."""
    from tests.helpers.cli import precompute, write_jsonl
    d, teacher = setup["dir"], setup["dir"] / "teacher"
    data = write_jsonl(d / "policy.jsonl", tiny["train"][:8])
    common = ["--teacher", teacher, "--data", data, "--backend", "hf", "--shard-size", 4]
    res = precompute(*common, "--sample", 8, "--out", d / "sampled", shared_ray=True)
    assert res.returncode == 0, res.stderr[-3000:]
    res = precompute(*common, "--mode", "generate", "--generator", setup["student"], "--gen-temperature", 1.0,
                     "--gen-max-new-tokens", 12, "--top-k", 8, "--out", d / "rollouts", shared_ray=True)
    assert res.returncode == 0, res.stderr[-3000:]
    return {"sampled": d / "sampled", "token-rkl": d / "rollouts"}


@pytest.mark.parametrize("objective", ["sampled", "token-rkl"])
def test_lora_trains_on_a_sampled_cache_and_with_token_rkl(setup, policy_caches, tmp_path, objective):
    """The sampled forward KL (a --sample cache) and token-rkl (the base's own sampled completions) train only the
    adapters through the fused head; the loss they log is theirs, and it falls."""
    out = tmp_path / "o"
    extra = ("--objective", "token-rkl") if objective == "token-rkl" else ()
    cmd = train_cmd(dict(setup, cache=policy_caches[objective]), out, "--max-steps", 6, *LORA, "--save-every", 0,
                    "--lr", 2e-2, "--batch-size", 8, *extra)      # step 1 is all 8 records
    res = run(cmd)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = losses(out)
    summary = json.load(open(out / "train_summary.json"))
    assert len(rows) == 6 and summary["lora"]["r"] == 4
    assert all(np.isfinite(r["kd"]) for r in rows) and rows[-1]["kd"] != rows[0]["kd"]
    cache = open_cache(str(policy_caches[objective]))
    if objective == "token-rkl":
        # step 1: the adapters start at zero, so the student is its base, the policy that drew the tokens: the
        # loss is the mean log-ratio log S(y) - log T(y) over every sampled token
        ratios = np.concatenate([r.behavior_logprobs - r.target_logprobs for r in cache])
        assert rows[0]["positions"] == len(ratios)
        assert rows[0]["kd"] == pytest.approx(float(ratios.mean()), rel=1e-4, abs=1e-5)
    else:
        assert cache.manifest["sample"] == 8 and rows[0]["positions"] == sum(len(r.positions) for r in cache)
    base, final = weights(setup["student"]), weights(out / "final")
    assert any(not torch.equal(base[k], final[k]) for k in base if "proj" in k)
    assert all(torch.equal(base[k], final[k]) for k in base if "embed" in k or "norm" in k)
