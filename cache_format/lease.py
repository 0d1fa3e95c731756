"""Leases: who is writing or reading a cache, on storage that has no flock.

A lease is a small JSON object {owner, host, boot_id, pidns, pid, pid_start, generation, started,
expires} renewed by a heartbeat thread. It is live while `expires` is in the future, unless it was
made on this very boot of this very host, in this PID namespace, by a process that no longer
exists (no such pid, or a pid reused by a process started at another time): a kill -9 frees it at
once on the same machine, and after the TTL anywhere else, including on another machine that
happens to share the host name (containers, cloned VMs). Writers hold an exclusive lease
(`.writer.lock`, created with a conditional put) on object stores; its `generation` grows with
every takeover and fences the manifest (writer.py). Every reading run holds a shared one
(`.readers/<id>.json`), so `gc` can see that a cache is in use without readers coordinating.
"""
import functools
import hashlib
import os
import re
import shutil
import socket
import sys
import tempfile
import threading
import time
import uuid

from kdcache.common.env import env_seconds

from .errors import ConflictError, LockedError

TTL = 120.0        # seconds; KDCACHE_LEASE_TTL (120, 30s, 2m, ...) overrides it, read when a lease is made
READERS_DIR = ".readers"
LAST_USED = ".last_used.json"
BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"


def pid_namespace():
    """This process's PID namespace ('pid:[4026531836]'): containers sharing a host name differ here."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


@functools.lru_cache(maxsize=1)
def boot_id():
    """This boot of this kernel (Linux: a random UUID drawn at boot); None where unknown.

    The PID namespace's inode is the same constant on every Linux host, so it cannot tell two machines
    apart; the boot id can, and it also changes when a cloned VM or a machine reboots."""
    try:
        with open(BOOT_ID_PATH, encoding="ascii") as f:
            return f.read().strip() or None
    except (OSError, ValueError):
        return None


def boot_key():
    """12 hex digits naming the pid space of this process: this boot, host name and PID namespace.
    Two processes with the same key can look up each other's pids; None where the boot is unknown."""
    boot = boot_id()
    if boot is None:
        return None
    who = f"{boot}\n{socket.gethostname()}\n{pid_namespace()}"
    return hashlib.sha256(who.encode("utf-8")).hexdigest()[:12]


def pid_start(pid):
    """Start time of process `pid` in clock ticks after boot (field 22 of /proc/<pid>/stat).

    FileNotFoundError when no such process exists; other OSError or ValueError when it cannot be told."""
    pid = int(pid)
    if pid <= 0:
        raise ValueError(f"no process has pid {pid}")
    with open(f"/proc/{pid}/stat", "rb") as f:
        data = f.read()
    fields = data[data.rindex(b")") + 2:].split()     # the name (field 2) may hold spaces and ')'
    return int(fields[22 - 3])


def process_gone(pid, start):
    """True only if it is certain that the process `pid` started at `start` no longer runs in this pid
    space: no process has that pid, or one started at another time does (the pid was reused)."""
    if not os.path.isdir("/proc/self"):
        return False
    try:
        now = pid_start(pid)
    except FileNotFoundError:
        return True
    except (OSError, ValueError, TypeError, IndexError):
        return False
    return isinstance(start, int) and not isinstance(start, bool) and now != start


def process_tag(pid=None):
    """'k<boot_key>-<pid>-<start ticks>': names a per-process directory unambiguously across hosts and
    boots (start 0 if the process is gone: such a tag is of a dead process)."""
    pid = os.getpid() if pid is None else int(pid)
    try:
        start = pid_start(pid)
    except (OSError, ValueError, IndexError):
        start = 0
    return f"k{boot_key() or '0' * 12}-{pid}-{start}"


