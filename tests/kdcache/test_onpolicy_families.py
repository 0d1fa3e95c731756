"""`kdcache onpolicy` beyond ChatML and a local store: a Llama 3 teacher and student (three stop ids, a system
header the template writes itself, multi-turn prompts), the round caches in an S3 store (`--store URL`)."""
import json
import os
import sys

import numpy as np
import pytest

from kdcache.cache_format import open_cache, verify_cache
from tests.helpers.cli import on_shared_ray, run, user_env, write_jsonl

pytestmark = [pytest.mark.ray, pytest.mark.deepspeed, pytest.mark.slow]

ROUNDS, PROMPTS, STEPS, NEW = 2, 3, 2, 6


def test_a_llama3_loop_keeps_its_round_caches_in_a_remote_store_and_stops_on_the_familys_ids(bucket, tmp_path):
    """Round caches under s3://BUCKET/onpolicy (each verified there), the family's three stop ids recorded in each
    and in final/; round 1's prompts are the template's own rendering of each chat's turns before its last answer,
    and its completions the initial student's greedy ones, token for token."""
    from kdcache.common.chat import render
    from kdcache.pipeline.teacher_hf import HFTeacher
    from tests.helpers.families import CHATS, FAMILY_ARCH, corpus_texts, family_model, family_tokenizer
    tok = family_tokenizer("llama3", str(tmp_path / "tok"), corpus_texts())
    teacher, student = str(tmp_path / "teacher"), str(tmp_path / "student")
    family_model(tok, teacher, arch=FAMILY_ARCH["llama3"], seed=0)
    family_model(tok, student, arch=FAMILY_ARCH["llama3"], seed=1)
    chats = [c["messages"] for c in CHATS if c["name"] in ("two_turns", "system_three_turns", "spaces_answer",
                                                               "one_turn")]
    data = write_jsonl(tmp_path / "prompts.jsonl", [{"messages": m} for m in chats])
    store, out = f"{bucket}/onpolicy", str(tmp_path / "run")
    args = ["--teacher", teacher, "--student", student, "--data", data, "--out", out, "--store", store,
            "--rounds", ROUNDS, "--prompts-per-round", PROMPTS, "--steps-per-round", STEPS, "--batch-size", 2,
            "--gen-max-new-tokens", NEW, "--gen-temperature", 0, "--top-k", 8, "--logprob-dtype", "float32",
            "--backend", "hf", "--shard-size", 2, "--warmup-steps", 1, "--no-progress", "--worker-cpus", "0.5",
            "--ray-pass-credentials"]
    args, env = on_shared_ray(args, user_env(RAY_ADDRESS=""))
    res = run([sys.executable, "-m", "kdcache", "onpolicy", *map(str, args)], env, 900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]

    with open(os.path.join(out, "summary.json")) as f:
        rounds = json.load(f)["rounds"]
    assert [e["done"] for e in rounds] == [True] * ROUNDS
    assert [e["steps"] for e in rounds] == [[1, STEPS], [STEPS + 1, 2 * STEPS]]
    caches = [e["cache"] for e in rounds]
    assert all(c.startswith(store + "/") for c in caches) and len(set(caches)) == ROUNDS, caches
    assert not os.path.exists(os.path.join(out, "store"))            # nothing in the default local store
    stops = set(np.atleast_1d(json.load(open(os.path.join(teacher, "generation_config.json")))["eos_token_id"]))
    assert {tok.convert_ids_to_tokens(int(t)) for t in stops} == {"<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"}
    for c in caches:
        assert verify_cache(c).ok
        assert set(map(int, open_cache(c).eos_token_ids)) == stops
    final = json.load(open(os.path.join(out, "final", "generation_config.json")))
    assert set(np.atleast_1d(final["eos_token_id"]).tolist()) == stops

    # round 1: prompts 0..2, rendered by the family's own template; completions the initial student's greedy ones
    first = sorted(open_cache(caches[0]), key=lambda r: r.sample_id)
    assert len(first) == PROMPTS
    model = HFTeacher(student, dtype="float32")
    for r, msgs in zip(first, chats):
        last = max(i for i, m in enumerate(msgs) if m["role"] == "assistant")
        prompt = tok(render(tok, msgs[:last], gen_prompt=True), add_special_tokens=False)["input_ids"]
        assert tok.convert_ids_to_tokens(prompt[0]) == "<|begin_of_text|>" and prompt.count(prompt[0]) == 1
        assert r.input_ids[:len(prompt)].tolist() == prompt and r.positions[0] == len(prompt) - 1
        new, ended, _ = model.generate([np.array(prompt)], max_new_tokens=[NEW], temperature=0.0, top_p=1.0,
                                       seeds=[0], turn_ends=stops, logprobs=True)[0]
        assert r.input_ids[len(prompt):].tolist() == new and r.truncated == (not ended)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        assert [json.loads(line)["step"] for line in f] == list(range(1, ROUNDS * STEPS + 1))
