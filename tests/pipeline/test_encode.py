import numpy as np
import pytest

from kdcache.common.errors import SkipSample
from kdcache.pipeline.data import parse_row
from kdcache.pipeline.encode import Encoder, end_of_turn_ids
from tests.helpers.chats import MULTI


def targets(enc):
    return [enc.input_ids[p + 1] for p in enc.positions]


def test_end_of_turn_is_the_template_stop_token(tiny):
    tok = tiny["tok"]
    assert end_of_turn_ids(tok) == [tok.convert_tokens_to_ids("<|im_end|>")]


def test_chat_targets_are_assistant_text_plus_end_of_turn(tiny):
    tok = tiny["tok"]
    enc = Encoder(tok).encode(parse_row(MULTI))
    # Token-exact: the ids are the tokenizer's ids of the rendered template, nothing re-templated.
    assert enc.input_ids.tolist() == tok(tok.apply_chat_template(MULTI["messages"], tokenize=False),
                                add_special_tokens=False)["input_ids"]
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    t = targets(enc)
    # Every assistant turn is trained, each through its end-of-turn token; nothing else is.
    assert t.count(im_end) == 2
    text = tok.decode(t)
    assert text == "sql, python<|im_end|>docker<|im_end|>"
    assert "question" not in text and "brief" not in text


def test_eos_position_is_the_last_trained_position(tiny):
    tok = tiny["tok"]
    for rec in tiny["train"][:20]:
        enc = Encoder(tok).encode(parse_row(rec))
        assert enc.input_ids[enc.positions[-1] + 1] == tok.eos_token_id
        assert np.all(np.diff(enc.positions) == 1)       # single turn: one contiguous span


def test_pair_with_template_equals_two_turn_chat(tiny):
    tok = tiny["tok"]
    a = Encoder(tok).encode(parse_row({"prompt": "hello there", "completion": "sql"}))
    b = Encoder(tok).encode(parse_row({"messages": [{"role": "user", "content": "hello there"},
                                                       {"role": "assistant", "content": "sql"}]}))
    assert np.array_equal(a.input_ids, b.input_ids) and np.array_equal(a.positions, b.positions)


def test_pair_raw_and_text_append_eos(tiny):
    tok = tiny["tok"]
    enc = Encoder(tok, template="raw").encode(parse_row({"prompt": "hello", "completion": "docker sql"}))
    assert tok.decode(targets(enc)) == "docker sql<|im_end|>"
    enc = Encoder(tok).encode(parse_row({"text": "docker and sql"}))
    assert enc.positions[0] == 0 and len(enc.positions) == len(enc.input_ids) - 1
    assert enc.input_ids[-1] == tok.convert_tokens_to_ids("<|endoftext|>")    # the document end, not <|im_end|>


def test_truncate_flags_and_drop_skips(tiny):
    tok = tiny["tok"]
    full = Encoder(tok).encode(parse_row(MULTI))
    cut = Encoder(tok, max_length=len(full.input_ids) - 3).encode(parse_row(MULTI))
    assert cut.truncated and len(cut.input_ids) == len(full.input_ids) - 3
    assert cut.positions.max() <= len(cut.input_ids) - 2
    with pytest.raises(SkipSample) as e:
        Encoder(tok, max_length=len(full.input_ids) - 3, overlong="drop").encode(parse_row(MULTI))
    assert e.value.reason == "too_long"
    with pytest.raises(SkipSample) as e:
        Encoder(tok, max_length=5).encode(parse_row(MULTI))   # nothing of any answer fits
    assert e.value.reason == "no_targets"


def test_generate_mode_encodes_prompt_up_to_generation_prompt(tiny):
    tok = tiny["tok"]
    enc = Encoder(tok).encode_prompt(parse_row(MULTI))
    want = tok.apply_chat_template(MULTI["messages"][:4], tokenize=False, add_generation_prompt=True)
    assert tok.decode(enc.input_ids.tolist()) == want
    with pytest.raises(SkipSample):
        Encoder(tok).encode_prompt(parse_row({"text": "x"}))


def test_enormous_message_is_truncated_and_flagged_or_dropped(tiny):
    tok = tiny["tok"]
    huge = {"messages": [{"role": "user", "content": "docker " * 20000}, {"role": "assistant", "content": "sql"}]}
    with pytest.raises(SkipSample) as e:                       # the answer lies beyond max_length: nothing to train
        Encoder(tok, max_length=512).encode(parse_row(huge))
    assert e.value.reason == "no_targets"
    long_answer = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "sql " * 5000}]}
    enc = Encoder(tok, max_length=512).encode(parse_row(long_answer))
    assert enc.truncated and len(enc.input_ids) == 512 and enc.positions.max() == 510
    with pytest.raises(SkipSample) as e:
        Encoder(tok, max_length=512, overlong="drop").encode(parse_row(long_answer))
    assert e.value.reason == "too_long"


def test_a_template_that_refuses_a_chat_is_a_bad_record_not_a_crash(tiny):
    import copy

    from kdcache.common.errors import BadRow
    tok = copy.deepcopy(tiny["tok"])
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                         "{{ raise_exception('System role not supported') }}{% endif %}"
                         "{{ m['content'] + '<|im_end|>' }}{% endfor %}")
    chat = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                         {"role": "assistant", "content": "sql"}]}
    with pytest.raises(BadRow, match="chat template refuses this chat: TemplateError: System role not supported"):
        Encoder(tok).encode(parse_row(chat))


