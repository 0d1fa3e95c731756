"""Zarr v3 backend: one Zarr group (a directory) per shard.

Token-major arrays plus CSR offsets. Each array uses the sharding codec with a
single Zarr shard spanning the whole array, so every array is one file of
compressed inner chunks plus an index. A group is written whole into a temp
directory by exactly one writer, then renamed into place: Zarr's own
concurrent partial writes are never used. Layout in SPEC.md "Zarr backend".
"""

import numpy as np
import zarr
from zarr.codecs import BloscCodec, ZstdCodec

from .atomic import write_new
from .errors import ShardError
from .fingerprint import check_shard_tree
from .manifest import FORMAT_VERSION
from .record import Record

EXT = "zarr"
CODECS = ("zstd", "blosc-zstd", "none")
DEFAULT_CODEC = "blosc-zstd"   # the smallest in bench/storage.py
TOKEN_CHUNK = 16384      # inner chunk of 1-D token/position arrays (elements)
TOPK_CHUNK = 1024        # inner chunk of [P, k] arrays (rows)
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


def _csr(arrays):
    offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
    np.cumsum([len(a) for a in arrays], out=offsets[1:])
    return offsets


def write_shard(path, records, *, top_k, logprob_dtype="float16", codec=DEFAULT_CODEC):
    """Write checked records to the group directory `path` atomically. Returns (bytes, sha256)."""
    if codec not in CODECS:
        raise ShardError(f"{path}: zarr codec must be one of {CODECS}, got {codec!r}")
    np_lp = np.float16 if logprob_dtype == "float16" else np.float32

    def cat(name, dtype, shape_tail=()):
        parts = [getattr(r, name) for r in records]
        return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros((0,) + shape_tail, dtype)

    def fill(tmp):
        g = zarr.open_group(zarr.storage.LocalStore(tmp), mode="w", zarr_format=3, attributes={
            "kdcache_format_version": FORMAT_VERSION, "top_k": top_k, "num_samples": len(records),
            "logprob_dtype": logprob_dtype})
        _put(g, "sample_id", np.array([r.sample_id for r in records], dtype=np.int64), TOKEN_CHUNK, codec)
        _put(g, "truncated", np.array([r.truncated for r in records], dtype=np.bool_), TOKEN_CHUNK, codec)
        _put(g, "token_offsets", _csr([r.input_ids for r in records]), TOKEN_CHUNK, codec)
        _put(g, "input_ids", cat("input_ids", np.int32), TOKEN_CHUNK, codec)
        _put(g, "position_offsets", _csr([r.positions for r in records]), TOKEN_CHUNK, codec)
        _put(g, "positions", cat("positions", np.int32), TOKEN_CHUNK, codec)
        _put(g, "tail_mass", cat("tail_mass", np.float32), TOKEN_CHUNK, codec)
        _put(g, "topk_ids", cat("topk_ids", np.int32, (top_k,)), TOPK_CHUNK, codec)
        _put(g, "topk_logprobs", cat("topk_logprobs", np_lp, (top_k,)), TOPK_CHUNK, codec)

    return write_new(path, fill)


class Shard:
    """Reads one shard group; offsets are loaded once, payload arrays are sliced on demand."""

    def __init__(self, path, top_k):
        self.path = path
        # Zarr's LocalStore follows links: a linked chunk (c/0 -> /anywhere) would be read as shard data.
        check_shard_tree(path)
        try:
            g = zarr.open_group(zarr.storage.LocalStore(path, read_only=True), mode="r", zarr_format=3)
            version = g.attrs.get("kdcache_format_version")
            self._a = {name: g[name] for name in (
                "input_ids", "positions", "tail_mass", "topk_ids", "topk_logprobs")}
            self._sid = g["sample_id"][...]
            self._trunc = g["truncated"][...]
            self._toff = g["token_offsets"][...]
            self._poff = g["position_offsets"][...]
        except Exception as e:  # zarr raises many types for damaged stores
            raise ShardError(f"{path}: cannot open as a kdcache Zarr group ({type(e).__name__}: {e})") from e
        if version != FORMAT_VERSION:
            raise ShardError(f"{path}: shard format version {version!r}, this reader reads {FORMAT_VERSION}; "
                             "upgrade kdcache or re-run precompute")
        if self._a["topk_ids"].shape[1:] != (top_k,):
            raise ShardError(f"{path}: top_k is {self._a['topk_ids'].shape[1:]} in the shard, {top_k} in the manifest")
        self._block = (None, None)

    def __len__(self):
        return len(self._sid)

    def _read(self, lo, hi):
        """Decode samples [lo, hi) into flat arrays with local offsets."""
        t0, t1, p0, p1 = self._toff[lo], self._toff[hi], self._poff[lo], self._poff[hi]
        try:
            return {
                "input_ids": self._a["input_ids"][t0:t1], "positions": self._a["positions"][p0:p1],
                "tail_mass": self._a["tail_mass"][p0:p1], "topk_ids": self._a["topk_ids"][p0:p1],
                "topk_logprobs": self._a["topk_logprobs"][p0:p1].astype(np.float32),
                "toff": self._toff[lo:hi + 1] - t0, "poff": self._poff[lo:hi + 1] - p0, "lo": lo,
            }
        except Exception as e:
            raise ShardError(f"{self.path}: samples [{lo}, {hi}) are unreadable ({type(e).__name__}: {e})") from e

    def _record(self, blk, i):
        r = i - blk["lo"]
        t0, t1, p0, p1 = blk["toff"][r], blk["toff"][r + 1], blk["poff"][r], blk["poff"][r + 1]
        return Record(int(self._sid[i]), blk["input_ids"][t0:t1], blk["positions"][p0:p1],
                      blk["topk_ids"][p0:p1], blk["topk_logprobs"][p0:p1], blk["tail_mass"][p0:p1],
                      bool(self._trunc[i]))

    def __getitem__(self, i):
        if not 0 <= i < len(self):
            raise IndexError(f"{self.path}: row {i} out of range [0, {len(self)})")
        lo = i - i % READ_BLOCK          # decode the whole block: neighbours are usually read next
        if self._block[0] != lo:
            self._block = (lo, self._read(lo, min(lo + READ_BLOCK, len(self))))
        return self._record(self._block[1], i)

    def __iter__(self):
        for lo in range(0, len(self), READ_BLOCK):
            hi = min(lo + READ_BLOCK, len(self))
            blk = self._read(lo, hi)
            for i in range(lo, hi):
                yield self._record(blk, i)
