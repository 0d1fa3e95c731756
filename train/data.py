"""Streaming the cache into the trainer: deterministic order, rank split, prefetch, resumable position.

Order for (seed, epoch): the listed shards are permuted and each shard's rows
are permuted; concatenated, that is the epoch's global order of all N samples.
Rank r reads the contiguous span [r*N // world, (r+1)*N // world) of it (as
mosaicml/streaming splits at sample granularity): every sample once per epoch,
any complete cache on any world size, ranks within one sample of each other, and
each rank touches only the shards its span crosses. A rank holds at most
`prefetch` decoded shards in memory, never the whole cache. The stream's
position (epoch, segment cursor, row cursor) after each batch is part of every
checkpoint, so a resumed run continues with exactly the next samples.
"""
import queue
import threading
from dataclasses import dataclass

import numpy as np

from kdcache.cache_format import ShardError, hash_json, open_cache
from kdcache.cache_format.reader import READ_AHEAD
from kdcache.common.batching import budget_groups
from kdcache.common.errors import TrainDataError


@dataclass(frozen=True)
class StreamPosition:
    """Where a stream stands: the next sample is row `row_cursor` of segment `shard_cursor` (a shard's part of this
    rank's span, see CacheStream.segments) of epoch `epoch`'s order. Saved in every checkpoint under these keys."""
    epoch: int = 0
    shard_cursor: int = 0
    row_cursor: int = 0

    def to_dict(self) -> dict:
        return {"epoch": self.epoch, "shard_cursor": self.shard_cursor, "row_cursor": self.row_cursor}

    @classmethod
    def from_dict(cls, d: dict) -> "StreamPosition":
        return cls(int(d["epoch"]), int(d["shard_cursor"]), int(d["row_cursor"]))

    def after_row(self, row: int, n_rows: int, n_segments: int) -> "StreamPosition":
        """The position after row `row` (of n_rows) of this segment: the next row, segment, or epoch."""
        if row + 1 < n_rows:
            return StreamPosition(self.epoch, self.shard_cursor, row + 1)
        if self.shard_cursor + 1 < n_segments:
            return StreamPosition(self.epoch, self.shard_cursor + 1, 0)
        return StreamPosition(self.epoch + 1, 0, 0)


@dataclass
class LoadedShard:
    """One segment, decoded by the loader thread: its place in the order, its records and the rows to read."""
    epoch: int
    segment: int          # its index in the epoch's list of segments
    n_segments: int
    records: list         # [Record], the whole shard ([] when damaged)
    rows: np.ndarray      # the rows of this rank's span, in reading order
    damaged: bool = False


