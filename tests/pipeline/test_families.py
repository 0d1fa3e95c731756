"""Real template shapes (tests/helpers/families.py): every allowed chat is cached token-exact, nothing is
skipped, every assistant turn is trained through its end-of-turn token, and no user or system token is."""
import numpy as np
import pytest

from kdcache.common.chat import render
from kdcache.common.errors import BadRow
from kdcache.demo.task import corpus, make_splits
from kdcache.pipeline.data import parse_row
from kdcache.pipeline.encode import Encoder, document_end_id, end_of_turn_ids
from tests.helpers.families import CHATS, CODE, FAMILIES, corpus_texts, expected_refusal, family_tokenizer


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    texts = corpus_texts() + list(corpus(make_splits(60, 0, seed=0)[0]))
    return {name: family_tokenizer(name, str(root / name), texts) for name in FAMILIES}


def trained_runs(sample):
    """The trained target indices, split into runs of consecutive tokens (one per assistant turn)."""
    targets = sample.positions + 1
    return np.split(targets, np.flatnonzero(np.diff(targets) > 1) + 1)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_chat_is_cached_token_exact_and_trained_on_answers_only(tokenizers, family):
    tok = tokenizers[family]
    enc = Encoder(tok, max_length=4096)
    for chat in CHATS:
        msgs, record = chat["messages"], parse_row({"messages": chat["messages"]})
        if expected_refusal(family, msgs):
            with pytest.raises(BadRow, match="chat template refuses"):
                enc.encode(record)                  # counted and listed by the job, never a crash
            continue
        s = enc.encode(record)                      # no SkipSample: nothing is lost
        full = render(tok, msgs)
        assert s.input_ids.tolist() == tok(full, add_special_tokens=False)["input_ids"], chat["name"]
        answers = [m["content"] for m in msgs if m["role"] == "assistant"]
        runs = trained_runs(s)
        assert len(runs) == len(answers), chat["name"]
        for run, answer in zip(runs, answers):
            ids = s.input_ids[run]
            assert ids[-1] in enc.turn_ends and not np.isin(ids[:-1], list(enc.turn_ends)).any(), chat["name"]
            text = tok.decode(ids.tolist())
            assert answer.split("</think>")[-1].strip() in text, (family, chat["name"], text)
            for m in msgs:
                if m["role"] in ("user", "system"):
                    assert m["content"] not in text, (family, chat["name"], text)


def test_an_answer_starting_with_whitespace_is_trained_from_its_first_character(tokenizers):
    """Qwen2's pre-tokenizer merges the template's newline with the answer's: that token is trained."""
    tok = tokenizers["chatml"]
    chat = next(c for c in CHATS if c["name"] == "code_answer")
    s = Encoder(tok).encode(parse_row({"messages": chat["messages"]}))
    first = s.positions[0] + 1
    before = tok.decode(s.input_ids[:first].tolist())
    assert before.endswith("<|im_start|>assistant") or before.endswith("<|im_start|>assistant\n")
    assert CODE in tok.decode(s.input_ids[first:].tolist())               # the leading newline and indent too


