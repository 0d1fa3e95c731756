"""--cross-tokenizer (issue 46, train/cross.py) on real template families (tests/helpers/families.py): a teacher
cache of one family, a student of another. Every trained position of the student's own rendering is kept, the
end of each turn maps the teacher's end-of-turn distribution onto the student's end-of-turn token (rule 1 across
families), a 1:1 position carries the teacher's row mapped by equal bytes, every row sums to 1 with its tail, a
sample that cannot be derived byte-exactly is counted and never trained; `kdcache train` refuses the pair
without the flag, trains it with the flag, and reports coverage."""
import json
import os
import shutil

import numpy as np
import pytest

from kdcache.cache_format import open_cache
from kdcache.cache_format.manifest import MANIFEST_NAME
from kdcache.cache_format.record import span_positions
from kdcache.common.chat import chat_spans
from kdcache.demo.task import corpus, make_splits
from kdcache.train import cross as xt
from kdcache.train.align import token_bytes
from tests.helpers.cli import kdcache, precompute, write_jsonl
from tests.helpers.families import CHAT, FAMILY_ARCH, corpus_texts, family_model, family_tokenizer

NAMES = ("one_turn", "two_turns", "newline_answer", "spaces_answer", "code_answer")
EXTRA = [[{"role": "user", "content": "One letter, please."}, {"role": "assistant", "content": "a"}],
         [{"role": "user", "content": "Write it in French."},
          {"role": "assistant", "content": "naïve café — 日本語 🙂"}]]
PAIRS = [("llama3", "qwen3"), ("gemma", "chatml"), ("chatml", "gemma"),
         # SentencePiece-style pieces, as the real Gemma, Mistral v0.3 and Llama 2 / Mistral v0.1 tokenizers have
         # ("\u2581" spaces, byte fallback; a dummy-prefix space on a text's first piece, or on every segment
         # between special tokens): tests/helpers/families.py
         ("gemma:sentencepiece", "qwen3"), ("qwen3", "mistral:sentencepiece-prefix"),
         ("mistral:sentencepiece-legacy", "llama3"), ("chatml", "mistral:sentencepiece-legacy")]


def _family(name):
    """(family, pieces) of a PAIRS entry."""
    family, _, pieces = name.partition(":")
    return family, pieces or "bytelevel"


def chats(n_demo=6):
    demo = [r["messages"] for r in make_splits(n_demo, 0, seed=3)[0]]
    return [CHAT[n] for n in NAMES] + EXTRA + demo


def build(root, teacher, student, data_rows):
    texts = corpus_texts() + list(corpus(make_splits(60, 0, seed=0)[0])) + [m["content"] for c in EXTRA for m in c]
    (teacher, t_pieces), (student, s_pieces) = _family(teacher), _family(student)
    t_tok = family_tokenizer(teacher, str(root / "t-tok"), texts, vocab_size=700, pieces=t_pieces)
    s_tok = family_tokenizer(student, str(root / "s-tok"), texts[::-1], vocab_size=500,  # other merges and ids
                             pieces=s_pieces)
    t_dir, s_dir = str(root / "teacher"), str(root / "student")
    family_model(t_tok, t_dir, arch=FAMILY_ARCH[teacher], seed=0)
    family_model(s_tok, s_dir, arch=FAMILY_ARCH[student], seed=1)
    data = write_jsonl(root / "data.jsonl", [{"messages": m} for m in data_rows])
    cache = root / "cache"
    res = precompute("--teacher", t_dir, "--data", data, "--out", cache, "--backend", "hf", "--top-k", 16,
                     "--shard-size", 4, shared_ray=True)
    assert res.returncode == 0, res.stderr[-3000:]
    from transformers import AutoTokenizer
    return {"cache": str(cache), "teacher": t_dir, "student": s_dir, "t_tok": AutoTokenizer.from_pretrained(t_dir),
            "s_tok": AutoTokenizer.from_pretrained(s_dir), "rows": data_rows, "data": data}


