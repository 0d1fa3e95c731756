"""Ray's processes go when the job's driver goes, even by kill -9.

Ray starts most of its processes with PR_SET_PDEATHSIG, but not all: after a kill -9 of the driver alone, its
dashboard and runtime-env agents were seen alive a minute later (issue 23). So a job that starts its own Ray
also starts this reaper: a small process that watches the driver through a pipe and, once the pipe closes
(the driver exited, however it died), kills what the driver's process tree held at its last look, less what it
held when the reaper started.

Each look records (pid, start time), so a pid reused since is never killed. Linux only (it reads /proc); elsewhere
start() returns None. A job that joins a cluster starts no reaper: that cluster is not the job's to stop.
"""
import os
import select
import signal
import subprocess
import sys

LOOK_S = 0.5


def start():
    """The reaper for this process, or None where /proc cannot be read. Call before Ray starts; the pipe's write
    end is not inherited (Python's default), so only this process holds it open."""
    if not os.path.isdir(f"/proc/{os.getpid()}"):
        return None
    before = ",".join(map(str, tree(os.getpid())))      # not Ray's: what this process had started before it
    return subprocess.Popen([sys.executable, "-m", "kdcache.pipeline.reaper", str(os.getpid()), before],
                            stdin=subprocess.PIPE, cwd="/", start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def stop(proc):
    """After a clean shutdown: close the pipe (the reaper kills whatever is left) and wait for it."""
    if proc is not None:
        proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def _stat(pid):
    """(parent pid, start time) of a live process, else None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            s = f.read()
    except OSError:
        return None
    fields = s[s.rindex(")") + 2:].split()
    return None if fields[0] == "Z" else (int(fields[1]), fields[19])


def tree(root, skip=()):
    """{pid: start time} of root's live descendants, the subtrees of `skip` left out."""
    children = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (st := _stat(int(name))) is not None:
            children.setdefault(st[0], []).append((int(name), st[1]))
    found, frontier = {}, [root]
    while frontier:
        for pid, started in children.get(frontier.pop(), ()):
            if pid not in found and pid not in skip:
                found[pid] = started
                frontier.append(pid)
    return found


def watch(driver: int, before=frozenset()):
    """before: the driver's descendants when it started the reaper, not Ray's (a program calling kdcache in
    process may have children of its own): left alone, with their subtrees."""
    seen = {}
    while True:
        ready, _, _ = select.select([sys.stdin], [], [], LOOK_S)
        if ready and not os.read(sys.stdin.fileno(), 4096):
            break                                   # EOF: the driver is gone (or done)
        seen = tree(driver, skip={os.getpid()} | before) or seen
    for pid, started in seen.items():
        st = _stat(pid)
        if st is not None and st[1] == started:     # the same process, not a reused pid
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


if __name__ == "__main__":
    watch(int(sys.argv[1]), {int(p) for p in sys.argv[2].split(",") if p} if len(sys.argv) > 2 else set())
