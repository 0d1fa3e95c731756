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

import numpy as np

from kdcache.cache_format import ShardError, hash_json, open_cache
from kdcache.cache_format.reader import READ_AHEAD
from kdcache.common.batching import budget_groups
from kdcache.common.errors import TrainDataError


class CacheStream:
    def __init__(self, cache_dir, *, rank=0, world=1, seed=0, shuffle=True, batch_size=8, max_tokens=0,
                 prefetch=2, epochs=None, skip_damaged=False, track_use=False, readahead=READ_AHEAD, part=(0, 1)):
        """part (i, n): read only every n-th segment of this rank's span from the i-th (a DataLoader worker's
        disjoint share: whole shards, never split between workers)."""
        self.cache = open_cache(cache_dir, track_use=track_use)
        if len(self.cache) < world:
            self.cache.close()
            raise TrainDataError(f"{cache_dir}: {len(self.cache)} sample(s) cannot feed {world} ranks (each rank "
                                 "needs at least one per epoch)")
        self.rank, self.world, self.seed, self.shuffle, self.part = rank, world, seed, shuffle, part
        self.batch_size, self.max_tokens, self.prefetch, self.epochs = batch_size, max_tokens, prefetch, epochs
        self.state = {"epoch": 0, "shard_cursor": 0, "row_cursor": 0}
        self.skip_damaged = skip_damaged
        self.readahead = readahead   # shards a remote cache downloads ahead of the decoder
        self.damaged = {}          # shard path -> samples skipped because its checksum failed
        self._verified = set()

    # -- the order -------------------------------------------------------------------
    def segments(self, epoch):
        """[(shard position j, rows of shard j)] this rank reads in `epoch`, in order: its span of the global order."""
        n = self.cache.num_shards
        order = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
        lo, hi = self.span()
        out, start = [], 0
        for j in order:
            size = self.cache.shards[j]["num_samples"]
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
        n = self.cache.shards[j]["num_samples"]
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch, self.cache.shards[j]["index"]]).permutation(n)

    def plan(self):
        """What a saved position means: the cache (fingerprint and committed shards) and the order's settings.
        A resume under another plan would skip or repeat samples, so checkpoints record it."""
        m = self.cache.manifest
        return {"cache_fingerprint": m["fingerprint"],
                "shards_sha256": hash_json([[s["index"], s["sha256"]] for s in m["shards"]]),
                "num_shards": len(m["shards"]), "world_size": self.world, "seed": self.seed,
                "shuffle": self.shuffle, "split": "sample-spans"}

    def samples_per_epoch(self):
        lo, hi = self.span()
        return hi - lo

    # -- resumable position ----------------------------------------------------------
    def state_dict(self):
        return dict(self.state)

    def load_state_dict(self, state):
        self.state = {k: int(state[k]) for k in ("epoch", "shard_cursor", "row_cursor")}

    # -- streaming -------------------------------------------------------------------
    def _shard_loader(self, start, out):
        """Background thread: decode shards in stream order into `out` (bounded queue)."""
        epoch, cursor = start
        try:
            plan = self.segments(epoch)
            while self.epochs is None or epoch < self.epochs:
                following = self.segments(epoch + 1)
                for c in range(cursor, len(plan)):
                    ahead = [j for j, _ in (plan + following)[c:c + 1 + self.readahead]]   # into the next epoch
                    self.cache.prefetch(ahead)
                    j, rows = plan[c]
                    if not self._sound(j, len(rows)):
                        out.put(("damaged", epoch, c, len(plan), [], rows))
                        continue
                    out.put(("shard", epoch, c, len(plan), list(self.cache.iter_shard(j)), rows))
                epoch, cursor, plan = epoch + 1, 0, following
            out.put(("end",))
        except BaseException as e:  # surface reader errors in the trainer thread
            out.put(("error", e))

    def _sound(self, j, n_rows):
        """Checksum a shard before its first use: a damaged shard fails the run, or is skipped and its
        n_rows samples of this rank's span are counted."""
        if j in self._verified:
            return True
        info = self.cache.shards[j]
        try:
            self.cache.checked_path(j)
            self._verified.add(j)
            return True
        except ShardError as e:
            if not self.skip_damaged:
                raise ShardError(f"{e} ({info['num_samples']} samples). Run `kdcache verify {self.cache.directory}`; "
                                 "pass --skip-damaged-shards to train on the rest.") from e
        self.damaged[info["path"]] = n_rows          # this epoch's share of it
        return False

    def close(self):
        """Release the cache (its reader lease, downloaded shards). The stream cannot be read afterwards."""
        self.cache.close()

    def samples(self):
        """Yield (record, state after it) from the saved position onward."""
        st = self.state
        q = queue.Queue(maxsize=self.prefetch)
        threading.Thread(target=self._shard_loader, args=((st["epoch"], st["shard_cursor"]), q), daemon=True).start()
        first = True
        while True:
            item = q.get()
            if item[0] == "end":
                return
            if item[0] == "error":
                raise item[1]
            kind, epoch, c, n_plan, recs, rows = item
            if kind == "damaged":
                first = False
                continue
            start = st["row_cursor"] if first else 0
            first = False
            for r in range(start, len(rows)):
                nxt = {"epoch": epoch, "shard_cursor": c, "row_cursor": r + 1}
                if r + 1 == len(rows):
                    nxt = {"epoch": epoch + 1, "shard_cursor": 0, "row_cursor": 0} if c + 1 == n_plan \
                        else {"epoch": epoch, "shard_cursor": c + 1, "row_cursor": 0}
                yield recs[rows[r]], nxt

    def batches(self):
        """Yield (list of records, state after the batch): batch_size samples, or fewer under max_tokens."""
        for group in budget_groups(self.samples(), lambda item: len(item[0].input_ids), max_tokens=self.max_tokens,
                                   max_items=self.batch_size):
            yield [rec for rec, _ in group], group[-1][1]
