"""Reading a cache: `open_cache(path or URL)` for either backend, local or remote."""
import bisect
import os
import time
import warnings
from collections import OrderedDict

from .errors import ManifestMissing, ShardError
from .fingerprint import hash_tree
from .lease import reader_lease
from .location import as_location
from .manifest import load_manifest, safe_shard_path
from .storage import get_format
from .values import Rules

OPEN_SHARDS = 4  # shard readers kept open for random access
READ_AHEAD = 4   # shards a remote cache downloads ahead of a sequential reader


class Cache:
    """A committed logit cache. Only shards listed in the manifest are visible.

    len(cache), cache[i] (global index over listed shards, in shard order),
    cache.iter_shard(j) (j-th listed shard), iter(cache), cache.manifest.
    A remote cache (fsspec URL) is read through a bounded local directory of downloaded,
    checksummed shards (fetch_bytes), filled ahead of the reader by `prefetch`.
    track_use=True announces this reader with a lease (see lease.py) so `kdcache gc` leaves
    the cache alone while it runs; close() withdraws it.
    check_values=True (the default) checks every decoded block against the format's value rules (values.py:
    what `verify` checks; a NaN tail mass, a positive log-prob, draws that do not add up) before any record of
    it is handed out, raising ShardError naming the shard, sample and position; False reads without them.
    """

    def __init__(self, directory, *, track_use=False, fetch_bytes=None, fetch_dir=None, check_values=True):
        self.location = as_location(directory)
        self.directory = self.location.url
        self._lease = None
        if track_use:
            load_manifest(self.location)      # not a cache: fail before leaving any trace in the directory
            try:
                self._lease = reader_lease(self.location)
            except OSError as e:              # read-only access: read anyway, but gc cannot see this run
                warnings.warn(f"{self.directory}: cannot announce this reader ({e}); `kdcache gc` will not "
                              "know the cache is in use", stacklevel=2)
        self._open = OrderedDict()
        self._fetcher = None
        try:
            self.manifest = self._load(retry=track_use)
            self.shards = self.manifest.shards
            self.top_k = self.manifest.top_k
            self.sample = self.manifest.sample or 0     # a sampled cache's draws per position (SPEC.md 4.4)
            self._reader_cls = get_format(self.manifest.backend).Shard
            self.rules = Rules.of(self.manifest) if check_values else None
            self._starts = [0]
            for s in self.shards:
                self._starts.append(self._starts[-1] + s.num_samples)
            if self.location.remote:
                from .fetch import ShardFetcher
                self._fetcher = ShardFetcher(self.location, self.shards, max_bytes=fetch_bytes, directory=fetch_dir,
                                             pinned=lambda: list(self._open), pinned_max=OPEN_SHARDS)
        except BaseException:
            self.close()                      # no lease or download threads left behind
            raise

    def _load(self, retry):
        # A reader that announced itself may catch `gc` between removing the manifest and
        # putting it back on seeing this reader's lease: look again before giving up.
        for attempt in range(3 if retry else 1):
            try:
                return load_manifest(self.location)
            except ManifestMissing:
                if attempt == 2 or not retry:
                    raise
                time.sleep(1.0)

    def __len__(self):
        return self._starts[-1]

    @property
    def num_shards(self):
        return len(self.shards)

    @property
    def complete(self):
        return bool(self.manifest.complete)

    @property
    def eos_token_ids(self):
        return list(self.manifest.eos_token_ids)

    def shard(self, j):
        """The reader of the j-th listed shard (opened on demand, a few kept open)."""
        if j in self._open:
            self._open.move_to_end(j)
            return self._open[j]
        info = self.shards[j]
        path = self.local_path(j)
        reader = self._reader_cls(path, self.top_k, rules=self.rules)
        if len(reader) != info.num_samples:
            raise ShardError(f"{path}: holds {len(reader)} samples, the manifest says {info.num_samples}")
        if getattr(reader, "sample", 0) != self.sample:
            raise ShardError(f"{path}: {reader.sample} draws per position in the shard, {self.sample} in the manifest")
        self._open[j] = reader
        if len(self._open) > OPEN_SHARDS:
            self._open.popitem(last=False)
        return reader

    def local_path(self, j):
        """A local path of the j-th listed shard (downloaded and checksummed first if the cache is remote)."""
        info = self.shards[j]
        if self._fetcher is not None:
            return self._fetcher.get(j)
        path = safe_shard_path(self.directory, info.path)
        if not os.path.exists(path):
            raise ShardError(f"{path}: shard {info.index} is listed in the manifest but missing")
        return path

    def checked_path(self, j):
        """local_path(j) after checking the shard's sha256 against the manifest (ShardError if it fails)."""
        path = self.local_path(j)
        if self._fetcher is None and hash_tree(path, shard=True) != self.shards[j].sha256:
            raise ShardError(f"{path}: shard {self.shards[j].index} fails its sha256 checksum")
        return path

    def prefetch(self, js):
        """Hint: these shard positions are read next (remote caches start downloading them)."""
        if self._fetcher is not None:
            self._fetcher.prefetch(js)

    def close(self):
        self._open.clear()
        if self._fetcher is not None:
            self._fetcher.close()
        if self._lease is not None:
            self._lease.release()
            self._lease = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def locate(self, i):
        """(shard position j, row within the shard) of global sample index i."""
        if not 0 <= i < len(self):
            raise IndexError(f"sample index {i} out of range [0, {len(self)})")
        j = bisect.bisect_right(self._starts, i) - 1
        return j, i - self._starts[j]

    def __getitem__(self, i):
        j, row = self.locate(int(i))
        return self.shard(j)[row]

    def iter_shard(self, j):
        yield from self.shard(j)

    def __iter__(self):
        for j in range(self.num_shards):
            self.prefetch(range(j, min(j + 1 + READ_AHEAD, self.num_shards)))
            yield from self.iter_shard(j)


def open_cache(path, **kwargs):
    return Cache(path, **kwargs)
