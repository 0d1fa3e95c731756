"""manifest.json: the commit record of a cache.

Written last and atomically. A shard not listed here does not exist for readers.
"""
import json
import os
import time

from .atomic import atomic_write_bytes
from .errors import ManifestError

FORMAT_NAME = "kdcache-logits"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
SHARD_DIR = "shards"
LOGPROB_DTYPES = ("float16", "float32")
REQUIRED = ("format", "format_version", "backend", "top_k", "vocab_size", "eos_token_ids",
            "logprob_dtype", "fingerprint", "num_shards_planned", "complete", "shards", "counts")
SHARD_REQUIRED = ("index", "path", "sample_start", "sample_end", "num_samples", "num_tokens",
                  "num_positions", "bytes", "sha256")


def shard_name(index: int, backend_ext: str) -> str:
    return f"{SHARD_DIR}/shard-{index:05d}.{backend_ext}"


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


def save_manifest(directory, manifest):
    data = json.dumps(manifest, indent=1, sort_keys=True).encode("utf-8") + b"\n"
    atomic_write_bytes(os.path.join(directory, MANIFEST_NAME), data)


def load_manifest(directory):
    path = os.path.join(directory, MANIFEST_NAME)
    if not os.path.isfile(path):
        raise ManifestError(f"{path}: no manifest; this is not a kdcache cache (or nothing was committed yet)")
    try:
        with open(path, "rb") as f:
            manifest = json.loads(f.read().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ManifestError(f"{path}: not valid JSON ({e}); the manifest is damaged") from e
    validate_manifest(manifest, directory)
    return manifest


def validate_manifest(m, directory):
    path = os.path.join(directory, MANIFEST_NAME)
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
        safe_shard_path(directory, s["path"])


def safe_shard_path(directory, rel):
    """Resolve a manifest shard path, refusing anything that leaves the cache directory.

    Absolute paths, '..' components and symbolic links are refused: a manifest
    from elsewhere must not make a reader open files outside the cache.
    """
    where = os.path.join(directory, MANIFEST_NAME)
    if not isinstance(rel, str) or not rel:
        raise ManifestError(f"{where}: shard path {rel!r} is not a non-empty string")
    if rel.startswith("/") or "\\" in rel or os.path.isabs(rel):
        raise ManifestError(f"{where}: shard path {rel!r} is absolute; only paths inside the cache are allowed")
    parts = rel.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise ManifestError(f"{where}: shard path {rel!r} has empty, '.' or '..' parts; refused")
    full = os.path.join(directory, *parts)
    probe = directory
    for p in parts:
        probe = os.path.join(probe, p)
        if os.path.islink(probe):
            raise ManifestError(f"{where}: shard path {rel!r} goes through a symbolic link ({probe}); refused")
    return full