@pytest.mark.parametrize("how", ["no template", "template raw"])
def test_chat_records_without_a_template_are_concatenated_and_trained(tiny, how):
    import copy
    tok = copy.deepcopy(tiny["tok"])
    if how == "no template":
        tok.chat_template = None
    enc = Encoder(tok, template="raw" if how == "template raw" else "auto").encode(parse_row(MULTI))
    ids = enc.input_ids.tolist()
    pieces = [tok(m["content"], add_special_tokens=False)["input_ids"] for m in MULTI["messages"]]
    answers = [p + [tok.eos_token_id] for p, m in zip(pieces, MULTI["messages"]) if m["role"] == "assistant"]
    assert targets(enc) == [t for a in answers for t in a]          # every answer, each through its EOS
    assert "<|im_start|>" not in tok.decode(ids)                     # no template text


class Counting:
    """The tokenizer, counting the characters it is handed (the work a record costs)."""

    def __init__(self, tok):
        self.tok, self.chars = tok, 0

    def __call__(self, text, **kw):
        self.chars = max(self.chars, len(text))
        return self.tok(text, **kw)

    def __getattr__(self, name):
        return getattr(self.tok, name)


@pytest.mark.parametrize("kind", ["text", "chat", "raw"])
def test_a_huge_record_is_cut_before_tokenizing_and_keeps_the_same_ids(tiny, kind):
    """A 20 MB record took 31 s and 3.4 GiB to keep 511 tokens (issue 23, item 11). The text is cut before
    tokenizing, at a length no max_length tokens can reach past, and the sample is what tokenizing the whole
    text and truncating gives."""
    tok = tiny["tok"]
    words = " ".join(f"docker{i % 97} sql kubernetes" for i in range(40000))        # ~1 MB
    rec = {"text": words} if kind == "text" else \
        {"messages": [{"role": "user", "content": "list the skills"}, {"role": "assistant", "content": words}]}
    counting = Counting(tok)
    enc = Encoder(counting, max_length=64, template="raw" if kind == "raw" else "auto")
    got = enc.encode(parse_row(rec))
    assert counting.chars <= enc.max_chars < len(words) / 10                     # bounded work
    whole = Encoder(tok, max_length=10**7, template="raw" if kind == "raw" else "auto").encode(parse_row(rec))
    assert got.truncated and len(got.input_ids) == 64
    assert got.input_ids.tolist() == whole.input_ids[:64].tolist()             # token-exact: the same prefix
    assert got.positions.tolist() == whole.positions[whole.positions <= 62].tolist()
    with pytest.raises(SkipSample, match="too_long|max_length"):
        Encoder(counting, max_length=64, overlong="drop", template="raw" if kind == "raw" else "auto").encode(
            parse_row(rec))


def test_a_chat_past_max_messages_is_skipped_and_counted_before_the_template_runs(tiny):
    """Issue 23, item 11: the messages per record are capped (configurable), so a hostile 100k-message chat costs
    nothing; the cap's own length passes."""
    tok = tiny["tok"]
    turns = [{"role": r, "content": f"m{i}"} for i in range(6) for r in ("user", "assistant")]   # 12 messages
    calls = []
    real = tok.apply_chat_template
    tok.apply_chat_template = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        with pytest.raises(SkipSample) as e:
            Encoder(tok, max_length=512, max_messages=11).encode(parse_row({"messages": turns}))
        assert e.value.reason == "too_many_messages" and "12 messages > max_messages 11" in str(e.value)
        with pytest.raises(SkipSample, match="too_many_messages|max_messages"):
            Encoder(tok, max_length=512, max_messages=11).encode_prompt(parse_row({"messages": turns}))
        n = len(calls)
        assert Encoder(tok, max_length=512, max_messages=12).encode(parse_row({"messages": turns})).positions.size
    finally:
        tok.apply_chat_template = real
    assert n <= 2 and len(calls) > n          # refused without rendering (Encoder() renders once to find the ends)


def test_a_chat_whose_last_answer_was_cut_by_its_writer_trains_that_answer_but_not_its_end(tiny):
    """"truncated": true on a chat or pair (a rollout cut by its generation budget, kdcache onpolicy
    --cross-tokenizer): the template still closes the turn, but the end it writes is not trained; earlier turns'
    ends are. The flag must be a bool, and the source keeps it."""
    from kdcache.cache_format.errors import ShardError
    from kdcache.cache_format.source import check_chat
    from kdcache.common.errors import BadRow
    from kdcache.pipeline.source import chat_of
    tok = tiny["tok"]
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    whole = Encoder(tok).encode(parse_row(MULTI))
    cut = Encoder(tok).encode(parse_row(dict(MULTI, truncated=True)))
    assert cut.input_ids.tolist() == whole.input_ids.tolist()           # the same rendering, closed by the template
    assert cut.positions.tolist() == whole.positions[:-1].tolist()       # all but the last turn's end
    assert targets(cut).count(im_end) == 1 and targets(cut)[-1] != im_end and cut.truncated and not whole.truncated
    pair = {"prompt": "q", "completion": "sql, pyth", "truncated": True}
    enc = Encoder(tok).encode(parse_row(pair))
    assert im_end not in targets(enc) and tok.decode(targets(enc)) == "sql, pyth" and enc.truncated
    assert chat_of(parse_row(pair)) == {"kind": "pair", "prompt": "q", "completion": "sql, pyth", "truncated": True}
    assert "truncated" not in chat_of(parse_row(MULTI))
    with pytest.raises(BadRow, match="truncated"):
        parse_row(dict(MULTI, truncated="yes"))
    with pytest.raises(ShardError, match="truncated"):
        check_chat({"kind": "text", "text": "a", "truncated": True}, "sample 0")
