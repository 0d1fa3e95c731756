"""Privileged context under the real templates of tests/helpers/families.py (Qwen3, Llama 3, Gemma, Mistral,
ChatML): a hint in the teacher's system prompt or first user turn reaches the teacher's rendering, the trained
tokens are the student's, the teacher scores them in its own context (a forward pass over its rendering), and
a template that would drop the hint or refuses its role is a bad record, named, never a silent copy of the
student's view."""
import numpy as np
import pytest
import torch

from kdcache.common.chat import render
from kdcache.common.errors import BadRow
from kdcache.pipeline.data import parse_row
from kdcache.pipeline.encode import Encoder
from kdcache.pipeline.teacher_hf import HFTeacher
from tests.helpers.families import CHAT, FAMILIES, FAMILY_ARCH, corpus_texts, family_model, family_tokenizer

HINT = "Hint: the skills are sql and kubernetes."
CHATS = {"one_turn": CHAT["one_turn"], "two_turns": CHAT["two_turns"], "spaces_answer": CHAT["spaces_answer"],
         "think_two_turns": CHAT["think_two_turns"]}


def in_system(msgs):
    return [{"role": "system", "content": HINT}] + [m for m in msgs if m["role"] != "system"]


def in_first_user(msgs):
    out, done = [], False
    for m in msgs:
        if m["role"] == "user" and not done:
            m, done = dict(m, content=HINT + "\n\n" + m["content"]), True
        out.append(m)
    return out


# What each template does with a system hint in a chat that ends with an assistant turn (score mode).
SYSTEM_HINT = {"qwen3": None, "llama3": None, "chatml": None,
               "gemma": "System role not supported",            # the template raises on any system turn
               "mistral": "renders both to the same tokens"}    # the system prompt goes into the last user turn only


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """{family: (tokenizer, teacher dir)}: each family's tokenizer and a tiny random teacher of its architecture."""
    from kdcache.demo.task import corpus, make_splits
    root = tmp_path_factory.mktemp("hinted_families")
    texts = corpus_texts() + list(corpus(make_splits(60, 0, seed=0)[0])) + [HINT]
    out = {}
    for name in FAMILIES:
        tok = family_tokenizer(name, str(root / name / "tok"), texts)
        family_model(tok, str(root / name / "teacher"), arch=FAMILY_ARCH[name])
        out[name] = (tok, root / name / "teacher")
    return out


def ids_of(tok, msgs, **kw):
    return tok(render(tok, msgs, **kw), add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("where", [in_system, in_first_user], ids=["system", "first_user"])
def test_a_hint_reaches_the_teachers_rendering_and_the_trained_tokens_stay_the_students(families, family, where):
    tok, _ = families[family]
    enc = Encoder(tok, max_length=4096)
    for name, msgs in CHATS.items():
        rec = {"messages": msgs, "teacher_messages": where(msgs)}
        refusal = SYSTEM_HINT[family] if where is in_system else None
        if refusal:
            with pytest.raises(BadRow, match=refusal):
                enc.encode(parse_row(rec))
            continue
        s = enc.encode(parse_row(rec))
        plain = enc.encode(parse_row({"messages": msgs}))
        assert s.input_ids.tolist() == plain.input_ids.tolist() == ids_of(tok, msgs), (family, name)
        assert s.positions.tolist() == plain.positions.tolist()
        assert s.teacher_ids.tolist() == ids_of(tok, rec["teacher_messages"]), (family, name)
        assert HINT in tok.decode(s.teacher_ids.tolist()) and HINT not in tok.decode(s.input_ids.tolist())
        np.testing.assert_array_equal(s.teacher_ids[s.teacher_positions + 1], s.input_ids[s.positions + 1])
        ends = [int(t) for t in s.teacher_ids[s.teacher_positions + 1] if t in enc.turn_ends]
        answers = sum(m["role"] == "assistant" for m in msgs)
        assert len(ends) == answers and int(s.teacher_ids[s.teacher_positions[-1] + 1]) in enc.turn_ends  # rule 1


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_mode_prompts_carry_the_hint_in_every_family(families, family):
    """Generate mode renders the prompt before the last assistant turn; there Mistral's template does write the
    system prompt (the last turn is a user turn), so every family's teacher prompt holds the hint."""
    tok, _ = families[family]
    msgs = CHATS["two_turns"]
    where = in_first_user if family == "gemma" else in_system
    p = Encoder(tok).encode_prompt(parse_row({"messages": msgs, "teacher_messages": where(msgs)}))
    assert p.input_ids.tolist() == ids_of(tok, msgs[:-1], gen_prompt=True)
    assert p.teacher_ids.tolist() == ids_of(tok, where(msgs)[:-1], gen_prompt=True)
    assert HINT in tok.decode(p.teacher_ids.tolist())


@pytest.mark.parametrize("family", FAMILIES)
def test_the_teacher_scores_the_students_tokens_in_its_own_context(families, family):
    """What a worker scores (Sample.scored) is the teacher's rendering: its top-k there equal a forward pass of the
    family's teacher over the teacher's own rendering at the matching positions, and differ from one over the
    student's (the hint changes the scores)."""
    from transformers import AutoModelForCausalLM
    tok, teacher = families[family]
    msgs = CHATS["two_turns"]
    s = Encoder(tok).encode(parse_row({"messages": msgs, "teacher_messages": in_first_user(msgs)}))
    ids, positions = s.scored
    got = HFTeacher(str(teacher)).score([ids], [positions], 8)[0]
    model = AutoModelForCausalLM.from_pretrained(str(teacher), dtype=torch.float32).eval()
    with torch.no_grad():
        own = torch.log_softmax(model(torch.tensor([ids_of(tok, in_first_user(msgs))])).logits[0].float(), -1)
        student = torch.log_softmax(model(torch.tensor([s.input_ids.tolist()])).logits[0].float(), -1)
    top = own[torch.as_tensor(s.teacher_positions, dtype=torch.long)].topk(8)
    np.testing.assert_array_equal(got.ids[:, 0], top.indices[:, 0].numpy())
    np.testing.assert_allclose(got.logprobs, top.values.numpy(), atol=1e-4)
    assert np.abs(student[torch.as_tensor(s.positions, dtype=torch.long)].topk(8).values.numpy()
                  - got.logprobs).max() > 1e-3
