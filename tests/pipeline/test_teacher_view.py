"""Privileged context (issue 45, part 2): records with "teacher_messages" beside "messages" (or "teacher_input_ids"
and "teacher_labels" beside ids) are scored by the teacher under its own rendering, a hint in its system prompt,
while the cache keeps the student's ids and positions; each position then holds the teacher's top-k for the same
next token in its own context. A record whose completions differ between the two views is refused by its line
and turn, never shifted."""
import json

import numpy as np
import pytest
import torch

from kdcache.cache_format import open_cache, verify_cache
from kdcache.common.errors import BadRow
from kdcache.pipeline.data import parse_row
from kdcache.pipeline.encode import Encoder
from tests.helpers.cli import kdcache, precompute, write_jsonl

IGN = -100


def hinted(rec, hint="Hint: the skills are listed in the posting."):
    """rec with teacher_messages: the same chat after a system prompt only the teacher sees."""
    return dict(rec, teacher_messages=[{"role": "system", "content": hint}] + rec["messages"])


def test_the_teacher_view_holds_the_teachers_rendering_with_the_same_trained_tokens(tiny):
    tok = tiny["tok"]
    rec = hinted(tiny["train"][0])
    s = Encoder(tok).encode(parse_row(rec))
    plain = Encoder(tok).encode(parse_row(tiny["train"][0]))
    assert s.input_ids.tolist() == plain.input_ids.tolist() and s.positions.tolist() == plain.positions.tolist()
    want = tok(tok.apply_chat_template(rec["teacher_messages"], tokenize=False), add_special_tokens=False)
    assert s.teacher_ids.tolist() == want["input_ids"] and len(s.teacher_ids) > len(s.input_ids)
    np.testing.assert_array_equal(s.teacher_ids[s.teacher_positions + 1], s.input_ids[s.positions + 1])
    assert int(s.input_ids[s.positions[-1] + 1]) in Encoder(tok).turn_ends            # rule 1 in both views


def test_completions_that_differ_between_the_views_are_refused_by_turn(tiny):
    tok = tiny["tok"]
    rec = hinted(tiny["train"][0])
    other = json.loads(json.dumps(rec))
    other["teacher_messages"][-1]["content"] += " and more"
    with pytest.raises(BadRow, match="assistant turn 0 differs"):
        Encoder(tok).encode(parse_row(other))
    fewer = dict(rec, teacher_messages=[m for m in rec["teacher_messages"] if m["role"] != "assistant"]
                 + [{"role": "user", "content": "x"}])
    with pytest.raises(BadRow, match="assistant"):
        Encoder(tok).encode(parse_row(fewer))
    with pytest.raises(BadRow, match="'teacher_messages' needs 'messages'"):
        parse_row({"prompt": "p", "completion": "c", "teacher_messages": rec["teacher_messages"]})


def test_generate_mode_puts_one_completion_after_each_views_prompt(tiny):
    """Generate mode (onpolicy's rollouts): the prompt of each view, then the same completion after both; the
    trained positions are the completion's in each view."""
    from kdcache.pipeline.encode import with_completion
    tok = tiny["tok"]
    rec = hinted(tiny["train"][0])
    p = Encoder(tok).encode_prompt(parse_row(rec))
    def want(msgs):
        text = tok.apply_chat_template(msgs[:-1], tokenize=False, add_generation_prompt=True)
        return tok(text, add_special_tokens=False)["input_ids"]
    assert p.input_ids.tolist() == want(rec["messages"]) and p.teacher_ids.tolist() == want(rec["teacher_messages"])
    assert len(p.positions) == len(p.teacher_positions) == 0
    new = [7, 8, 9]
    full = with_completion(p, new, ended=True)
    assert full.input_ids[len(p.input_ids):].tolist() == full.teacher_ids[len(p.teacher_ids):].tolist() == new
    np.testing.assert_array_equal(full.input_ids[full.positions + 1], full.teacher_ids[full.teacher_positions + 1])
    assert full.positions[0] == len(p.input_ids) - 1 and full.teacher_positions[0] == len(p.teacher_ids) - 1
    plain = Encoder(tok).encode_prompt(parse_row(tiny["train"][0]))
    assert plain.teacher_ids is None and with_completion(plain, new, True).teacher_ids is None
    long = Encoder(tok, max_length=len(p.teacher_ids))
    with pytest.raises(Exception, match="teacher's prompt"):
        long.encode_prompt(parse_row(rec))                  # the teacher's prompt alone fills max_length
    ids = {"input_ids": [5, 6, 9, 3], "labels": [IGN, IGN, 9, 3],
           "teacher_input_ids": [5, 7, 7, 6, 9, 3], "teacher_labels": [IGN] * 4 + [9, 3]}
    q = Encoder(tok, vocab_size=len(tok)).encode_prompt(parse_row(ids))
    assert q.input_ids.tolist() == [5, 6] and q.teacher_ids.tolist() == [5, 7, 7, 6]


