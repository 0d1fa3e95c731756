"""Short and markup-like answers are found where the template puts them, never inside its markup.

The oracle here does not search text: for assistant turn i it renders the chat up to that turn with the
generation prompt, and the turn is trained from the first token that overlaps the end of that rendering
through the first end-of-turn token after it (the definition in kdcache/common/chat.py). Searching for an answer
such as "a", "e" or "end" from the end of the previous message finds it inside `<|im_start|>assistant` or the
user's `<|im_end|>` instead (issue 23, item 1).
"""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kdcache.common.chat import render
from kdcache.common.errors import BadRow
from kdcache.demo.task import corpus, make_splits
from kdcache.pipeline.data import parse_row
from kdcache.pipeline.encode import Encoder
from tests.helpers.families import FAMILIES, corpus_texts, family_tokenizer

SHORT = ["a", "d", "e", "end", "of", "turn", "t", "k", "s", "", "<", ">", "|", "assistant", "model", "user",
         "end_of_turn", "im_end", "eot_id", "\n", " a", "a ", "INST", "[/INST]", "7"]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("short")
    texts = corpus_texts() + list(corpus(make_splits(40, 0, seed=1)[0]))
    return {name: family_tokenizer(name, str(root / name), texts) for name in FAMILIES}


def expected_runs(tok, msgs, turn_ends):
    """[range of trained target indices] per assistant turn, from prefix renderings (no text search)."""
    full = render(tok, msgs)
    enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
    ids, ends = enc["input_ids"], np.array([e for _, e in enc["offset_mapping"]])
    runs = []
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        opened = render(tok, msgs[:i], gen_prompt=True)
        assert full.startswith(opened), "the template renders the history differently once the turn is added"
        a = int(np.searchsorted(ends, len(opened), side="right"))
        eot = next(j for j in range(a, len(ids)) if ids[j] in turn_ends)
        runs.append(list(range(a, eot + 1)))
    return ids, runs


def trained_runs(sample):
    targets = sample.positions + 1
    return [r.tolist() for r in np.split(targets, np.flatnonzero(np.diff(targets) > 1) + 1)] if len(targets) else []


def check(tok, answers):
    turns = []
    for n, answer in enumerate(answers):
        turns += [{"role": "user", "content": f"question {n}: list the skills"},
                  {"role": "assistant", "content": answer}]
    enc = Encoder(tok, max_length=4096)
    if any(not a.strip() for a in answers):      # an empty answer is a bad row: counted and listed, never trained
        with pytest.raises(BadRow, match=r"messages\[\d+\]\.content' is empty"):
            enc.encode(parse_row({"messages": turns}))
        return
    s = enc.encode(parse_row({"messages": turns}))
    ids, want = expected_runs(tok, turns, enc.turn_ends)
    assert s.input_ids.tolist() == ids
    got = trained_runs(s)
    if got != want:          # adjacent runs (an empty answer right after a turn end) merge: compare as sets
        assert sorted(t for r in got for t in r) == sorted(t for r in want for t in r), \
            (answers, [tok.decode([ids[t] for t in r]) for r in got], [tok.decode([ids[t] for t in r]) for r in want])


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("answer", SHORT)
def test_a_short_answer_is_trained_where_the_template_puts_it(tokenizers, family, answer):
    check(tokenizers[family], [answer])


@pytest.mark.parametrize("family", FAMILIES)
def test_short_answers_in_a_multi_turn_chat_shift_nothing(tokenizers, family):
    check(tokenizers[family], ["a", "e", "end", "of", "turn", "<", "assistant", "user"])


@pytest.mark.parametrize("family", FAMILIES)
def test_an_answer_of_one_token_is_trained_with_its_end_of_turn(tokenizers, family):
    tok = tokenizers[family]
    one = next(t for t in ("the", "a", "s") if len(tok(t, add_special_tokens=False)["input_ids"]) == 1)
    check(tok, [one])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(family=st.sampled_from(FAMILIES),
       answers=st.lists(st.text(alphabet="abdeflnortu<>|_/[] \n", max_size=5), min_size=1, max_size=3))
def test_random_short_answers(tokenizers, family, answers):
    check(tokenizers[family], answers)
