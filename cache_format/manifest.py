"""manifest.json: the commit record of a cache.

Written last and atomically. A shard not listed here does not exist for readers.
"""
import json
import math
import os
import re
import time
from dataclasses import dataclass

from .compact import LOGPROB_DTYPES
from .errors import ManifestError, ManifestMissing
from .location import as_location

FORMAT_NAME = "kdcache-logits"
FORMAT_VERSION = 2                 # what this writer writes, but for sampled caches
SAMPLED_VERSION = 3                # what it writes for a sampled cache (--sample N: SPEC.md 4.4)
READS_VERSIONS = (1, 2, 3)         # what its readers read (SPEC.md section 8)
MAX_SAMPLE = 255                   # draws per position: a draw count fits a byte
MANIFEST_NAME = "manifest.json"
SHARD_DIR = "shards"
REQUIRED = ("format", "format_version", "backend", "top_k", "vocab_size", "eos_token_ids",
            "logprob_dtype", "fingerprint", "num_shards_planned", "complete", "shards", "counts")
SHARD_REQUIRED = ("index", "path", "sample_start", "sample_end", "num_samples", "num_tokens",
                  "num_positions", "bytes", "sha256")
COUNTS = ("samples", "tokens", "positions", "bytes")
# Optional per-shard figures a format-2 writer records (SPEC.md section 3): the fidelity of what it stored
# against the teacher's exact top-k, and the teacher's cross-entropy on the data's own tokens.
STATS = ("kl_sum", "kl_max", "target_nll_sum", "target_positions")
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


def shard_name(index: int, backend_ext: str, tag: str | None = None) -> str:
    """shards/shard-00003-1a2b3c4d.arrow with the writing job's tag (every writer has one); without a tag (older
    caches, single-file tools) shards/shard-00003.arrow."""
    return f"{SHARD_DIR}/shard-{index:05d}{'-' + tag if tag else ''}.{backend_ext}"


def shard_range(index: int, shard_size: int, num_records: int) -> tuple[int, int]:
    """[lo, hi): the records shard `index` covers under a plan of shard_size records per shard (SPEC.md 3)."""
    return min(index * shard_size, num_records), min((index + 1) * shard_size, num_records)


