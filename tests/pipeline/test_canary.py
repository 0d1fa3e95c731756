"""A served teacher's canary (issue 45, part 3; pipeline/canary.py): positions of the job's own data, drawn by its
seed, whose next-token log-probs are kept in the manifest; a teacher that scores them otherwise is refused. Here the
picking and the check, with in-process teachers (tests/pipeline/test_served.py holds a real `vllm serve` to it)."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kdcache.cache_format import Storage
from kdcache.pipeline import canary
from kdcache.pipeline.canary import CanaryError
from kdcache.pipeline.data import parse_row
from kdcache.pipeline.encode import Encoder
from kdcache.pipeline.teacher_hf import HFTeacher
from tests.helpers.cli import write_jsonl
from tests.pipeline.test_teacher_view import hinted


def _cfg(data, seed=0, mode="score"):
    return SimpleNamespace(data=str(data), seed=seed, mode=mode)


@pytest.fixture
def data(tiny, tmp_path):
    """20 hinted chats with a malformed record at index 1 (the canary passes over it: the scan names it)."""
    rows = [hinted(r) for r in tiny["train"][:20]]
    rows.insert(1, {"nothing": "usable"})
    return write_jsonl(tmp_path / "d.jsonl", rows), rows


def test_the_canary_is_drawn_by_the_jobs_seed_from_its_first_records_trained_positions(tiny, data):
    path, rows = data
    enc = Encoder(tiny["tok"])
    c = canary.pick(_cfg(path), enc, 64)
    assert len(c.where) == 64 and c.where == canary.pick(_cfg(path), enc, 64).where     # fixed by the seed
    assert canary.pick(_cfg(path, seed=1), enc, 64).where != c.where
    valid, pool = [], 0                   # records from the first on, until they hold 2 x 64 positions
    for i, r in enumerate(rows):
        if "messages" in r and pool < canary.POOL * 64:
            valid.append(i)
            pool += len(enc.encode(parse_row(r), i).positions)
    assert pool >= 128 and len(valid) < len(rows) - 1
    assert 1 not in c.sample_ids and set(c.sample_ids) <= set(valid) and max(c.sample_ids) > len(valid) // 2
    for sid, seq, pos in zip(c.sample_ids, c.seqs, c.positions):
        s = enc.encode(parse_row(rows[sid]), sid)
        np.testing.assert_array_equal(seq, s.teacher_ids)                    # the teacher's own view is scored
        assert set(pos.tolist()) <= set(s.teacher_positions.tolist()) and sorted(pos.tolist()) == pos.tolist()
    every = sum(len(enc.encode(parse_row(r), i).positions) for i, r in enumerate(rows) if "messages" in r)
    assert len(canary.pick(_cfg(path), enc, 10 ** 6).where) == every        # no more than the data holds
    gen = canary.pick(_cfg(path, mode="generate"), enc, 10 ** 6)            # generate mode: the prompts' positions
    for sid, seq, pos in zip(gen.sample_ids, gen.seqs, gen.positions):
        prompt = enc.encode_prompt(parse_row(rows[sid]), sid)
        np.testing.assert_array_equal(seq, prompt.teacher_ids)
        assert pos.tolist() == list(range(len(seq) - 1))


def test_the_canary_holds_a_teacher_to_its_weights(tiny, stopping, data):
    """The same teacher passes; a teacher with other weights is refused naming positions and the difference. The
    scores are the teacher's log-probs of the actual next token (checked against a forward pass)."""
    path, _ = data
    c = canary.pick(_cfg(path), Encoder(tiny["tok"]), 64)
    teacher, other = HFTeacher(tiny["teacher"]), HFTeacher(stopping["greedy"])
    lps = canary.score(teacher, c)
    got = []
    for seq, pos in zip(c.seqs, c.positions):
        with torch.no_grad():
            logits = teacher.model(torch.tensor(seq[None], dtype=torch.long)).logits[0].double()
        got += torch.log_softmax(logits, -1)[pos, seq[pos + 1]].tolist()
    np.testing.assert_allclose(lps, got, atol=1e-4)
    ref = canary.entry(c, lps, 0.05)
    assert ref["positions"] == c.where and len(ref["target_logprobs"]) == 64
    assert canary.check(ref, c, canary.score(teacher, c), 0.05, "URL", "this job") < 1e-5
    now = canary.score(other, c)
    with pytest.raises(CanaryError) as e:
        canary.check(ref, c, now, 0.05, "http://h:1/v1", "this job as it started")
    msg = str(e.value)
    assert "http://h:1/v1" in msg and "64 canary positions" in msg and "tolerance 0.05" in msg
    worst = int(np.argmax(np.abs(now - lps)))
    assert f"differs by {np.abs(now - lps).mean():.4f} nats" in msg
    assert f"record {c.where[worst][0]} position {c.where[worst][1]}: {lps[worst]:.4f} then" in msg
    assert "none of its scores went into the cache" in msg
    # a small shift within the tolerance passes; beyond it, refused
    assert canary.check(ref, c, lps + 0.04, 0.05, "URL", "x") == pytest.approx(0.04)
    with pytest.raises(CanaryError, match="differs by 0.0600"):
        canary.check(ref, c, lps - 0.06, 0.05, "URL", "x")
    with pytest.raises(CanaryError, match="canary positions of this job differ"):
        canary.check(dict(ref, positions=ref["positions"][1:]), c, lps, 0.05, "URL", "x")


def test_a_teacher_worker_with_other_weights_refuses_to_start(tiny, stopping, data):
    """Each worker scores the canary as it loads its teacher (here in-process teachers stand in for servers)."""
    from kdcache.pipeline.worker import TeacherWorker, WorkerSpec
    path, _ = data
    c = canary.pick(_cfg(path), Encoder(tiny["tok"]), 32)
    ref = canary.entry(c, canary.score(HFTeacher(tiny["teacher"]), c), 0.05)
    held = {"canary": c, "reference": ref, "tolerance": 0.05}

    def spec(model):
        return WorkerSpec("hf", model, teacher_kwargs=dict(dtype="float32"), storage=Storage(top_k=4),
                          vocab_size=tiny["tok"].vocab_size, generate=None, canary=held)
    assert TeacherWorker(spec(tiny["teacher"])).teacher is not None
    with pytest.raises(CanaryError, match="measured by a teacher worker as it started"):
        TeacherWorker(spec(stopping["greedy"]))
