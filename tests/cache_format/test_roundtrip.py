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