@pytest.fixture(scope="module", params=PAIRS, ids=[f"{t}-to-{s}" for t, s in PAIRS])
def pair(request, tmp_path_factory):
    teacher, student = request.param
    return build(tmp_path_factory.mktemp(f"{teacher}-{student}".replace(":", "-")), teacher, student, chats())


def converted(pair):
    conv = xt.CrossTokenizer(pair["cache"], pair["s_tok"])
    with open_cache(pair["cache"]) as cache:
        recs = list(cache)
    return conv, [(r, conv.convert(r)) for r in recs]


def test_every_student_position_is_kept_and_each_turn_ends_on_the_teachers_end(pair):
    conv, out = converted(pair)
    s_tok = pair["s_tok"]
    kept = 0
    for rec, got in out:
        if got is None:
            continue
        kept += 1
        msgs = pair["rows"][rec.sample_id]
        ids, spans = chat_spans(s_tok, msgs, conv.s_ends)
        assert got.input_ids.tolist() == ids                          # the student's own rendering, its own ids
        assert got.positions.tolist() == span_positions(spans).tolist()   # every trained position, none shifted
        ends = [b - 2 for _, b in spans]                              # the positions that predict each turn's end
        assert np.isin(np.asarray(ids)[np.asarray(ends) + 1], list(conv.s_ends)).all()
        row = {int(p): i for i, p in enumerate(got.positions)}
        t_rows = {int(p): i for i, p in enumerate(rec.positions)}
        t_ends = [int(p) for p in rec.positions if rec.input_ids[p + 1] in conv.t_ends]
        assert len(t_ends) == len(ends)
        for p_s, p_t in zip(ends, t_ends):
            i = row[p_s]
            assert got.position_kinds[i] == xt.END_OF_TURN
            eot = int(got.input_ids[p_s + 1])
            t_i = t_rows[p_t]
            t_eot = int(rec.input_ids[p_t + 1])
            want = float(np.exp(rec.topk_logprobs[t_i][rec.topk_ids[t_i] == t_eot]).sum())
            have = float(np.exp(got.topk_logprobs[i][got.topk_ids[i] == eot]).sum())
            assert have >= want - 1e-6                                # the teacher's stop mass is the student's
            # and the teacher's log-prob of its own end of turn (stored at any rank) is the student's target's
            assert np.isfinite(rec.target_logprobs[t_i]) and got.target_logprobs[i] == rec.target_logprobs[t_i]
        for i, k in enumerate(got.position_kinds):
            used = got.topk_ids[i] >= 0
            mass = float(np.exp(got.topk_logprobs[i][used].astype(np.float64)).sum() + got.tail_mass[i])
            assert abs(mass - 1) < 1e-4, (i, mass)
            target = int(got.input_ids[got.positions[i] + 1])
            if k in (xt.INSIDE, xt.TEMPLATE):                          # the student's own cross-entropy
                assert used.sum() == 1 and got.topk_ids[i][0] == target and got.tail_mass[i] == 0
    assert kept >= len(out) - 2, conv.coverage.summary()               # at most the think / odd chats skipped
    cov = conv.coverage.summary()
    assert cov["share_end_of_turn"] > 0 and cov["share_one_to_one"] > 0 and 0 < cov["mass_mapped"] <= 1


