"""Cache records -> one micro-batch: model inputs plus flat per-position teacher targets.

Shapes: R rows of T tokens; N trained positions in the batch; k teacher entries per position.
"""
from dataclasses import dataclass, fields

import numpy as np
import torch

from kdcache.common.errors import TrainDataError


@dataclass
class Batch:
    input_ids: torch.Tensor              # int64 (R, T)
    attention_mask: torch.Tensor | None  # int64 (R, T), 1 on real tokens; None when packed
    position_ids: torch.Tensor | None    # int64 (R, T), restarting at 0 per packed sample; None when padded
    batch_index: torch.Tensor            # int64 (N,) row of each trained position
    positions: torch.Tensor              # int64 (N,) column of each trained position
    sample_index: torch.Tensor           # int64 (N,) which record (0..B-1) each position belongs to
    targets: torch.Tensor                # int64 (N,) the token each position predicts
    topk_ids: torch.Tensor               # int64 (N, k) or (N, k + 1) with the target column (see with_target);
                                         # -1 = no entry (ragged rows, ids outside the student's vocab)
    topk_logprobs: torch.Tensor          # float32 (N, k) or (N, k + 1)
    tail_mass: torch.Tensor              # float32 (N,)
    n_tokens: int                        # real (unpadded) tokens
    n_outside_vocab: int                 # teacher entries moved to the tail bucket (see collate)
    sample_ids: list                     # [int] per record
    truncated: list                      # [bool] per record
    stream_state: dict | None = None     # records from kdcache.CacheDataset: where its stream stands after this
    #                                      batch (CacheDataset.mark_trained takes it); None otherwise
    target_logprobs: torch.Tensor | None = None    # float32 (N,) the teacher's log-prob of each target, NaN unknown
    behavior_logprobs: torch.Tensor | None = None  # float32 (N,) the log-prob each target was sampled with (generate
    #                                                mode with --generator), NaN unknown; None when no record has it
    topk_weights: torch.Tensor | None = None       # float32 (N, k) a sampled cache's estimator weights per entry
    #                                                (sampled_weights); None for a top-k cache
    position_kinds: torch.Tensor | None = None     # int64 (N,) --cross-tokenizer: each position's kind (train/cross.py
    #                                                KINDS); None otherwise
    objective: str | None = None                   # what this micro-batch trains ("gkd", "token-rkl"), set by the
    #                                                trainer where a run's caches differ; None: the run's objective

    @property
    def n_positions(self):
        return int(self.positions.shape[0])

    def to(self, device):
        """The batch with every tensor on `device`."""
        return Batch(**{k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
                        for k, v in self.as_dict().items()})

    def as_dict(self):
        """The fields as a plain dict (no copies), for loops that want a mapping (Hugging Face Trainer,
        Accelerate); Batch(**d) rebuilds the batch."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


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


def _layout(records, pad_id, pack_len):
    """(ids, mask, position_ids or None, place): the token grid and each record's (row, offset)."""
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
    return ids, mask, position_ids, place


def with_target(tid, tlp, tail, targets, target_lp):
    """One more column: the target token where the cache knows its teacher log-prob and it is not among the
    stored entries. Its mass leaves the tail bucket, so the loss's tail term is exact for the true token.
    Arrays [N, k], [N, k], [N], [N], [N] -> [N, k + 1], [N, k + 1], [N]."""
    add = np.isfinite(target_lp) & ~(tid == targets[:, None]).any(axis=1)
    p = np.where(add, np.exp(np.where(add, target_lp, 0.0)), 0.0)
    col_id = np.where(add, targets, -1)[:, None]
    col_lp = np.where(add, target_lp, -np.inf).astype(np.float32)[:, None]
    return (np.concatenate([tid, col_id], axis=1), np.concatenate([tlp, col_lp], axis=1),
            np.clip(tail - p, 0.0, 1.0).astype(np.float32))


def sampled_weights(tid, tlp, tail, counts):
    """A sampled cache's teacher mass per entry for the loss's estimator (train/losses.py sampled_kl_per_position):
    p for an exact entry (count 0), tail_mass * count / draws for a drawn id (the draws were taken from the mass
    outside the exact entries), 0 for an unused slot. Arrays [N, k], [N, k], [N], [N, k] -> float32 [N, k]; each
    row sums to 1 (up to rounding)."""
    counts = counts.astype(np.float64)
    draws = np.maximum(counts.sum(axis=1, keepdims=True), 1.0)
    exact = np.exp(np.where((tid >= 0) & (counts == 0), tlp.astype(np.float64), -np.inf))
    return np.where(counts > 0, tail[:, None].astype(np.float64) * counts / draws, exact).astype(np.float32)


