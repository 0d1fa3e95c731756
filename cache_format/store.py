"""A store: one root (a directory or an fsspec URL) holding many caches, each named by its fingerprint.

    ROOT/kdcache-store.json              marks the root as a store
    ROOT/<alias>--<fingerprint[:16]>/    one cache (manifest.json, shards/, report/, ...)

A precompute aimed at a store computes the fingerprint of its inputs first and looks for a
cache whose name ends in that fingerprint: found complete, it is reused with no teacher work;
found incomplete, it is resumed; otherwise a new one is started under the alias. `ls` lists the
caches, `gc` removes incomplete or unused ones, never one that a run is writing or reading.
"""
import calendar
import fcntl
import os
import re
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

from .errors import CacheError, ConflictError, LockedError, ManifestMissing
from .lease import LAST_USED, READERS_DIR, Lease, is_live, live_readers
from .location import as_location
from .lock import LOCK_NAME, DirLock
from .manifest import MANIFEST_NAME, Manifest, load_manifest

STORE_MARKER = "kdcache-store.json"
CLAIMS_DIR = ".claims"
SEP = "--"
ID_LEN = 16
NAME_RE = re.compile(r"^[A-Za-z0-9._-]+--[0-9a-f]{16}$")


def is_store(where):
    return as_location(where).exists(STORE_MARKER)


def init_store(where):
    loc = as_location(where)
    if not loc.exists(STORE_MARKER):
        try:
            loc.write_json(STORE_MARKER, {"format": "kdcache-store", "version": 1}, exclusive=True)
        except ConflictError:
            pass           # another job made it first
    return loc


def slug(text):
    return re.sub(r"[^A-Za-z0-9._]+", "-", str(text)).strip("-.")[:80] or "cache"


def cache_name(alias, fingerprint):
    return f"{slug(alias)}{SEP}{fingerprint[:ID_LEN]}"


def is_cache_name(name):
    return isinstance(name, str) and bool(NAME_RE.fullmatch(name))   # fullmatch: `$` lets a trailing newline in


def _claim(fingerprint):
    return f"{CLAIMS_DIR}/{fingerprint[:ID_LEN]}.json"


def _read_claim(loc, fingerprint):
    """The name claimed for this fingerprint, or None if the claim is absent, damaged (a crash mid-write, a
    hand edit) or names anything but a plain child ending in this fingerprint: a claim is data, never a path."""
    try:
        name = loc.read_json(_claim(fingerprint)).get("name")
    except (FileNotFoundError, ValueError, AttributeError):
        return None
    return name if is_cache_name(name) and name.endswith(SEP + fingerprint[:ID_LEN]) else None


def _is_link(loc, name):
    return not loc.remote and os.path.islink(loc.path(name))


def find_cache(where, fingerprint):
    """Name of the cache in the store made from these inputs (any alias), or None."""
    loc = as_location(where)
    name = _read_claim(loc, fingerprint)
    if name is not None:
        return name
    suffix = SEP + fingerprint[:ID_LEN]          # a cache copied in by hand has no claim
    return next((n for n in loc.list() if n.endswith(suffix) and is_cache_name(n)), None)


def resolve(where, fingerprint, alias):
    """(URL or path of the cache for this fingerprint, whether it already existed). Creates the store marker.

    A new name is claimed in .claims/<fingerprint[:16]>.json (see _take_claim), so two jobs started at
    once with the same inputs (under any aliases) agree on one cache; the writer lock then lets only
    one of them run the teacher.
    """
    loc = init_store(where)
    name = find_cache(loc, fingerprint)
    found = name is not None
    if not found:
        name = _take_claim(loc, fingerprint, cache_name(alias, fingerprint))
    if _is_link(loc, name):
        raise CacheError(f"{loc.path(name)} is a symbolic link; kdcache does not follow links in a store. "
                         "Remove the link, or move the cache it points to into the store under that name.")
    return loc.path(name), found


