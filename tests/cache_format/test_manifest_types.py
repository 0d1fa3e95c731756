"""The typed seams of the format: Manifest and ShardEntry round-trip the JSON exactly, the writer owns one Storage
and refuses a shard written with another, and shard ranges come from one function."""
import json
import os

import pytest

from kdcache.cache_format import (
    CacheError,
    CacheWriter,
    ManifestError,
    ShardEntry,
    Storage,
    load_manifest,
    shard_range,
    write_shard_file,
)
from tests.helpers.cli import ROOT
from tests.helpers.records import make_records, writer_kwargs

FIXTURES = [os.path.join(ROOT, "tests", "fixtures", *where) for where in
            (("v1", "arrow"), ("v1", "zarr"), ("v2", "cache"))]


@pytest.mark.parametrize("cache", FIXTURES, ids=["v1-arrow", "v1-zarr", "v2"])
def test_a_manifest_round_trips_to_the_same_json(cache):
    raw = json.load(open(os.path.join(cache, "manifest.json")))
    m = load_manifest(cache)
    assert m.to_json() == raw
    assert [s.to_json() for s in m.shards] == raw["shards"]
    assert m.shards[0] == ShardEntry.from_json(raw["shards"][0]) and m.fingerprint == raw["fingerprint"]
    assert m["top_k"] == raw["top_k"] and m.get("absent", 7) == 7      # the read-only JSON view
    with pytest.raises(TypeError):
        m["top_k"] = 3


def test_unknown_keys_survive_a_rewrite(tmp_path):
    """A newer writer's extra keys are kept when this one commits to the same manifest."""
    recs = make_records(8, seed=1)
    kw = writer_kwargs("arrow")
    with CacheWriter(tmp_path, shard_size=4, num_records=8, **kw) as w:
        w.write_shard(0, recs[:4], sample_start=0, sample_end=4)
    raw = json.load(open(tmp_path / "manifest.json"))
    raw["from_a_newer_writer"] = {"x": 1}
    (tmp_path / "manifest.json").write_text(json.dumps(raw))
    with CacheWriter(tmp_path, shard_size=4, num_records=8, **kw) as w:
        w.write_shard(1, recs[4:], sample_start=4, sample_end=8)
    after = json.load(open(tmp_path / "manifest.json"))
    assert after["from_a_newer_writer"] == {"x": 1} and after["complete"] and len(after["shards"]) == 2
    assert after["counts"]["samples"] == 8 and after["created"] == raw["created"]


def test_a_shard_written_with_other_storage_is_refused(tmp_path):
    recs = make_records(8, seed=2)
    with CacheWriter(tmp_path, shard_size=4, num_records=8, **writer_kwargs("arrow")) as w:
        for other in (Storage("arrow", 8, logprob_dtype="float32"), Storage("arrow", 8, codec="lz4"),
                      Storage("zarr", 8), Storage("arrow", 8, top_p=0.9)):
            written = write_shard_file(tmp_path, 0, recs[:4], storage=other, vocab_size=300, sample_start=0,
                                       sample_end=4, tag=w.shard_tag)
            with pytest.raises(ManifestError, match=r"shard 0 was written as .* but this cache stores arrow/zstd"):
                w.commit(written)
        assert w.manifest.shards == []
        same = write_shard_file(tmp_path, 0, recs[:4], storage=Storage("arrow", 8), vocab_size=300, sample_start=0,
                                sample_end=4, tag=w.shard_tag)
        w.commit(same)                                  # equal settings, another object: accepted
        assert [s.index for s in w.manifest.shards] == [0]


def test_storage_refuses_what_its_format_cannot_store():
    with pytest.raises(CacheError, match="codec 'blosc-zstd' is not one of the arrow format's"):
        Storage("arrow", 8, codec="blosc-zstd")
    with pytest.raises(CacheError, match="unknown storage format 'parquet'"):
        Storage("parquet", 8)
    with pytest.raises(CacheError, match="logprob_dtype"):
        Storage("zarr", 8, logprob_dtype="int4")
    assert Storage("zarr", 8).codec == "blosc-zstd"               # None is the format's default, resolved


def test_shard_ranges_tile_the_records():
    assert [shard_range(j, 4, 10) for j in range(3)] == [(0, 4), (4, 8), (8, 10)]
    assert shard_range(3, 4, 10) == (10, 10)                       # past the end: empty