def test_id_records_take_teacher_ids_whose_labels_train_the_same_tokens(tiny):
    tok = tiny["tok"]
    eos = tok.eos_token_id
    rec = {"input_ids": [5, 6, 9, 3, eos], "labels": [IGN, IGN, 9, 3, eos],
           "teacher_input_ids": [5, 7, 7, 7, 6, 9, 3, eos], "teacher_labels": [IGN] * 5 + [9, 3, eos]}
    s = Encoder(tok, vocab_size=len(tok)).encode(parse_row(rec))
    assert s.positions.tolist() == [1, 2, 3] and s.teacher_positions.tolist() == [4, 5, 6]
    bad = dict(rec, teacher_labels=[IGN] * 6 + [3, eos])
    with pytest.raises(BadRow, match="teacher_labels train 2 tokens and labels 3"):
        Encoder(tok, vocab_size=len(tok)).encode(parse_row(bad))
    with pytest.raises(BadRow, match="needs 'teacher_labels'"):
        parse_row({k: v for k, v in rec.items() if k != "teacher_labels"})


@pytest.mark.ray
def test_a_hinted_cache_holds_the_teachers_scores_in_its_own_context(tiny, tmp_path):
    """End to end: the stored top-k at each student position is the teacher's forward pass over its own rendering
    (the hint included) at the matching position, not over the student's; a mismatched record fails the job,
    named by file, line and turn."""
    from transformers import AutoModelForCausalLM
    recs = [hinted(r) for r in tiny["train"][:6]]
    data = write_jsonl(tmp_path / "d.jsonl", recs)
    out = tmp_path / "cache"
    res = precompute("--teacher", tiny["teacher"], "--data", data, "--out", out, "--backend", "hf", "--top-k", 8,
                     "--logprob-dtype", "float32", "--shard-size", 3, shared_ray=True)
    assert res.returncode == 0, res.stderr[-3000:]
    assert verify_cache(str(out)).ok
    model = AutoModelForCausalLM.from_pretrained(tiny["teacher"], torch_dtype=torch.float32).eval()
    tok = tiny["tok"]
    for rec, want in zip(open_cache(str(out)), recs):
        plain = Encoder(tok).encode(parse_row({"messages": want["messages"]}))
        assert rec.input_ids.tolist() == plain.input_ids.tolist()                 # the student's view is stored
        assert rec.teacher_input_ids is not None and len(rec.teacher_input_ids) > len(rec.input_ids)
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([rec.teacher_input_ids.tolist()])).logits[0].float(), -1)
            lp_student = torch.log_softmax(model(torch.tensor([rec.input_ids.tolist()])).logits[0].float(), -1)
        top = lp[torch.as_tensor(rec.teacher_positions, dtype=torch.long)].topk(8)
        np.testing.assert_array_equal(rec.topk_ids[:, 0], top.indices[:, 0].numpy())
        np.testing.assert_allclose(rec.topk_logprobs, top.values.numpy(), atol=1e-4)
        other = lp_student[torch.as_tensor(rec.positions, dtype=torch.long)].topk(8).values.numpy()
        assert np.abs(other - rec.topk_logprobs).max() > 1e-3                    # the hint changed the scores
    first = next(iter(open_cache(str(out))))
    shown = kdcache("inspect", out, "--sample", 0)
    assert shown.returncode == 0, shown.stderr
    assert f"teacher view (teacher_input_ids, {len(first.teacher_input_ids)} tokens): " \
        f"{first.teacher_input_ids.tolist()}" in shown.stdout
    assert f"student view (input_ids): {first.input_ids.tolist()}" in shown.stdout
    # a student trains on its own view: the batch holds input_ids and positions, as for any cache
    from kdcache import collate
    got = list(open_cache(str(out)))[:2]
    batch = collate(got, pad_id=0, student_vocab=len(tok))
    assert batch.input_ids[0, :len(got[0].input_ids)].tolist() == got[0].input_ids.tolist()
    # the cache as --data (a rescore) is scored under the same teacher views
    again = precompute("--teacher", tiny["teacher"], "--data", out, "--out", tmp_path / "rescored", "--backend", "hf",
                       "--top-k", 8, "--logprob-dtype", "float32", shared_ray=True)
    assert again.returncode == 0, again.stderr[-3000:]
    for a, b in zip(open_cache(str(out)), open_cache(str(tmp_path / "rescored"))):
        assert b.teacher_input_ids.tolist() == a.teacher_input_ids.tolist()
        np.testing.assert_allclose(b.topk_logprobs, a.topk_logprobs, atol=1e-5)
    bad = [recs[0], recs[1], json.loads(json.dumps(recs[2]))]
    bad[2]["teacher_messages"][-1]["content"] = "something else"
    data = write_jsonl(tmp_path / "bad.jsonl", bad)
    res = precompute("--teacher", tiny["teacher"], "--data", data, "--out", tmp_path / "c2", "--backend", "hf",
                     "--top-k", 8, shared_ray=True)
    assert res.returncode != 0 and f"{data}:3" in res.stderr and "assistant turn 0 differs" in res.stderr, \
        res.stderr[-3000:]


