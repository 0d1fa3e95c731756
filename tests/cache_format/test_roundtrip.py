import numpy as np
import pytest

from kdcache.cache_format import open_cache, write_cache
from tests.helpers.records import make_records, writer_kwargs

BACKENDS = ["arrow", "zarr"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_round_trip_exact_ids_and_logprobs_within_precision(tmp_path, backend, dtype):
    recs = make_records(150, seed=1)
    write_cache(tmp_path, recs, shard_size=64, **writer_kwargs(backend, logprob_dtype=dtype))
    cache = open_cache(tmp_path)
    assert len(cache) == 150 and cache.num_shards == 3 and cache.complete
    for orig in recs:
        got = cache[orig.sample_id]
        assert got.sample_id == orig.sample_id
        np.testing.assert_array_equal(got.input_ids, orig.input_ids)
        np.testing.assert_array_equal(got.positions, orig.positions)
        np.testing.assert_array_equal(got.topk_ids, orig.topk_ids)
        assert got.topk_logprobs.dtype == np.float32
        # the writer takes float32, then rounds to the stored dtype
        want = orig.topk_logprobs.astype(np.float32).astype(dtype).astype(np.float32)
        np.testing.assert_array_equal(got.topk_logprobs, want)
        np.testing.assert_allclose(got.tail_mass, orig.tail_mass, rtol=0, atol=1e-7)
        assert got.truncated == orig.truncated


@pytest.mark.parametrize("backend", BACKENDS)
def test_random_access_equals_streaming(tmp_path, backend):
    recs = make_records(300, seed=2)     # > one Arrow record batch / Zarr read block per shard
    write_cache(tmp_path, recs, shard_size=280, **writer_kwargs(backend))
    cache = open_cache(tmp_path)
    streamed = [r for j in range(cache.num_shards) for r in cache.iter_shard(j)]
    assert [r.sample_id for r in streamed] == list(range(300))
    order = np.random.default_rng(0).permutation(300)
    for i in order:
        a, b = cache[int(i)], streamed[int(i)]
        for f in ("input_ids", "positions", "topk_ids", "topk_logprobs", "tail_mass"):
            np.testing.assert_array_equal(getattr(a, f), getattr(b, f))


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_shard_round_trips(tmp_path, backend):
    from kdcache.cache_format import CacheWriter
    with CacheWriter(tmp_path, num_shards_planned=2, **writer_kwargs(backend)) as w:
        w.write_shard(0, [], sample_start=0, sample_end=10)     # every record of the unit was skipped
        w.write_shard(1, make_records(3), sample_start=10, sample_end=13)
    cache = open_cache(tmp_path)
    assert len(cache) == 3 and list(cache.iter_shard(0)) == []


def test_targets_are_next_tokens():
    rec = make_records(1, seed=3)[0]
    np.testing.assert_array_equal(rec.targets, rec.input_ids[rec.positions + 1])


def test_arrow_arrays_read_from_their_buffers_equal_to_numpy():
    """arrow_format._numpy (Arrow's to_numpy imports pandas): the same values as to_numpy for sliced arrays, bools
    at an offset that is not a multiple of 8, float16, empty arrays; arrays with nulls go through to_numpy."""
    import pyarrow as pa

    from kdcache.cache_format.arrow_format import _numpy
    rng = np.random.default_rng(0)
    cases = [pa.array(rng.integers(-9, 9, 40), pa.int32()), pa.array(rng.integers(0, 255, 40), pa.uint8()),
             pa.array(rng.normal(size=40), pa.float32()), pa.array(rng.normal(size=40).astype(np.float16)),
             pa.array(rng.integers(0, 9, 40), pa.int64()), pa.array(rng.random(40) < 0.5)]
    for arr in cases:
        for a in (arr, arr.slice(3), arr.slice(11, 17), arr.slice(40)):
            got = _numpy(a)
            assert got.dtype == a.to_numpy(zero_copy_only=False).dtype
            np.testing.assert_array_equal(got, a.to_numpy(zero_copy_only=False))
    with_null = pa.array([1.0, None, 3.0], pa.float32())
    np.testing.assert_array_equal(_numpy(with_null), [1.0, np.nan, 3.0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_reader_process_does_not_import_pandas(tmp_path, backend):
    """Every training rank reads shards: pandas (0.3 s, 50 MB per process) is not among what that costs."""
    import json
    import subprocess
    import sys
    recs = make_records(40, seed=3) + make_records(9, seed=4, truncated=True)
    for i, r in enumerate(recs):
        r.sample_id = i
    write_cache(tmp_path, recs, shard_size=16, **writer_kwargs(backend))
    code = ("import sys, json; from kdcache.cache_format import open_cache\n"
            f"c = open_cache({str(tmp_path)!r})\n"
            "rows = [[r.sample_id, bool(r.truncated), len(r.input_ids)] for r in c]\n"
            "lengths = [int(x) for j in range(c.num_shards) for x in c.shard(j).lengths()]\n"
            "print(json.dumps({'pandas': 'pandas' in sys.modules, 'rows': rows, 'lengths': lengths}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    got = json.loads(out)
    assert got["rows"] == [[r.sample_id, bool(r.truncated), len(r.input_ids)] for r in recs]
    assert got["lengths"] == [len(r.input_ids) for r in recs]
    assert not got["pandas"]