@contextmanager
def _claims_lock(loc):
    """Serialise local claim writers (flock: the kernel drops it if the holder dies). An O_EXCL create
    alone leaves an empty claim after a crash that nobody could safely replace."""
    path = loc.path(f"{CLAIMS_DIR}/.lock")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _take_claim(loc, fingerprint, name):
    """Claim `name` for the fingerprint unless a valid claim exists; returns the name that holds."""
    body = {"name": name, "fingerprint": fingerprint}
    if not loc.remote:
        with _claims_lock(loc):      # under the lock: read, and if absent or damaged, replace (temp + rename)
            held = _read_claim(loc, fingerprint)
            if held is None:
                loc.write_json(_claim(fingerprint), body)
            return held or name
    for _ in range(5):    # object stores: create, or replace exactly the damaged version seen (If-Match)
        etag = loc.etag(_claim(fingerprint))    # the tag first: a claim written after it makes the put fail
        held = _read_claim(loc, fingerprint)
        if held is not None:
            return held
        try:
            loc.write_json(_claim(fingerprint), body, exclusive=etag is None, if_match=etag)
        except ConflictError:
            continue
        held = _read_claim(loc, fingerprint)    # stores without conditional puts: the last writer wins
        if held is not None:
            return held
    raise CacheError(f"{loc.path(_claim(fingerprint))}: could not claim a cache name (the claim keeps changing "
                     "or stays unreadable); delete that file and start again")


