"""Teacher workers kept up from one precompute job to the next (pipeline/pool.py, for kdcache onpolicy's rounds):
the teacher is loaded once, the generator every job; a job that fails gives nothing back to the pool."""
import json
import sys
import textwrap

import pytest

from tests.helpers.cli import run, user_env, write_jsonl


def test_a_kept_worker_keeps_its_teacher_and_loads_the_generator_again(tiny, tmp_path):
    from kdcache.cache_format import Storage
    from kdcache.pipeline.worker import TeacherWorker, WorkerSpec

    def spec(teacher, generator):
        return WorkerSpec("hf", teacher, {"dtype": "float32"}, Storage("arrow", 4), 400,
                          generate={"max_new_tokens": 2}, generator={"backend": "hf", "model_path": generator,
                                                                     "kwargs": {"dtype": "float32"}})
    worker = TeacherWorker(spec(tiny["teacher"], tiny["teacher"]))
    teacher, generator = worker.teacher, worker.generator
    worker.load(spec(tiny["teacher"], tiny["teacher"]))
    assert worker.teacher is teacher                  # the same teacher: kept
    assert worker.generator is not generator          # the generator (the student, new weights each round): again
    other = str(tmp_path / "other")
    import shutil
    shutil.copytree(tiny["teacher"], other)
    worker.load(spec(other, tiny["teacher"]))
    assert worker.teacher is not teacher and worker.spec.model_path == other


@pytest.mark.ray
@pytest.mark.slow
def test_jobs_of_one_pool_share_ray_and_the_teacher_worker_a_failed_job_gives_none_back(tiny, tmp_path):
    from tests.helpers.raycluster import shared_head
    head = shared_head()
    good = [write_jsonl(tmp_path / f"d{i}.jsonl", tiny["train"][4 * i:4 * i + 4]) for i in range(3)]
    bad = write_jsonl(tmp_path / "bad.jsonl", tiny["train"][:3] + ["{not json"])
    script = textwrap.dedent(f"""
        import json, sys
        from kdcache.common.config import load
        from kdcache.common.errors import KdcacheError
        from kdcache.pipeline.config import PrecomputeConfig
        from kdcache.pipeline.job import run_precompute
        from kdcache.pipeline.pool import WorkerPool
        pool, out = WorkerPool(), []
        for i, data in enumerate({json.dumps([good[0], good[1], bad, good[2]])}):
            cfg = load(PrecomputeConfig, None, dict(teacher={tiny['teacher']!r}, data=data, backend="hf",
                       out={str(tmp_path)!r} + f"/c{{i}}", top_k=4, progress=False, worker_cpus=0.5,
                       ray_address={head.address!r}))
            try:
                s = run_precompute(cfg, pool=pool)
                out.append({{"startup": s["startup"], "complete": s["complete"], "ray": s.get("ray")}})
            except KdcacheError as e:
                out.append({{"error": str(e)[:200]}})
            out[-1]["kept_after"] = len(pool.workers)
        pool.close()
        print("RESULT " + json.dumps(out), flush=True)
    """)
    res = run([sys.executable, "-c", script], dict(user_env(RAY_ADDRESS=""), **head.env()), 300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    jobs = json.loads(next(line for line in res.stdout.splitlines() if line.startswith("RESULT "))[7:])
    first, second, failed, after = jobs
    assert first["complete"] and "kept_workers" not in first["startup"] and first["kept_after"] == 1
    assert second["complete"] and second["startup"]["kept_workers"] == 1 and second["kept_after"] == 1
    assert "bad.jsonl" in failed["error"] and failed["kept_after"] == 0    # its workers were stopped, not kept
    assert after["complete"] and "kept_workers" not in after["startup"]