def num_shards(num_records, shard_size):
    """Shards of the plan: ceil(records / shard_size), and one (empty) shard for no records."""
    return max(1, -(-int(num_records) // int(shard_size)))


@dataclass(frozen=True)
class ShardEntry:
    """One committed shard, as listed in the manifest's `shards` (SPEC.md section 3).

    sample_start/sample_end: the half-open range of dataset record indices it covers (skipped records leave
    gaps); num_truncated and stats are absent in format-1 caches (None here, and left out when written)."""
    index: int
    path: str                   # relative to the cache, e.g. shards/shard-00003-1a2b3c4d.arrow
    sample_start: int
    sample_end: int
    num_samples: int
    num_tokens: int
    num_positions: int
    bytes: int
    sha256: str                 # SPEC.md section 5
    num_truncated: int | None = None
    stats: dict | None = None   # STATS keys: stored fidelity and the teacher's NLL of the data's tokens

    @classmethod
    def from_json(cls, d: dict) -> "ShardEntry":
        return cls(**{f: d[f] for f in SHARD_REQUIRED}, num_truncated=d.get("num_truncated"),
                   stats=d.get("stats"))

    def to_json(self) -> dict:
        d = {f: getattr(self, f) for f in SHARD_REQUIRED}
        if self.num_truncated is not None:
            d["num_truncated"] = self.num_truncated
        if self.stats is not None:
            d["stats"] = dict(self.stats)
        return d


# Keys that are typed attributes of Manifest; any other key a manifest holds is kept as it is.
_OPTIONAL = ("top_p", "sample", "fingerprint_parts", "created", "updated", "meta", "plan", "writer_generation",
             "source")


class Manifest:
    """manifest.json, parsed and validated: the commit record of a cache (SPEC.md section 3).

    Fields are attributes (`m.top_k`, `m.shards`: a list of ShardEntry sorted by index); the writer changes it
    only through commit() and set_meta(). `m[key]` reads the JSON form (what `kdcache inspect --json` prints),
    for code written against the dict this used to be; it cannot be written to.
    """

    def __init__(self, data: dict):
        self.format, self.format_version = data["format"], data["format_version"]
        self.backend = data["backend"]               # the storage format: "arrow" or "zarr" (SPEC.md 4)
        self.top_k, self.vocab_size = data["top_k"], data["vocab_size"]
        self.eos_token_ids = list(data["eos_token_ids"])
        self.logprob_dtype = data["logprob_dtype"]
        self.fingerprint = data["fingerprint"]
        self.num_shards_planned, self.complete = data["num_shards_planned"], data["complete"]
        self.counts = dict(data["counts"])
        self.shards = sorted((ShardEntry.from_json(s) for s in data["shards"]), key=lambda s: s.index)
        self.top_p = data.get("top_p")
        self.sample = data.get("sample")             # a sampled cache's draws per position, or None
        self.fingerprint_parts = data.get("fingerprint_parts", {})
        self.created, self.updated = data.get("created"), data.get("updated")
        self.meta = dict(data.get("meta") or {})
        self.plan = data.get("plan")                 # {"shard_size": S, "records": N} or None
        self.writer_generation = data.get("writer_generation")
        self.source = data.get("source")             # SPEC.md 4.6: the conversations and teacher tokenizer, or None
        self._present = {k for k in _OPTIONAL if k in data}
        self._extra = {k: v for k, v in data.items() if k not in REQUIRED and k not in _OPTIONAL}

    # -- lookup ------------------------------------------------------------------------
    def shard(self, index: int) -> ShardEntry | None:
        """The committed shard of plan index `index`, or None."""
        return next((s for s in self.shards if s.index == index), None)

    def done_indices(self) -> set[int]:
        return {s.index for s in self.shards}

    def shard_range(self, index: int) -> tuple[int, int] | None:
        """The records the plan gives shard `index`, or None for a cache without a plan."""
        return None if not self.plan else shard_range(index, self.plan["shard_size"], self.plan["records"])

    # -- changes (the writer's) --------------------------------------------------------
    def commit(self, entry: ShardEntry, where="") -> None:
        """Add a finished shard and recount. ManifestError if it is listed already or outside the plan."""
        if entry.index in self.done_indices():
            raise ManifestError(f"{where}: shard {entry.index} is already committed")
        if not 0 <= entry.index < self.num_shards_planned:
            raise ManifestError(f"{where}: shard index {entry.index} outside the plan [0, {self.num_shards_planned})")
        self.shards = sorted([*self.shards, entry], key=lambda s: s.index)
        self.recount()

    def set_meta(self, key: str, value) -> None:
        self.meta[key] = value

    def recount(self) -> None:
        """Counts from the shard list, the complete flag, the time of this change."""
        self.counts = {c: sum(getattr(s, c if c == "bytes" else "num_" + c) for s in self.shards) for c in COUNTS}
        self.complete = len(self.shards) == self.num_shards_planned
        self.updated = _now()

    # -- the JSON form -----------------------------------------------------------------
    def to_json(self) -> dict:
        d = {"format": self.format, "format_version": self.format_version, "backend": self.backend,
             "top_k": self.top_k, "vocab_size": self.vocab_size, "eos_token_ids": list(self.eos_token_ids),
             "logprob_dtype": self.logprob_dtype, "fingerprint": self.fingerprint,
             "num_shards_planned": self.num_shards_planned, "complete": self.complete,
             "counts": dict(self.counts), "shards": [s.to_json() for s in self.shards], **self._extra}
        for k in _OPTIONAL:
            if k in self._present or getattr(self, k) is not None:
                d[k] = getattr(self, k)
        return d

    def __getitem__(self, key):
        return self.to_json()[key]

    def get(self, key, default=None):
        return self.to_json().get(key, default)

    def __contains__(self, key):
        return key in self.to_json()


def new_manifest(*, backend, top_k, vocab_size, eos_token_ids, fingerprint, fingerprint_parts,
                 num_shards_planned, logprob_dtype="float16", top_p=None, meta=None, plan=None,
                 sample=0) -> Manifest:
    if logprob_dtype not in LOGPROB_DTYPES:
        raise ManifestError(f"logprob_dtype must be one of {LOGPROB_DTYPES}, got {logprob_dtype!r}")
    now = _now()
    return Manifest({
        "format": FORMAT_NAME,
        "format_version": SAMPLED_VERSION if sample else FORMAT_VERSION,
        "backend": backend,
        "top_k": int(top_k),
        "vocab_size": int(vocab_size),
        "eos_token_ids": sorted(int(t) for t in eos_token_ids),
        "logprob_dtype": logprob_dtype,
        "top_p": None if top_p is None else float(top_p),
        **({"sample": int(sample)} if sample else {}),
        "fingerprint": fingerprint,
        "fingerprint_parts": fingerprint_parts,
        "num_shards_planned": int(num_shards_planned),
        "complete": False,
        "created": now,
        "updated": now,
        "counts": {"samples": 0, "tokens": 0, "positions": 0, "bytes": 0},
        "shards": [],
        "meta": meta or {},
        **({"plan": plan} if plan else {}),
    })


def cache_stats(m):
    """Figures from the shards' `stats` (None where no shard records them): kl_mean, kl_max over trained
    positions, and the teacher's cross-entropy (nats/token) and perplexity on the data's own tokens."""
    stats = [s.stats for s in m.shards if s.stats]
    positions = sum(s.num_positions for s in m.shards if s.stats)
    targets = sum(st.get("target_positions", 0) for st in stats)
    ce = sum(st.get("target_nll_sum", 0.0) for st in stats) / targets if targets else None
    return {"kl_mean": sum(st.get("kl_sum", 0.0) for st in stats) / positions if positions else None,
            "kl_max": max((st.get("kl_max", 0.0) for st in stats), default=None) if stats else None,
            "teacher_ce": ce, "teacher_ppl": None if ce is None else math.exp(min(ce, 700.0))}


def fidelity_text(m):
    st = cache_stats(m)
    if st["kl_mean"] is None:
        return "not recorded (format 1)"
    return f"KL(exact top-k || stored) mean {st['kl_mean']:.2e}, max {st['kl_max']:.2e} per position"


def teacher_ce_text(m):
    st = cache_stats(m)
    if st["teacher_ce"] is None:
        return "not recorded"
    ppl = st["teacher_ppl"]
    return f"cross-entropy {st['teacher_ce']:.3f} nats/token, perplexity " + (f"{ppl:.2f}" if ppl < 1e6 else
                                                                             f"{ppl:.3e}")


def _now():
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def save_manifest(where, manifest: Manifest, *, exclusive=False, if_match=None):
    """Write the manifest whole (temp + rename locally, one conditional PUT on S3). Returns its version tag."""
    data = json.dumps(manifest.to_json(), indent=1, sort_keys=True).encode("utf-8") + b"\n"
    return as_location(where).write_bytes(MANIFEST_NAME, data, exclusive=exclusive, if_match=if_match)


def load_manifest(where) -> Manifest:
    loc = as_location(where)
    path = loc.path(MANIFEST_NAME)
    try:
        data = loc.read_bytes(MANIFEST_NAME)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        raise ManifestMissing(f"{path}: no manifest; this is not a kdcache cache (or nothing was committed yet)") \
            from None
    try:
        manifest = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ManifestError(f"{path}: not valid JSON ({e}); the manifest is damaged") from e
    validate_manifest(manifest, loc)
    return Manifest(manifest)


def validate_manifest(m, where):
    """Check every field's type and range (SPEC.md section 3); ManifestError naming the key and what it found.

    A manifest may come from anywhere (a shared bucket, a download): nothing in it is trusted until
    this passes, and no local path is ever built from it except through safe_shard_path.
    """
    loc = as_location(where)
    path = loc.path(MANIFEST_NAME)

    def bad(what):
        raise ManifestError(f"{path}: {what}; the manifest is damaged or was not written by kdcache")

    if not isinstance(m, dict):
        raise ManifestError(f"{path}: expected a JSON object, found {type(m).__name__}")
    if m.get("format") != FORMAT_NAME:
        raise ManifestError(f"{path}: format is {m.get('format')!r}, expected {FORMAT_NAME!r}")
    version = m.get("format_version")
    if version not in READS_VERSIONS or isinstance(version, bool):
        raise ManifestError(
            f"{path}: format_version {version!r} is not supported; this reader reads versions "
            f"{'/'.join(map(str, READS_VERSIONS))}. Upgrade kdcache (newer cache) or re-run precompute (older cache).")
    missing = [k for k in REQUIRED if k not in m]
    if missing:
        raise ManifestError(f"{path}: missing keys {missing}")
    dtypes = LOGPROB_DTYPES if version >= 2 else ("float16", "float32")
    if m["logprob_dtype"] not in dtypes:
        raise ManifestError(f"{path}: logprob_dtype {m['logprob_dtype']!r} not in {dtypes}")
    top_p = m.get("top_p")
    if top_p is not None and not (isinstance(top_p, float) and 0.0 < top_p <= 1.0):
        bad(f"top_p must be null or a number in (0, 1], found {top_p!r}")
    sample = m.get("sample")
    if version == SAMPLED_VERSION and not (_count(sample, 1) and sample <= MAX_SAMPLE and top_p is None):
        bad(f"a format {SAMPLED_VERSION} (sampled) cache needs sample, its draws per position, in "
            f"[1, {MAX_SAMPLE}] and top_p null; found sample {sample!r}, top_p {top_p!r}")
    if version != SAMPLED_VERSION and sample is not None:
        bad(f"sample is set ({sample!r}) but format_version is {version}, not {SAMPLED_VERSION}")
    for key, ok, need in [
        ("backend", isinstance(m["backend"], str), "a string"),
        ("top_k", _count(m["top_k"]), "an integer >= 0"),
        ("vocab_size", _count(m["vocab_size"], 1), "a positive integer"),
        ("eos_token_ids", isinstance(m["eos_token_ids"], list) and m["eos_token_ids"]
         and all(_count(t) and t < m["vocab_size"] for t in m["eos_token_ids"]), "a non-empty list of token ids"),
        ("fingerprint", isinstance(m["fingerprint"], str), "a string"),
        ("num_shards_planned", _count(m["num_shards_planned"], 1), "a positive integer"),
        ("complete", isinstance(m["complete"], bool), "true or false"),
        ("shards", isinstance(m["shards"], list), "a list"),
        ("counts", isinstance(m["counts"], dict) and all(_count(m["counts"].get(c)) for c in COUNTS),
         f"an object of non-negative integers {list(COUNTS)}"),
        ("plan", m.get("plan") is None or (isinstance(m["plan"], dict) and _count(m["plan"].get("shard_size"), 1)
                                           and _count(m["plan"].get("records"))),
         "absent or an object of shard_size >= 1 and records >= 0"),
        ("writer_generation", m.get("writer_generation") is None or _count(m["writer_generation"]),
         "absent or a non-negative integer"),
    ]:
        if not ok:
            bad(f"{key} must be {need}, found {m.get(key)!r}")
    if m.get("source") is not None:
        from .source import validate_source
        validate_source(m["source"], m["num_shards_planned"], bad)
    seen = set()
    for s in m["shards"]:
        _check_shard_entry(s, m["num_shards_planned"], bad)
        if s["index"] in seen:
            raise ManifestError(f"{path}: shard index {s['index']} listed twice")
        seen.add(s["index"])
        check_shard_path(loc, s["path"])
        if not loc.remote:
            safe_shard_path(loc.url, s["path"])


def _count(x, least=0):
    """x is an int (not a bool) >= least."""
    return isinstance(x, int) and not isinstance(x, bool) and x >= least


def _check_shard_entry(s, planned, bad):
    if not isinstance(s, dict):
        bad(f"a shard entry must be an object, found {s!r}")
    gone = [k for k in SHARD_REQUIRED if k not in s]
    if gone:
        bad(f"shard entry {s.get('index')!r} misses keys {gone}")
    where = f"shard entry {s['index']!r}"
    if not _count(s["index"]) or s["index"] >= planned:
        bad(f"{where}: index must be an integer in [0, {planned}), found {s['index']!r}")
    counts = [k for k in ("sample_start", "sample_end", "num_samples", "num_tokens", "num_positions", "bytes",
                          "num_truncated") if k in s and not _count(s[k])]
    if counts:
        bad(f"{where}: {counts[0]} must be a non-negative integer, found {s[counts[0]]!r}")
    if s["sample_end"] < s["sample_start"] or s["num_samples"] > s["sample_end"] - s["sample_start"]:
        bad(f"{where}: {s['num_samples']} samples do not fit its range [{s['sample_start']}, {s['sample_end']})")
    if not (isinstance(s["sha256"], str) and SHA256_RE.match(s["sha256"])):
        bad(f"{where}: sha256 must be 64 lowercase hex digits, found {s['sha256']!r}")
    stats = s.get("stats")
    if stats is not None and not (isinstance(stats, dict) and all(
            k in STATS and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
            for k, v in stats.items())):
        bad(f"{where}: stats must be an object of non-negative numbers {list(STATS)}, found {stats!r}")


def check_shard_path(where, rel):
    """Refuse shard paths that could leave the cache: absolute, '..', '.', empty parts, backslashes."""
    at = as_location(where).path(MANIFEST_NAME)
    if not isinstance(rel, str) or not rel:
        raise ManifestError(f"{at}: shard path {rel!r} is not a non-empty string")
    if rel.startswith("/") or "\\" in rel or os.path.isabs(rel) or "://" in rel:
        raise ManifestError(f"{at}: shard path {rel!r} is absolute; only paths inside the cache are allowed")
    if any(p in ("", ".", "..") for p in rel.split("/")):
        raise ManifestError(f"{at}: shard path {rel!r} has empty, '.' or '..' parts; refused")
    return rel


def safe_shard_path(directory, rel):
    """Resolve a manifest shard path in a local cache, refusing anything that leaves the directory.

    Besides the string rules of check_shard_path, symbolic links are refused: a manifest
    from elsewhere must not make a reader open files outside the cache.
    """
    check_shard_path(directory, rel)
    where = os.path.join(directory, MANIFEST_NAME)
    parts = rel.split("/")
    full = os.path.join(directory, *parts)
    probe = directory
    for p in parts:
        probe = os.path.join(probe, p)
        if os.path.islink(probe):
            raise ManifestError(f"{where}: shard path {rel!r} goes through a symbolic link ({probe}); refused")
    return full
