"""The README's snippets that read shards with pyarrow, HF datasets, Polars, DuckDB and zarr-python, run as written."""
import json
import os
import re

import numpy as np
import pytest

from kdcache.cache_format import open_cache, write_cache
from tests.helpers.cli import ROOT
from tests.helpers.records import make_records, writer_kwargs


def readme_snippets():
    text = open(os.path.join(ROOT, "README.md")).read()
    section = text.split("### Reading shards without kdcache", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def run_snippets(cache_dir, blocks, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf"))
    env = {}
    for code in blocks:
        exec(compile(code.replace('"cache/', f'"{cache_dir}/'), "README.md", "exec"), env)
    return env


@pytest.fixture
def arrow_cache(tmp_path):
    recs = make_records(30, seed=11)
    write_cache(tmp_path / "cache", recs, shard_size=12, **writer_kwargs("arrow"))
    # A shard file written by an interrupted job but never committed: the snippets must not read it.
    write_cache(tmp_path / "other", make_records(5, seed=1), shard_size=5, **writer_kwargs("arrow"))
    rel = json.loads((tmp_path / "other" / "manifest.json").read_text())["shards"][0]["path"]
    os.replace(tmp_path / "other" / rel, tmp_path / "cache" / "shards" / "shard-00007.arrow")
    return tmp_path / "cache"


def test_readme_has_every_tool():
    joined = "\n".join(readme_snippets())
    for tool in ("import pyarrow", "import datasets", "import polars", "import duckdb", "import zarr"):
        assert tool in joined


def test_arrow_shards_open_in_pyarrow_datasets_polars_and_duckdb(arrow_cache, tmp_path, monkeypatch):
    blocks = [b for b in readme_snippets() if "import zarr" not in b]
    env = run_snippets(arrow_cache, blocks, tmp_path, monkeypatch)
    cache = open_cache(arrow_cache)
    want_ids = [r.sample_id for r in cache]
    positions = sum(len(r.positions) for r in cache)
    top1 = max(float(r.topk_logprobs[0, 0]) for r in cache)

    assert env["table"].column("sample_id").to_pylist() == want_ids
    assert env["ds"]["sample_id"] == want_ids
    k = cache.top_k
    assert np.array(env["ds"][3]["topk_ids"]).reshape(-1, k).tolist() == cache[3].topk_ids.tolist()
    assert env["df"]["sample_id"].to_list() == want_ids
    np.testing.assert_allclose(np.array(env["df"]["topk_values"][5].to_list(), dtype=np.float32).reshape(-1, k),
                               cache[5].topk_logprobs)
    count, n_pos, best = env["row"]
    assert (count, n_pos) == (len(want_ids), positions) and abs(best - top1) < 1e-6


def test_zarr_shards_open_in_zarr_python(tmp_path, monkeypatch):
    recs = make_records(20, seed=12)
    write_cache(tmp_path / "cache", recs, shard_size=20, **writer_kwargs("zarr"))
    blocks = [b for b in readme_snippets() if "shards = [" in b or "import zarr" in b]
    env = run_snippets(tmp_path / "cache", blocks, tmp_path, monkeypatch)
    ids, ends, counts = env["topk_ids"], env["ends"], env["counts"]
    np.testing.assert_array_equal(ids.reshape(-1, 8), np.concatenate([r.topk_ids for r in recs]))
    off = env["offsets"]
    rows = [ids[ends[p] - counts[p]:ends[p]] for p in range(off[7], off[8])]
    np.testing.assert_array_equal(np.array(rows), recs[7].topk_ids)
