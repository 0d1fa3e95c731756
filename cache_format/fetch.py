"""Remote shards on local disk: a bounded LRU directory, filled ahead of the reader, checksummed on arrival.

One per reading process (a temporary directory removed when the reader goes away, or by the next
reader on the machine if its process was killed), so many readers of one remote cache never
coordinate. A shard is downloaded whole (beside its final
name, then renamed), its sha256 checked against the manifest, then opened like a local one.
"""
import os
import shutil
import tempfile
import threading
import time
import warnings
import weakref
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

from kdcache.common.atomic import remove
from kdcache.common.env import env_size

from .errors import ShardError
from .fingerprint import hash_tree
from .lease import process_dir

DEFAULT_BYTES = 8 * 2**30      # KDCACHE_FETCH_BYTES: 8G, 512M, ...
RETRIES = 3


class ShardFetcher:
    """Downloads a remote cache's shards into a local directory that never holds more than max_bytes.

    pinned() names the shards a reader has open (never removed); pinned_max bounds how many. A budget below
    (pinned_max + 1) x the largest shard cannot be kept (those shards and the one being read must be on disk),
    so it is raised to that, with a warning naming both figures."""

    def __init__(self, loc, shards, *, directory=None, max_bytes=None, workers=4, pinned=None, pinned_max=0):
        self.loc, self.shards = loc, shards
        asked = int(max_bytes or env_size("KDCACHE_FETCH_BYTES", DEFAULT_BYTES))
        floor = (pinned_max + 1) * max((s.bytes for s in shards), default=0)
        if asked < floor:
            warnings.warn(f"{loc.url}: a download budget of {asked:,} bytes (KDCACHE_FETCH_BYTES) is below what "
                          f"reading this cache needs on disk at once, {pinned_max} open shard(s) and the one read "
                          f"next, of up to {floor // (pinned_max + 1):,} bytes each: using {floor:,} bytes",
                          stacklevel=3)
        self.max_bytes = max(asked, floor)
        self.dir = process_dir(directory or tempfile.gettempdir(), "kdcache-shards-")
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.dir, True)
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="kdcache-fetch")
        self._futures = {}                 # j -> Future of the local path
        self._present = OrderedDict()      # j -> bytes on disk, least recently used first
        self._consumed = set()             # shards handed to the reader at least once
        self._lock = threading.Lock()
        self._pinned = pinned or (lambda: ())
        self.downloaded_bytes = 0

    def prefetch(self, js, force=False):
        """Start downloading these shard positions in the background, in order, while they fit the budget
        (bytes on disk plus bytes in flight). Shards already read make room first; unread ones never do."""
        with self._lock:
            for j in js:
                f = self._futures.get(j)
                if f is not None and not (f.done() and f.exception() is not None):
                    continue
                need = self.shards[j].bytes
                if not force:
                    self._evict(room=need, consumed_only=True)
                    used = sum(self._present.values()) + self._inflight()
                    if used and used + need > self.max_bytes:
                        break              # the rest of the read-ahead waits for room
                self._futures[j] = self._pool.submit(self._download, j)

    def get(self, j):
        """Local path of shard position j, downloading it now if it is not here yet (after making room for it:
        read shards go first, then unread ones, waiting for downloads in flight where only they stand in the
        way)."""
        self._make_room(j)
        self.prefetch([j], force=True)
        path = self._futures[j].result()
        with self._lock:
            self._consumed.add(j)
            if j in self._present:
                self._present.move_to_end(j)
            self._evict(keep=j)
        return path

    def _make_room(self, j):
        need = self.shards[j].bytes
        while True:
            with self._lock:
                f = self._futures.get(j)
                if f is not None and not (f.done() and f.exception() is not None):
                    return                         # here or on its way: counted already
                self._evict(keep=j, room=need)
                flying = [f for k, f in self._futures.items() if not f.done()]
                if sum(self._present.values()) + self._inflight() + need <= self.max_bytes or not flying:
                    return
            wait(flying, return_when=FIRST_COMPLETED)   # downloads in flight: once done they can be removed

    def _local(self, j):
        """Where shard position j lives here: a name of ours, never a path taken from the manifest."""
        return os.path.join(self.dir, f"shard-{j:06d}")

    def _inflight(self):
        return sum(self.shards[j].bytes for j, f in self._futures.items() if not f.done())

    def _download(self, j):
        info = self.shards[j]
        local = self._local(j)
        for attempt in range(RETRIES):
            try:
                self.loc.download(info.path, local)
                break
            except FileNotFoundError:
                raise ShardError(f"{self.loc.path(info.path)}: shard {info.index} is listed in the manifest "
                                 "but missing") from None
            except OSError as e:
                if attempt + 1 == RETRIES:
                    raise ShardError(f"{self.loc.path(info.path)}: download failed ({e})") from e
                time.sleep(0.5 * 2 ** attempt)
        if hash_tree(local) != info.sha256:
            remove(local)
            raise ShardError(f"{self.loc.path(info.path)}: shard {info.index} fails its sha256 checksum "
                             "(the stored bytes changed after it was committed)")
        with self._lock:
            self._present[j] = info.bytes
            self.downloaded_bytes += info.bytes
        return local

    def _evict(self, keep=None, room=0, consumed_only=False):
        """Drop shards until `room` more bytes fit the budget: read ones first (least recently used),
        then, unless consumed_only, unread ones. Never `keep`, pinned or in-flight shards."""
        total = sum(self._present.values()) + self._inflight()
        busy = set(self._pinned()) | {keep} | {j for j, f in self._futures.items() if not f.done()}
        order = [j for j in self._present if j in self._consumed]
        if not consumed_only:
            order += [j for j in self._present if j not in self._consumed]
        for j in order:
            if total + room <= self.max_bytes:
                break
            if j in busy:
                continue
            total -= self._present.pop(j)
            self._futures.pop(j, None)
            self._consumed.discard(j)
            remove(self._local(j))

    def close(self):
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._cleanup()
