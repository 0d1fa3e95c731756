"""The one exception hierarchy of kdcache: its root and the errors that are not about a cache.

Every kdcache error derives from KdcacheError; the `kdcache` command catches it
once, prints the message and exits 2 (Interrupted: 128 + the signal). Every message
names the file, line, record, shard or key, what was expected, what was found, and
what to do. The cache's own errors (CacheError and below) are in kdcache.cache_format.errors.

    KdcacheError
    ├── ConfigError          a bad key or value in a config file or flag
    ├── DataError            the dataset cannot be read, or holds a malformed record under --on-bad-record fail
    │   ├── BadRow        one record cannot be parsed (the job counts it, lists it, or fails on it)
    │   └── SkipSample       one record is valid but unusable under the job's policy (reason: a short key)
    ├── TokenizerMismatch    the student's tokenizer is not the one the cache's ids came from
    ├── TrainDataError       the cache or run directory cannot feed this training run (too few samples, ...)
    ├── WorkerDied           a teacher worker was killed or failed mid-job (committed shards are safe)
    ├── Interrupted          a signal stopped the job before it could finish its work in hand (exit 128+N)
    └── CacheError           anything wrong with a logit cache (kdcache.cache_format.errors)
"""


class KdcacheError(Exception):
    """Root of every kdcache error."""


class ConfigError(KdcacheError):
    """A bad key or value in a config file or flag."""


class DataError(KdcacheError):
    """The dataset cannot be read, or holds a malformed record under on_bad_record=fail."""


class BadRow(DataError):
    """A record that cannot be parsed; the message says which field and why."""


class SkipSample(DataError):
    """A record that cannot be used under the job's policy; `reason` is the key it is counted under."""

    def __init__(self, reason, message):
        super().__init__(message)
        self.reason = reason


class TokenizerMismatch(KdcacheError):
    """The student's tokenizer differs from the one the cache's token ids came from."""


class TrainDataError(KdcacheError):
    """The cache, or the run directory (run_id.json, a checkpoint), cannot feed this training run as configured."""


class WorkerDied(KdcacheError):
    """A teacher worker was killed or crashed mid-job."""


class Interrupted(KdcacheError):
    """A signal (e.g. SIGTERM to the whole process group) stopped the job's workers; what was committed is safe."""

    def __init__(self, message, signal_name, signum):
        super().__init__(message)
        self.signal_name, self.exit_code = signal_name, 128 + int(signum)
