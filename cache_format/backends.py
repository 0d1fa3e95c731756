"""Storage backends: a plain dict from the manifest's `backend` name to the module that stores shards.

A backend module provides (see arrow_backend.py, zarr_backend.py):
    EXT                 the shard name's extension (shards/shard-00003-<tag>.EXT)
    CODECS              the compression codecs it accepts; DEFAULT_CODEC, one of them
    write_shard(path, records, *, top_k, logprob_dtype, codec) -> (bytes, sha256), atomically
    Shard(path, top_k)  a reader: len(), [row], iteration, each row a Record
    field_bytes(path, codec) -> {field: bytes}, for `kdcache inspect`
Adding a backend is one module plus one line here; SPEC.md section 4 gets its byte layout.
"""
from . import arrow_backend, zarr_backend
from .errors import CacheError

BACKENDS = {"arrow": arrow_backend, "zarr": zarr_backend}


def get_backend(name):
    if name not in BACKENDS:
        raise CacheError(f"unknown storage backend {name!r}; choose one of {sorted(BACKENDS)}")
    return BACKENDS[name]


def default_codec(name, codec=None):
    """The codec a shard of backend `name` is written with: `codec` if given, else the backend's default."""
    return codec or get_backend(name).DEFAULT_CODEC
