"""`kdcache onpolicy --cross-tokenizer` (issue 46, kdcache/onpolicy_cross.py): a ChatML teacher and a Llama 3
student, whose ids mean nothing to each other. Each round the student writes its completions in its own template
and tokens, their text is scored by the teacher in its own template (a score-mode cache with its source), and
the student trains on that cache through train/cross.py."""
import json
import os
import sys

import numpy as np
import pytest

from kdcache.cache_format import open_cache, verify_cache
from kdcache.cache_format.source import CacheSource
from kdcache.common.chat import chat_spans, render
from tests.helpers.cli import on_shared_ray, run, user_env, write_jsonl
from tests.helpers.families import CHAT, FAMILY_ARCH, corpus_texts, family_model, family_tokenizer, warm_model

pytestmark = [pytest.mark.ray, pytest.mark.deepspeed, pytest.mark.slow]

ROUNDS, PROMPTS, STEPS, NEW = 2, 3, 2, 4
PROMPT_CHATS = [CHAT["two_turns"], CHAT["code_answer"], CHAT["spaces_answer"], CHAT["one_turn"],
                [{"role": "user", "content": "Écris-le en français: naïve café 🙂"},
                 {"role": "assistant", "content": "naïve"}]]


@pytest.fixture(scope="module")
def loop(tmp_path_factory):
    root = tmp_path_factory.mktemp("onpolicy-cross")
    texts = corpus_texts() + [m["content"] for c in PROMPT_CHATS for m in c]
    t_tok = family_tokenizer("chatml", str(root / "t-tok"), texts, vocab_size=700)
    s_tok = family_tokenizer("llama3", str(root / "s-tok"), texts[::-1], vocab_size=500)
    teacher, student = str(root / "teacher"), str(root / "student")
    family_model(t_tok, teacher, arch=FAMILY_ARCH["chatml"], seed=0)
    family_model(s_tok, student, arch=FAMILY_ARCH["llama3"], seed=1)
    warm_model(student, PROMPT_CHATS, steps=300)
    data = write_jsonl(root / "prompts.jsonl", [{"messages": m} for m in PROMPT_CHATS])
    out = str(root / "run")
    res = run(*_command(teacher, student, data, out), 900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    from transformers import AutoTokenizer
    return {"out": out, "teacher": teacher, "student": student, "stdout": res.stdout, "data": data, "root": root,
            "t_tok": AutoTokenizer.from_pretrained(teacher), "s_tok": AutoTokenizer.from_pretrained(student)}


def _command(teacher, student, data, out, **env):
    args = ["--teacher", teacher, "--student", student, "--data", data, "--out", out, "--cross-tokenizer",
            "--rounds", ROUNDS, "--prompts-per-round", PROMPTS, "--steps-per-round", STEPS, "--batch-size", 2,
            "--gen-max-new-tokens", NEW, "--gen-temperature", 0, "--top-k", 8, "--logprob-dtype", "float32",
            "--backend", "hf", "--shard-size", 2, "--warmup-steps", 1, "--save-every", 1, "--no-progress",
            "--worker-cpus", "0.5"]
    args, env = on_shared_ray(args, user_env(RAY_ADDRESS="", **env))
    return [sys.executable, "-m", "kdcache", "onpolicy", *map(str, args)], env


def _round(out, r, name):
    with open(os.path.join(out, "rounds", f"round-{r + 1:04d}", name)) as f:
        return f.read().strip()


def test_the_student_writes_in_its_own_tokens_and_the_teacher_scores_that_text(loop):
    """Round 1's rollout: the student's own rendering of each prompt and its greedy completion, token for token.
    Every round's scoring cache holds those completions' bytes as the answer of each chat (truncated where the
    budget cut them), its ids the teacher's rendering of that chat, its end of turn trained only where the
    student ended its answer."""
    from kdcache.pipeline.teacher_hf import HFTeacher
    from kdcache.train.align import token_bytes
    out, s_tok, t_tok = loop["out"], loop["s_tok"], loop["t_tok"]
    with open(os.path.join(out, "summary.json")) as f:
        rounds = json.load(f)["rounds"]
    assert [e["done"] for e in rounds] == [True] * ROUNDS
    pieces = token_bytes(s_tok)
    s_ends = set(int(t) for t in open_cache(_round(out, 0, "rollout.txt")).eos_token_ids)
    model = HFTeacher(loop["student"], dtype="float32")
    seen = set()                                 # truncated flags of the scored completions
    for r in range(ROUNDS):
        rollout, scored = _round(out, r, "rollout.txt"), _round(out, r, "cache.txt")
        assert rollout != scored and verify_cache(rollout).ok and verify_cache(scored).ok
        counts = rounds[r]["completions"]
        assert counts["completions"] == PROMPTS and counts["prompts"] == PROMPTS
        rolled = sorted(open_cache(rollout), key=lambda x: x.sample_id)
        assert len(rolled) == PROMPTS
        kept = {s: i for i, s in enumerate(counts["rollout_samples"])}      # rollout sample -> scored sample
        assert len(kept) + sum(counts[k] for k in ("not_utf8", "special_token", "blank")) == PROMPTS
        assert len(kept) == len(open_cache(scored)) > 0
        assert counts["truncated"] == sum(x.truncated for x in rolled if x.sample_id in counts["rollout_samples"])
        src = CacheSource(scored, open_cache(scored).manifest)
        chats = {}
        for index in range(len(open_cache(scored).manifest.shards)):
            ids, got = src.chats(index)
            chats.update(zip(ids.tolist(), got))
        for x in rolled:
            prompt = PROMPT_CHATS[(r * PROMPTS + x.sample_id) % len(PROMPT_CHATS)]
            head = prompt[:max(i for i, m in enumerate(prompt) if m["role"] == "assistant")]
            p_ids = s_tok(render(s_tok, head, gen_prompt=True), add_special_tokens=False)["input_ids"]
            assert x.input_ids[:len(p_ids)].tolist() == p_ids                 # the student's own template and ids
            new = x.input_ids[len(p_ids):].tolist()
            if r == 0:                                                        # the initial student's greedy tokens
                want, ended, _ = model.generate([np.array(p_ids)], max_new_tokens=[NEW], temperature=0.0,
                                                top_p=1.0, seeds=[0], turn_ends=s_ends, logprobs=True)[0]
                assert new == want and x.truncated == (not ended)
            if x.sample_id not in kept:                # left out, counted by its reason
                continue
            answer = b"".join(pieces[t] for t in (new if x.truncated else new[:-1])).decode("utf-8")
            chat = chats[kept[x.sample_id]]
            assert chat["messages"] == head + [{"role": "assistant", "content": answer}]
            assert chat.get("truncated", False) == bool(x.truncated)
        seen.update(bool(x.truncated) for x in rolled if x.sample_id in kept)
        for rec in open_cache(scored):
            chat = chats[rec.sample_id]
            ids, spans = chat_spans(t_tok, chat["messages"], set(open_cache(scored).eos_token_ids))
            assert rec.input_ids.tolist() == ids                              # the teacher's own rendering
            last = int(rec.input_ids[rec.positions[-1] + 1])
            assert (last in open_cache(scored).eos_token_ids) == (not chat.get("truncated", False))
            assert bool(rec.truncated) == chat.get("truncated", False)
    assert seen == {True, False}                 # both an answer the budget cut and one the student ended


def test_training_maps_every_round_onto_the_students_positions_and_reports_coverage(loop):
    out = loop["out"]
    with open(os.path.join(out, "train_summary.json")) as f:
        summary = json.load(f)
    assert summary["step"] == ROUNDS * STEPS
    cov = summary["cross_tokenizer"]
    assert set(cov) == {_round(out, ROUNDS - 1, "cache.txt")}               # the last round's cache, its coverage
    c = next(iter(cov.values()))
    assert c["samples"] > 0 and c["positions"] > 0 and not c["skipped"], c
    assert c["share_one_to_one"] + c["share_aligned"] > 0
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == list(range(1, ROUNDS * STEPS + 1))
    assert all(np.isfinite(r["loss"]) for r in rows)
    assert all(sum(v for k, v in r.items() if k.startswith("positions_")) > 0 for r in rows)
    from kdcache.train import cross as xt
    ends, cut = set(), set()
    for r in range(ROUNDS):                       # the student's view: its end of turn trained where it ended
        cache = _round(out, r, "cache.txt")
        conv = xt.CrossTokenizer(cache, loop["s_tok"])
        for rec in open_cache(cache):
            got = conv.convert(rec)
            assert got is not None, conv.coverage.first_skip
            last_target = int(got.input_ids[got.positions[-1] + 1])
            if rec.truncated:                     # its answer's positions, not the end the template added
                cut.add(rec.sample_id)
                assert last_target not in conv.s_ends and got.truncated
                assert int(got.position_kinds[-1]) != xt.END_OF_TURN
            else:
                ends.add(rec.sample_id)
                assert last_target in conv.s_ends and int(got.position_kinds[-1]) == xt.END_OF_TURN
    assert ends and cut
    assert "--cross-tokenizer" in loop["stdout"] and "cut by --gen-max-new-tokens" in loop["stdout"]
    final = os.path.join(out, "final")
    from transformers import AutoTokenizer
    assert AutoTokenizer.from_pretrained(final).get_vocab() == loop["s_tok"].get_vocab()   # still its own tokenizer


def test_what_cross_tokenizer_rounds_refuse_and_when_they_are_token_exact(loop, tmp_path, capsys):
    from kdcache import onpolicy
    from kdcache.common.errors import ConfigError
    from kdcache.onpolicy_cross import cross_rounds
    data = write_jsonl(tmp_path / "p.jsonl", [{"messages": m} for m in PROMPT_CHATS])
    base = ["--teacher", loop["teacher"], "--student", loop["student"], "--data", data, "--out", str(tmp_path / "o"),
            "--prompts-per-round", "2", "--steps-per-round", "2", "--cross-tokenizer"]
    cfg, pre, train = onpolicy.parse(base)
    assert train["cross_tokenizer"] is True
    assert cross_rounds(train, [loop["teacher"]], loop["student"])
    with pytest.raises(ConfigError, match="token-rkl weighs the student's sampled ids"):
        onpolicy.parse(base + ["--objective", "token-rkl", "--gen-temperature", "1"])
    with pytest.raises(ConfigError, match="`base` teachers share the student's tokenizer"):
        onpolicy.parse(["--teacher", "base"] + base[2:] + ["--lora-r", "4"])
    with pytest.raises(ConfigError, match="served teacher"):
        cross_rounds(train, ["http://127.0.0.1:9/v1"], loop["student"])
    capsys.readouterr()
    assert not cross_rounds(train, [loop["student"]], loop["student"])        # one tokenizer: token-exact rounds
    assert "the rounds are token-exact" in capsys.readouterr().out
    assert not cross_rounds({}, [loop["teacher"]], loop["student"])           # no flag: the plain loop


def test_a_loop_killed_between_a_rollout_and_its_scoring_resumes_to_the_same_run(loop):
    """kill -9 of the loop once round 2's completions are text (chats.jsonl written, its counts not yet), then a
    rerun: the same chats, round caches, per-step losses and final weights as the loop that ran through."""
    out = str(loop["root"] / "killed")
    cmd, env = _command(loop["teacher"], loop["student"], loop["data"], out,
                        KDCACHE_CRASH_AT="before-replace-chats.jsonl.counts.json@2")
    res = run(cmd, env, 900)
    round2 = os.path.join(out, "rounds", "round-0002")
    assert res.returncode == -9, res.stdout[-2000:] + res.stderr[-2000:]                 # the fault landed there
    assert os.path.isfile(os.path.join(round2, "chats.jsonl"))
    assert not os.path.exists(os.path.join(round2, "chats.jsonl.counts.json"))
    with open(os.path.join(out, "summary.json")) as f:
        assert [e["stage"] for e in json.load(f)["rounds"]] == ["trained", "new"]
    cmd, env = _command(loop["teacher"], loop["student"], loop["data"], out)
    res = run(cmd, env, 900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    ref = loop["out"]
    for r in range(ROUNDS):
        with open(os.path.join(ref, "rounds", f"round-{r + 1:04d}", "chats.jsonl"), "rb") as a, \
                open(os.path.join(out, "rounds", f"round-{r + 1:04d}", "chats.jsonl"), "rb") as b:
            assert a.read() == b.read()
        assert open_cache(_round(ref, r, "cache.txt")).manifest.fingerprint == \
            open_cache(_round(out, r, "cache.txt")).manifest.fingerprint
    rows = [[json.loads(line) for line in open(os.path.join(o, "metrics.jsonl"))] for o in (ref, out)]
    assert [(x["step"], x["loss"]) for x in rows[0]] == [(x["step"], x["loss"]) for x in rows[1]]
    from safetensors.numpy import load_file
    a, b = (load_file(os.path.join(o, "final", "model.safetensors")) for o in (ref, out))
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
