"""Reading vLLM's flat logprob layout (prompt and generated steps), without starting vLLM."""
import sys
import types
from types import SimpleNamespace

import numpy as np
import pytest

from kdcache.pipeline.teacher_vllm import VLLMTeacher, _topk_from_flat


class Flat:
    """vLLM FlatLogprobs: per prompt position, [prompt token (any rank), rank 1, ..., rank k]; position 0 empty."""

    def __init__(self, T, k, V, rng, shuffle=False):
        self.start_indices, self.end_indices, self.token_ids, self.logprobs, self.ranks = [0], [0], [], [], []
        self.want_ids, self.want_lp, self.want_target, self.seq = [], [], [], [0]
        for _ in range(1, T):
            lp = np.log(rng.dirichlet(np.ones(V)))
            order = np.argsort(-lp)
            tok = int(rng.integers(V))
            entries = [(tok, lp[tok], int(np.flatnonzero(order == tok)[0]) + 1)]
            self.seq.append(tok)
            self.want_target.append(lp[tok])
            entries += [(int(order[r]), lp[order[r]], r + 1) for r in range(k)]
            if shuffle:                                   # an unexpected order forces the per-position path
                entries = [entries[i] for i in rng.permutation(len(entries))]
            self.start_indices.append(len(self.token_ids))
            for t, v, r in entries:
                self.token_ids.append(t)
                self.logprobs.append(float(v))
                self.ranks.append(r)
            self.end_indices.append(len(self.token_ids))
            self.want_ids.append(order[:k])
            self.want_lp.append(lp[order[:k]])


@pytest.mark.parametrize("shuffle", [False, True])
def test_topk_from_flat_layout(shuffle):
    T, k = 15, 6
    flat = Flat(T, k, 40, np.random.default_rng(1), shuffle=shuffle)
    pos = np.array([0, 3, 4, T - 2])                      # position t reads entry t + 1
    ids, lps, target = _topk_from_flat(flat, pos + 1, np.array(flat.seq)[pos + 1], k)
    assert ids.dtype == np.int32 and lps.dtype == np.float32 and ids.shape == lps.shape == (len(pos), k)
    np.testing.assert_array_equal(ids, np.array(flat.want_ids)[pos])
    np.testing.assert_allclose(lps, np.array(flat.want_lp)[pos], rtol=1e-6)
    np.testing.assert_allclose(target, np.array(flat.want_target)[pos], rtol=1e-6)   # the token itself, any rank


@pytest.fixture
def fake_vllm(monkeypatch):
    """A teacher whose engine answers with given outputs; a stand-in `vllm` module for its imports."""
    mod = types.ModuleType("vllm")
    mod.SamplingParams = lambda **kw: SimpleNamespace(**kw)
    mod.TokensPrompt = lambda prompt_token_ids: prompt_token_ids
    monkeypatch.setitem(sys.modules, "vllm", mod)

    def make(outputs):
        t = object.__new__(VLLMTeacher)
        t.calls = []
        t.llm = SimpleNamespace(generate=lambda prompts, params, use_tqdm: t.calls.append(params) or outputs)
        return t
    return make


def test_wrong_length_is_an_error(fake_vllm):
    flat = Flat(5, 3, 20, np.random.default_rng(0))
    t = fake_vllm([SimpleNamespace(prompt_logprobs=flat)])
    with pytest.raises(RuntimeError, match="for 5 positions, expected 6"):
        t.score([np.zeros(6, np.int32)], [np.array([0])], 3)


