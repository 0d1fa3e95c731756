"""Builders of caches whose values a buggy writer got wrong: records with consistent target log-probs, edits of one
stored column of a committed shard (Arrow or Zarr), and re-signing (checksums and sizes put back into the
manifest, as a buggy writer would commit them), so that only the value checks can find the damage."""
import json

import numpy as np
import pyarrow as pa

from kdcache.cache_format import Record, hash_tree, open_cache
from kdcache.cache_format.verify import disk_bytes

EOS = 2


def consistent_records(n, *, vocab=300, k=8, seed=0, min_len=6, max_len=30, eos=EOS):
    """Records as a teacher writes them: the top-k of a full softmax over `vocab` and, at every position, the
    target's own log-prob from the same softmax (so the target rule holds). Each sample ends with `eos`."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        T = int(rng.integers(min_len, max_len))
        ids = rng.integers(3, vocab, size=T).astype(np.int32)
        ids[-1] = eos
        pos = np.arange(int(rng.integers(1, T - 1)), T - 1, dtype=np.int32)
        logits = rng.normal(size=(len(pos), vocab)) * 2.5
        lp = logits - np.logaddexp.reduce(logits, axis=1, keepdims=True)
        top = np.argsort(-lp, axis=1, kind="stable")[:, :k].astype(np.int32)
        target = lp[np.arange(len(pos)), ids[pos + 1]].astype(np.float32)
        out.append(Record(i, ids, pos, top, np.take_along_axis(lp, top, 1).astype(np.float32), None, False,
                          target))
    return out


def manifest(cache):
    return json.loads((cache / "manifest.json").read_text())


def shard(cache, j):
    """(manifest path, file path) of the j-th listed shard."""
    rel = manifest(cache)["shards"][j]["path"]
    return rel, cache / rel


def resign(cache):
    """Put every shard's checksum and size back into the manifest: its checksum passes whatever it holds."""
    path = cache / "manifest.json"
    m = json.loads(path.read_text())
    for s in m["shards"]:
        s.update(sha256=hash_tree(str(cache / s["path"]), shard=True), bytes=disk_bytes(str(cache / s["path"])))
    m["counts"]["bytes"] = sum(s["bytes"] for s in m["shards"])
    path.write_text(json.dumps(m))


def rows_of(cache, j, sample_row):
    """(first flat position row, first flat entry) of the shard's sample_row-th sample, and that Record (read
    without value checks): where its per-position and per-entry values lie in the shard's flat columns."""
    with open_cache(cache, check_values=False) as c:     # closed (and copied) before the shard is rewritten
        recs = [Record(**{k: np.array(v) if isinstance(v, np.ndarray) else v for k, v in r.__dict__.items()})
                for r in c.iter_shard(j)]
    before = recs[:sample_row]
    rows = sum(len(r.positions) for r in before)
    entries = sum(int(r.topk_counts.sum()) for r in before)
    return rows, entries, recs[sample_row]


def edit_arrow(path, column, edit):
    """Replace the flat values of list `column` of an Arrow shard by edit(values copy) (same length), keeping
    its offsets, batches and metadata."""
    reader = pa.ipc.open_file(pa.memory_map(str(path), "r"))
    table = reader.read_all()
    rpb = int(reader.schema.metadata[b"kdcache.rows_per_batch"])
    col = table.column(column).combine_chunks()
    values = np.asarray(col.values.to_numpy(zero_copy_only=False)).copy()
    new = edit(values)
    assert len(new) == len(values)
    arr = pa.ListArray.from_arrays(col.offsets, pa.array(new, col.type.value_type))
    table = table.set_column(table.schema.get_field_index(column), table.schema.field(column), arr)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table, max_chunksize=rpb)


def edit_zarr(path, name, edit):
    """Replace array `name` of a Zarr shard group by edit(values copy) (any length: the array is resized)."""
    import zarr
    arr = zarr.open_array(str(path / name), mode="r+")
    new = np.asarray(edit(arr[:].copy()), dtype=arr.dtype)
    if new.shape != arr.shape:
        arr.resize(new.shape)
    arr[:] = new


def edit(path, name, fn):
    """edit_arrow or edit_zarr, by the shard's extension."""
    (edit_zarr if str(path).endswith(".zarr") else edit_arrow)(path, name, fn)


def put(index, value):
    """An edit that sets values[index] = value."""
    def fn(values):
        values[index] = value
        return values
    return fn
