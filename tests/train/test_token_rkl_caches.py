"""Which caches token-rkl may train (only completions a policy sampled at a temperature > 0, with their
behaviour log-probs), and a token-rkl run's off-policy --mix-cache trained with GKD, counted per objective."""
import json

import pytest
import torch

from kdcache.common.errors import ConfigError
from kdcache.train.checks import check_sampled, not_sampled_by_a_policy, objectives
from kdcache.train.config import TrainConfig
from kdcache.train.losses import LossConfig, token_rkl_per_position
from tests.helpers.cli import precompute, write_jsonl
from tests.train.common import run, train_cmd


def _manifest(**capture):
    return {"fingerprint_parts": {"capture": capture}}


ON_POLICY = _manifest(mode="generate", generator="abc", temperature=1.0, top_p=1.0)


def _cfg(**kw):
    return TrainConfig(**{"cache": "C", "student": "S", "out": "O", "objective": "token-rkl", **kw})


@pytest.mark.parametrize("manifest,why", [
    (_manifest(mode="score"), "score mode"),
    (_manifest(mode="generate", temperature=1.0, top_p=1.0), "without --generator"),
    (_manifest(mode="generate", generator="abc", temperature=0.0, top_p=1.0), "greedy"),
    ({}, "score mode"),                                             # a cache that records no capture at all
])
def test_token_rkl_is_refused_on_completions_no_policy_sampled(manifest, why):
    assert why in not_sampled_by_a_policy(manifest)
    with pytest.raises(ConfigError, match=f"token-rkl on C: .*{why}"):
        objectives(_cfg(), [manifest])


def test_token_rkl_trains_a_generator_cache_and_gkd_trains_off_policy_data_beside_it(capsys):
    assert not_sampled_by_a_policy(ON_POLICY) is None
    assert objectives(_cfg(), [ON_POLICY]) == ["token-rkl"]
    assert objectives(_cfg(mix_cache="M", max_steps=4), [ON_POLICY, _manifest(mode="score")]) == ["token-rkl", "gkd"]
    assert objectives(_cfg(mix_cache="M", max_steps=4), [ON_POLICY, ON_POLICY]) == ["token-rkl", "token-rkl"]
    assert objectives(_cfg(cache=["C", "D", "E"]), [ON_POLICY, _manifest(mode="score"), ON_POLICY]) == \
        ["token-rkl", "gkd", "token-rkl"]
    assert objectives(_cfg(objective="gkd"), [_manifest(mode="score")]) == ["gkd"]
    assert "top-p" not in capsys.readouterr().err


def test_beta_of_a_token_rkl_run_is_the_divergence_of_its_gkd_micro_batches():
    cfg = _cfg(mix_cache="M", max_steps=4, beta=1.0)
    assert cfg.loss_config(objective="gkd").beta == 1.0 and cfg.loss_config().beta == 0.0
    assert cfg.loss_config().objective == "token-rkl"
    with pytest.raises(ConfigError, match="beta: 1.0 with --objective token-rkl and no off-policy cache"):
        objectives(_cfg(beta=1.0), [ON_POLICY])
    with pytest.raises(ConfigError, match="beta: 1.0 with --objective token-rkl and no off-policy cache"):
        objectives(_cfg(beta=1.0, cache=["C", "D"]), [ON_POLICY, ON_POLICY])


def test_a_nucleus_is_named_with_its_bias(capsys):
    objectives(_cfg(), [_manifest(mode="generate", generator="abc", temperature=1.0, top_p=0.9)])
    err = capsys.readouterr().err
    assert "--gen-top-p 0.9" in err and "nucleus-truncated" in err


def test_nan_behaviour_is_refused_not_read_as_the_student_itself():
    logp = torch.log_softmax(torch.randn(4, 10), -1)
    targets, t_lp = torch.tensor([1, 2, 3, 4]), torch.full((4,), -2.0)
    b = torch.full((4,), -1.5)
    token_rkl_per_position(logp, targets, t_lp, b)                     # finite: fine
    b[2] = float("nan")
    with pytest.raises(ConfigError, match="1 of 4 positions have no behaviour log-prob"):
        token_rkl_per_position(logp, targets, t_lp, b)
    token_rkl_per_position(logp, targets, t_lp, None)                  # None: sampled from this student just now
    assert LossConfig(objective="token-rkl").beta == 0.0


