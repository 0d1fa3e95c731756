"""Zarr v3 backend: one Zarr group (a directory) per shard.

Flat arrays plus CSR offsets (cache_format/layout.py);
format 1 groups stay readable. Each array uses the sharding codec with a
single Zarr shard spanning the whole array, so every array is one file of
compressed inner chunks plus an index. A group is written whole into a temp
directory by exactly one writer, then renamed into place: Zarr's own
concurrent partial writes are never used. Layout in SPEC.md "Zarr backend".
"""

import asyncio

import numpy as np
import zarr
import zarr.api.asynchronous as zarr_async
from zarr.codecs import BloscCodec, ZstdCodec
from zarr.core.sync import sync

from . import layout
from .errors import ShardError
from .fingerprint import check_shard_tree
from .manifest import FORMAT_VERSION, READS_VERSIONS, SAMPLED_VERSION
from .publish import write_new

EXT = "zarr"
CODECS = ("zstd", "blosc-zstd", "none")
DEFAULT_CODEC = "blosc-zstd"   # the smallest in bench/storage.py
TOKEN_CHUNK = 16384      # inner chunk of 1-D token/position arrays (elements)
ENTRY_CHUNK = 65536      # inner chunk of the per-entry arrays (elements)
READ_BLOCK = 256         # samples decoded at once when streaming


def _compressors(codec, itemsize):
    if codec == "zstd":
        return [ZstdCodec(level=3)]
    if codec == "blosc-zstd":
        return [BloscCodec(cname="zstd", clevel=5, shuffle="shuffle", typesize=itemsize)]
    return None


