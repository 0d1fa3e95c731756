"""kdcache logit-cache format: writers, readers, manifest, fingerprint, verify, stores.

Depends on numpy, pyarrow and zarr; caches at URLs (s3://, gs://, memory://) also on fsspec,
imported only when a URL is used. The byte layout is in SPEC.md.
"""
from .errors import (  # noqa: F401
    CacheError,
    FingerprintError,
    LockedError,
    ManifestError,
    ManifestMissing,
    RecordError,
    ShardError,
)
from .fingerprint import fingerprint, hash_file, hash_json, hash_tree  # noqa: F401
from .manifest import FORMAT_VERSION, Manifest, ShardEntry, load_manifest, shard_range  # noqa: F401
from .reader import Cache, open_cache  # noqa: F401
from .record import Record, tail_mass_from_logprobs  # noqa: F401
from .storage import Storage  # noqa: F401
from .verify import verify_cache  # noqa: F401
from .writer import CacheWriter, write_cache, write_shard_file  # noqa: F401