def test_one_to_one_rows_are_the_teachers_rows_mapped_by_bytes(pair):
    conv, out = converted(pair)
    t_pieces, s_pieces = token_bytes(pair["t_tok"]), token_bytes(pair["s_tok"])
    checked = 0
    for rec, got in out:
        if got is None:
            continue
        for i in np.flatnonzero(got.position_kinds == xt.ONE_TO_ONE):
            p_s = int(got.positions[i])
            target = int(got.input_ids[p_s + 1])
            # the teacher row whose target has the student target's bytes, at the same place in the answer
            t_rows = [j for j, p in enumerate(rec.positions) if t_pieces[rec.input_ids[p + 1]] == s_pieces[target]]
            assert t_rows
            t_row = {int(t): float(np.exp(lp)) for t, lp in zip(rec.topk_ids[t_rows[0]], rec.topk_logprobs[t_rows[0]])}
            s_row = {int(t): float(np.exp(lp)) for t, lp in zip(got.topk_ids[i], got.topk_logprobs[i]) if t >= 0}
            mapped = {}
            for t, p in t_row.items():
                s = int(conv.t2s[t])
                if s >= 0:
                    mapped[s] = mapped.get(s, 0.0) + p
            if any(abs(mapped.get(s, 0) - p) > 1e-5 for s, p in s_row.items()):
                continue          # a repeated token elsewhere in the answer: not this row
            assert set(s_row) == set(mapped)
            checked += 1
    assert checked > 0


def test_a_normalizing_student_skips_and_counts_the_sample(tmp_path):
    # chatml's tokenizer normalizes to NFC (as Qwen2's): a decomposed accent does not come back byte for byte
    rows = [CHAT["one_turn"], [{"role": "user", "content": "Say it."}, {"role": "assistant", "content": "cafe\u0301"}]]
    p = build(tmp_path, "llama3", "chatml", rows)
    conv, out = converted(p)
    assert out[0][1] is not None and out[1][1] is None
    assert conv.coverage.skipped == {"not_byte_exact": 1}
    assert "sample 1" in conv.coverage.first_skip["not_byte_exact"]


