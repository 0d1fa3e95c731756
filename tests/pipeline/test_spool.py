import os

import numpy as np

from kdcache.cache_format.lease import process_tag
from kdcache.pipeline.dispatch import unit_samples
from kdcache.pipeline.encode import Sample
from kdcache.pipeline.spool import Spool


def spool_of(tmp_path, ids):
    sp = Spool(str(tmp_path))
    for sid in ids:
        sp.add(Sample(sid, np.array([sid, sid + 1], np.int32), np.array([0], np.int32), sid % 2 == 1))
    sp.close_writing()
    return sp


def test_round_trip_in_order(tmp_path):
    sp = spool_of(tmp_path, range(2500))              # more than one Arrow batch
    rows = list(sp)
    assert [r.sample_id for r in rows] == list(range(2500))
    assert rows[7].input_ids.tolist() == [7, 8] and rows[7].truncated is True
    assert rows[7].input_ids.dtype == rows[7].positions.dtype == np.int32
    sp.delete()
    assert not any(p.name.startswith("kdcache-spool-") for p in tmp_path.iterdir())


def test_units_include_shards_whose_records_were_all_skipped(tmp_path):
    sp = spool_of(tmp_path, [0, 1, 5, 9])            # shards 0:[0,1] 1:[] 2:[5] 3:[] 4:[9]
    def units(todo):
        reader = sp.reader()
        return {j: [s.sample_id for s in unit_samples(reader, j, 2)] for j in sorted(todo)}
    assert units(range(5)) == {0: [0, 1], 1: [], 2: [5], 3: [], 4: [9]}
    assert units({1, 4}) == {1: [], 4: [9]}


def test_spools_of_killed_jobs_are_swept(tmp_path):
    import subprocess
    gone = subprocess.Popen(["true"])
    gone.wait()
    stale = tmp_path / f"kdcache-spool-{process_tag(gone.pid)}-abcd"   # as if its job was killed with kill -9
    stale.mkdir()
    live = spool_of(tmp_path, [0, 1])                             # a running job's (this process)
    mine = spool_of(tmp_path, [0])
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted([os.path.basename(live.dir), os.path.basename(mine.dir)])
