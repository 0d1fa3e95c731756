"""Leases: who is writing or reading a cache, on storage that has no flock.

A lease is a small JSON object {owner, host, pid, started, expires} renewed by a heartbeat
thread. It is live while `expires` is in the future, unless it names this host and a process
that no longer exists: a kill -9 frees it at once on the same machine, and after the TTL
anywhere else. Writers hold an exclusive lease (`.writer.lock`, created with a conditional
put) on object stores; every reading run holds a shared one (`.readers/<id>.json`), so `gc`
can see that a cache is in use without readers coordinating with each other.
"""
import os
import re
import shutil
import socket
import sys
import tempfile
import threading
import time
import uuid

from .errors import ConflictError, LockedError

TTL = float(os.environ.get("KDCACHE_LEASE_TTL", "120"))
READERS_DIR = ".readers"
LAST_USED = ".last_used.json"


def pid_alive(pid):
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, TypeError):
        return True
    return True


def pid_namespace():
    """This process's PID namespace ('pid:[4026531836]'): containers sharing a host name differ here."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def process_tag(pid=None):
    """'<pid namespace inode>-<pid>': names a per-process directory unambiguously on this machine."""
    ns = re.sub(r"\D", "", pid_namespace() or "") or "0"
    return f"{ns}-{os.getpid() if pid is None else pid}"


def process_dir(base, prefix):
    """A new directory `<prefix><process_tag>-*` under base, after removing those of dead processes
    of this PID namespace (kill -9 skips cleanup; other containers' directories are left alone)."""
    ns = process_tag().split("-")[0]
    try:
        names = os.listdir(base)
    except OSError:
        names = []
    for name in names:
        m = re.match(re.escape(prefix) + r"(\d+)-(\d+)-", name)
        if m and m.group(1) == ns and not pid_alive(int(m.group(2))):
            shutil.rmtree(os.path.join(base, name), ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{prefix}{process_tag()}-", dir=base)


def _expires(info):
    try:
        return float(info.get("expires", 0))
    except (TypeError, ValueError):
        return 0.0


def is_live(info, now=None):
    """True while the lease's holder may still be running."""
    now = time.time() if now is None else now
    if not isinstance(info, dict) or _expires(info) <= now:
        return False
    same_machine = info.get("host") == socket.gethostname() and info.get("pidns") == pid_namespace()
    if same_machine and not pid_alive(info.get("pid")):
        return False
    return True


def describe(info, now=None):
    now = time.time() if now is None else now
    return (f"pid {info.get('pid')} on {info.get('host')}, lease expires in "
            f"{max(0.0, _expires(info) - now):.0f} s")


class Lease:
    """An exclusive (writer) or shared (reader) lease object at `rel` in a Location."""

    def __init__(self, loc, rel, *, exclusive, ttl=None):
        self.loc, self.rel, self.exclusive = loc, rel, exclusive
        self.ttl = float(ttl or TTL)
        self.owner = uuid.uuid4().hex
        self.started = self._renewed = time.time()
        self.lost = False
        self._etag = None
        self._stop = threading.Event()
        self._thread = None

    def _body(self):
        return {"owner": self.owner, "host": socket.gethostname(), "pidns": pid_namespace(), "pid": os.getpid(),
                "started": self.started, "expires": time.time() + self.ttl}

    def acquire(self):
        if not self.exclusive:
            self.loc.write_json(self.rel, self._body())
        else:
            self._acquire_exclusive()
        self._thread = threading.Thread(target=self._beat, daemon=True, name=f"lease {self.rel}")
        self._thread.start()
        return self

    def _acquire_exclusive(self):
        where = self.loc.path(self.rel)
        for _ in range(5):
            try:
                self._etag = self.loc.write_json(self.rel, self._body(), exclusive=True)
                return
            except ConflictError:
                pass
            try:    # the tag first: if the holder renews meanwhile, taking over that tag fails below
                etag = self.loc.etag(self.rel)
                held = self.loc.read_json(self.rel)
            except (FileNotFoundError, ValueError):
                continue
            if etag is None:
                continue
            if is_live(held):
                raise LockedError(f"{where}: the cache is being written by another process ({describe(held)}). "
                                  "Only one writer may own a cache; wait for it to finish or stop it.")
            try:   # stale (holder dead or lapsed): take over exactly the version judged stale
                self._etag = self.loc.write_json(self.rel, self._body(), if_match=etag)
            except ConflictError:
                continue
            if self.loc.read_json(self.rel).get("owner") == self.owner:
                return
        raise LockedError(f"{where}: could not take the writer lease (other writers keep racing for it)")

    def _beat(self):
        while not self._stop.wait(self.ttl / 4):
            try:
                tag = self.loc.write_json(self.rel, self._body(), if_match=self._etag if self.exclusive else None)
                if self.exclusive:
                    self._etag = tag
            except ConflictError:
                self.lost = True
                print(f"kdcache: lost the lease {self.loc.path(self.rel)} to another process", file=sys.stderr)
                return
            except OSError as e:   # transient, we hope: try again next beat; say so, and say when it lapses
                lapsed = time.time() - self._renewed > self.ttl
                print(f"kdcache: cannot renew the lease {self.loc.path(self.rel)} ({e})"
                      + ("; it has lapsed: gc may now treat this cache as unused" if lapsed else ""), file=sys.stderr)
                continue
            self._renewed = time.time()

    def check(self):
        """Raise if the lease was lost (another process took it over after it lapsed)."""
        if self.lost:
            raise LockedError(f"{self.loc.path(self.rel)}: lost the writer lease to another process; "
                              "stopping before committing anything more")

    def release(self):
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        try:
            if self.loc.read_json(self.rel).get("owner") == self.owner:
                self.loc.remove(self.rel)
        except (FileNotFoundError, ValueError):
            pass

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


def stamp_use(loc):
    """Record that the cache at `loc` was used now (what `gc --unused-since` looks at); skipped if read-only."""
    try:
        loc.write_json(LAST_USED, {"time": time.time(), "host": socket.gethostname(), "pid": os.getpid()})
    except OSError:
        pass


def reader_lease(loc):
    """Announce a reading run on the cache at `loc` (shared; renewed until released) and stamp last use."""
    name = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}.json"
    lease = Lease(loc, f"{READERS_DIR}/{name}", exclusive=False).acquire()
    stamp_use(loc)
    return lease


def live_readers(loc, now=None):
    """Lease bodies of the runs reading the cache at `loc` now."""
    out = []
    for name in loc.list(READERS_DIR):
        try:
            info = loc.read_json(f"{READERS_DIR}/{name}")
        except (FileNotFoundError, ValueError):
            continue
        if is_live(info, now):
            out.append(info)
    return out
