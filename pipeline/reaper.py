"""Ray's processes go when the job's driver goes, even by kill -9.

Ray starts most of its processes with PR_SET_PDEATHSIG, but not all: after a kill -9 of the driver alone, its
dashboard and runtime-env agents were seen alive a minute later (issue 23). So a job that starts its own Ray
also starts this reaper: a small process that watches the driver through a pipe and, once the pipe closes
(the driver exited, however it died), kills what the driver's process tree held at its last look, less what it
held when the reaper started.

Each look records (pid, start time), so a pid reused since is never killed. A process the last look missed (two
of Ray's agents once outlived a driver on a loaded machine, likely restarted between looks) is found by its Ray
session: once the driver has told the reaper its session directory (announce), the reaper also kills, after the
driver is gone, every process whose stdout or stderr is a file in that directory, as all of Ray's are. Linux only
(it reads /proc); elsewhere start() returns None. A job that joins a cluster starts no reaper: that cluster is not
the job's to stop.
"""
import os
import select
import signal
import subprocess
import sys
import time

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


def announce(proc, session_dir):
    """Tell the reaper the job's Ray session directory (see the module's docstring)."""
    if proc is not None and session_dir:
        try:
            proc.stdin.write(f"session {session_dir}\n".encode())
            proc.stdin.flush()
        except (OSError, ValueError):
            pass


def stop(proc):
    """After a clean shutdown: close the pipe (the reaper kills whatever is left, at once) and wait for it."""
    if proc is not None:
        try:
            proc.stdin.write(b"clean\n")
        except (OSError, ValueError):
            pass
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


def in_session(session_dir, skip=()):
    """Live pids whose stdout or stderr is a file under session_dir (Ray's processes of that session)."""
    root = os.path.realpath(session_dir) + os.sep
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in skip:
            continue
        for fd in (1, 2):
            try:
                if os.readlink(f"/proc/{name}/fd/{fd}").startswith(root):
                    found.append(int(name))
                    break
            except OSError:
                pass
    return found


def watch(driver: int, before=frozenset()):
    """before: the driver's descendants when it started the reaper, not Ray's (a program calling kdcache in
    process may have children of its own): left alone, with their subtrees."""
    seen, sessions, buf, clean = {}, [], b"", False
    while True:
        ready, _, _ = select.select([sys.stdin], [], [], LOOK_S)
        if ready:
            data = os.read(sys.stdin.fileno(), 4096)
            if not data:
                break                               # EOF: the driver is gone (or done)
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                if line.startswith(b"session "):
                    sessions.append(line[len(b"session "):].decode())
                clean = clean or line == b"clean"
        seen = tree(driver, skip={os.getpid()} | before) or seen
    for pid, started in seen.items():
        st = _stat(pid)
        if st is not None and st[1] == started:     # the same process, not a reused pid
            _kill(pid)
    # What the last look missed, and (unless the driver shut its Ray down itself) what was mid-start then.
    for n in range(0 if not sessions else 1 if clean else 3):
        if n:
            time.sleep(LOOK_S)
        for session in sessions:
            for pid in in_session(session, skip={os.getpid()} | set(before)):
                _kill(pid)


def _kill(pid):
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


if __name__ == "__main__":
    watch(int(sys.argv[1]), {int(p) for p in sys.argv[2].split(",") if p} if len(sys.argv) > 2 else set())
