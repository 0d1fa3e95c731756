"""Arrow IPC backend: one IPC *file* (random-access format) per shard.

List columns, one row per sample, so plain pyarrow, HF datasets, DuckDB and Polars can read
a shard without kdcache. Layout in SPEC.md section "Arrow backend"; format 1 shards stay readable.
"""
import numpy as np
import pyarrow as pa

from . import layout
from .compact import VALUE_DTYPES, id_dtype_of
from .errors import ShardError
from .manifest import FORMAT_VERSION, READS_VERSIONS, SAMPLED_VERSION
from .publish import write_new

EXT = "arrow"
CODECS = ("lz4", "zstd", "none")
DEFAULT_CODEC = "zstd"       # the smallest in bench/storage.py
ROWS_PER_BATCH = 256
# vs pyarrow's 1: about 10% fewer bytes; 6 saves 6% more but writes float16 shards 2x slower
ZSTD_LEVEL = 3


def _options(codec):
    if codec == "none":
        return pa.ipc.IpcWriteOptions(compression=None)
    return pa.ipc.IpcWriteOptions(compression=pa.Codec(codec, compression_level=ZSTD_LEVEL)
                                  if codec == "zstd" else codec)
ARROW_TYPES = {np.dtype(np.int32): pa.int32(), np.dtype(np.uint16): pa.uint16(), np.dtype(np.uint8): pa.uint8(),
               np.dtype(np.float32): pa.float32(), np.dtype(np.float16): pa.float16()}
# (column, numpy dtype or None where the shard decides it, which offsets index it)
COLUMNS = (("input_ids", np.int32, "token_offsets"), ("positions", np.int32, "position_offsets"),
           ("topk_counts", np.uint16, "position_offsets"), ("tail_mass", np.float32, "position_offsets"),
           ("target_logprobs", np.float32, "position_offsets"), ("topk_ids", None, "entry_offsets"),
           ("topk_values", None, "entry_offsets"))
SAMPLED = (("sample_counts", np.uint8, "entry_offsets"),)              # format 3: after topk_values
# last, where the records carry them; a teacher view (SPEC.md 4.5) is teacher_positions and teacher_input_ids
OPTIONAL = (("behavior_logprobs", np.float32, "position_offsets"), ("teacher_positions", np.int32, "position_offsets"),
            ("teacher_input_ids", np.int32, "teacher_token_offsets"))


def schema(top_k, logprob_dtype, id_dtype, optional=(), sample=0):
    shard = {"topk_ids": np.dtype(id_dtype), "topk_values": np.dtype(VALUE_DTYPES[logprob_dtype])}
    meta = {"kdcache.format_version": str(SAMPLED_VERSION if sample else FORMAT_VERSION), "kdcache.top_k": str(top_k),
            "kdcache.rows_per_batch": str(ROWS_PER_BATCH), "kdcache.logprob_dtype": logprob_dtype}
    if sample:
        meta["kdcache.sample"] = str(sample)
    return pa.schema(
        [("sample_id", pa.int64()), ("truncated", pa.bool_())] +
        [(name, pa.list_(ARROW_TYPES[np.dtype(dt or shard[name])]))
         for name, dt, _ in COLUMNS + (SAMPLED if sample else ()) + tuple(c for c in OPTIONAL if c[0] in optional)],
        metadata=meta)


INT32_MAX = 2**31 - 1      # Arrow list offsets are int32: a record batch's column holds at most this many values


def _batch(cols: layout.Columns, sch):
    entry = cols.entry_offsets
    if max(int(entry[-1]), int(cols.token_offsets[-1]), int(cols.position_offsets[-1])) > INT32_MAX:
        raise ShardError(f"{ROWS_PER_BATCH} samples hold {int(entry[-1]):,} top-k entries, more than an Arrow list "
                         f"column's int32 offsets can address ({INT32_MAX:,}); write this cache with --format zarr")
    arrays = [pa.array(cols.sample_id, pa.int64()), pa.array(cols.truncated, pa.bool_())]
    for name, _, off in COLUMNS + tuple(c for c in SAMPLED + OPTIONAL if c[0] in sch.names):
        offsets = entry if off == "entry_offsets" else getattr(cols, off)
        values = getattr(cols, name)
        if name == "teacher_input_ids" and values is None:       # no record of this batch has a teacher view
            offsets, values = np.zeros(len(cols.sample_id) + 1, np.int64), np.zeros(0, np.int32)
        elif name == "teacher_positions" and values is None:
            values = np.full(len(cols.positions), -1, np.int32)
        elif values is None:               # an optional column this batch's records lack: NaN, as SPEC.md says
            values = np.full(len(cols.positions), np.nan, np.float32)
        arrays.append(pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values)))
    return pa.record_batch(arrays, schema=sch)


