"""Shards are created whole: written under a temp name, checksummed, then published (kdcache.common.atomic)."""
from kdcache.common.atomic import disk_bytes, publish, remove, temp_name

from .fingerprint import hash_tree


def write_new(path, fill):
    """Create `path` (a file or a directory) atomically: fill(temp) writes it under a temp name, then it is
    checksummed and published. Returns (bytes, sha256 as in SPEC.md section 5)."""
    tmp = temp_name(path)
    try:
        fill(tmp)
        size, digest = disk_bytes(tmp), hash_tree(tmp)
        publish(tmp, path)
    except BaseException:
        remove(tmp)
        raise
    return size, digest