def process_dir(base, prefix):
    """A new directory `<prefix><process_tag>-*` under base, after removing those of processes proven dead:
    made in this pid space (boot, host, PID namespace) by a pid that is gone or was reused. kill -9 skips
    cleanup; directories of other hosts, boots or containers, and old-style names, are left alone."""
    mine = boot_key()
    try:
        names = os.listdir(base) if mine else []
    except OSError:
        names = []
    for name in names:
        m = re.match(re.escape(prefix) + r"k([0-9a-f]{12})-(\d+)-(\d+)-", name)
        if m and m.group(1) == mine and process_gone(int(m.group(2)), int(m.group(3))):
            shutil.rmtree(os.path.join(base, name), ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{prefix}{process_tag()}-", dir=base)


def _expires(info):
    try:
        return float(info.get("expires", 0))
    except (TypeError, ValueError):
        return 0.0


def _generation(info):
    g = info.get("generation") if isinstance(info, dict) else None
    return g if isinstance(g, int) and not isinstance(g, bool) and g >= 0 else 0


def holder_gone(info):
    """The lease names this boot, host and PID namespace, and its process is provably gone."""
    here = boot_id()
    return (here is not None and info.get("boot_id") == here and info.get("host") == socket.gethostname()
            and info.get("pidns") == pid_namespace() and process_gone(info.get("pid"), info.get("pid_start")))


def is_live(info, now=None):
    """True while the lease's holder may still be running (leases without boot_id wait for the TTL)."""
    now = time.time() if now is None else now
    if not isinstance(info, dict) or _expires(info) <= now:
        return False
    return not holder_gone(info)


def describe(info, now=None):
    now = time.time() if now is None else now
    if not isinstance(info, dict):
        return "no readable lease"
    return (f"pid {info.get('pid')} on {info.get('host')}, lease expires in "
            f"{max(0.0, _expires(info) - now):.0f} s")


def _own_start():
    try:
        return pid_start(os.getpid())
    except (OSError, ValueError, IndexError):
        return None


class Lease:
    """An exclusive (writer) or shared (reader) lease object at `rel` in a Location.

    An exclusive lease is lost for good, and check() raises, once another process took it over, once
    it lapsed (not renewed for a whole TTL: others may have judged it dead), or once renewing it failed
    in an unexpected way: when its state is unknown the holder must stop, never renew it silently.
    """

    def __init__(self, loc, rel, *, exclusive, ttl=None):
        self.loc, self.rel, self.exclusive = loc, rel, exclusive
        self.ttl = float(ttl or env_seconds("KDCACHE_LEASE_TTL", TTL))
        self.owner = uuid.uuid4().hex
        self.started = time.time()
        self.generation = 0          # fencing token: one more than the holder it replaced (exclusive)
        self.lost = False
        self._why = None
        self._expires = 0.0          # `expires` of the last body written: others may take over after it
        self._etag = None
        self._stop = threading.Event()
        self._thread = None

    def _body(self):
        return {"owner": self.owner, "host": socket.gethostname(), "boot_id": boot_id(), "pidns": pid_namespace(),
                "pid": os.getpid(), "pid_start": _own_start(), "generation": self.generation,
                "started": self.started, "expires": time.time() + self.ttl}

    def _put(self, **cond):
        body = self._body()
        tag = self.loc.write_json(self.rel, body, **cond)
        self._expires = body["expires"]
        return tag

    def acquire(self, after=0):
        """Take the lease. after: a generation the new one must exceed (the manifest's writer_generation,
        which outlives a released lease object)."""
        if self.lost:
            raise LockedError(f"{self.loc.path(self.rel)}: this lease was lost ({self._why}); it is never taken "
                              "again silently: start a new job, which resumes from the last commit")
        if not self.exclusive:
            self._put()
        else:
            self._acquire_exclusive(after)
        self._thread = threading.Thread(target=self._beat, daemon=True, name=f"lease {self.rel}")
        self._thread.start()
        return self

    def _acquire_exclusive(self, after):
        where = self.loc.path(self.rel)
        for _ in range(5):
            self.generation = int(after) + 1
            try:
                self._etag = self._put(exclusive=True)
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
            self.generation = max(int(after), _generation(held)) + 1
            try:   # stale (holder dead or lapsed): take over exactly the version judged stale
                self._etag = self._put(if_match=etag)
            except ConflictError:
                continue
            if self.loc.read_json(self.rel).get("owner") == self.owner:
                return
        raise LockedError(f"{where}: could not take the writer lease (other writers keep racing for it)")

    def _lose(self, why):
        if not self.lost:
            self.lost, self._why = True, why
            print(f"kdcache: lost the lease {self.loc.path(self.rel)}: {why}", file=sys.stderr)

    def _beat(self):
        while not self._stop.wait(self.ttl / 4):
            if self.exclusive and time.time() >= self._expires:
                self._lose(f"not renewed for {self.ttl:g} s, so it lapsed and another process may hold it")
                return
            try:
                tag = self._put(if_match=self._etag if self.exclusive else None)
            except ConflictError:
                self._lose("another process took it over")
                return
            except Exception as e:  # noqa: BLE001 -- a dead heartbeat must never go unnoticed
                if self.exclusive and not isinstance(e, OSError):
                    self._lose(f"renewing it failed unexpectedly ({e!r})")
                    return
                # transient, we hope (a writer stops once the lease lapses; a reader keeps trying)
                print(f"kdcache: cannot renew the lease {self.loc.path(self.rel)} ({e!r})", file=sys.stderr)
                continue
            if self.exclusive:
                self._etag = tag

    def check(self):
        """Raise if the lease was lost (taken over, lapsed, or its renewal failed unexpectedly)."""
        if self.exclusive and not self.lost and self._expires and time.time() >= self._expires:
            self._lose(f"not renewed for {self.ttl:g} s, so it lapsed and another process may hold it")
        if self.lost:
            self._refuse()

    def _refuse(self):
        raise LockedError(f"{self.loc.path(self.rel)}: lost the writer lease ({self._why}); stopping without "
                          "committing anything more. Run the job again: it resumes from the last commit")

    def confirm(self):
        """check(), then read the lease object itself: LockedError unless it still names this owner and
        generation (a holder that stalled, or whose clock is off, must not trust its own bookkeeping)."""
        self.check()
        try:
            held = self.loc.read_json(self.rel)
        except (FileNotFoundError, ValueError):
            held = None
        if not isinstance(held, dict) or held.get("owner") != self.owner or held.get("generation") != self.generation:
            self._lose(f"the lease object now shows {describe(held)}, generation {_generation(held)}; "
                       f"this job's was {self.generation}")
            self._refuse()

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