class CacheStream:
    def __init__(self, cache_dir, *, rank=0, world=1, seed=0, shuffle=True, batch_size=8, max_tokens=0,
                 prefetch=2, epochs=None, skip_damaged=False, track_use=False, readahead=READ_AHEAD, part=(0, 1),
                 check_values=True):
        """part (i, n): read only every n-th segment of this rank's span from the i-th (a DataLoader worker's
        disjoint share: whole shards, never split between workers). check_values: run the reader's value rules on
        every decoded block (kdcache.cache_format.values; False only to measure what they cost)."""
        self.cache = open_cache(cache_dir, track_use=track_use, check_values=check_values)
        if len(self.cache) < world:
            self.cache.close()
            raise TrainDataError(f"{cache_dir}: {len(self.cache)} sample(s) cannot feed {world} ranks (each rank "
                                 "needs at least one per epoch)")
        self.rank, self.world, self.seed, self.shuffle, self.part = rank, world, seed, shuffle, part
        self.batch_size, self.max_tokens, self.prefetch, self.epochs = batch_size, max_tokens, prefetch, epochs
        self.position = StreamPosition()
        self.skip_damaged = skip_damaged
        self.readahead = readahead   # shards a remote cache downloads ahead of the decoder
        self.damaged = {}          # shard path -> samples skipped: its checksum failed, or its values (see _records)
        self._verified = set()     # shard positions whose checksum passed
        self._refused = set()      # shard positions found damaged and skipped

    # -- the order -------------------------------------------------------------------
    def segments(self, epoch):
        """[(shard position j, rows of shard j)] this rank reads in `epoch`, in order: its span of the global order."""
        n = self.cache.num_shards
        order = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
        lo, hi = self.span()
        out, start = [], 0
        for j in order:
            size = self.cache.shards[j].num_samples
            a, b = max(lo, start), min(hi, start + size)
            if a < b:
                out.append((int(j), self.rows_for(epoch, j)[a - start:b - start]))
            start += size
        return out[self.part[0]::self.part[1]]

    def span(self):
        """[lo, hi): this rank's share of each epoch's global order."""
        total = len(self.cache)
        return self.rank * total // self.world, (self.rank + 1) * total // self.world

    def rows_for(self, epoch, j):
        n = self.cache.shards[j].num_samples
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch, self.cache.shards[j].index]).permutation(n)

    def order(self):
        """What a saved position refers to: the cache (fingerprint and committed shards) and the order's settings.
        A resume under another order would skip or repeat samples, so checkpoints record it."""
        m = self.cache.manifest
        return {"cache_fingerprint": m.fingerprint,
                "shards_sha256": hash_json([[s.index, s.sha256] for s in m.shards]),
                "num_shards": len(m.shards), "world_size": self.world, "seed": self.seed,
                "shuffle": self.shuffle, "split": "sample-spans"}

    def samples_per_epoch(self):
        lo, hi = self.span()
        return hi - lo

    def count_batches(self, epochs):
        """How many micro-batches batches() yields over `epochs` epochs from the start: batch_size samples each,
        or fewer under max_tokens, grouped as batches() groups them (across epoch ends too). Reads only each
        shard's sample lengths."""
        if not self.max_tokens:
            return -(-self.samples_per_epoch() * epochs // self.batch_size)
        lengths = {}

        def of(j):
            if j not in lengths:
                lengths[j] = self.cache.shard(j).lengths()
            return lengths[j]
        flat = np.concatenate([of(j)[rows] for e in range(epochs) for j, rows in self.segments(e)] or
                              [np.zeros(0, np.int64)])
        return sum(1 for _ in budget_groups(flat.tolist(), int, max_tokens=self.max_tokens,
                                            max_items=self.batch_size))

    # -- resumable position ----------------------------------------------------------
    def state_dict(self) -> dict:
        return self.position.to_dict()

    def load_state_dict(self, state: dict):
        self.position = StreamPosition.from_dict(state)

    def carry_over(self, state: dict):
        """A checkpoint of another cache (--new-cache): this cache is read from its start."""
        self.position = StreamPosition()

    # -- streaming -------------------------------------------------------------------
    def _shard_loader(self, start: StreamPosition, out):
        """Background thread: decode shards in stream order into `out` (bounded queue): LoadedShard items, then
        None at the end, or the exception that stopped it."""
        epoch, cursor = start.epoch, start.shard_cursor
        try:
            segs = self.segments(epoch)
            while self.epochs is None or epoch < self.epochs:
                following = self.segments(epoch + 1)
                for c in range(cursor, len(segs)):
                    ahead = [j for j, _ in (segs + following)[c:c + 1 + self.readahead]]   # into the next epoch
                    self.cache.prefetch(ahead)
                    j, rows = segs[c]
                    records = self._records(j, len(rows))
                    out.put(LoadedShard(epoch, c, len(segs), records or [], rows, damaged=records is None))
                epoch, cursor, segs = epoch + 1, 0, following
            out.put(None)
        except BaseException as e:  # surface reader errors in the trainer thread
            out.put(e)

    def _records(self, j, n_rows):
        """Shard j's records, its checksum checked before its first use and every block's values as it is decoded
        (the reader's value rules, what `kdcache verify` checks). A damaged shard, by either, fails the run naming
        it, or is skipped (None) and its n_rows samples of this rank's span are counted in `damaged`."""
        entry = self.cache.shards[j]
        if j not in self._refused:
            try:
                if j not in self._verified:
                    self.cache.checked_path(j)
                    self._verified.add(j)
                return list(self.cache.iter_shard(j))
            except ShardError as e:
                if not self.skip_damaged:
                    raise ShardError(f"{e} ({entry.num_samples} samples). Run `kdcache verify "
                                     f"{self.cache.directory}`; pass --skip-damaged-shards to train on the "
                                     "rest.") from e
                self._refused.add(j)        # not decoded again in later epochs
        self.damaged[entry.path] = n_rows          # this epoch's share of it
        return None

    def close(self):
        """Release the cache (its reader lease, downloaded shards). The stream cannot be read afterwards."""
        self.cache.close()

    def samples(self):
        """Yield (record, StreamPosition after it) from the saved position onward."""
        start = self.position
        q = queue.Queue(maxsize=self.prefetch)
        threading.Thread(target=self._shard_loader, args=(start, q), daemon=True).start()
        first = True
        while True:
            item = q.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            begin = start.row_cursor if first else 0
            first = False
            if item.damaged:
                continue
            here = StreamPosition(item.epoch, item.segment, 0)
            for r in range(begin, len(item.rows)):
                yield item.records[item.rows[r]], here.after_row(r, len(item.rows), item.n_segments)

    def batches(self):
        """Yield (list of records, StreamPosition after the batch): batch_size samples, or fewer under max_tokens."""
        for group in budget_groups(self.samples(), lambda item: len(item[0].input_ids), max_tokens=self.max_tokens,
                                   max_items=self.batch_size):
            yield [rec for rec, _ in group], group[-1][1]
