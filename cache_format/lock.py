"""One writer per directory (a cache, a training run's --out), enforced with an advisory flock.

The kernel drops the lock when the holder dies (even by kill -9), so a crash
never leaves a stale lock behind.
"""
import fcntl
import os
import socket

from .errors import LockedError

LOCK_NAME = ".writer.lock"


class DirLock:
    def __init__(self, directory, name=LOCK_NAME, refusal=None):
        """refusal: what the error says after naming the holder (default: a cache's one-writer rule)."""
        self.path = os.path.join(directory, name)
        self.refusal = refusal or ("Only one writer may own a cache directory; wait for it to finish or stop it.")
        self._fd = None

    def acquire(self):
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 200).decode("utf-8", "replace").strip() or "unknown process"
            os.close(fd)
            raise LockedError(
                f"{os.path.dirname(self.path)} is being written by another process ({holder}). {self.refusal}"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode())
        os.fsync(fd)
        self._fd = fd
        return self

    @property
    def fd(self):
        """The held lock's descriptor (a child given it keeps the lock held while it lives), or None."""
        return self._fd

    def release(self):
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()
