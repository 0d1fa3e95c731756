"""Streaming the cache into the trainer: deterministic order, rank split, prefetch, resumable position.

Order for (seed, epoch): the listed shards are permuted, shard i of that order
goes to rank i % world, and each shard's rows are permuted. A rank holds at
most `prefetch` decoded shards in memory, never the whole cache. The stream's
position (epoch, shard cursor, row cursor) after each batch is part of every
checkpoint, so a resumed run continues with exactly the next samples.
"""
import queue
import threading

import numpy as np
import torch

from cache_format import CacheError, ShardError, open_cache
from cache_format.reader import READ_AHEAD


class DataStateError(CacheError):
    pass


class CacheStream:
    def __init__(self, cache_dir, *, rank=0, world=1, seed=0, shuffle=True, batch_size=8, max_tokens=0,
                 prefetch=2, epochs=None, skip_damaged=False, track_use=False, readahead=READ_AHEAD):
        self.cache = open_cache(cache_dir, track_use=track_use)
        if self.cache.num_shards < world:
            self.cache.close()
            raise DataStateError(f"{cache_dir}: {self.cache.num_shards} shard(s) cannot feed {world} ranks; "
                                 "each rank reads whole shards. Precompute with a smaller --shard-size.")
        self.rank, self.world, self.seed, self.shuffle = rank, world, seed, shuffle
        self.batch_size, self.max_tokens, self.prefetch, self.epochs = batch_size, max_tokens, prefetch, epochs
        self.state = {"epoch": 0, "shard_cursor": 0, "row_cursor": 0}
        self.skip_damaged = skip_damaged
        self.readahead = readahead   # shards a remote cache downloads ahead of the decoder
        self.damaged = {}          # shard path -> samples skipped because its checksum failed
        self._verified = set()

    # -- the order -------------------------------------------------------------------
    def shards_for(self, epoch):
        """Positions (in the manifest's shard list) this rank reads in `epoch`, in order."""
        n = self.cache.num_shards
        order = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
        return [int(j) for j in order[self.rank::self.world]]

    def rows_for(self, epoch, j):
        n = self.cache.shards[j]["num_samples"]
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch, self.cache.shards[j]["index"]]).permutation(n)

    def samples_per_epoch(self):
        return sum(self.cache.shards[j]["num_samples"] for j in self.shards_for(0))

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
            while self.epochs is None or epoch < self.epochs:
                plan = self.shards_for(epoch)
                for c in range(cursor, len(plan)):
                    ahead = plan[c:c + 1 + self.readahead]
                    if c + 1 + self.readahead > len(plan):   # the next epoch's first shards
                        ahead += self.shards_for(epoch + 1)[:c + 1 + self.readahead - len(plan)]
                    self.cache.prefetch(ahead)
                    if not self._sound(plan[c]):
                        out.put(("damaged", epoch, c, len(plan), []))
                        continue
                    recs = list(self.cache.iter_shard(plan[c]))
                    out.put(("shard", epoch, c, len(plan), recs))
                epoch, cursor = epoch + 1, 0
            out.put(("end",))
        except BaseException as e:  # surface reader errors in the trainer thread
            out.put(("error", e))

    def _sound(self, j):
        """Checksum a shard before its first use: a damaged shard fails the run, or is skipped and counted."""
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
        self.damaged[info["path"]] = info["num_samples"]
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
            kind, epoch, c, n_plan, recs = item
            if kind == "damaged":
                first = False
                continue
            rows = self.rows_for(epoch, self.shards_for(epoch)[c])
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
        batch, longest, state = [], 0, None
        for rec, nxt in self.samples():
            n = len(rec.input_ids)
            if batch and (len(batch) == self.batch_size or
                          (self.max_tokens and max(longest, n) * (len(batch) + 1) > self.max_tokens)):
                yield batch, state
                batch, longest = [], 0
            batch.append(rec)
            longest = max(longest, n)
            state = nxt
        if batch:
            yield batch, state


