"""Backend registry: a plain dict from the manifest's `backend` name to its module."""
from . import arrow_backend, zarr_backend

BACKENDS = {"arrow": arrow_backend, "zarr": zarr_backend}
READERS = {"arrow": arrow_backend.ArrowShard, "zarr": zarr_backend.ZarrShard}
DEFAULT_CODEC = {"arrow": "zstd", "zarr": "blosc-zstd"}  # smallest in bench/storage.py


def get_backend(name):
    if name not in BACKENDS:
        from .errors import CacheError
        raise CacheError(f"unknown backend {name!r}; choose one of {sorted(BACKENDS)}")
    return BACKENDS[name]
