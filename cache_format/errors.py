"""The cache's errors: CacheError and below (the root, KdcacheError, is in kdcache.common.errors).

    CacheError               anything wrong with a logit cache
    ├── ManifestError        manifest.json is unreadable, of an unknown version, or unsafe
    │   └── ManifestMissing  no manifest.json: not a cache, or nothing committed yet
    ├── ShardError           a shard is missing, damaged, or disagrees with the manifest
    ├── RecordError          a record handed to a writer breaks the format's invariants
    ├── FingerprintError     the fingerprint cannot be computed, or differs from the existing cache
    ├── LockedError          another writer holds the cache
    └── ConflictError        a conditional write lost a race (another process wrote first)
"""
from kdcache.common.errors import KdcacheError


class CacheError(KdcacheError):
    """Anything wrong with a logit cache."""


class ManifestError(CacheError):
    """manifest.json is unreadable, of an unknown version, or unsafe."""


class ManifestMissing(ManifestError):
    """There is no manifest.json: not a cache, or nothing was committed yet."""


class ShardError(CacheError):
    """A shard file is missing, damaged, or does not match the manifest."""


class RecordError(CacheError):
    """A record handed to a writer breaks the format's invariants."""


class FingerprintError(CacheError):
    """The fingerprint could not be computed, or differs from the existing cache."""


class LockedError(CacheError):
    """Another writer holds the cache directory."""


class ConflictError(CacheError):
    """A conditional write failed: the object exists, or changed since this process last wrote it."""
