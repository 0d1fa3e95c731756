"""`kdcache precompute` into a store on an S3-compatible server: killed, resumed, then reused by fingerprint."""
import json
import os

import numpy as np
import pytest

from kdcache.cache_format import open_cache, verify_cache
from kdcache.cache_format.location import Location
from kdcache.cache_format.store import STORE_MARKER, list_caches
from tests.helpers.cli import precompute, write_jsonl

pytestmark = [pytest.mark.ray, pytest.mark.slow]
# The jobs that write to the store start a Ray of their own: the workers write the shards, with the S3 server's
# credentials from the job's environment, which a shared head (tests/helpers/raycluster.py) started before this
# test's bucket does not have. The local reference joins the shared head.


def test_remote_store_precompute_killed_resumed_then_reused(tiny, tmp_path, bucket):
    store = f"{bucket}/kd"
    data = write_jsonl(tmp_path / "d.jsonl", tiny["train"][:30])
    args = ["--teacher", tiny["teacher"], "--data", data, "--backend", "hf", "--top-k", 8, "--shard-size", 5,
            "--format", "zarr"]

    # 1. kill -9 of the driver just before its third manifest PUT (the second shard's commit).
    env = {"KDCACHE_CRASH_AT": "before-replace-manifest.json@3"}
    res = precompute(*args, "--out", store, "--store", "--alias", "tiny chats", extra_env=env)
    assert res.returncode == -9, res.stderr[-3000:]
    assert Location(store).exists(STORE_MARKER)
    [entry] = list_caches(store)
    assert entry.name.startswith("tiny-chats--") and entry.state == "incomplete 1/6"
    url = entry.url

    # 2. The same command resumes it: the dead driver's lease is taken over, committed shards kept.
    res = precompute(*args, "--out", store, "--alias", "tiny chats")          # the marker makes --store implicit
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"found the cache of these inputs: {url}" in res.stdout
    assert "resuming, 1 of 6 shards already committed" in res.stdout
    assert verify_cache(url).ok

    # 3. Again, even under another alias: found by fingerprint, no teacher work at all.
    manifest = Location(url).read_bytes("manifest.json")
    res = precompute(*args, "--out", store, "--alias", "some other name")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "reusing it: nothing to do, no teacher work" in res.stdout and "teacher work     none" in res.stdout
    assert Location(url).read_bytes("manifest.json") == manifest and len(list_caches(store)) == 1

    # 4. Token-exact and equal to an uninterrupted run on local disk.
    res = precompute(*args, "--out", tmp_path / "local", shared_ray=True)
    assert res.returncode == 0, res.stderr[-3000:]
    remote, local = open_cache(url), open_cache(tmp_path / "local")
    assert remote.manifest["fingerprint"] == local.manifest["fingerprint"]
    assert len(remote) == len(local) == 30
    for a, b in zip(remote, local):
        assert a.sample_id == b.sample_id and np.array_equal(a.input_ids, b.input_ids)
        assert np.array_equal(a.topk_ids, b.topk_ids) and np.array_equal(a.topk_logprobs, b.topk_logprobs)
    summary = json.loads(Location(url).read_bytes("report/summary.json"))
    assert summary["resumed"] and summary["samples_written"] == 30
    # the source (SPEC.md 4.6: conversations, teacher tokenizer) is written on either store
    assert set(os.listdir(tmp_path / "local")) == {"manifest.json", "shards", "report", "source", ".writer.lock"}
    assert remote.manifest["source"]["tokenizer"] == local.manifest["source"]["tokenizer"]
