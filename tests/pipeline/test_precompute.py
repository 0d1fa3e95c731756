"""End to end: `kdcache precompute` on Ray with the hf backend, resume, refusal, bad records, kill -9."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from kdcache.cache_format import open_cache, verify_cache
from tests.helpers.chats import MULTI
from tests.helpers.cli import precompute, user_env, user_project, write_jsonl
from tests.helpers.raycluster import shared_head

pytestmark = [pytest.mark.ray, pytest.mark.slow]



@pytest.fixture(scope="module")
def mixed(tiny, tmp_path_factory):
    """A finished cache over chat, multi-turn, prompt/completion and text records plus two bad lines."""
    d = tmp_path_factory.mktemp("mixed")
    rows = [tiny["train"][0], MULTI, {"prompt": "hello there", "completion": "sql"}, "{broken json",
            {"text": "docker and kubernetes"}, {"messages": [{"role": "user", "content": "no answer"}]},
            tiny["train"][1], tiny["train"][2]]
    data = write_jsonl(d / "data.jsonl", rows)
    out = d / "cache"
    args = ["--teacher", tiny["teacher"], "--data", data, "--out", out, "--backend", "hf", "--top-k", 16,
            "--shard-size", 3, "--on-bad-record", "skip"]
    res = precompute(*args)                      # a Ray of its own (test_existing_ray_cluster_same_code_path)
    assert res.returncode == 0, res.stderr
    return {"out": out, "data": data, "args": args, "stdout": res.stdout, "rows": rows}


def test_cache_is_sound_and_bad_records_are_listed(mixed):
    rep = verify_cache(mixed["out"])
    assert rep.ok, rep.problems
    cache = open_cache(mixed["out"])
    assert [r.sample_id for r in cache] == [0, 1, 2, 4, 6, 7]           # 3 and 5 skipped, ids stable
    skipped = [json.loads(x) for x in open(mixed["out"] / "report" / "skipped.jsonl")]
    assert [(s["sample_id"], s["where"].rsplit(":", 1)[1]) for s in skipped] == [(3, "4"), (5, "6")]
    summary = json.load(open(mixed["out"] / "report" / "summary.json"))
    assert summary["skipped"] == {"bad_record": 2} and summary["samples_written"] == 6
    assert "skipped" in mixed["stdout"] and "bad_record: 2" in mixed["stdout"]


def test_eos_position_present_and_equal_to_direct_forward(mixed, tiny):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny["teacher"], dtype=torch.float32).eval()
    cache = open_cache(mixed["out"])
    eos = set(cache.eos_token_ids)
    for rec in cache:
        is_eos = np.isin(rec.targets, list(eos))
        assert is_eos.any(), f"sample {rec.sample_id} lost its end-of-turn position"
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([rec.input_ids.tolist()])).logits[0].float(), -1)
        want_lp, want_ids = lp[torch.as_tensor(rec.positions.astype(np.int64))].topk(16, dim=-1)
        np.testing.assert_array_equal(rec.topk_ids, want_ids.numpy())     # every position, the ranks too
        np.testing.assert_allclose(rec.topk_logprobs, want_lp.numpy(), atol=4e-3)   # float16 storage
        tail = 1 - want_lp.double().exp().sum(-1).numpy()
        np.testing.assert_allclose(rec.tail_mass, tail, atol=1e-5)
        pos = torch.as_tensor(rec.positions.astype(np.int64))       # the data's own next token, at any rank
        want_target = lp[pos, torch.as_tensor(rec.targets.astype(np.int64))].numpy()
        np.testing.assert_allclose(rec.target_logprobs, want_target, atol=1e-5)


def test_multi_turn_trains_every_assistant_turn_and_no_user_turn(mixed, tiny):
    tok = tiny["tok"]
    rec = open_cache(mixed["out"])[1]
    assert rec.sample_id == 1
    assert tok.decode(rec.targets.tolist()) == "sql, python<|im_end|>docker<|im_end|>"


def test_rerun_is_a_noop_that_says_so(mixed):
    before = (mixed["out"] / "manifest.json").read_text()
    res = precompute(*mixed["args"], shared_ray=True)
    assert res.returncode == 0 and "nothing to do" in res.stdout
    assert (mixed["out"] / "manifest.json").read_text() == before


def test_different_settings_into_same_directory_refused(mixed):
    args = list(mixed["args"])
    args[args.index("--top-k") + 1] = 8
    res = precompute(*args, "--max-length", 256, shared_ray=True)
    assert res.returncode == 2
    # The first run's max_length was the default: the teacher's context of 512 tokens.
    assert "format.top_k: 16 -> 8" in res.stderr and "capture.max_length: 512 -> 256" in res.stderr


def test_bad_record_fails_by_default_naming_file_and_line(mixed, tmp_path):
    args = list(mixed["args"])
    args[args.index("--out") + 1] = tmp_path / "c"
    args = args[:args.index("--on-bad-record")]
    res = precompute(*args, shared_ray=True)
    assert res.returncode == 2 and "data.jsonl:4: invalid JSON" in res.stderr
    assert not (tmp_path / "c").exists()                      # failed before any teacher work


def _session(sid):
    """{pid: command} of the live processes in session `sid` (the driver's, started with start_new_session)."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[3]) == sid and fields[0] != "Z":
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    found[int(pid)] = f.read().replace(b"\0", b" ")[:80].decode(errors="replace")
        except (OSError, ValueError):
            continue
    return found


def test_kill9_then_resume_equals_uninterrupted(tiny, tmp_path):
    """kill -9 of the driver alone: Ray's processes go with it (their PR_SET_PDEATHSIG), the lock is free, and the
    resume completes the cache. In the compact mode (ragged rows, sqrt8), so the whole pipeline runs it too. The
    random-init teacher is flat (its top 8 hold about 3% of the mass): --top-p 0.01 keeps a few entries per position."""
    data = write_jsonl(tmp_path / "d.jsonl", tiny["train"][:60])
    common = ["--teacher", tiny["teacher"], "--data", data, "--backend", "hf", "--top-k", 8, "--shard-size", 2,
              "--format", "zarr", "--workers", 1, "--logprob-dtype", "sqrt8", "--top-p", 0.01]
    ref = precompute(*common, "--out", tmp_path / "ref", shared_ray=True)
    assert ref.returncode == 0, ref.stderr

    out = tmp_path / "killed"
    env = user_env(RAY_ADDRESS="")
    proc = subprocess.Popen([sys.executable, "-m", "kdcache", "precompute", "--no-progress", "--worker-cpus", "0.5",
                             *map(str, common), "--out", str(out)], cwd=user_project(), env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    committed = 0
    while time.time() < deadline and proc.poll() is None:
        try:
            committed = len(json.loads((out / "manifest.json").read_text())["shards"])
        except (OSError, ValueError):
            committed = 0
        if committed >= 4:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the job finished before it could be killed"
    assert len(_session(proc.pid)) >= 3                     # the driver, Ray's head and a worker at least
    os.kill(proc.pid, signal.SIGKILL)                       # the driver alone, as `kill -9 PID` does (issue 23)
    proc.wait()
    left, deadline = _session(proc.pid), time.time() + 20
    while left and time.time() < deadline:
        time.sleep(0.5)
        left = _session(proc.pid)
    os.killpg(proc.pid, signal.SIGKILL) if left else None
    assert not left, f"Ray's processes outlived the driver: {left}"
    assert 4 <= committed < 30
    assert verify_cache(out).ok                              # what was committed is sound

    res = precompute(*common, "--out", out)
    assert res.returncode == 0, res.stderr
    assert "resuming" in res.stdout
    a, b = open_cache(tmp_path / "ref"), open_cache(out)
    assert len(a) == len(b) == 60 and b.complete
    for ra, rb in zip(a, b):
        assert ra.sample_id == rb.sample_id
        for f in ("input_ids", "positions", "topk_ids", "topk_logprobs", "tail_mass", "target_logprobs"):
            np.testing.assert_array_equal(getattr(ra, f), getattr(rb, f))
    assert verify_cache(out).ok
    assert (np.concatenate([r.topk_counts for r in a]) < 8).any()       # the rows really are ragged


def test_generate_mode_stores_teacher_completions(tiny, stopping, tmp_path):
    """Sampled generate mode (temperature 1, the default) with a teacher that stops: every generated step is
    trained, the end-of-turn step of a completion that ended included, and one that did not is flagged; each
    completion is the one its sample's own seed (--seed + sample id) draws, whatever shard it fell in;
    --gen-top-p near 0 is greedy decoding."""
    tok, rows = tiny["tok"], tiny["train"][:8]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    common = ["--teacher", stopping["sampled"], "--data", data, "--backend", "hf", "--mode", "generate",
              "--gen-max-new-tokens", 12, "--top-k", 8, "--logprob-dtype", "float32"]
    for out, extra in (("g", ["--shard-size", 4]), ("top", ["--gen-top-p", 1e-6, "--shard-size", 3])):
        res = precompute(*common, "--out", tmp_path / out, *extra, shared_ray=True)
        assert res.returncode == 0, res.stderr
        assert verify_cache(tmp_path / out).ok
    eos, ended = tok.eos_token_id, []
    for raw, rec in zip(rows, open_cache(tmp_path / "g")):
        prompt = tok.apply_chat_template(raw["messages"][:-1], tokenize=False, add_generation_prompt=True)
        n_prompt = len(tok(prompt, add_special_tokens=False)["input_ids"])
        assert rec.positions[0] == n_prompt - 1 and rec.positions[-1] == len(rec.input_ids) - 2
        ended.append(bool(rec.input_ids[-1] == eos))
        assert rec.truncated == (not ended[-1])
        assert (rec.targets == eos).sum() == ended[-1]             # the end-of-turn step is the last, trained
        assert len(rec.input_ids) - n_prompt == (len(rec.positions)) <= 12
    assert any(ended) and not all(ended), ended                    # both kinds really ran
    from kdcache.pipeline.teacher_hf import HFTeacher
    recs = list(open_cache(tmp_path / "g"))
    prompts = [r.input_ids[:r.positions[0] + 1] for r in recs]
    alone = HFTeacher(stopping["sampled"], dtype="float32").generate(            # all 8 at once, in this process
        prompts, max_new_tokens=[12] * 8, temperature=1.0, top_p=1.0, seeds=[r.sample_id for r in recs],
        turn_ends={eos})
    for rec, p, (new, _) in zip(recs, prompts, alone):
        assert rec.input_ids.tolist() == p.tolist() + list(new)    # per-sample seeds: shards change nothing
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(stopping["sampled"], dtype=torch.float32).eval()
    for raw, rec in zip(rows, open_cache(tmp_path / "top")):       # top-p near 0 keeps the likeliest token only
        ids = tok.apply_chat_template(raw["messages"][:-1], add_generation_prompt=True, return_tensors="pt",
                                      return_dict=True)["input_ids"]
        greedy = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                                eos_token_id=eos, pad_token_id=tok.pad_token_id)[0]
        assert rec.input_ids.tolist() == greedy.tolist()


def test_existing_ray_cluster_same_code_path(mixed, tmp_path):
    """--ray-address: a Ray head started separately on 127.0.0.1 (this process's shared one) gives the same cache as
    a job-local Ray (the module's cache)."""
    head = shared_head()
    args = list(mixed["args"])
    args[args.index("--out") + 1] = tmp_path / "c"
    res = precompute(*args, shared_ray=True)
    assert res.returncode == 0, res.stderr[-3000:]
    # The job joined that head (a flag ignored would have run on a private Ray); the module's job, without
    # --ray-address, started its own Ray, though this cluster may have been running already.
    joined = json.loads((tmp_path / "c" / "report" / "summary.json").read_text())["ray"]
    private = json.loads((mixed["out"] / "report" / "summary.json").read_text())["ray"]
    assert joined["gcs_address"].endswith(f":{head.port}") and joined["own"] is False, joined
    assert private["own"] is True and not private["gcs_address"].endswith(f":{head.port}"), private
    a, b = open_cache(mixed["out"]), open_cache(tmp_path / "c")
    assert len(a) == len(b)
    for ra, rb in zip(a, b):
        for f in ("sample_id", "input_ids", "positions", "topk_ids", "topk_logprobs", "tail_mass"):
            np.testing.assert_array_equal(getattr(ra, f), getattr(rb, f))


@pytest.mark.parametrize("point", ["before-replace-manifest.json@3", "before-publish@2"])
def test_crash_at_commit_points_then_resume_equals_uninterrupted(mixed, tmp_path, monkeypatch, point):
    """SIGKILL exactly before the manifest replace (driver) or before a shard rename (worker), then resume. After
    the driver's crash, a rerun with another --shard-size is refused and writes nothing (the reported loss: that
    rerun used to end 'complete' with records missing)."""
    args = list(mixed["args"])
    args[args.index("--out") + 1] = tmp_path / "c"
    monkeypatch.setenv("KDCACHE_CRASH_AT", point)
    first = precompute(*args, shared_ray=True)
    monkeypatch.delenv("KDCACHE_CRASH_AT")
    # The fault landed: the first run died there and left a cache of 3 planned shards with only those before it
    # committed (the 3rd manifest write is the 2nd shard's commit; the 2nd shard rename is the 2nd shard's).
    m = json.loads((tmp_path / "c" / "manifest.json").read_text())
    assert first.returncode != 0 and not m["complete"]
    assert m["num_shards_planned"] == 3 and len(m["shards"]) == 1, m["shards"]
    assert verify_cache(tmp_path / "c").ok                         # what was committed is sound
    if point.startswith("before-replace"):
        other = list(args)
        other[other.index("--shard-size") + 1] = 5
        res = precompute(*other, shared_ray=True)
        assert res.returncode == 2 and "Resume with --shard-size 3" in res.stderr, res.stderr[-2000:]
        assert json.loads((tmp_path / "c" / "manifest.json").read_text()) == m       # the refusal wrote nothing
    res = precompute(*args, shared_ray=True)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resuming, 1 of 3 shards already committed" in res.stdout
    a, b = open_cache(mixed["out"]), open_cache(tmp_path / "c")
    assert b.complete and len(a) == len(b)
    for ra, rb in zip(a, b):
        for f in ("sample_id", "input_ids", "positions", "topk_ids", "topk_logprobs", "tail_mass"):
            np.testing.assert_array_equal(getattr(ra, f), getattr(rb, f))


def test_disk_full_in_a_worker_is_a_clear_error_and_loses_nothing(mixed, tmp_path, monkeypatch):
    args = list(mixed["args"])
    args[args.index("--out") + 1] = tmp_path / "c"
    monkeypatch.setenv("KDCACHE_ENOSPC_AT", "before-publish@2")
    first = precompute(*args, shared_ray=True)
    assert first.returncode == 2, first.stderr[-2000:]
    assert "No space left on device" in first.stderr and "shard" in first.stderr and "Traceback" not in first.stderr
    monkeypatch.delenv("KDCACHE_ENOSPC_AT")
    assert verify_cache(tmp_path / "c").ok
    temps = [p for p in os.listdir(tmp_path / "c" / "shards") if p.startswith(".")]
    assert not [p for p in temps if p.startswith(".shard-00001")]     # the failed write left no temp file
    res = precompute(*args, shared_ray=True)
    assert res.returncode == 0, res.stderr[-3000:]
    # a shard in flight when the job stopped may leave one; the resumed job sweeps it away
    assert not [p for p in os.listdir(tmp_path / "c" / "shards") if p.startswith(".")]
    assert [r.sample_id for r in open_cache(tmp_path / "c")] == [r.sample_id for r in open_cache(mixed["out"])]


def test_a_signal_to_the_whole_process_group_stops_cleanly_and_the_rerun_resumes(tiny, tmp_path):
    """A batch scheduler signals the driver and Ray's processes at once (SIGHUP, a closed terminal, takes the
    same path: make chaos runs both)."""
    sig = signal.SIGTERM
    data = write_jsonl(tmp_path / "d.jsonl", tiny["train"])                      # 120 records, 60 shards
    common = ["--teacher", tiny["teacher"], "--data", data, "--backend", "hf", "--top-k", 16, "--shard-size", 2]
    out = tmp_path / "c"
    env = user_env(RAY_ADDRESS="")
    proc = subprocess.Popen([sys.executable, "-m", "kdcache", "precompute", "--no-progress", "--worker-cpus", "0.5",
                             *map(str, common), "--out", str(out)], cwd=user_project(), env=env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 180
    while time.time() < deadline and proc.poll() is None:
        try:
            if len(json.loads((out / "manifest.json").read_text())["shards"]) >= 2:
                break
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    assert proc.poll() is None, "the job finished before the signal: make it longer"
    os.killpg(proc.pid, sig)
    output, _ = proc.communicate(timeout=180)
    committed = len(open_cache(out).shards)
    assert committed < 60, "the signal landed after the last commit: it interrupted nothing"
    # Either the workers outlived the signal and the shards in flight were committed (exit 0), or they
    # stopped with the group (exit 128 + N): both say how to resume, neither shows a traceback.
    assert proc.returncode in (0, 128 + sig), output[-3000:]
    assert "rerun the same command to resume" in output and "Traceback" not in output, output[-3000:]
    assert verify_cache(out).ok
    res = precompute(*common, "--out", out)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resuming" in res.stdout and [r.sample_id for r in open_cache(out)] == list(range(120))


def test_overlong_drop_and_max_messages_through_the_command_are_counted_and_listed(tiny, tmp_path):
    """--overlong drop and --max-messages: the samples they leave out are counted in summary.json and listed in
    report/skipped.jsonl with their line; the rest are written."""
    long = {"messages": [{"role": "user", "content": "docker " * 600}, {"role": "assistant", "content": "sql"}]}
    chatty = {"messages": [{"role": r, "content": f"m{i}"} for i in range(3) for r in ("user", "assistant")]}
    rows = [tiny["train"][0], long, chatty, tiny["train"][1]]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    res = precompute("--teacher", tiny["teacher"], "--data", data, "--out", tmp_path / "c", "--backend", "hf",
                     "--top-k", 4, "--max-length", 256, "--overlong", "drop", "--max-messages", 4, shared_ray=True)
    assert res.returncode == 0, res.stderr[-2000:]
    summary = json.loads((tmp_path / "c" / "report" / "summary.json").read_text())
    assert summary["skipped"] == {"too_long": 1, "too_many_messages": 1} and summary["samples_written"] == 2
    listed = [json.loads(x) for x in (tmp_path / "c" / "report" / "skipped.jsonl").read_text().splitlines()]
    assert sorted((x["reason"], x["sample_id"], x["where"]) for x in listed) == [
        ("too_long", 1, f"{data}:2"), ("too_many_messages", 2, f"{data}:3")], listed
    assert [r.sample_id for r in open_cache(tmp_path / "c")] == [0, 3]