@pytest.mark.ray
@pytest.mark.slow
def test_generate_mode_with_teacher_views_scores_each_completion_in_the_teachers_context(tiny, stopping, tmp_path):
    """--mode generate on hinted records (onpolicy's rollouts). With a --generator (the student's part): it
    generates from the student's prompt, its log-probs are taken there, and the teacher scores the same completion
    after its own prompt. Without one, the teacher (one that stops for some prompts only) generates greedily in its
    own view."""
    from kdcache.pipeline.teacher_hf import HFTeacher
    recs = [hinted(r) for r in tiny["train"][:8]]
    data = write_jsonl(tmp_path / "d.jsonl", recs)
    common = ("--data", data, "--backend", "hf", "--mode", "generate", "--gen-max-new-tokens", 12, "--top-k", 8,
              "--logprob-dtype", "float32", "--seed", 5)
    res = precompute("--teacher", tiny["teacher"], "--generator", tiny["teacher"], "--out", tmp_path / "g",
                     "--gen-temperature", 0.8, *common, shared_ray=True)
    assert res.returncode == 0, res.stderr[-3000:]
    assert verify_cache(str(tmp_path / "g")).ok
    enc = Encoder(tiny["tok"])
    model = HFTeacher(tiny["teacher"], dtype="float32").model

    def log_softmax(ids, temperature=1.0):
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids.tolist()])).logits[0].float() / temperature, -1)

    got = list(open_cache(str(tmp_path / "g")))
    assert [r.sample_id for r in got] == list(range(8))
    for r, rec in zip(got, recs):
        p = enc.encode_prompt(parse_row(rec))
        n = len(r.input_ids) - len(p.input_ids)
        assert n > 0 and r.input_ids[:len(p.input_ids)].tolist() == p.input_ids.tolist()
        assert r.teacher_input_ids[:len(p.teacher_ids)].tolist() == p.teacher_ids.tolist()
        assert r.teacher_input_ids[len(p.teacher_ids):].tolist() == r.input_ids[len(p.input_ids):].tolist()
        top = log_softmax(r.teacher_input_ids)[torch.as_tensor(r.teacher_positions, dtype=torch.long)].topk(8)
        np.testing.assert_allclose(r.topk_logprobs, top.values.numpy(), atol=1e-4)
        student = log_softmax(r.input_ids, 0.8)[torch.as_tensor(r.positions, dtype=torch.long), r.targets].numpy()
        np.testing.assert_allclose(r.behavior_logprobs, student, atol=2e-5)      # sampled in the student's view
    # the teacher alone, greedy: each token is the argmax of the teacher's view, not of the student's
    res = precompute("--teacher", stopping["greedy"], "--out", tmp_path / "t", "--gen-top-p", 1e-6, *common,
                     shared_ray=True)
    assert res.returncode == 0, res.stderr[-3000:]
    model = HFTeacher(stopping["greedy"], dtype="float32").model
    differs = 0
    for r in open_cache(str(tmp_path / "t")):
        t_pos = torch.as_tensor(r.teacher_positions, dtype=torch.long)
        assert log_softmax(r.teacher_input_ids)[t_pos].argmax(-1).tolist() == r.targets.tolist()
        differs += log_softmax(r.input_ids)[torch.as_tensor(r.positions, dtype=torch.long)].argmax(-1).tolist() \
            != r.targets.tolist()
    assert differs > 0                                      # the hint changed what the teacher wrote somewhere
