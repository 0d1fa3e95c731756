"""How a cache stores the teacher's rows: the storage formats (a plain dict of modules) and one Storage object.

A storage format module provides (see arrow_format.py, zarr_format.py):
    EXT                 the shard name's extension (shards/shard-00003-<tag>.EXT)
    CODECS              the compression codecs it accepts; DEFAULT_CODEC, one of them
    write_shard(path, records, *, top_k, logprob_dtype, codec, sample) -> (bytes, sha256), atomically
    Shard(path, top_k, rules=None)  a reader: len(), [row], iteration, each row a Record (a sampled shard says
                        its draws per position itself); rules (values.Rules): each decoded block's values are
                        checked against them before any record is cut from it
    field_bytes(path, codec) -> {field: bytes}, for `kdcache inspect`
Adding a format is one module plus one line here; SPEC.md section 4 gets its byte layout. The manifest names
the format under its key `backend` (kept so that existing caches stay valid).
"""
from dataclasses import dataclass

from . import arrow_format, zarr_format
from .compact import LOGPROB_DTYPES
from .errors import CacheError
from .manifest import FORMAT_VERSION, MAX_SAMPLE, SAMPLED_VERSION

FORMATS = {"arrow": arrow_format, "zarr": zarr_format}
MAX_ENTRIES = 65535      # entries a position may hold: topk_counts is uint16 (SPEC.md 1)


def get_format(name):
    if name not in FORMATS:
        raise CacheError(f"unknown storage format {name!r}; choose one of {sorted(FORMATS)}")
    return FORMATS[name]


def default_codec(name, codec=None):
    """The codec a shard of format `name` is written with: `codec` if given, else the format's default."""
    return codec or get_format(name).DEFAULT_CODEC


@dataclass(frozen=True)
class Storage:
    """The storage settings of one cache: set once by the job, owned by its CacheWriter (which refuses to commit a
    shard written otherwise), recorded in the fingerprint's `format` part. codec None: the format's default."""
    format: str = "arrow"            # a key of FORMATS
    top_k: int = 64                  # entries kept per position (at most)
    logprob_dtype: str = "float16"   # one of compact.LOGPROB_DTYPES
    codec: str | None = None
    top_p: float | None = None       # adaptive k: the mass each position's entries reach (None: all top_k)
    sample: int = 0                  # draws per position from the rest of the distribution (0: not sampled)

    def __post_init__(self):
        mod = get_format(self.format)
        object.__setattr__(self, "codec", default_codec(self.format, self.codec))
        object.__setattr__(self, "top_k", int(self.top_k))
        if self.top_p is not None:
            object.__setattr__(self, "top_p", float(self.top_p))
        if self.top_k < 0:
            raise CacheError(f"top_k must be >= 0 (0: no entries, only the target log-probs), got {self.top_k}")
        if self.logprob_dtype not in LOGPROB_DTYPES:
            raise CacheError(f"logprob_dtype must be one of {LOGPROB_DTYPES}, got {self.logprob_dtype!r}")
        if self.codec not in mod.CODECS:
            raise CacheError(f"codec {self.codec!r} is not one of the {self.format} format's: {sorted(mod.CODECS)}")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise CacheError(f"top_p must be in (0, 1], got {self.top_p}")
        object.__setattr__(self, "sample", int(self.sample))
        if not 0 <= self.sample <= MAX_SAMPLE:
            raise CacheError(f"sample must be in [0, {MAX_SAMPLE}] draws per position, got {self.sample}")
        if self.width > MAX_ENTRIES:
            raise CacheError(f"top_k {self.top_k} plus sample {self.sample} is more than the {MAX_ENTRIES} entries a "
                             "position can hold (topk_counts is 16 bits)")
        if self.sample and self.top_p is not None:
            raise CacheError("sample and top_p do not combine: a sampled cache keeps an exact top-k plus draws "
                             "from the rest, not a top-p prefix")

    @property
    def width(self) -> int:
        """Entries a position may hold: the top_k exact ones plus, in a sampled cache, one per draw."""
        return self.top_k + self.sample

    @property
    def module(self):
        return get_format(self.format)

    def fingerprint_part(self) -> dict:
        """The fingerprint's `format` part (SPEC.md section 6); its keys are what existing caches recorded."""
        part = {"version": SAMPLED_VERSION if self.sample else FORMAT_VERSION, "backend": self.format,
                "top_k": self.top_k, "logprob_dtype": self.logprob_dtype, "codec": self.codec, "top_p": self.top_p}
        if self.sample:          # only then: the fingerprints of existing caches stay what they were
            part["sample"] = self.sample
        return part

    def describe(self) -> str:
        top_p = "" if self.top_p is None else f", top_p {self.top_p}"
        sample = f", {self.sample} draws per position" if self.sample else ""
        return f"{self.format}/{self.codec}, top_k {self.top_k}{sample}, {self.logprob_dtype}{top_p}"
