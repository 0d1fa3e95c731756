"""The lock on a training run's --out: one trainer per directory. No torch here: the --nproc-per-node launcher
takes it before any rank starts, so a refusal ends the job at once (a rank-0-only refusal after the ranks started
left rank 1 waiting 600 s for a rendezvous that never came)."""
import os

from kdcache.cache_format.lock import DirLock

OUT_LOCK = ".train.lock"
FD_ENV = "KDCACHE_OUT_LOCK_FD"     # set by train/launch.py in rank 0: the launcher's lock, inherited
REFUSAL = ("Another `kdcache train` is training into this --out: wait for it, stop it (its ranks stop with it), "
           "or pass another --out.")


class Inherited:
    """A lock on --out taken by the launcher and inherited by rank 0 (the same open file: the kernel keeps it
    held while either process lives)."""

    def __init__(self, fd: int):
        self.fd = fd

    def release(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def lock_out(out: str, rank: int):
    """Rank 0 holds a lock on --out for the whole run (the kernel drops it when the process dies, kill -9
    included): a second trainer started on the same --out is refused, instead of training beside the first and
    removing its temporary checkpoints. Other ranks hold nothing (None)."""
    if rank != 0:
        return None
    if os.environ.get(FD_ENV):
        return Inherited(int(os.environ.pop(FD_ENV)))
    os.makedirs(out, exist_ok=True)
    return DirLock(out, OUT_LOCK, refusal=REFUSAL).acquire()
