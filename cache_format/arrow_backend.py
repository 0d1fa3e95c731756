"""Arrow IPC backend: one IPC *file* (random-access format) per shard.

Nested list columns, so plain pyarrow, HF datasets, DuckDB and Polars can read
a shard without kdcache. Layout in SPEC.md section "Arrow backend".
"""
import numpy as np
import pyarrow as pa

from .atomic import write_new
from .errors import ShardError
from .manifest import FORMAT_VERSION
from .record import Record

EXT = "arrow"
CODECS = ("lz4", "zstd", "none")
DEFAULT_CODEC = "zstd"       # the smallest in bench/storage.py
ROWS_PER_BATCH = 256


def schema(top_k, logprob_dtype):
    lp = pa.float16() if logprob_dtype == "float16" else pa.float32()
    return pa.schema([
        ("sample_id", pa.int64()),
        ("input_ids", pa.list_(pa.int32())),
        ("positions", pa.list_(pa.int32())),
        ("topk_ids", pa.list_(pa.list_(pa.int32(), top_k))),
        ("topk_logprobs", pa.list_(pa.list_(lp, top_k))),
        ("tail_mass", pa.list_(pa.float32())),
        ("truncated", pa.bool_()),
    ], metadata={"kdcache.format_version": str(FORMAT_VERSION), "kdcache.top_k": str(top_k),
                 "kdcache.rows_per_batch": str(ROWS_PER_BATCH)})


def _list(arrays, dtype, k=None):
    lengths = np.fromiter((len(a) for a in arrays), dtype=np.int64, count=len(arrays))
    offsets = np.zeros(len(arrays) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.concatenate(arrays).astype(dtype, copy=False).reshape(-1)
    values = pa.array(flat)
    if k is not None:
        values = pa.FixedSizeListArray.from_arrays(values, k)
    return pa.ListArray.from_arrays(pa.array(offsets), values)


def _batch(records, sch, top_k, np_lp):
    return pa.record_batch([
        pa.array([r.sample_id for r in records], pa.int64()),
        _list([r.input_ids for r in records], np.int32),
        _list([r.positions for r in records], np.int32),
        _list([r.topk_ids for r in records], np.int32, top_k),
        _list([r.topk_logprobs for r in records], np_lp, top_k),
        _list([r.tail_mass for r in records], np.float32),
        pa.array([r.truncated for r in records], pa.bool_()),
    ], schema=sch)


def write_shard(path, records, *, top_k, logprob_dtype="float16", codec=DEFAULT_CODEC):
    """Write checked records to `path` atomically. Returns (bytes, sha256)."""
    if codec not in CODECS:
        raise ShardError(f"{path}: arrow codec must be one of {CODECS}, got {codec!r}")
    sch = schema(top_k, logprob_dtype)
    np_lp = np.float16 if logprob_dtype == "float16" else np.float32
    opts = pa.ipc.IpcWriteOptions(compression=None if codec == "none" else codec)

    def fill(tmp):
        with pa.OSFile(tmp, "wb") as sink, pa.ipc.new_file(sink, sch, options=opts) as w:
            for i in range(0, len(records), ROWS_PER_BATCH):
                w.write_batch(_batch(records[i:i + ROWS_PER_BATCH], sch, top_k, np_lp))

    return write_new(path, fill)


class Shard:
    """Reads one shard; decodes one record batch at a time (kept until the next is needed)."""

    def __init__(self, path, top_k):
        self.path = path
        try:
            self._file = pa.ipc.open_file(pa.memory_map(path, "r"))
        except (OSError, pa.ArrowInvalid) as e:
            raise ShardError(f"{path}: cannot open as an Arrow IPC file ({e})") from e
        meta = self._file.schema.metadata or {}
        version = meta.get(b"kdcache.format_version", b"").decode()
        if version != str(FORMAT_VERSION):
            raise ShardError(f"{path}: shard format version {version or 'missing'!r}, this reader reads "
                             f"{FORMAT_VERSION}; upgrade kdcache or re-run precompute")
        got_k = self._file.schema.field("topk_ids").type.value_type.list_size
        if got_k != top_k:
            raise ShardError(f"{path}: top_k is {got_k} in the shard but {top_k} in the manifest")
        # Every batch but the last holds exactly rows_per_batch rows (SPEC.md).
        rpb = int(self._file.schema.metadata[b"kdcache.rows_per_batch"])
        nb = self._file.num_record_batches
        last = self._file.get_record_batch(nb - 1).num_rows if nb else 0
        self._starts = [b * rpb for b in range(nb)] + [max(nb - 1, 0) * rpb + last]
        self._cached = (None, None)

    def __len__(self):
        return self._starts[-1]

    def _decoded(self, b):
        if self._cached[0] != b:
            try:
                batch = self._file.get_record_batch(b)
            except (OSError, pa.ArrowInvalid) as e:
                raise ShardError(f"{self.path}: record batch {b} is unreadable ({e})") from e
            self._cached = (b, _decode(batch))
        return self._cached[1]

    def __getitem__(self, row):
        if not 0 <= row < len(self):
            raise IndexError(f"{self.path}: row {row} out of range [0, {len(self)})")
        b = int(np.searchsorted(self._starts, row, side="right")) - 1
        return _row(self._decoded(b), row - self._starts[b])

    def __iter__(self):
        for b in range(len(self._starts) - 1):
            cols = self._decoded(b)
            for r in range(self._starts[b + 1] - self._starts[b]):
                yield _row(cols, r)


def _flat(col):
    """(offsets int64 [n+1], values ndarray) of a list column, zero-copy where possible."""
    offsets = np.asarray(col.offsets, dtype=np.int64)
    values = col.values
    if pa.types.is_fixed_size_list(values.type):
        k = values.type.list_size
        base = values.values.slice(values.offset * k, len(values) * k)
        arr = base.to_numpy(zero_copy_only=False).reshape(-1, k)
    else:
        arr = values.to_numpy(zero_copy_only=False)
    return offsets - offsets[0], arr


def _decode(batch):
    cols = {name: _flat(batch.column(name)) for name in
            ("input_ids", "positions", "topk_ids", "topk_logprobs", "tail_mass")}
    cols["sample_id"] = batch.column("sample_id").to_numpy()
    cols["truncated"] = batch.column("truncated").to_numpy(zero_copy_only=False)
    return cols


def _row(cols, r):
    def take(name):
        off, vals = cols[name]
        return vals[off[r]:off[r + 1]]

    return Record(
        sample_id=int(cols["sample_id"][r]),
        input_ids=take("input_ids"),
        positions=take("positions"),
        topk_ids=take("topk_ids"),
        topk_logprobs=take("topk_logprobs").astype(np.float32),
        tail_mass=take("tail_mass"),
        truncated=bool(cols["truncated"][r]),
    )