def collate(records, *, pad_id, student_vocab, pack_len=0) -> Batch:
    """Batch cache records.

    Padding (pack_len=0): one sample per row, attention_mask marks real tokens. Packing (pack_len>0):
    samples share rows of up to pack_len tokens; position_ids restart at 0 for every sample and no
    attention_mask is passed, from which transformers builds a block-diagonal causal mask, so
    packed samples never attend to each other.
    """
    ids, mask, position_ids, place = _layout(records, pad_id, pack_len)
    if ids.max() >= student_vocab:
        raise TrainDataError(f"sample {records[int(np.argmax(ids.max(1)))].sample_id} holds token id {ids.max()} "
                             f"but the student has {student_vocab} embeddings: the tokenizers differ")
    bidx = np.concatenate([np.full(len(r.positions), row) for r, (row, _) in zip(records, place)])
    pos = np.concatenate([r.positions.astype(np.int64) + off for r, (_, off) in zip(records, place)])
    sidx = np.concatenate([np.full(len(r.positions), i) for i, r in enumerate(records)])
    tid = np.concatenate([r.topk_ids for r in records]).astype(np.int64)
    tlp = np.concatenate([r.topk_logprobs for r in records]).astype(np.float32)
    tail = np.concatenate([r.tail_mass for r in records]).astype(np.float32)
    targets = ids[bidx, pos + 1]
    target_lp = _per_position(records, "target_logprobs")
    sampled = [r.sample_counts is not None for r in records]
    if any(sampled) and not all(sampled):
        raise TrainDataError("a batch mixes records of a sampled cache (--sample) with top-k records: their losses "
                             "differ, so one batch cannot hold both")
    weights = sampled_weights(tid, tlp, tail, np.concatenate([r.sample_counts for r in records])) \
        if records and all(sampled) else None
    if target_lp is not None and weights is None:     # a sampled row's estimator needs no target column
        tid, tlp, tail = with_target(tid, tlp, tail, targets, target_lp)
    behavior_lp = _per_position(records, "behavior_logprobs")
    # Explicit rule for padded vocabularies (e.g. 152064 teacher rows vs 151936 student rows): teacher ids
    # the student cannot represent leave the support and their mass joins the tail bucket.
    outside = tid >= student_vocab
    n_outside = int(outside.sum())
    if n_outside:
        tail = np.clip(tail + np.where(outside, np.exp(tlp), 0.0).sum(1), 0.0, 1.0).astype(np.float32)
        tid = np.where(outside, -1, tid)
        if weights is not None:           # a sampled row loses that mass: the student has no such id to learn
            weights = np.where(outside, 0.0, weights).astype(np.float32)
    as_t = torch.from_numpy
    return Batch(
        input_ids=as_t(ids), attention_mask=None if pack_len else as_t(mask),
        position_ids=None if position_ids is None else as_t(position_ids),
        batch_index=as_t(bidx.astype(np.int64)), positions=as_t(pos), sample_index=as_t(sidx.astype(np.int64)),
        targets=as_t(targets), topk_ids=as_t(tid), topk_logprobs=as_t(tlp), tail_mass=as_t(tail),
        n_tokens=int(mask.sum()), n_outside_vocab=n_outside,
        sample_ids=[r.sample_id for r in records], truncated=[r.truncated for r in records],
        stream_state=getattr(records[-1], "stream_state", None) if records else None,
        target_logprobs=None if target_lp is None else as_t(target_lp),
        behavior_logprobs=None if behavior_lp is None else as_t(behavior_lp),
        topk_weights=None if weights is None else as_t(weights),
        position_kinds=None if any(getattr(r, "position_kinds", None) is None for r in records) or not records
        else as_t(np.concatenate([r.position_kinds for r in records]).astype(np.int64)))


def _per_position(records, name):
    """float32 [N] of an optional per-position column over the records, NaN where a record lacks it; None when
    none has it."""
    if all(getattr(r, name, None) is None for r in records):
        return None
    return np.concatenate([np.full(len(r.positions), np.nan, np.float32) if getattr(r, name, None) is None
                           else np.asarray(getattr(r, name), np.float32) for r in records])