def _put(group, name, data, chunk_rows, codec):
    rows = max(int(data.shape[0]), 1)
    chunk = min(chunk_rows, rows)
    shard_rows = -(-rows // chunk) * chunk
    arr = group.create_array(
        name=name, shape=data.shape, dtype=data.dtype,
        chunks=(chunk,) + data.shape[1:], shards=(shard_rows,) + data.shape[1:],
        compressors=_compressors(codec, data.dtype.itemsize), fill_value=0)
    if data.size:
        arr[...] = data


# Format 2 arrays: (name, chunk length). Per-sample, per-token, per-position and per-entry arrays are 1-D.
ARRAYS = (("sample_id", TOKEN_CHUNK), ("truncated", TOKEN_CHUNK), ("token_offsets", TOKEN_CHUNK),
          ("input_ids", TOKEN_CHUNK), ("position_offsets", TOKEN_CHUNK), ("positions", TOKEN_CHUNK),
          ("topk_counts", TOKEN_CHUNK), ("tail_mass", TOKEN_CHUNK), ("target_logprobs", TOKEN_CHUNK),
          ("topk_ids", ENTRY_CHUNK), ("topk_values", ENTRY_CHUNK))
OPTIONAL = (("behavior_logprobs", TOKEN_CHUNK), ("teacher_positions", TOKEN_CHUNK))   # per position, where carried
TEACHER = (("teacher_input_ids", TOKEN_CHUNK), ("teacher_token_offsets", TOKEN_CHUNK))   # a teacher view's tokens
SAMPLED = (("sample_counts", ENTRY_CHUNK),)           # per entry, in sampled shards (format 3)


def write_shard(path, records, *, top_k, logprob_dtype="float16", codec=DEFAULT_CODEC, sample=0):
    """Write checked records to the group directory `path` atomically. Returns (bytes, sha256)."""
    if codec not in CODECS:
        raise ShardError(f"{path}: zarr codec must be one of {CODECS}, got {codec!r}")
    cols = layout.encode(records, top_k=top_k, logprob_dtype=logprob_dtype, sample=sample)
    attrs = {"kdcache_format_version": SAMPLED_VERSION if sample else FORMAT_VERSION, "top_k": top_k,
             "num_samples": len(records), "logprob_dtype": logprob_dtype, **({"sample": sample} if sample else {})}

    def fill(tmp):
        g = zarr.open_group(zarr.storage.LocalStore(tmp), mode="w", zarr_format=3, attributes=attrs)
        for name, chunk in ARRAYS + SAMPLED + OPTIONAL + TEACHER:
            if getattr(cols, name) is not None:
                _put(g, name, getattr(cols, name), chunk, codec)

    return write_new(path, fill)


V1_PAYLOAD = ("input_ids", "positions", "tail_mass", "topk_ids", "topk_logprobs")
PAYLOAD = ("input_ids", "positions", "tail_mass", "target_logprobs", "topk_ids", "topk_values")
INDEX = ("sample_id", "truncated", "token_offsets", "position_offsets")


def _readable(version):
    return version in READS_VERSIONS and not isinstance(version, bool)


async def _open(path):
    """(attrs, {payload name: AsyncArray}, {index name: ndarray}) of a shard group, in one event-loop visit:
    zarr-python runs every read as a coroutine on its own thread, and one gather per step instead of one
    round trip per array makes streamed reads 1.1-1.2x faster (BENCHMARKS.md). Arrays are None when the
    format version is one this reader does not read."""
    g = await zarr_async.open_group(store=zarr.storage.LocalStore(path, read_only=True), mode="r", zarr_format=3)
    attrs = dict(g.attrs)
    version = attrs.get("kdcache_format_version")
    if not _readable(version):
        return attrs, None, None
    payload = V1_PAYLOAD if version == 1 else PAYLOAD
    if version != 1:
        names = {n async for n in g.array_keys()}
        payload += tuple(n for n, _ in SAMPLED + OPTIONAL + TEACHER[:1] if n in names)
    index = INDEX + (() if version == 1 else ("topk_counts",) + (("teacher_token_offsets",)
                                                                 if "teacher_input_ids" in payload else ()))
    arrays = dict(zip(payload + index, await asyncio.gather(*(g.getitem(n) for n in payload + index))))
    got = await asyncio.gather(*(arrays[n].getitem(slice(None)) for n in index))
    return attrs, {n: arrays[n] for n in payload}, dict(zip(index, got))


async def _slices(arrays, wanted):
    """{name: arrays[name][lo:hi]} for wanted {name: (lo, hi)}, read concurrently."""
    got = await asyncio.gather(*(arrays[n].getitem(slice(int(lo), int(hi))) for n, (lo, hi) in wanted.items()))
    return dict(zip(wanted, got))


class Shard:
    """Reads one shard group; offsets are loaded once, payload arrays are sliced a block at a time."""

    def __init__(self, path, top_k, rules=None):
        """rules: values.Rules to check each decoded block against (None: lengths only)."""
        self.path, self.top_k, self.rules = path, top_k, rules
        # Zarr's LocalStore follows links: a linked chunk (c/0 -> /anywhere) would be read as shard data.
        check_shard_tree(path)
        try:
            attrs, self._a, index = sync(_open(path))
        except Exception as e:  # zarr raises many types for damaged stores
            raise ShardError(f"{path}: cannot open as a kdcache Zarr group ({type(e).__name__}: {e})") from e
        self.version = attrs.get("kdcache_format_version")
        self.logprob_dtype = attrs.get("logprob_dtype")
        if not _readable(self.version):
            raise ShardError(f"{path}: shard format version {self.version!r}, this reader reads "
                             f"{'/'.join(map(str, READS_VERSIONS))}; upgrade kdcache or re-run precompute")
        v1 = self.version == 1
        self.sample = attrs.get("sample", 0) if self.version >= SAMPLED_VERSION else 0
        if self.version >= SAMPLED_VERSION and not (isinstance(self.sample, int) and self.sample >= 1
                                                    and "sample_counts" in self._a):
            raise ShardError(f"{path}: a format {self.version} shard without its draws per position or their counts")
        self._sid, self._trunc = index["sample_id"], index["truncated"]
        self._toff, self._poff = index["token_offsets"], index["position_offsets"]
        got_k = self._a["topk_ids"].shape[1] if v1 else attrs.get("top_k")
        if got_k != top_k:
            raise ShardError(f"{path}: top_k is {got_k} in the shard, {top_k} in the manifest")
        # entry e of position p: format 1 rows are [P, k]; format 2 entries are flat, counts per position
        self._counts = None if v1 else index["topk_counts"]
        self._teacher_off = index.get("teacher_token_offsets")
        self._eoff = None if v1 else np.concatenate([[0], np.cumsum(self._counts, dtype=np.int64)])
        self._block = (None, None)

    def __len__(self):
        return len(self._sid)

    def sample_ids(self):
        """int64 [n]: the shard's sample ids, in stored order."""
        return np.asarray(self._sid, np.int64)

    def lengths(self):
        """int64 [n]: each sample's token count, from the token offsets (read at open)."""
        return np.diff(np.asarray(self._toff)).astype(np.int64)

    def _read(self, lo, hi):
        """Decode samples [lo, hi)."""
        t0, t1, p0, p1 = self._toff[lo], self._toff[hi], self._poff[lo], self._poff[hi]
        try:
            if self.version == 1:
                a = sync(_slices(self._a, {"input_ids": (t0, t1), "positions": (p0, p1), "tail_mass": (p0, p1),
                                           "topk_ids": (p0, p1), "topk_logprobs": (p0, p1)}))
                P = p1 - p0
                per_entry = dict(topk_counts=np.full(P, self.top_k, np.uint16),
                                 target_logprobs=np.full(P, np.nan, np.float32),
                                 topk_ids=a["topk_ids"].reshape(-1), topk_values=a["topk_logprobs"].reshape(-1))
            else:
                e0, e1 = self._eoff[p0], self._eoff[p1]
                optional = {n: (p0, p1) for n, _ in OPTIONAL if n in self._a}
                optional.update({n: (e0, e1) for n, _ in SAMPLED if n in self._a})
                teacher = {}
                if self._teacher_off is not None:
                    u0, u1 = self._teacher_off[lo], self._teacher_off[hi]
                    optional["teacher_input_ids"] = (u0, u1)
                    teacher["teacher_token_offsets"] = self._teacher_off[lo:hi + 1] - u0
                a = sync(_slices(self._a, {"input_ids": (t0, t1), "positions": (p0, p1), "tail_mass": (p0, p1),
                                           "target_logprobs": (p0, p1), "topk_ids": (e0, e1),
                                           "topk_values": (e0, e1), **optional}))
                per_entry = dict(topk_counts=self._counts[p0:p1], target_logprobs=a["target_logprobs"],
                                 topk_ids=a["topk_ids"], topk_values=a["topk_values"],
                                 **{n: a[n] for n in optional}, **teacher)
            cols = layout.Columns(
                sample_id=self._sid[lo:hi], truncated=self._trunc[lo:hi], token_offsets=self._toff[lo:hi + 1] - t0,
                input_ids=a["input_ids"], position_offsets=self._poff[lo:hi + 1] - p0,
                positions=a["positions"], tail_mass=a["tail_mass"], **per_entry)
        except Exception as e:
            raise ShardError(f"{self.path}: samples [{lo}, {hi}) are unreadable ({type(e).__name__}: {e})") from e
        return lo, layout.Decoded(cols, top_k=self.top_k, logprob_dtype=self.logprob_dtype, sample=self.sample,
                                  where=f"{self.path} (samples [{lo}, {hi}))", rules=self.rules)

    def __getitem__(self, i):
        if not 0 <= i < len(self):
            raise IndexError(f"{self.path}: row {i} out of range [0, {len(self)})")
        lo = i - i % READ_BLOCK          # decode the whole block: neighbours are usually read next
        if self._block[0] != lo:
            self._block = self._read(lo, min(lo + READ_BLOCK, len(self)))
        return self._block[1].record(i - lo)

    def __iter__(self):
        for lo in range(0, len(self), READ_BLOCK):
            _, dec = self._read(lo, min(lo + READ_BLOCK, len(self)))
            for r in range(len(dec)):
                yield dec.record(r)


def field_bytes(path, codec=None):
    """{array: bytes on disk} of a shard group (exact: every array is its own files)."""
    import os
    out = {}
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if os.path.isdir(full):
            out[name] = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(full) for f in fs)
    return out
