"""Content fingerprints: sha256 of canonical, sorted, type-checked JSON.

Built from content only (file bytes, settings, format version), never from
paths or modification times. Anything that cannot be hashed is an error: a
random fallback would make every run look new and silently defeat reuse.
"""
import hashlib
import json
import math
import os
import stat

from .errors import FingerprintError, ShardError

CHUNK = 1 << 20


def canonical_json(obj) -> str:
    """Canonical JSON of plain data (dict, list, tuple, str, int, float, bool, None).

    Keys are sorted; ints and floats stay distinct (1 vs 1.0); NaN and other
    types are refused with the offending key path named.
    """
    return json.dumps(_check(obj, "$"), sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _check(obj, where):
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        if not math.isfinite(obj):
            raise FingerprintError(f"cannot fingerprint {where}: non-finite float {obj!r}")
        return obj
    if isinstance(obj, (list, tuple)):
        return [_check(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            if not isinstance(k, str):
                raise FingerprintError(f"cannot fingerprint {where}: key {k!r} is not a string")
            out[k] = _check(v, f"{where}.{k}")
        return out
    raise FingerprintError(
        f"cannot fingerprint {where}: value of type {type(obj).__name__} is not plain data "
        "(convert it to str/int/float/list/dict first)")


def hash_json(obj) -> str:
    return hashlib.sha256(canonical_json(obj).encode("utf-8")).hexdigest()


def hash_file(path) -> str:
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(CHUNK), b""):
                h.update(block)
    except OSError as e:
        raise FingerprintError(f"cannot fingerprint file {path}: {e}") from e
    return h.hexdigest()


def hash_tree(path, *, shard=False) -> str:
    """sha256 over (relative path, file sha256) of every file under path, sorted.

    Used both for fingerprints of model directories and for checksums of
    directory shards (Zarr), so it must not depend on walk order. Model and
    dataset directories may hold symbolic links (a Hugging Face cache snapshot
    links to its blobs), so by default links are followed; shard=True refuses
    anything but plain files and directories (check_shard_tree).
    """
    if shard:
        check_shard_tree(path)
    if os.path.isfile(path):
        return hash_file(path)
    if not os.path.isdir(path):
        raise FingerprintError(f"cannot hash {path}: no such file or directory")
    entries = []
    for root, dirs, files in os.walk(path):
        dirs.sort()
        for name in sorted(files):
            full = os.path.join(root, name)
            rel = os.path.relpath(full, path).replace(os.sep, "/")
            entries.append([rel, hash_file(full)])
    entries.sort()
    return hash_json(entries)


def irregular_entries(path) -> list:
    """[(relative path, what it is)] of every entry at or under path that is not a plain file or directory.

    os.walk does not enter a linked directory but lists it, so links to directories are found too.
    """
    def kind(p):
        try:
            mode = os.lstat(p).st_mode
            if stat.S_ISLNK(mode):
                return f"a symbolic link (to {os.readlink(p)})"
        except FileNotFoundError:     # absent (or gone meanwhile): the caller reports a missing shard
            return None
        return None if stat.S_ISREG(mode) or stat.S_ISDIR(mode) else "not a regular file"

    top = kind(path)
    if top:
        return [(".", top)]
    out = []
    if os.path.isdir(path):
        for root, dirs, files in os.walk(path):
            for name in dirs + files:
                full = os.path.join(root, name)
                what = kind(full)
                if what:
                    out.append((os.path.relpath(full, path).replace(os.sep, "/"), what))
    return sorted(out)


def check_shard_tree(path):
    """ShardError unless the shard at path (a file, or a Zarr group directory) holds only plain files.

    A link inside a shard would make a reader, verify or a checksum read bytes outside the cache
    (any file the link names), so a shard holding one is refused, never read through.
    """
    bad = irregular_entries(path)
    if bad:
        rel, what = bad[0]
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        entry = "the shard itself" if rel == "." else f"shard entry {rel!r}"
        raise ShardError(
            f"{path}: {entry} is {what}{more}; a shard must hold only regular files and is never "
            "read through a link. The cache was altered after it was written: restore the shard's files, or "
            "recompute the cache into a new directory.")


def fingerprint(parts: dict) -> str:
    """The cache fingerprint: a hash of named parts (each plain data or a hex digest)."""
    if not isinstance(parts, dict) or not parts:
        raise FingerprintError("fingerprint parts must be a non-empty dict")
    return hash_json({k: parts[k] for k in sorted(parts)})


def diff_parts(old: dict, new: dict) -> list:
    """Names of the fingerprint parts that differ (added, removed or changed)."""
    keys = sorted(set(old) | set(new))
    return [k for k in keys if hash_json(old.get(k)) != hash_json(new.get(k))]


def describe_diff(old: dict, new: dict) -> list:
    """Readable differences between two parts dicts: 'capture.max_length: 512 -> 1024', 'teacher: content differs'."""
    out = []
    for key in diff_parts(old, new):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            for sub in diff_parts(a, b):
                out.append(f"{key}.{sub}: {a.get(sub)!r} -> {b.get(sub)!r}")
        elif a is None or b is None:
            out.append(f"{key}: {'added' if a is None else 'removed'}")
        else:
            out.append(f"{key}: content differs")
    return out