class _Sampled(dict):
    """A sampled cache's manifest, as check_sampled reads it."""
    def __init__(self, top_k):
        super().__init__()
        self.sample, self.top_k = 12, top_k


def test_a_tempered_loss_on_a_sampled_cache_needs_an_exact_top_k_and_is_named_biased(capsys):
    cfg = TrainConfig(cache="C", student="S", out="O", temperature=2.0)
    with pytest.raises(ConfigError, match="temperature: 2.0 on the sampled cache C, which stores no exact top-k"):
        check_sampled(cfg, [_Sampled(top_k=0)])
    check_sampled(cfg, [_Sampled(top_k=8)])
    assert "consistent, not unbiased" in capsys.readouterr().err
    check_sampled(TrainConfig(cache="C", student="S", out="O"), [_Sampled(top_k=0)])      # tau 1: exact
    assert capsys.readouterr().err == ""


# ---------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def caches(tiny, stopping, tmp_path_factory):
    """A generator cache (the tiny student samples at temperature 1, the stopping teacher scores) and a
    score-mode cache of the same teacher: on-policy and off-policy data."""
    d = tmp_path_factory.mktemp("rkl")
    data = write_jsonl(d / "d.jsonl", tiny["train"][:8])
    common = ("--teacher", stopping["sampled"], "--data", data, "--backend", "hf", "--top-k", 8,
              "--logprob-dtype", "float32", "--shard-size", 4)
    gen = precompute(*common, "--out", d / "gen", "--mode", "generate", "--generator", tiny["teacher"],
                     "--gen-temperature", 1, "--gen-max-new-tokens", 8, shared_ray=True)
    assert gen.returncode == 0, gen.stderr[-3000:]
    score = precompute(*common, "--out", d / "score", shared_ray=True)
    assert score.returncode == 0, score.stderr[-3000:]
    student = d / "student"
    from kdcache.demo.models import make_model
    make_model(tiny["tok"], "test", seed=5).config.save_pretrained(str(student))
    tiny["tok"].save_pretrained(str(student))
    return {"gen": d / "gen", "score": d / "score", "student": student, "dir": d}


@pytest.mark.ray
@pytest.mark.slow
def test_train_refuses_token_rkl_on_a_score_mode_cache(caches, tmp_path):
    setup = {"cache": caches["score"], "student": caches["student"]}
    res = run(train_cmd(setup, tmp_path / "out", "--objective", "token-rkl", "--max-steps", 2))
    assert res.returncode != 0
    assert f"token-rkl on {caches['score']}" in res.stderr and "score mode" in res.stderr, res.stderr[-2000:]
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


@pytest.mark.ray
@pytest.mark.slow
def test_a_token_rkl_run_trains_its_off_policy_mix_with_gkd_and_counts_each(caches, tmp_path):
    setup = {"cache": caches["gen"], "student": caches["student"]}
    out = tmp_path / "out"
    res = run(train_cmd(setup, out, "--objective", "token-rkl", "--mix-cache", caches["score"], "--mix-lambda",
                        0.5, "--beta", 1, "--max-steps", 8, "--batch-size", 2, "--save-every", 0))
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(x) for x in open(out / "metrics.jsonl")]
    seen = {"gkd": 0, "token-rkl": 0, "sft": 0}
    for row in rows:
        n = row["positions_by_objective"]
        assert sum(n.values()) == row["positions"]
        # one micro-batch per step: a step from --mix-cache trains GKD only, one from the round cache token-rkl
        assert n["gkd" if row["mixed_batches"] else "token-rkl"] == row["positions"], row
        for o, kd in row["kd_by_objective"].items():
            seen[o] += n[o] > 0
            if o == "gkd" and kd is not None:
                assert kd >= 0                          # a divergence over the buckets (token-rkl's can be < 0)
    assert seen["gkd"] and seen["token-rkl"] and not seen["sft"], seen
