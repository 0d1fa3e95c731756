"""What a job hands its workers (settle.Job.worker_spec) and how a worker seeds each sample's draws: the plumbing
that only slow end-to-end tests used to reach (issue 42, section 4)."""
import dataclasses

import numpy as np
import pytest

from kdcache.cache_format import Storage
from kdcache.pipeline.config import PrecomputeConfig
from kdcache.pipeline.encode import Sample
from kdcache.pipeline.settle import Job
from kdcache.pipeline.worker import TeacherWorker, WorkerSpec


def _job(tmp_path, **cfg):
    (tmp_path / "t").mkdir(exist_ok=True)
    c = PrecomputeConfig(teacher=str(tmp_path / "t"), data="d.jsonl", out=str(tmp_path / "o"), **cfg)
    c = dataclasses.replace(c, workers=c.workers or 1)           # settle resolves it before worker_spec
    return Job(c, encoder=None, tokenizer_id={}, turn_ends=[2], teacher_backend="hf", backend_reason="test",
               server=None, gpus=0, dtype="float32", vocab_size=100, storage=Storage(top_k=8), parts={},
               t_start=0.0, generator_backend="hf" if c.generator else None)


@pytest.mark.parametrize("workers,threads,cores,want", [(2, 0, 8, 4), (4, 0, 8, 2), (3, 0, 2, 1), (2, 5, 8, 5)])
def test_threads_0_divides_the_cores_among_the_workers(tmp_path, monkeypatch, workers, threads, cores, want):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(cores)))
    spec = _job(tmp_path, workers=workers, threads=threads).worker_spec()
    assert spec.teacher_kwargs["threads"] == want


def test_batch_tokens_reach_the_teacher_and_the_generator(tmp_path):
    (tmp_path / "g").mkdir()
    spec = _job(tmp_path, batch_tokens=1234, mode="generate", generator=str(tmp_path / "g")).worker_spec()
    assert spec.teacher_kwargs["batch_tokens"] == 1234
    assert spec.generator["kwargs"]["batch_tokens"] == 1234
    assert spec.generate["seed"] == 0 and spec.generate["max_new_tokens"] > 0


class _SeedRecorder:
    """A teacher that records the seeds its draws are given."""
    def __init__(self):
        self.seeds = []

    def score_sampled(self, seqs, positions, k, n, seeds):
        self.seeds.extend(seeds)
        return [(None, None)] * len(seqs)


def test_each_sample_draws_with_the_job_seed_plus_its_id_so_equal_records_draw_differently():
    worker = TeacherWorker.__new__(TeacherWorker)          # no model: only the seeding is under test
    worker.spec = WorkerSpec("hf", "-", {}, Storage(top_k=0, logprob_dtype="float32", sample=4), 100, None, seed=7)
    worker.teacher = _SeedRecorder()
    same = np.array([1, 5, 6, 2], np.int32)
    worker._score([Sample(3, same, np.array([1, 2], np.int32)), Sample(9, same, np.array([1, 2], np.int32))], 0)
    assert worker.teacher.seeds == [10, 16]                 # seed + sample id: two equal records, two seeds