def pack_rows(lengths, pack_len):
    """First-fit, in order: row index and start offset of each sample in rows of at most pack_len tokens."""
    rows, used = [], []
    for n in lengths:
        for r, u in enumerate(used):
            if u + n <= pack_len:
                rows.append((r, u))
                used[r] += n
                break
        else:
            rows.append((len(used), 0))
            used.append(n)
    return rows, used


def collate(records, *, pad_id, student_vocab, pack_len=0):
    """Batch cache records into model inputs and flat per-position teacher targets.

    Padding (pack_len=0): one sample per row, attention_mask marks real tokens. Packing (pack_len>0):
    samples share rows of up to pack_len tokens; position_ids restart at 0 for every sample and no
    attention_mask is passed, from which transformers builds a block-diagonal causal mask, so
    packed samples never attend to each other.
    Returns tensors: input_ids (R, T); attention_mask (R, T) or None; position_ids (R, T) or None;
    batch_index (row), positions (column), sample_index, targets (N,); topk_ids (N, k) with -1 where
    the teacher id lies outside the student's embedding; topk_logprobs (N, k); tail_mass (N,).
    """
    lengths = [len(r.input_ids) for r in records]
    if pack_len:
        place, used = pack_rows(lengths, pack_len)
        R, T = len(used), max(used)
    else:
        place, R, T = [(b, 0) for b in range(len(records))], len(records), max(lengths)
    ids = np.full((R, T), pad_id, dtype=np.int64)
    mask = np.zeros((R, T), dtype=np.int64)
    position_ids = np.tile(np.arange(T), (R, 1)) if pack_len else None
    for r, (row, off) in zip(records, place):
        n = len(r.input_ids)
        ids[row, off:off + n] = r.input_ids
        mask[row, off:off + n] = 1
        if pack_len:
            position_ids[row, off:off + n] = np.arange(n)
    if pack_len:   # the padding after the last sample of a row is a segment of its own
        for row, u in enumerate(used):
            position_ids[row, u:] = np.arange(T - u)
    if ids.max() >= student_vocab:
        raise DataStateError(f"sample {records[int(np.argmax(ids.max(1)))].sample_id} holds token id {ids.max()} "
                             f"but the student has {student_vocab} embeddings: the tokenizers differ")
    bidx = np.concatenate([np.full(len(r.positions), row) for r, (row, _) in zip(records, place)])
    pos = np.concatenate([r.positions.astype(np.int64) + off for r, (_, off) in zip(records, place)])
    sidx = np.concatenate([np.full(len(r.positions), i) for i, r in enumerate(records)])
    tid = np.concatenate([r.topk_ids for r in records]).astype(np.int64)
    tlp = np.concatenate([r.topk_logprobs for r in records]).astype(np.float32)
    tail = np.concatenate([r.tail_mass for r in records]).astype(np.float32)
    # Explicit rule for padded vocabularies (e.g. 152064 teacher rows vs 151936 student rows): teacher ids
    # the student cannot represent leave the support and their mass joins the tail bucket.
    outside = tid >= student_vocab
    n_outside = int(outside.sum())
    if n_outside:
        tail = np.clip(tail + np.where(outside, np.exp(tlp), 0.0).sum(1), 0.0, 1.0).astype(np.float32)
        tid = np.where(outside, -1, tid)
    return {
        "input_ids": torch.from_numpy(ids),
        "attention_mask": None if pack_len else torch.from_numpy(mask),
        "position_ids": None if position_ids is None else torch.from_numpy(position_ids),
        "batch_index": torch.from_numpy(bidx.astype(np.int64)), "positions": torch.from_numpy(pos),
        "sample_index": torch.from_numpy(sidx.astype(np.int64)),
        "targets": torch.from_numpy(ids[bidx, pos + 1]),
        "topk_ids": torch.from_numpy(tid), "topk_logprobs": torch.from_numpy(tlp), "tail_mass": torch.from_numpy(tail),
        "n_positions": len(pos), "n_tokens": int(mask.sum()), "n_outside_vocab": n_outside,
        "sample_ids": [r.sample_id for r in records], "truncated": [r.truncated for r in records],
    }
