"""top_k 0: no entries at all, only tail_mass (1) and the target log-probs, which every position must then hold.
What the sampled-token objective (train --objective token-rkl) reads, at a fraction of a top-k cache's bytes."""
import dataclasses

import numpy as np
import pytest

from kdcache.cache_format import RecordError, open_cache, verify_cache, write_cache
from kdcache.cache_format.manifest import validate_manifest
from kdcache.cache_format.record import check_record
from tests.helpers.records import make_records, writer_kwargs


def no_entries(recs, seed=0):
    rng = np.random.default_rng(seed)
    return [dataclasses.replace(r, topk_ids=np.empty((len(r.positions), 0), np.int32),
                                topk_logprobs=np.empty((len(r.positions), 0), np.float32),
                                tail_mass=np.ones(len(r.positions), np.float32),
                                target_logprobs=-rng.exponential(size=len(r.positions)).astype(np.float32))
            for r in recs]


@pytest.mark.parametrize("backend,dtype", [("arrow", "float16"), ("arrow", "sqrt8"), ("zarr", "float32"),
                                           ("zarr", "sqrt8")])
def test_a_top_k_zero_cache_round_trips_its_target_logprobs_and_verifies(tmp_path, backend, dtype):
    recs = no_entries(make_records(40, seed=1))
    write_cache(tmp_path, recs, shard_size=16, **writer_kwargs(backend, k=0, logprob_dtype=dtype))
    assert verify_cache(tmp_path).ok
    cache = open_cache(tmp_path)
    assert cache.manifest["top_k"] == 0
    for orig in recs:
        got = cache[orig.sample_id]
        assert got.topk_ids.shape == (len(orig.positions), 0) == got.topk_logprobs.shape
        np.testing.assert_array_equal(got.input_ids, orig.input_ids)
        np.testing.assert_array_equal(got.target_logprobs, orig.target_logprobs)
        np.testing.assert_array_equal(got.tail_mass, 1.0)


def test_top_k_zero_needs_every_target_logprob_and_a_top_k_cache_still_needs_an_entry():
    rec = no_entries(make_records(1, seed=2))[0]
    check_record(rec, 0, 300)
    gap = rec.target_logprobs.copy()
    gap[1] = np.nan
    for bad in (dataclasses.replace(rec, target_logprobs=None), dataclasses.replace(rec, target_logprobs=gap)):
        with pytest.raises(RecordError, match="top_k 0 stores only the target log-probs"):
            check_record(bad, 0, 300)
    with pytest.raises(RecordError, match="must be"):
        check_record(rec, 8, 300)                     # [P, 0] entries in a top-8 cache


def test_a_manifest_may_say_top_k_zero_but_not_less(tmp_path):
    write_cache(tmp_path, no_entries(make_records(4)), shard_size=4, **writer_kwargs("arrow", k=0))
    m = open_cache(tmp_path).manifest.to_json()
    validate_manifest(m, str(tmp_path))
    with pytest.raises(Exception, match="top_k"):
        validate_manifest(dict(m, top_k=-1), str(tmp_path))
