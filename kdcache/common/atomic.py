"""Atomic file and directory publication.

Every write goes: temp name in the same directory, flush, fsync, os.replace,
fsync of the parent directory. A crash leaves the old state or the new one,
never a partial file under a final name.
"""
import os
import shutil
import signal
import uuid

# Fault injection for bench/chaos.py and the tests. KDCACHE_CRASH_AT="NAME@N": SIGKILL this process
# the N-th time it reaches crash point NAME. KDCACHE_ENOSPC_AT="NAME@N": raise "No space left on
# device" there instead (a disk filling up). KDCACHE_SIGTERM_AT="NAME@N": send this process SIGTERM there and go
# on (a signal that lands mid-write). KDCACHE_STOP_AT="NAME@N": stop this process there (SIGSTOP), so that a test
# acts at a known point (SIGCONT goes on). Unset in normal runs: one string test, no effect.
_FAULTS = {kind: os.environ.get(var, "").partition("@") for kind, var in
           (("kill", "KDCACHE_CRASH_AT"), ("enospc", "KDCACHE_ENOSPC_AT"), ("term", "KDCACHE_SIGTERM_AT"),
            ("stop", "KDCACHE_STOP_AT"))}
_HITS = {}


def crash_point(name):
    for kind, (target, _, n) in _FAULTS.items():
        if target and target == name:
            _HITS[kind] = _HITS.get(kind, 0) + 1
            if _HITS[kind] == int(n or 1):
                if kind == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                elif kind in ("term", "stop"):
                    os.kill(os.getpid(), signal.SIGTERM if kind == "term" else signal.SIGSTOP)
                    continue
                raise OSError(28, "No space left on device (injected)")


def fsync_path(path):
    """fsync a file or directory by path (directories: so a rename in them is durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)



def temp_name(final_path):
    """A unique hidden sibling of final_path (same filesystem, so rename is atomic)."""
    head, tail = os.path.split(os.path.abspath(final_path))
    return os.path.join(head, f".{tail}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def atomic_write_bytes(path, data: bytes):
    tmp = temp_name(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        crash_point("before-replace-" + os.path.basename(path))
        os.replace(tmp, path)
    except BaseException:
        remove(tmp)
        raise
    fsync_path(os.path.dirname(os.path.abspath(path)))


def fsync_tree(path):
    """fsync every file and directory under path (bottom-up)."""
    for root, _dirs, files in os.walk(path, topdown=False):
        for name in files:
            fsync_path(os.path.join(root, name))
        fsync_path(root)


def publish(tmp_path, final_path):
    """Move a finished temp file or directory to its final name.

    A directory replaces an existing one (left by an uncommitted earlier attempt)
    by first moving the old one aside; readers never see a mix of the two.
    """
    crash_point("before-publish")
    if os.path.isdir(tmp_path):
        fsync_tree(tmp_path)
        if os.path.lexists(final_path):
            old = temp_name(final_path) + ".old"
            os.replace(final_path, old)
            os.replace(tmp_path, final_path)
            remove(old)
        else:
            os.replace(tmp_path, final_path)
    else:
        fsync_path(tmp_path)
        os.replace(tmp_path, final_path)
    fsync_path(os.path.dirname(os.path.abspath(final_path)))


def disk_bytes(path):
    """Size of a file, or the sum of the sizes of every file under a directory (SPEC.md section 3 `bytes`)."""
    if os.path.isdir(path):
        return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
    return os.path.getsize(path)


def remove(path):
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        try:
            os.remove(path)
        except FileNotFoundError:
            pass