def test_generate_scored_reads_each_generated_step(fake_vllm):
    """One pass: the generated ids, and at step j the top-k and the generated token's own log-prob."""
    k, flat = 4, Flat(6, 4, 30, np.random.default_rng(2))
    steps = SimpleNamespace(**{name: getattr(flat, name)[1:] for name in ("start_indices", "end_indices")},
                            token_ids=flat.token_ids, logprobs=flat.logprobs, ranks=flat.ranks)
    new = flat.seq[1:]                                    # 5 generated tokens; step j is entry j
    t = fake_vllm([SimpleNamespace(outputs=[SimpleNamespace(token_ids=new, logprobs=steps)])])
    out = t.generate_scored([np.array([1, 2]), np.array([3])], k=k, max_new_tokens=[5, 0], temperature=0.0,
                            top_p=1.0, seeds=[7, 8], turn_ends={new[-1]})
    (params,) = t.calls
    assert len(params) == 1 and params[0].logprobs == k and params[0].flat_logprobs and params[0].seed == 7
    (got_new, ended, sc), (none, ended2, empty) = out
    assert got_new == new and ended and none == [] and not ended2 and empty.ids.shape == (0, k)
    np.testing.assert_array_equal(sc.ids, np.array(flat.want_ids))
    np.testing.assert_allclose(sc.logprobs, np.array(flat.want_lp), rtol=1e-6)
    np.testing.assert_allclose(sc.target_logprobs, np.array(flat.want_target), rtol=1e-6)
    # generate() is the same pass with the scores dropped
    assert t.generate([np.array([1, 2]), np.array([3])], max_new_tokens=[5, 0], temperature=0.0, top_p=1.0,
                      seeds=[7, 8], turn_ends={new[-1]}) == [(new, True), ([], False)]


def test_an_engine_that_cannot_split_samples_gets_whole_ones_and_says_so(monkeypatch, capsys):
    """--batch-tokens is vLLM's step (a longer sample split over steps). A model whose engine has no chunked
    prefill refuses a step below max_model_len (vLLM's ValueError): the teacher then asks for whole samples per
    step and says what that costs; any other refusal is raised as it is."""
    made = []

    def llm(**kw):
        made.append(kw["max_num_batched_tokens"])
        if kw["max_num_batched_tokens"] < kw["max_model_len"]:
            raise ValueError(f"max_num_batched_tokens ({kw['max_num_batched_tokens']}) is smaller than "
                             f"max_model_len ({kw['max_model_len']}).")
        return SimpleNamespace()
    mod = types.ModuleType("vllm")
    mod.LLM = llm
    monkeypatch.setitem(sys.modules, "vllm", mod)
    VLLMTeacher("m", max_length=4096, batch_tokens=512)
    assert made == [512, 4096]
    assert "cannot split a sample over engine steps" in capsys.readouterr().out
    made.clear()
    VLLMTeacher("m", max_length=4096, batch_tokens=8192)            # a step above max_model_len: asked as given
    assert made == [8192]

    def refuses(**kw):
        raise ValueError("max_logprobs must be ...")
    mod.LLM = refuses
    with pytest.raises(ValueError, match="max_logprobs"):
        VLLMTeacher("m", max_length=4096, batch_tokens=512)


@pytest.mark.parametrize("cpu,ranks,length,want", [(True, 1, 2048, 4096), (True, 2, 2048, 8192),
                                                    (True, 1, 6000, 6000), (True, 1, 32768, 8192),
                                                    (False, 1, 2048, 8192), (False, 4, 2048, 8192)])
def test_batch_tokens_0_is_vllms_own_cpu_step_on_cpu_and_8192_on_gpus(monkeypatch, cpu, ranks, length, want):
    """--batch-tokens 0 (the default): vLLM's CPU default of 4096 per rank on CPU, where 8192 scored 7-10% slower
    (BENCHMARKS.md), but never below a sample of up to 8192 tokens (a sampled generator's prompt must fit one step
    on CPU, as it did at the old default); 8192 on GPUs, where the step's [tokens, V] log-probs bound memory. A
    value given is kept."""
    made = []

    def llm(**kw):
        made.append(kw["max_num_batched_tokens"])
        return SimpleNamespace()
    mod = types.ModuleType("vllm")
    mod.LLM = llm
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = SimpleNamespace(is_cpu=lambda: cpu)
    monkeypatch.setitem(sys.modules, "vllm", mod)
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
    tp = {} if ranks == 1 else {"tensor_parallel_size": ranks}
    VLLMTeacher("m", max_length=length, batch_tokens=0, **tp)
    VLLMTeacher("m", max_length=length, batch_tokens=1234, **tp)
    assert made == [want, 1234]


def test_the_default_batch_tokens_is_0_and_the_hf_teacher_reads_it_as_8192(tiny):
    from kdcache.pipeline.config import PrecomputeConfig
    from kdcache.pipeline.teacher_hf import HFTeacher
    assert PrecomputeConfig.__dataclass_fields__["batch_tokens"].default == 0
    assert HFTeacher(tiny["teacher"], batch_tokens=0).batch_tokens == 8192
    assert HFTeacher(tiny["teacher"], batch_tokens=300).batch_tokens == 300
