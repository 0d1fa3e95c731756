"""One small exception hierarchy for the cache format.

Every message names the file, shard or key, what was expected, what was found,
and what to do about it.
"""


class CacheError(Exception):
    """Base class: anything wrong with a logit cache."""


class ManifestError(CacheError):
    """manifest.json is missing, unreadable, of an unknown version, or unsafe."""


class ShardError(CacheError):
    """A shard file is missing, damaged, or does not match the manifest."""


class LockedError(CacheError):
    """Another writer holds the cache directory."""


class FingerprintError(CacheError):
    """The fingerprint could not be computed, or differs from the existing cache."""


class RecordError(CacheError):
    """A record handed to a writer breaks the format's invariants."""
