"""No idle start-up: the teacher workers start while the driver reads the dataset, and get each shard as soon as
its records are read; nothing is committed before the whole dataset has been read (a malformed record at its
end still leaves nothing behind)."""
import json
import os
import time

import pytest

from kdcache.cache_format import open_cache, verify_cache
from kdcache.common.errors import DataError
from tests.helpers.cli import user_project, write_jsonl

pytestmark = [pytest.mark.ray, pytest.mark.slow]

FAST = 8          # records read at full speed; then the reader slows down until a worker has written a shard


class SlowReader:
    """kdcache.pipeline.data.iter_rows that, after FAST records, takes up to `budget` seconds per record (sleeping in
    small steps) until a shard file appears under `out`: a dataset slow to read, without a fixed sleep. Records
    when that happened and what the manifest held then."""

    def __init__(self, out, budget=1.0, give_up=240):
        from kdcache.pipeline.data import iter_rows
        self.iter_rows, self.out, self.budget, self.give_up = iter_rows, out, budget, give_up
        self.seen_at_record = None        # records read when the first shard file was there
        self.committed_then = None        # shards in the manifest at that moment
        self.finished = False

    def shard_files(self):
        try:
            return [n for n in os.listdir(self.out / "shards") if not n.startswith(".")]
        except OSError:
            return []

    def __call__(self, path):
        t_end = time.time() + self.give_up
        for raw in self.iter_rows(path):
            if raw.index >= FAST and self.seen_at_record is None:
                t = time.time() + self.budget
                while time.time() < min(t, t_end) and not self.shard_files():
                    time.sleep(0.02)
                if self.shard_files():
                    self.seen_at_record = raw.index
                    self.committed_then = len(json.loads((self.out / "manifest.json").read_text())["shards"])
            yield raw
        self.finished = True


def run_in_process(monkeypatch, reader, **settings):
    """`kdcache precompute` in this process (so the reader can be slowed down), on a Ray of its own."""
    from kdcache.common.config import load
    from kdcache.pipeline import job
    from kdcache.pipeline.config import PrecomputeConfig
    monkeypatch.setenv("RAY_ADDRESS", "")
    monkeypatch.delenv("PYTHONPATH", raising=False)   # the Ray workers import kdcache from its install
    monkeypatch.chdir(user_project())                 # Ray puts the driver's directory on the workers' path
    monkeypatch.setattr(job, "iter_rows", reader)
    cfg = load(PrecomputeConfig, None, dict(backend="hf", top_k=8, worker_cpus=0.5, progress=False, **settings))
    return job.run_precompute(cfg)


def test_workers_get_shards_while_the_dataset_is_read_and_commit_after(tiny, tmp_path, monkeypatch):
    rows = (tiny["train"] * 2)[:200]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    out = tmp_path / "c"
    reader = SlowReader(out)
    s = run_in_process(monkeypatch, reader, teacher=tiny["teacher"], data=data, out=str(out), shard_size=4)
    # A worker wrote a shard file while the scan was still reading (far from its end), and nothing was committed
    # before the scan was over.
    assert reader.seen_at_record is not None and reader.seen_at_record < len(rows) - 20, reader.seen_at_record
    assert reader.committed_then == 0
    st = s["startup"]
    assert st["first_submit_s"] < st["scan_s"] <= st["first_commit_s"], st
    assert st["ray_s"] <= st["workers_ready_s"] <= st["first_submit_s"], st
    # The plan is the usual one: shard j = records [4j, 4j+4), all there, committed once each.
    cache = open_cache(out)
    assert cache.complete and [r.sample_id for r in cache] == list(range(len(rows)))
    assert sorted((x.index, x.sample_start, x.sample_end) for x in cache.shards) == \
        [(j, 4 * j, 4 * j + 4) for j in range(50)]
    assert verify_cache(out).ok
    assert s["shards_this_run"] == 50 and s["records"] == 200 and s["skipped"] == {}


def test_a_malformed_record_read_after_shards_were_scored_leaves_nothing(tiny, tmp_path, monkeypatch):
    rows = (tiny["train"] * 2)[:60] + ["{broken json"] + tiny["train"][:3]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    out = tmp_path / "c"
    reader = SlowReader(out, budget=3.0)     # up to 156 s for the first shard: a loaded machine starts Ray slowly
    with pytest.raises(DataError, match=r"d.jsonl:61: invalid JSON .*1 malformed record"):
        run_in_process(monkeypatch, reader, teacher=tiny["teacher"], data=data, out=str(out), shard_size=4)
    assert reader.seen_at_record is not None and reader.committed_then == 0    # shard files were written...
    assert not out.exists()                    # ...and taken back with the manifest: the directory is gone
    # Fixed, the same command makes the cache.
    write_jsonl(tmp_path / "d.jsonl", [r for r in rows if isinstance(r, dict)])
    s = run_in_process(monkeypatch, SlowReader(out, budget=0), teacher=tiny["teacher"], data=data, out=str(out),
                       shard_size=4)
    assert s["complete"] and s["samples_written"] == 63 and verify_cache(out).ok