def write_shard(path, records, *, top_k, logprob_dtype="float16", codec=DEFAULT_CODEC, sample=0):
    """Write checked records to `path` atomically. Returns (bytes, sha256)."""
    if codec not in CODECS:
        raise ShardError(f"{path}: arrow codec must be one of {CODECS}, got {codec!r}")
    id_dtype = id_dtype_of(records)
    sch = schema(top_k, logprob_dtype, id_dtype, sample=sample,
                 optional=[n for n, _, _ in OPTIONAL if any(getattr(r, n) is not None for r in records)])
    opts = _options(codec)

    def fill(tmp):
        with pa.OSFile(tmp, "wb") as sink, pa.ipc.new_file(sink, sch, options=opts) as w:
            for i in range(0, len(records), ROWS_PER_BATCH):
                cols = layout.encode(records[i:i + ROWS_PER_BATCH], top_k=top_k, logprob_dtype=logprob_dtype,
                                     id_dtype=id_dtype, sample=sample)
                try:
                    w.write_batch(_batch(cols, sch))
                except ShardError as e:
                    raise ShardError(f"{path}: {e}") from None

    return write_new(path, fill)


class Shard:
    """Reads one shard; decodes one record batch at a time (kept until the next is needed)."""

    def __init__(self, path, top_k, rules=None):
        """rules: values.Rules to check each decoded batch against (None: lengths only)."""
        self.path, self.top_k, self.rules = path, top_k, rules
        try:
            self._file = pa.ipc.open_file(pa.memory_map(path, "r"))
        except (OSError, pa.ArrowInvalid) as e:
            raise ShardError(f"{path}: cannot open as an Arrow IPC file ({e})") from e
        meta = self._file.schema.metadata or {}
        version = meta.get(b"kdcache.format_version", b"").decode()
        if version not in map(str, READS_VERSIONS):
            raise ShardError(f"{path}: shard format version {version or 'missing'!r}, this reader reads "
                             f"{'/'.join(map(str, READS_VERSIONS))}; upgrade kdcache or re-run precompute")
        self.version = int(version)
        got_k = int(meta.get(b"kdcache.top_k", b"0"))
        if got_k != top_k:
            raise ShardError(f"{path}: top_k is {got_k} in the shard but {top_k} in the manifest")
        self.logprob_dtype = _logprob_dtype(self._file.schema, meta, self.version)
        sample = meta.get(b"kdcache.sample", b"0").decode() if self.version >= SAMPLED_VERSION else "0"
        self.sample = int(sample) if sample.isdigit() else -1
        if self.version >= SAMPLED_VERSION and not (self.sample >= 1 and "sample_counts" in self._file.schema.names):
            raise ShardError(f"{path}: a format {self.version} shard without its draws per position or their counts")
        # Every batch but the last holds exactly rows_per_batch rows (SPEC.md).
        rpb = int(meta[b"kdcache.rows_per_batch"])
        nb = self._file.num_record_batches
        last = self._file.get_record_batch(nb - 1).num_rows if nb else 0
        self._starts = [b * rpb for b in range(nb)] + [max(nb - 1, 0) * rpb + last]
        self._cached = (None, None)

    def __len__(self):
        return self._starts[-1]

    def sample_ids(self):
        """int64 [n]: the shard's sample ids, in stored order."""
        try:
            parts = [_numpy(self._file.get_record_batch(b).column("sample_id")) for b in range(len(self._starts) - 1)]
        except (OSError, pa.ArrowInvalid) as e:
            raise ShardError(f"{self.path}: unreadable ({e})") from e
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)

    def lengths(self):
        """int64 [n]: each sample's token count, from the input_ids column's offsets."""
        try:
            parts = [np.diff(_numpy(self._file.get_record_batch(b).column("input_ids").offsets))
                     for b in range(len(self._starts) - 1)]
        except (OSError, pa.ArrowInvalid) as e:
            raise ShardError(f"{self.path}: unreadable ({e})") from e
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)

    def _decoded(self, b):
        if self._cached[0] != b:
            try:
                batch = self._file.get_record_batch(b)
                cols, offs = _columns(batch) if self.version >= 2 else (_columns_v1(batch, self.top_k), None)
            except (OSError, pa.ArrowInvalid) as e:
                raise ShardError(f"{self.path}: record batch {b} is unreadable ({e})") from e
            self._cached = (b, layout.Decoded(cols, top_k=self.top_k, logprob_dtype=self.logprob_dtype,
                                              where=f"{self.path} (record batch {b})", list_offsets=offs,
                                              sample=self.sample, rules=self.rules))
        return self._cached[1]

    def __getitem__(self, row):
        if not 0 <= row < len(self):
            raise IndexError(f"{self.path}: row {row} out of range [0, {len(self)})")
        b = int(np.searchsorted(self._starts, row, side="right")) - 1
        return self._decoded(b).record(row - self._starts[b])

    def __iter__(self):
        for b in range(len(self._starts) - 1):
            dec = self._decoded(b)
            for r in range(len(dec)):
                yield dec.record(r)


