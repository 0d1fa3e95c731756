"""Reading a cache: `open_cache(path)` for either backend."""
import bisect
import os
from collections import OrderedDict

from .backends import READERS
from .errors import ShardError
from .manifest import load_manifest, safe_shard_path

OPEN_SHARDS = 4  # shard readers kept open for random access


class Cache:
    """A committed logit cache. Only shards listed in the manifest are visible.

    len(cache), cache[i] (global index over listed shards, in shard order),
    cache.iter_shard(j) (j-th listed shard), iter(cache), cache.manifest.
    """

    def __init__(self, directory):
        self.directory = str(directory)
        self.manifest = load_manifest(self.directory)
        self.shards = self.manifest["shards"]
        self.top_k = self.manifest["top_k"]
        self._reader_cls = READERS.get(self.manifest["backend"])
        if self._reader_cls is None:
            raise ShardError(f"{self.directory}: unknown backend {self.manifest['backend']!r}")
        self._starts = [0]
        for s in self.shards:
            self._starts.append(self._starts[-1] + s["num_samples"])
        self._open = OrderedDict()

    def __len__(self):
        return self._starts[-1]

    @property
    def num_shards(self):
        return len(self.shards)

    @property
    def complete(self):
        return bool(self.manifest["complete"])

    @property
    def eos_token_ids(self):
        return list(self.manifest["eos_token_ids"])

    def shard(self, j):
        """The reader of the j-th listed shard (opened on demand, a few kept open)."""
        if j in self._open:
            self._open.move_to_end(j)
            return self._open[j]
        info = self.shards[j]
        path = safe_shard_path(self.directory, info["path"])
        if not os.path.exists(path):
            raise ShardError(f"{path}: shard {info['index']} is listed in the manifest but missing")
        reader = self._reader_cls(path, self.top_k)
        if len(reader) != info["num_samples"]:
            raise ShardError(f"{path}: holds {len(reader)} samples, the manifest says {info['num_samples']}")
        self._open[j] = reader
        if len(self._open) > OPEN_SHARDS:
            self._open.popitem(last=False)
        return reader

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
            yield from self.iter_shard(j)


def open_cache(path):
    return Cache(path)