def test_the_public_api_trains_teacher_positions_on_the_teacher_and_the_rest_on_cross_entropy(pair):
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    import kdcache
    with kdcache.open_cache(pair["cache"]) as cache:
        records = kdcache.CrossTokenizer(cache, pair["s_tok"]).convert_all(list(cache)[:6])
    batch = kdcache.collate(records, pad_id=pair["s_tok"].pad_token_id or 0, student_vocab=len(pair["s_tok"]))
    model = AutoModelForCausalLM.from_pretrained(pair["student"], dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    got = kdcache.kd_loss(logits, batch, beta=0.5, reduction="sum")
    got_chunked = kdcache.kd_loss_chunked(model.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
                                          .last_hidden_state.detach(), model.lm_head, batch, beta=0.5,
                                          reduction="sum")
    rows = logits[batch.batch_index, batch.positions]
    teach = torch.isin(batch.position_kinds, torch.tensor(xt.TEACHER_KINDS))
    plain = kdcache.Batch(**{**batch.as_dict(), "position_kinds": None})
    per = kdcache.kd_loss(rows, plain, beta=0.5, reduction="sum")           # every row as a teacher row
    ce = F.cross_entropy(rows[~teach], batch.targets[~teach], reduction="sum")
    sub = kdcache.Batch(**{**plain.as_dict(), **{k: getattr(plain, k)[teach] for k in (
        "batch_index", "positions", "sample_index", "targets", "topk_ids", "topk_logprobs", "tail_mass")},
        "target_logprobs": plain.target_logprobs[teach]})
    want = kdcache.kd_loss(rows[teach], sub, beta=0.5, reduction="sum") + ce
    assert teach.any() and (~teach).any()
    assert torch.allclose(got, want, rtol=1e-4) and torch.allclose(got_chunked, want, rtol=1e-3)
    assert not torch.allclose(per, want, rtol=1e-3)      # the kinds matter: one-hot rows under JSD are not CE


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    p = build(root, "llama3", "qwen3", chats(10))
    return p


def test_train_refuses_the_pair_without_the_flag_and_trains_it_with_it(trained, tmp_path):
    p = trained
    args = ("--cache", p["cache"], "--student", p["student"], "--max-steps", 3, "--batch-size", 4,
            "--save-every", 0, "--no-progress")
    res = kdcache("train", *args, "--out", tmp_path / "refused", timeout=300)
    assert res.returncode != 0 and "tokenizer differs" in res.stderr, res.stderr[-2000:]
    out = tmp_path / "run"
    res = kdcache("train", *args, "--out", out, "--cross-tokenizer", "--log-every", 1, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "--cross-tokenizer" in res.stdout and "mass mapped" in res.stdout
    summary = json.load(open(out / "train_summary.json"))
    cov = summary["cross_tokenizer"][p["cache"]]
    assert cov["share_end_of_turn"] > 0 and cov["share_one_to_one"] > 0 and cov["samples"] > 0
    rows = [json.loads(x) for x in open(out / "metrics.jsonl")]
    assert rows and all(r["positions_end_of_turn"] > 0 for r in rows)
    assert all(r["loss_end_of_turn"] is not None and np.isfinite(r["loss_end_of_turn"]) for r in rows)
    final = json.load(open(out / "final" / "generation_config.json"))
    eos = final["eos_token_id"] if isinstance(final["eos_token_id"], list) else [final["eos_token_id"]]
    assert set(eos) == set(xt.end_of_turn_ids(p["s_tok"]))         # the student stops at its own end of turn
    from transformers import AutoTokenizer
    assert AutoTokenizer.from_pretrained(out / "final").chat_template == p["s_tok"].chat_template


def test_identical_tokenizers_run_the_token_exact_path_and_say_so(trained, tmp_path):
    p = trained
    res = kdcache("train", "--cache", p["cache"], "--student", p["teacher"], "--out", tmp_path / "same",
                  "--max-steps", 2, "--batch-size", 4, "--save-every", 0, "--no-progress", "--cross-tokenizer",
                  timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "token-exact path" in res.stdout
    assert "cross_tokenizer" not in json.load(open(tmp_path / "same" / "train_summary.json"))


def test_a_cache_without_its_source_or_a_student_without_a_template_is_refused(trained, tmp_path):
    p = trained
    cache = str(tmp_path / "cache")
    shutil.copytree(p["cache"], cache)
    doc = json.load(open(os.path.join(cache, MANIFEST_NAME)))
    doc.pop("source")
    json.dump(doc, open(os.path.join(cache, MANIFEST_NAME), "w"))
    args = ("--student", p["student"], "--max-steps", 1, "--no-progress", "--cross-tokenizer")
    res = kdcache("train", "--cache", cache, *args, "--out", tmp_path / "a", timeout=300)
    assert res.returncode != 0 and "holds no source" in res.stderr and "kdcache source" in res.stderr, res.stderr
    bare = tmp_path / "bare"
    shutil.copytree(p["student"], bare)
    for name in ("chat_template.jinja",):
        if os.path.exists(bare / name):
            os.remove(bare / name)
    conf = json.load(open(bare / "tokenizer_config.json"))
    conf.pop("chat_template", None)
    json.dump(conf, open(bare / "tokenizer_config.json", "w"))
    res = kdcache("train", "--cache", p["cache"], *args[2:], "--student", bare, "--out", tmp_path / "b",
                  timeout=300)
    assert res.returncode != 0 and "no chat template" in res.stderr, res.stderr[-2000:]


def test_kill9_mid_run_then_resume_gives_the_uninterrupted_losses(trained, tmp_path):
    """Rule 3 under --cross-tokenizer: the derivation is a function of the cache alone, so a run killed mid-step
    and resumed redoes the steps since its last checkpoint with the uninterrupted run's losses, per kind too."""
    import sys

    from tests.train.common import kill9_mid_run, losses, run

    def cmd(out):
        return [sys.executable, "-m", "kdcache", "train", "--cache", trained["cache"], "--student",
                trained["student"], "--out", str(out), "--max-steps", 10, "--batch-size", 2, "--save-every", 3,
                "--no-progress", "--cross-tokenizer", "--beta", 0.5]
    cmd_s = [list(map(str, c)) for c in (cmd(tmp_path / "ref"), cmd(tmp_path / "o"))]
    ref = run(cmd_s[0])
    assert ref.returncode == 0, ref.stderr[-3000:]
    output = kill9_mid_run(cmd_s[1], tmp_path / "o", 5)
    assert 5 <= len(losses(tmp_path / "o")) < 10, output[-2000:]        # the kill landed mid-run
    res = run(cmd_s[1])
    assert res.returncode == 0 and "resumed from" in res.stdout, res.stderr[-3000:]
    got, want = losses(tmp_path / "o"), losses(tmp_path / "ref")
    assert [r["step"] for r in got] == list(range(1, 11))
    keys = ["loss"] + [f"loss_{k}" for k in xt.KINDS]
    assert [[r[k] for k in keys] for r in got] == [[r[k] for k in keys] for r in want]
    # the coverage counts every sample trained since step 1: the checkpoint carries them over the kill
    cov = [json.load(open(d / "train_summary.json"))["cross_tokenizer"][trained["cache"]]
           for d in (tmp_path / "o", tmp_path / "ref")]
    assert cov[0] == cov[1] and cov[0]["samples"] >= 10 * 2


def test_a_generate_mode_cache_trains_the_teachers_own_completions_in_the_students_tokens(tmp_path):
    """Sequence-level KD across families: the teacher (Gemma) wrote the answers (precompute --mode generate); the
    source holds the prompts and the cache the answers' ids. The student (Qwen3) renders each prompt with the
    answer's exact text (the bytes of the teacher's ids); an answer the teacher ended trains the student's end
    of turn on the teacher's end-of-turn row, one the budget cut does not, and nothing is skipped."""
    from tests.helpers.families import warm_model
    rows = [CHAT[n] for n in ("one_turn", "two_turns", "code_answer", "spaces_answer")] + EXTRA
    p = build(tmp_path, "gemma", "qwen3", [[{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]])
    warm_model(p["teacher"], rows, steps=300)
    data = write_jsonl(tmp_path / "prompts.jsonl", [{"messages": m} for m in rows])
    cache = str(tmp_path / "generated")
    res = precompute("--teacher", p["teacher"], "--data", data, "--out", cache, "--backend", "hf", "--top-k", 16,
                     "--mode", "generate", "--gen-max-new-tokens", 5, "--gen-temperature", 0, shared_ray=True)
    assert res.returncode == 0, res.stderr[-3000:]
    conv = xt.CrossTokenizer(cache, p["s_tok"])
    t_pieces = token_bytes(p["t_tok"])
    ended = cut = 0
    for rec in open_cache(cache):
        got = conv.convert(rec)
        assert got is not None, conv.coverage.first_skip
        new = rec.input_ids[rec.positions[0] + 1:].tolist()
        answer = b"".join(t_pieces[t] for t in (new if rec.truncated else new[:-1])).decode("utf-8")
        msgs = rows[rec.sample_id][:max(i for i, m in enumerate(rows[rec.sample_id]) if m["role"] == "assistant")]
        ids, spans = chat_spans(p["s_tok"], msgs + [{"role": "assistant", "content": answer}], conv.s_ends)
        assert got.input_ids.tolist() == ids                          # the student's rendering of that text
        last = int(got.input_ids[got.positions[-1] + 1])
        if rec.truncated:
            cut += 1
            assert last not in conv.s_ends and got.positions[-1] == spans[-1][1] - 3 and got.truncated
        else:
            ended += 1
            assert last in conv.s_ends and got.position_kinds[-1] == xt.END_OF_TURN
            row = rec.positions.tolist().index(len(rec.input_ids) - 2)   # the teacher's end-of-turn row
            assert np.isclose(got.target_logprobs[-1], rec.target_logprobs[row])
    assert ended and cut and not conv.coverage.skipped