def _logprob_dtype(sch, meta, version):
    if version >= 2:
        return meta.get(b"kdcache.logprob_dtype", b"").decode()
    return "float16" if sch.field("topk_logprobs").type.value_type.value_type == pa.float16() else "float32"


# Arrow's own to_numpy() goes through its pandas conversion, which imports pandas (0.3 s and 50 MB in every process
# that reads a shard, each training rank included); fixed-width arrays without nulls are read from their buffers.
_NUMPY = {pa.int8(): np.int8, pa.int16(): np.int16, pa.int32(): np.int32, pa.int64(): np.int64,
          pa.uint8(): np.uint8, pa.uint16(): np.uint16, pa.uint32(): np.uint32, pa.uint64(): np.uint64,
          pa.float16(): np.float16, pa.float32(): np.float32, pa.float64(): np.float64}


def _numpy(arr):
    """ndarray of a primitive Arrow array: zero-copy (read-only) over its data buffer, bools unpacked; anything
    else (nulls, other types) through to_numpy."""
    if arr.null_count == 0 and (arr.type in _NUMPY or pa.types.is_boolean(arr.type)):
        data = arr.buffers()[1]
        if data is None:                                   # an empty array may have no buffer
            return np.zeros(0, bool if pa.types.is_boolean(arr.type) else _NUMPY[arr.type])
        if pa.types.is_boolean(arr.type):
            bits = np.unpackbits(np.frombuffer(data, np.uint8), bitorder="little")
            return bits[arr.offset:arr.offset + len(arr)].astype(bool)
        return np.frombuffer(data, _NUMPY[arr.type], count=len(arr), offset=arr.offset * arr.type.byte_width)
    return arr.to_numpy(zero_copy_only=False)


def _flat(col):
    """(offsets int64 [n+1] from 0, values ndarray) of a list column, zero-copy where possible."""
    offsets = _numpy(col.offsets).astype(np.int64, copy=False)
    values = col.values.slice(offsets[0], offsets[-1] - offsets[0])
    if pa.types.is_fixed_size_list(values.type):          # format 1's [k] rows
        k = values.type.list_size
        arr = _numpy(values.values.slice(values.offset * k, len(values) * k))
    else:
        arr = _numpy(values)
    return offsets - offsets[0], arr


def _columns(batch):
    """(Columns, {list column: its own per-sample offsets}) of a format 2/3 record batch."""
    got = {name: _flat(batch.column(name)) for name, _, _ in COLUMNS + SAMPLED + OPTIONAL
           if name in batch.schema.names}
    teacher = {"teacher_token_offsets": got["teacher_input_ids"][0]} if "teacher_input_ids" in got else {}
    return layout.Columns(
        sample_id=_numpy(batch.column("sample_id")),
        truncated=_numpy(batch.column("truncated")),
        token_offsets=got["input_ids"][0], position_offsets=got["positions"][0],
        **{name: vals for name, (_, vals) in got.items()}, **teacher), {name: off for name, (off, _) in got.items()}


def _columns_v1(batch, top_k):
    """Format 1: fixed [k] rows, no counts, no target log-probs."""
    got = {name: _flat(batch.column(name)) for name in ("input_ids", "positions", "topk_ids", "topk_logprobs",
                                                          "tail_mass")}
    P = len(got["positions"][1])
    return layout.Columns(
        sample_id=_numpy(batch.column("sample_id")),
        truncated=_numpy(batch.column("truncated")),
        token_offsets=got["input_ids"][0], input_ids=got["input_ids"][1], position_offsets=got["positions"][0],
        positions=got["positions"][1], topk_counts=np.full(P, top_k, np.uint16), tail_mass=got["tail_mass"][1],
        target_logprobs=np.full(P, np.nan, np.float32), topk_ids=got["topk_ids"][1],
        topk_values=got["topk_logprobs"][1])


def field_bytes(path, codec=DEFAULT_CODEC):
    """{column: bytes}: each column of the shard written alone, in the shard's batches and codec (IPC files
    do not expose compressed sizes; a column's own file differs from its share by a few hundred bytes)."""
    table = pa.ipc.open_file(pa.memory_map(path, "r")).read_all()
    opts = _options(codec)
    out = {}
    for name in table.column_names:
        part = table.select([name])
        sink = pa.BufferOutputStream()
        with pa.ipc.new_file(sink, part.schema, options=opts) as w:
            for batch in part.to_batches(max_chunksize=ROWS_PER_BATCH):
                w.write_batch(batch)
        out[name] = sink.tell()
    return out
