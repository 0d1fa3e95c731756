"""A shard whose column lengths disagree (re-signed, so its checksum passes) is a ShardError naming the shard,
in verify (which goes on to the other shards) and in the readers, not a traceback (issue 42, item 10)."""
import json

import pyarrow as pa
import pytest

from kdcache.cache_format import hash_tree, open_cache, verify_cache, write_cache
from kdcache.cache_format.errors import ShardError
from kdcache.cache_format.verify import disk_bytes
from tests.helpers.records import make_records, writer_kwargs


def _rewrite(path, column, cut):
    """Drop the last `cut` values of sample 0's list `column` in an Arrow shard, metadata and batches kept."""
    reader = pa.ipc.open_file(pa.memory_map(str(path), "r"))
    table = reader.read_all()
    rpb = int(reader.schema.metadata[b"kdcache.rows_per_batch"])
    rows = table.column(column).to_pylist()
    rows[0] = rows[0][:len(rows[0]) - cut]
    table = table.set_column(table.schema.get_field_index(column), table.schema.field(column),
                             pa.array(rows, table.schema.field(column).type))
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table, max_chunksize=rpb)


def _resign(cache):
    path = cache / "manifest.json"
    m = json.loads(path.read_text())
    for s in m["shards"]:
        s.update(sha256=hash_tree(str(cache / s["path"]), shard=True), bytes=disk_bytes(str(cache / s["path"])))
    m["counts"]["bytes"] = sum(s["bytes"] for s in m["shards"])
    path.write_text(json.dumps(m))
    return m


@pytest.fixture
def damaged(tmp_path):
    write_cache(tmp_path, make_records(12, seed=3), shard_size=4, **writer_kwargs("arrow"))
    m = json.loads((tmp_path / "manifest.json").read_text())
    first, last = (tmp_path / m["shards"][i]["path"] for i in (0, 2))
    _rewrite(first, "topk_ids", 1)            # an entry short: topk_counts say more than there are
    _rewrite(last, "tail_mass", 1)            # a position's tail mass missing
    _resign(tmp_path)
    return tmp_path, m["shards"][0]["path"], m["shards"][2]["path"]


def test_verify_names_each_shard_and_goes_on(damaged):
    cache, first, last = damaged
    rep = verify_cache(cache)
    where = {w: why for w, why in rep.problems}
    assert "column lengths disagree" in where[first] and "topk_ids has" in where[first], rep.problems
    assert "column lengths disagree" in where[last] and "tail_mass" in where[last], rep.problems
    assert rep.shards_checked == 3


def test_the_reader_refuses_the_shard_by_name(damaged):
    cache, first, _ = damaged
    with pytest.raises(ShardError, match=f"{first}.*column lengths disagree"):
        list(open_cache(cache))
