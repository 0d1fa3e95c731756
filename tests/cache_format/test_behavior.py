"""The optional per-position column behavior_logprobs (generate mode with a generator: the log-prob each target was
sampled with): written only where the records carry it, read back exactly, absent otherwise, NaN for a record of a
shard that lacks it; caches without it read as before."""
import dataclasses

import numpy as np
import pyarrow as pa
import pytest

from kdcache.cache_format import RecordError, open_cache, verify_cache, write_cache
from kdcache.cache_format.record import check_record
from tests.helpers.records import make_records, writer_kwargs

BACKENDS = ["arrow", "zarr"]


def with_behavior(recs, seed=0, skip=()):
    rng = np.random.default_rng(seed)
    return [r if r.sample_id in skip else
            dataclasses.replace(r, behavior_logprobs=-rng.exponential(size=len(r.positions)).astype(np.float32))
            for r in recs]


@pytest.mark.parametrize("backend", BACKENDS)
def test_behavior_logprobs_round_trip_exactly_and_a_record_without_them_reads_nan(tmp_path, backend):
    recs = with_behavior(make_records(300, seed=3), skip={5, 299})
    write_cache(tmp_path, recs, shard_size=150, **writer_kwargs(backend))
    cache = open_cache(tmp_path)
    assert verify_cache(tmp_path).ok
    for orig in recs:
        got = cache[orig.sample_id]
        assert got.behavior_logprobs is not None and got.behavior_logprobs.dtype == np.float32
        if orig.behavior_logprobs is None:
            assert np.isnan(got.behavior_logprobs).all() and len(got.behavior_logprobs) == len(got.positions)
        else:
            np.testing.assert_array_equal(got.behavior_logprobs, orig.behavior_logprobs)    # float32, exact


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_cache_without_behavior_logprobs_has_no_such_column(tmp_path, backend):
    recs = make_records(20, seed=4)
    write_cache(tmp_path, recs, shard_size=10, **writer_kwargs(backend))
    cache = open_cache(tmp_path)
    assert all(r.behavior_logprobs is None for r in cache)
    shard = sorted((tmp_path / "shards").iterdir())[0]
    if backend == "arrow":
        names = pa.ipc.open_file(pa.memory_map(str(shard), "r")).schema.names
    else:
        names = [p.name for p in shard.iterdir()]
    assert "behavior_logprobs" not in names and "target_logprobs" in names


def test_behavior_logprobs_are_checked_like_target_logprobs():
    rec = make_records(1, seed=5)[0]
    P = len(rec.positions)
    with pytest.raises(RecordError, match=r"behavior_logprobs must be \[%d\]" % P):
        check_record(dataclasses.replace(rec, behavior_logprobs=np.zeros(P + 1, np.float32)), 8, 300)
    with pytest.raises(RecordError, match="behavior_logprobs must be <= 0"):
        check_record(dataclasses.replace(rec, behavior_logprobs=np.full(P, 0.5, np.float32)), 8, 300)
    got = check_record(dataclasses.replace(rec, behavior_logprobs=np.full(P, -np.inf, np.float32)), 8, 300)
    assert (got.behavior_logprobs == -1000.0).all()          # an impossible token: the floor, as top-k log-probs
