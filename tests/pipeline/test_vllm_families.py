"""vLLM on other families' templates and architectures (a file of its own so that it runs beside test_vllm.py)."""
import pytest

from kdcache.cache_format import open_cache, verify_cache
from tests.helpers.cli import precompute, write_jsonl
from tests.pipeline.test_vllm import assert_topk_parity, hf_reference

pytestmark = [pytest.mark.vllm, pytest.mark.ray, pytest.mark.slow]


@pytest.mark.parametrize("family,backend", [("gemma", "vllm"), ("mistral", "vllm"), ("llama3", "served")])
def test_vllm_on_other_families_agrees_with_transformers_and_stops_on_their_ids(family, backend, tmp_path):
    """Not only Qwen2 and ChatML: a Gemma 2 teacher (soft-capped logits, eager attention in transformers) and a
    Mistral one scored by vLLM in process, a Llama 3 one (three stop ids) through `vllm serve`; multi-turn chats:
    equal to transformers at every position, every end-of-turn position kept (verify), the family's stop ids
    recorded."""
    import vllm  # noqa: F401

    from kdcache.demo.task import corpus, make_splits
    from tests.helpers.families import (
        CHATS,
        FAMILY_ARCH,
        corpus_texts,
        expected_refusal,
        family_model,
        family_tokenizer,
    )
    from tests.helpers.vllm_server import VLLMServer
    tok = family_tokenizer(family, str(tmp_path / "tok"), corpus_texts() + list(corpus(make_splits(60, 0, seed=0)[0])))
    teacher = str(tmp_path / "teacher")
    family_model(tok, teacher, arch=FAMILY_ARCH[family])
    chats = [{"messages": c["messages"]} for c in CHATS if not expected_refusal(family, c["messages"])][:4]
    data = write_jsonl(tmp_path / "d.jsonl", chats)
    args = ["--data", data, "--out", tmp_path / "c", "--top-k", 16, "--logprob-dtype", "float32"]
    server = None
    try:
        if backend == "served":
            server = VLLMServer(teacher, max_logprobs=16, max_model_len=256, log_path=tmp_path / "vllm.log").start()
            res = precompute("--teacher", server.url, "--tokenizer", teacher, *args, timeout=600, shared_ray=True)
        else:
            res = precompute("--teacher", teacher, "--backend", "vllm", "--max-length", 256, "--enforce-eager", *args,
                             timeout=600, shared_ray=True)
    finally:
        if server is not None:
            server.stop()
    assert res.returncode == 0, res.stderr[-3000:]
    assert verify_cache(tmp_path / "c").ok
    cache = open_cache(tmp_path / "c")
    assert cache.manifest["meta"]["teacher_backend"] == backend
    recs = list(cache)
    assert len(recs) == len(chats)
    stops = {tok.convert_ids_to_tokens(int(t)) for t in cache.eos_token_ids}
    want = {"llama3": {"<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"}, "gemma": {"<end_of_turn>", "<eos>"},
            "mistral": {"</s>"}}[family]
    assert want <= stops, stops
    _, ref = hf_reference(teacher, recs, 16)
    for w, r in zip(ref, recs):
        assert_topk_parity(w, r)
