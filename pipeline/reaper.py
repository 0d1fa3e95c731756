"""Ray's processes go when the job's driver goes, even by kill -9.

Ray starts most of its processes with PR_SET_PDEATHSIG, but not all: after a kill -9 of the driver alone, its
dashboard and runtime-env agents were seen alive a minute later (issue 23). So a job that starts its own Ray
also starts this reaper: a small process that watches the driver through a pipe and, once the pipe closes
(the driver exited, however it died), kills what the driver's process tree held at any look and still runs,
less what it held when the reaper started.

Each look records (pid, start time), so a pid reused since is never killed, and adds to what earlier looks saw
(less what has exited since). A look that ran while the driver's exit reparented its children saw only part of
the tree (two of Ray's agents outlived a driver killed on a loaded machine, CI 2026-12); a subtree that left the
tree while the driver lived (its parent exited) is still the job's. A process no look saw (started after the
last one) is found two ways: as the child of a process being reaped, and by its Ray session (once the driver has
told the reaper its session directory, announce, every process whose stdout or stderr is a file in that
directory, as all of Ray's are).

The reaping is bounded by events, not by waits, so a busy machine cannot outrun it: every process found is
stopped (SIGSTOP) and seen stopped before the next look, so none of them can start another unseen; looks repeat
until one adds nothing; then all are killed, each is waited on until it has exited, and the session is looked
at again, until a look finds nothing. The reaper then says on the job's stderr what it found, if anything.
Linux only (it reads /proc); elsewhere start() returns None. A job that joins a cluster starts no reaper: that
cluster is not the job's to stop.
"""
import os
import select
import signal
import subprocess
import sys
import time
from collections import Counter

LOOK_S = 0.5        # between looks at the driver's tree while it lives
STATE_WAIT_S = 30   # the longest a process is waited on to stop or exit (one in uninterruptible sleep); reported


def start():
    """The reaper for this process, or None where /proc cannot be read. Call before Ray starts; the pipe's write
    end is not inherited (Python's default), so only this process holds it open. Its report goes to this
    process's stderr."""
    if not os.path.isdir(f"/proc/{os.getpid()}"):
        return None
    before = ",".join(map(str, tree(os.getpid())))      # not Ray's: what this process had started before it
    return subprocess.Popen([sys.executable, "-m", "kdcache.pipeline.reaper", str(os.getpid()), before],
                            stdin=subprocess.PIPE, cwd="/", start_new_session=True,
                            stdout=subprocess.DEVNULL)


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
            proc.wait(timeout=STATE_WAIT_S + 10)
        except subprocess.TimeoutExpired:
            proc.kill()


def _stat(pid):
    """(parent pid, start time, state) of a live process, else None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            s = f.read()
    except OSError:
        return None
    fields = s[s.rindex(")") + 2:].split()
    return None if fields[0] in ("Z", "X") else (int(fields[1]), fields[19], fields[0])


def _children():
    """{parent pid: [(pid, start time)]} of every live process: one look at /proc."""
    children = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (st := _stat(int(name))) is not None:
            children.setdefault(st[0], []).append((int(name), st[1]))
    return children


def tree(root, skip=()):
    """{pid: start time} of root's live descendants, the subtrees of `skip` left out."""
    children = _children()
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
        seen = {pid: started for pid, started in seen.items() if _same(pid, started)}
        seen.update(tree(driver, skip={os.getpid()} | before))
    t0 = time.monotonic()
    killed, stuck = reap(seen, sessions, skip={os.getpid()} | set(before))
    if killed or stuck:
        print(report(driver, clean, killed, stuck, time.monotonic() - t0), file=sys.stderr, flush=True)


def reap(seen, sessions, skip):
    """Kill the processes in seen ({pid: start time}) that are still those processes, their descendants and the
    sessions' processes (see the module's docstring). Returns ({pid: name} killed, {pid: name} of those still
    alive STATE_WAIT_S after their kill)."""
    killed, stuck = {}, {}
    found = {pid: started for pid, started in seen.items() if _same(pid, started)}
    found.update(_of_sessions(sessions, skip))
    while found:
        frozen = _freeze(found, sessions, skip | set(killed))
        for pid in frozen:
            _signal(pid, signal.SIGKILL)
        killed.update(frozen)
        stuck.update(_wait(frozen, lambda st: st is None))
        found = _of_sessions(sessions, skip | set(killed))
    return killed, {pid: killed[pid] for pid in stuck if _stat(pid) is not None}


def _freeze(found, sessions, skip):
    """Stop every process in found, then their children and the sessions' processes, until a look adds none.
    Returns {pid: name} of the stopped ones."""
    frozen = {}
    while found:
        for pid, started in found.items():
            if _same(pid, started):
                frozen[pid] = _name(pid)
                _signal(pid, signal.SIGSTOP)
        _wait({pid: None for pid in found if pid in frozen}, lambda st: st is None or st[2] in "tT")
        children = _children()
        found = {}
        for pid in frozen:
            for child, started in children.get(pid, ()):
                if child not in frozen and child not in skip:
                    found[child] = started
        found.update(_of_sessions(sessions, skip | set(frozen)))
    return frozen


def _of_sessions(sessions, skip):
    """{pid: start time} of the sessions' live processes."""
    found = {}
    for session in sessions:
        for pid in in_session(session, skip):
            if (st := _stat(pid)) is not None:
                found[pid] = st[1]
    return found


def _wait(pids, done):
    """Wait until done(_stat(pid)) for every pid, STATE_WAIT_S at most; returns those not done."""
    deadline, left = time.monotonic() + STATE_WAIT_S, dict(pids)
    while left:
        left = {pid: v for pid, v in left.items() if not done(_stat(pid))}
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    return left


def _same(pid, started):
    st = _stat(pid)
    return st is not None and st[1] == started      # the same process, not a reused pid


def _name(pid):
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def report(driver, clean, killed, stuck, seconds):
    """One line for the job's stderr: what the reaper found and did."""
    names = ", ".join(f"{n} x{c}" if c > 1 else n for n, c in sorted(Counter(killed.values()).items()))
    why = "shut down its Ray, which left" if clean else "is gone; it left"
    line = f"kdcache reaper: the job's driver (pid {driver}) {why} {len(killed)} process(es), killed in " \
           f"{seconds:.2f} s: {names}"
    if stuck:
        line += f"; {len(stuck)} still alive {STATE_WAIT_S} s after the kill: " + \
            ", ".join(f"{pid} ({n})" for pid, n in stuck.items())
    return line


def _signal(pid, sig):
    try:
        os.kill(pid, sig)
    except OSError:
        pass


if __name__ == "__main__":
    watch(int(sys.argv[1]), {int(p) for p in sys.argv[2].split(",") if p} if len(sys.argv) > 2 else set())