def parse_time(stamp):
    """Unix seconds of a manifest timestamp ('2026-11-30T10:43:07Z')."""
    return float(calendar.timegm(time.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ")))


@dataclass
class Entry:
    name: str
    url: str
    manifest: Manifest | None = None
    error: str | None = None
    readers: list = field(default_factory=list)
    writing: bool = False
    link: str | None = None              # a store child that is a symbolic link: its target, never followed
    updated: float | None = None         # last commit (or newest file, without a manifest)
    last_used: float | None = None       # last reader, or the last commit if never read

    @property
    def complete(self):
        return bool(self.manifest and self.manifest.complete)

    @property
    def state(self):
        if self.link is not None:
            return "link"
        if self.error:
            return "unreadable"
        if self.manifest is None:
            return "empty"
        m = self.manifest
        return "complete" if m.complete else f"incomplete {len(m.shards)}/{m.num_shards_planned}"


def _writer_live(loc):
    """Whether a precompute holds this cache now (looked at without writing anything)."""
    if not loc.remote:
        path = loc.path(LOCK_NAME)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)    # conflicts only with a writer's exclusive lock
            fcntl.flock(fd, fcntl.LOCK_UN)
            return False
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
    try:
        return is_live(loc.read_json(LOCK_NAME))
    except (FileNotFoundError, ValueError):
        return False


BOOKKEEPING = (LOCK_NAME, READERS_DIR, LAST_USED)


def _last_write(c):
    """Newest modification time of the cache's content (locks, leases and use stamps aside)."""
    times = [c.newest_mtime(n) for n in c.list() if n not in BOOKKEEPING]
    times = [t for t in times if t is not None]
    return max(times) if times else None


def _link_entry(loc, name):
    """A child that is a symbolic link: reported, never read or removed through (its target is outside the store)."""
    path = loc.path(name)
    target = os.readlink(path)
    return Entry(name=name, url=path, link=target,
                 error=f"{path} is a symbolic link to {target}; kdcache does not follow links in a store and "
                       "left both untouched: remove the link by hand if it is not wanted")


def describe_cache(loc, name):
    if _is_link(loc, name):
        return _link_entry(loc, name)
    c = loc.child(name)
    e = Entry(name=name, url=c.url)
    try:
        e.manifest = load_manifest(c)
    except ManifestMissing:
        pass                      # an empty cache: started, nothing committed yet
    except CacheError as err:
        e.error = str(err)
    try:
        e.updated = parse_time(e.manifest.updated) if e.manifest else _last_write(c)
    except (TypeError, KeyError, ValueError):
        e.updated = _last_write(c)
    e.readers = live_readers(c)
    e.writing = _writer_live(c)
    used = [e.updated or 0.0]
    try:
        used.append(float(c.read_json(LAST_USED)["time"]))
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        pass
    e.last_used = time.time() if e.readers else max(used)
    return e


def list_caches(where):
    """Every cache in the store (children named <alias>--<16 hex digits>), as Entries."""
    loc = as_location(where)
    out = []
    for name in loc.list():
        if is_cache_name(name):
            out.append(describe_cache(loc, name))
    return out


def _hold(loc):
    """Take the cache's writer lock for gc (LockedError if a precompute holds it)."""
    lock = Lease(loc, LOCK_NAME, exclusive=True) if loc.remote else DirLock(loc.url)
    return lock.acquire()


def remove_cache(loc):
    """Delete one cache unless a run reads or writes it. Returns None when removed, else the reason kept.

    Order: no live reader -> take the writer lock -> delete the manifest (from here on new readers
    find no cache) -> look for readers again, and if one announced itself meanwhile, put the manifest
    back and keep the cache -> delete everything else.
    """
    if not loc.remote and os.path.islink(loc.url):
        return "it is a symbolic link (not followed, nothing removed)"
    if live_readers(loc):
        return "being read"
    try:
        lock = _hold(loc)
    except LockedError:
        return "being written"
    try:
        try:
            manifest = loc.read_bytes(MANIFEST_NAME)
        except FileNotFoundError:
            manifest = None
        loc.remove(MANIFEST_NAME)
        if live_readers(loc):
            if manifest is not None:
                loc.write_bytes(MANIFEST_NAME, manifest)
            return "being read"
        for name in loc.list():
            if name != LOCK_NAME:
                loc.remove(name)
        if not loc.remote:                # the lock file goes last, while still held; a writer that
            loc.remove(LOCK_NAME)         # starts now makes a new directory and a new lock
            try:
                os.rmdir(loc.url)
            except OSError:
                pass                      # something new appeared: it is not ours to delete
    finally:
        lock.release()                    # remote: deletes the lease object, the last object left
    return None


def gc(where, *, incomplete_older_than=None, unused_since=None, dry_run=False, now=None):
    """Remove incomplete caches idle for more than `incomplete_older_than` seconds, and caches (complete
    or not) last used before `unused_since` (unix seconds). Returns [(Entry, action, reason)]."""
    now = time.time() if now is None else now
    loc = as_location(where)
    if not is_store(loc):
        raise CacheError(f"{loc.url} is not a kdcache store (no {STORE_MARKER}); gc only works on stores")
    decisions = []
    for e in list_caches(loc):
        why = None
        if e.link is not None:
            decisions.append((e, "kept", f"a symbolic link to {e.link}: not followed, nothing touched; "
                                    "remove the link by hand if it is not wanted"))
            continue
        if e.state == "unreadable":
            decisions.append((e, "kept", "manifest unreadable: inspect it by hand"))
            continue
        if incomplete_older_than is not None and not e.complete and (e.updated or 0) < now - incomplete_older_than:
            why = f"incomplete, idle {_age(now - (e.updated or 0))}"
        elif unused_since is not None and (e.last_used or 0) < unused_since:
            why = f"not used since {time.strftime('%Y-%m-%d %H:%M', time.gmtime(e.last_used or 0))}"
        if why is None:
            continue
        if e.readers:
            decisions.append((e, "kept", f"{why}, but {len(e.readers)} run(s) are reading it"))
        elif e.writing:
            decisions.append((e, "kept", f"{why}, but a precompute is writing it"))
        elif dry_run:
            decisions.append((e, "would remove", why))
        else:
            kept = remove_cache(as_location(e.url))
            decisions.append((e, "removed", why) if kept is None else (e, "kept", f"{why}, but {kept}"))
            if kept is None:
                _drop_claim(loc, e.name)
    return decisions


def _drop_claim(loc, name):
    fp16 = name.rsplit(SEP, 1)[1]
    if _read_claim(loc, fp16) == name:     # a claim now naming another cache is not ours to drop
        loc.remove(_claim(fp16))


def _age(seconds):
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"
