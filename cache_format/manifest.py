"""manifest.json: the commit record of a cache.

Written last and atomically. A shard not listed here does not exist for readers.
"""
import json
import os
import time

from .errors import ManifestError, ManifestMissing
from .location import as_location

FORMAT_NAME = "kdcache-logits"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
SHARD_DIR = "shards"
LOGPROB_DTYPES = ("float16", "float32")
REQUIRED = ("format", "format_version", "backend", "top_k", "vocab_size", "eos_token_ids",
            "logprob_dtype", "fingerprint", "num_shards_planned", "complete", "shards", "counts")
SHARD_REQUIRED = ("index", "path", "sample_start", "sample_end", "num_samples", "num_tokens",
                  "num_positions", "bytes", "sha256")


def shard_name(index: int, backend_ext: str, tag: str | None = None) -> str:
    """shards/shard-00003.arrow; with a writer tag (object stores) shards/shard-00003-1a2b3c4d.arrow."""
    return f"{SHARD_DIR}/shard-{index:05d}{'-' + tag if tag else ''}.{backend_ext}"


def new_manifest(*, backend, top_k, vocab_size, eos_token_ids, fingerprint, fingerprint_parts,
                 num_shards_planned, logprob_dtype="float16", meta=None):
    if logprob_dtype not in LOGPROB_DTYPES:
        raise ManifestError(f"logprob_dtype must be one of {LOGPROB_DTYPES}, got {logprob_dtype!r}")
    now = _now()
    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "backend": backend,
        "top_k": int(top_k),
        "vocab_size": int(vocab_size),
        "eos_token_ids": sorted(int(t) for t in eos_token_ids),
        "logprob_dtype": logprob_dtype,
        "fingerprint": fingerprint,
        "fingerprint_parts": fingerprint_parts,
        "num_shards_planned": int(num_shards_planned),
        "complete": False,
        "created": now,
        "updated": now,
        "counts": {"samples": 0, "tokens": 0, "positions": 0, "bytes": 0},
        "shards": [],
        "meta": meta or {},
    }


def _now():
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def recount(manifest):
    """Recompute counts from the shard list (sorted by index) and the complete flag."""
    shards = sorted(manifest["shards"], key=lambda s: s["index"])
    manifest["shards"] = shards
    manifest["counts"] = {
        "samples": sum(s["num_samples"] for s in shards),
        "tokens": sum(s["num_tokens"] for s in shards),
        "positions": sum(s["num_positions"] for s in shards),
        "bytes": sum(s["bytes"] for s in shards),
    }
    manifest["complete"] = len(shards) == manifest["num_shards_planned"]
    manifest["updated"] = _now()
    return manifest


def save_manifest(where, manifest, *, exclusive=False, if_match=None):
    """Write the manifest whole (temp + rename locally, one conditional PUT on S3). Returns its version tag."""
    data = json.dumps(manifest, indent=1, sort_keys=True).encode("utf-8") + b"\n"
    return as_location(where).write_bytes(MANIFEST_NAME, data, exclusive=exclusive, if_match=if_match)


def load_manifest(where):
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
    return manifest


def validate_manifest(m, where):
    loc = as_location(where)
    path = loc.path(MANIFEST_NAME)
    if not isinstance(m, dict):
        raise ManifestError(f"{path}: expected a JSON object, found {type(m).__name__}")
    if m.get("format") != FORMAT_NAME:
        raise ManifestError(f"{path}: format is {m.get('format')!r}, expected {FORMAT_NAME!r}")
    version = m.get("format_version")
    if version != FORMAT_VERSION:
        raise ManifestError(
            f"{path}: format_version {version!r} is not supported; this reader reads version "
            f"{FORMAT_VERSION}. Upgrade kdcache (newer cache) or re-run precompute (older cache).")
    missing = [k for k in REQUIRED if k not in m]
    if missing:
        raise ManifestError(f"{path}: missing keys {missing}")
    if m["logprob_dtype"] not in LOGPROB_DTYPES:
        raise ManifestError(f"{path}: logprob_dtype {m['logprob_dtype']!r} not in {LOGPROB_DTYPES}")
    if not isinstance(m["top_k"], int) or m["top_k"] < 1:
        raise ManifestError(f"{path}: top_k must be a positive integer, found {m['top_k']!r}")
    seen = set()
    for s in m["shards"]:
        gone = [k for k in SHARD_REQUIRED if k not in s]
        if gone:
            raise ManifestError(f"{path}: shard entry {s.get('index')} misses keys {gone}")
        if s["index"] in seen:
            raise ManifestError(f"{path}: shard index {s['index']} listed twice")
        seen.add(s["index"])
        check_shard_path(loc, s["path"])
        if not loc.remote:
            safe_shard_path(loc.url, s["path"])


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