def test_qwen3_trains_the_last_turns_empty_think_block(tokenizers):
    tok = tokenizers["qwen3"]
    chat = next(c for c in CHATS if c["name"] == "two_turns")
    s = Encoder(tok).encode(parse_row({"messages": chat["messages"]}))
    first, last = (tok.decode(s.input_ids[r].tolist()) for r in trained_runs(s))
    assert first == "sql<|im_end|>"                                        # earlier turn: as the template wrote it
    assert last == "<think>\n\n</think>\n\nkubernetes<|im_end|>"           # what the model writes after the prompt


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "gemma"])      # think blocks; no system role and a soft-capped head
def test_precompute_keeps_every_chat_the_template_allows(tokenizers, family, tmp_path):
    """End to end with the default --on-bad-record fail: every allowed multi-turn chat is cached, verify passes
    (every sample trains an end-of-turn position), and a teacher with the family's head scores it."""
    from kdcache.cache_format import open_cache, verify_cache
    from tests.helpers.cli import precompute, write_jsonl
    from tests.helpers.families import FAMILY_ARCH, family_model
    tok = tokenizers[family]
    teacher = tmp_path / "teacher"
    family_model(tok, str(teacher), arch=FAMILY_ARCH[family])
    allowed = [{"messages": c["messages"]} for c in CHATS if not expected_refusal(family, c["messages"])]
    data = write_jsonl(tmp_path / "d.jsonl", allowed)
    res = precompute("--teacher", teacher, "--data", data, "--out", tmp_path / "c", "--backend", "hf",
                     "--top-k", 8, "--shard-size", 4, shared_ray=True)
    assert res.returncode == 0, res.stderr[-3000:]
    cache = open_cache(tmp_path / "c")
    assert cache.complete and len(cache) == len(allowed) and cache.manifest["meta"]["skipped"] == {}
    assert verify_cache(tmp_path / "c").ok


def test_the_generation_configs_eos_ids_are_end_of_turn_ids(tokenizers, tmp_path):
    """Both backends stop on one recorded set: tokenizer EOS, template end-of-turn, generation config EOS."""
    from kdcache.pipeline.config import PrecomputeConfig
    from kdcache.pipeline.settle import settle
    from tests.helpers.cli import write_jsonl
    from tests.helpers.families import FAMILY_ARCH, family_model
    tok = tokenizers["llama3"]
    family_model(tok, str(tmp_path / "teacher"), arch=FAMILY_ARCH["llama3"])
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": "docker"}])
    job = settle(PrecomputeConfig(teacher=str(tmp_path / "teacher"), data=data, out=str(tmp_path / "c"),
                                  backend="hf"), 0.0)
    names = set(tok.convert_ids_to_tokens(job.turn_ends))
    assert {"<|eot_id|>", "<|end_of_text|>", "<|eom_id|>"} <= names
    assert job.parts["capture"]["eos_token_ids"] == job.turn_ends               # recorded, in the fingerprint


# Whether the document-end token is also one of the encoder's end-of-turn ids (the tokenizer's EOS plus the first
# special token the template writes after an answer):
DOCUMENT_END_ENDS_A_TURN = {
    "qwen3": False,     # <|endoftext|>; EOS and the template's turn end are both <|im_end|>
    "llama3": False,    # <|end_of_text|>; EOS and the template's turn end are both <|eot_id|>
    "gemma": True,      # <eos> is the tokenizer's EOS (the template's turn end is <end_of_turn>)
    "mistral": True,    # </s> is the EOS and the template writes it after every answer
    "chatml": False,    # <|endoftext|>; EOS and the template's turn end are both <|im_end|>
}


@pytest.mark.parametrize("family,end", [("qwen3", "<|endoftext|>"), ("llama3", "<|end_of_text|>"),
                                        ("gemma", "<eos>"), ("mistral", "</s>"), ("chatml", "<|endoftext|>")])
def test_a_text_record_ends_with_the_document_end_token(tokenizers, family, end):
    """A text record ends with the family's document-end token, trained; where that token is not the instruct
    EOS (Qwen, Llama 3) it is not an end-of-turn id, where it is (Gemma, Mistral) it is."""
    tok = tokenizers[family]
    enc = Encoder(tok)
    s = enc.encode(parse_row({"text": "docker and kubernetes"}))
    assert tok.convert_ids_to_tokens(int(s.input_ids[-1])) == end and s.positions[-1] == len(s.input_ids) - 2
    assert int(s.input_ids[-1]) == document_end_id(tok)
    assert (document_end_id(tok) in enc.turn_ends) is DOCUMENT_END_ENDS_A_TURN[family]
    assert (document_end_id(tok) in end_of_turn_ids(tok)) is DOCUMENT_END_ENDS_A_TURN[family]
