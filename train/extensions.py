"""DeepSpeed's JIT-built extensions: the CPU comm op skipped, and stale build locks cleared after a kill -9.

On CPU, `deepspeed.init_distributed` builds (or loads) a shared-memory all-reduce with torch's cpp_extension: 30-70 s
here the first time in each environment, and again whenever another environment on the machine built it last (the
build's hash covers its source paths). Only DeepSpeed's inference tensor-parallel layers call it; training's
collectives go through torch.distributed (gloo) either way. skip_cpu_comm_op marks it unavailable, so DeepSpeed
never builds it.

torch guards a build directory with a FileBaton: a `lock` file created with O_EXCL and removed when done. A process
killed inside that window (kill -9 during a build: the comm op before kdcache skipped it, an optimizer op a user's
DeepSpeed config asks for) leaves the file behind, and every later build of it sleeps on it forever: seen here, a
resumed trainer asleep with no end. So kdcache's own starts take a flock first (the kernel drops it when its holder
dies); holding it, a `lock` file that has not changed for STALE_S is a dead process's, and is removed (a build
touches its directory as it goes).
"""
import contextlib
import fcntl
import glob
import os
import sys
import time

STALE_S = 120


def build_root() -> str:
    from torch.utils.cpp_extension import get_default_build_root
    return os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()


def _newest_change(lock):
    """The latest modification time of the lock and the directory it guards (a live build writes there)."""
    d = os.path.dirname(lock)
    times = [os.stat(os.path.join(d, name)).st_mtime for name in os.listdir(d)]
    return max([os.stat(d).st_mtime, *times])


@contextlib.contextmanager
def build_guard(root=None, stale_s=STALE_S, poll_s=1.0):
    """Hold kdcache's build flock; clear stale torch build locks under root before yielding."""
    root = root or build_root()
    os.makedirs(root, exist_ok=True)
    fd = os.open(os.path.join(root, ".kdcache-build.lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)          # another kdcache start builds: wait for it (it cannot leave this)
        # <root>/py311_cpu/<op>/lock under torch's default root; <root>/<op>/lock under $TORCH_EXTENSIONS_DIR
        for lock in glob.glob(os.path.join(root, "*", "lock")) + glob.glob(os.path.join(root, "*", "*", "lock")):
            while os.path.exists(lock):
                try:
                    idle = time.time() - _newest_change(lock)
                except FileNotFoundError:
                    break                        # the builder finished meanwhile
                if idle >= stale_s:
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(lock)
                    print(f"kdcache: removed {lock}, a build lock unchanged for {idle:.0f} s (left by a process "
                          "killed while it built the extension)", file=sys.stderr, flush=True)
                    break
                time.sleep(poll_s)               # someone else's build, still going
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def skip_cpu_comm_op() -> bool:
    """Mark DeepSpeed's CPU shared-memory comm op unavailable before `deepspeed.init_distributed`, which then neither
    builds nor loads it. True if marked; False for a DeepSpeed without that op or that table (it does as it does)."""
    try:
        import deepspeed.ops
        from deepspeed.ops.op_builder.cpu.comm import ShareMemCommBuilder
        ops = deepspeed.ops.__compatible_ops__
    except (ImportError, AttributeError):
        return False
    if not isinstance(ops, dict):
        return False
    ops[ShareMemCommBuilder.NAME] = False
    return True
