"""Format 2's logical layout, shared by both backends: records <-> flat columns (SPEC.md section 4).

Every shard holds the same columns, flat and CSR-indexed per sample:
  per sample    sample_id int64, truncated bool
  per token     input_ids int32                       (sample i: token_offsets[i]:token_offsets[i+1])
  per position  positions int32, topk_counts uint16, tail_mass float32, target_logprobs float32 (NaN unknown),
                behavior_logprobs float32 (optional: only in shards whose records carry it)
  per entry     topk_ids (uint16, or int32 where an id exceeds 65535), topk_values: topk_counts[p] entries per
                position; float16/float32: ids and log-probs in rank order; sqrt8: see compact.py
                sample_counts uint8 (format 3, a sampled cache only): draws per entry, 0 for exact entries; the
                entries then come in ascending id order, ids as steps, whatever the log-prob coding
  teacher view  (optional, only in shards where a record carries one: privileged context, SPEC.md 4.5)
                teacher_input_ids int32 per teacher token (sample i: teacher_token_offsets[i]:[i+1]; empty for
                a sample whose teacher saw input_ids), teacher_positions int32 per position (-1 there)
Encoding and decoding are vectorised over a whole block of samples: no per-position Python loop.
"""
from dataclasses import dataclass

import numpy as np

from . import compact, values
from .record import Record


@dataclass
class Columns:
    """A block of samples, flat. *_offsets are int64 [n + 1], starting at 0."""
    sample_id: np.ndarray
    truncated: np.ndarray
    token_offsets: np.ndarray
    input_ids: np.ndarray
    position_offsets: np.ndarray
    positions: np.ndarray
    topk_counts: np.ndarray
    tail_mass: np.ndarray
    target_logprobs: np.ndarray
    topk_ids: np.ndarray
    topk_values: np.ndarray
    behavior_logprobs: np.ndarray | None = None     # None: the shard has no such column
    sample_counts: np.ndarray | None = None         # per entry; None: not a sampled shard
    teacher_token_offsets: np.ndarray | None = None  # the teacher view (all three, or None: the shard has none)
    teacher_input_ids: np.ndarray | None = None
    teacher_positions: np.ndarray | None = None

    @property
    def entry_offsets(self):
        """int64 [n + 1]: sample i's entries are topk_ids[entry_offsets[i]:entry_offsets[i+1]]."""
        ends = np.concatenate([[0], np.cumsum(self.topk_counts, dtype=np.int64)])
        return ends[self.position_offsets]


PER_SAMPLE = ("sample_id", "truncated")
PER_TOKEN = ("input_ids",)
PER_POSITION = ("positions", "topk_counts", "tail_mass", "target_logprobs")
OPTIONAL = ("behavior_logprobs", "teacher_positions")   # per position, written only where the records carry it
TEACHER = ("teacher_input_ids",)        # per teacher token, with the shard's teacher view
PER_ENTRY = ("topk_ids", "topk_values")
SAMPLED = ("sample_counts",)            # per entry, in sampled shards only (format 3)


def offsets(lengths):
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


def _cat(parts, dtype, empty_shape=(0,)):
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(empty_shape, dtype)


def encode(records, *, top_k, logprob_dtype, id_dtype=None, sample=0) -> Columns:
    """Checked records (dense [P, k] rows, -1 ids past a row's count) -> Columns. id_dtype: of topk_ids
    (default compact.id_dtype_of(records); a backend writing a shard in parts passes the shard's). sample: a
    sampled cache's draws per position (rows are then top_k + sample wide, with their sample_counts)."""
    width = top_k + sample
    ids = _cat([r.topk_ids for r in records], np.int32, (0, width))
    lps = _cat([r.topk_logprobs for r in records], np.float32, (0, width))
    counts = (ids >= 0).sum(axis=1)
    draws = _cat([r.sample_counts for r in records], np.uint8, (0, width)) if sample else None
    tid, tval, draws = compact.pack_entries(ids, lps, counts, logprob_dtype,
                                            id_dtype or compact.id_dtype_of(records), by_id=bool(sample),
                                            extra=draws)
    nan = np.float32(np.nan)
    return Columns(
        sample_id=np.array([r.sample_id for r in records], dtype=np.int64),
        truncated=np.array([r.truncated for r in records], dtype=np.bool_),
        token_offsets=offsets([len(r.input_ids) for r in records]),
        input_ids=_cat([r.input_ids for r in records], np.int32),
        position_offsets=offsets([len(r.positions) for r in records]),
        positions=_cat([r.positions for r in records], np.int32),
        topk_counts=counts.astype(np.uint16),
        tail_mass=_cat([r.tail_mass for r in records], np.float32),
        target_logprobs=_cat([np.full(len(r.positions), nan) if r.target_logprobs is None else r.target_logprobs
                              for r in records], np.float32),
        topk_ids=tid, topk_values=tval, sample_counts=draws,
        behavior_logprobs=_cat([np.full(len(r.positions), nan) if r.behavior_logprobs is None else
                                r.behavior_logprobs for r in records], np.float32)
        if any(r.behavior_logprobs is not None for r in records) else None,
        **_teacher_columns(records))


def _teacher_columns(records) -> dict:
    """The teacher view's columns of a block ({} where no record has one): a record without one gets no teacher
    tokens and teacher_positions -1 (its teacher saw input_ids)."""
    if all(r.teacher_input_ids is None for r in records):
        return {}
    none = np.zeros(0, np.int32)
    return dict(
        teacher_token_offsets=offsets([0 if r.teacher_input_ids is None else len(r.teacher_input_ids)
                                       for r in records]),
        teacher_input_ids=_cat([none if r.teacher_input_ids is None else r.teacher_input_ids for r in records],
                               np.int32),
        teacher_positions=_cat([np.full(len(r.positions), -1) if r.teacher_positions is None else
                                r.teacher_positions for r in records], np.int32))


def check_columns(c: Columns, where: str, list_offsets: dict | None = None):
    """Refuse a block whose column lengths disagree (SPEC.md section 4: every per-sample, per-token, per-position and
    per-entry column has as many values as its offsets say), naming `where` (the shard) and every disagreement,
    before any record is cut from it. list_offsets: {column: int64 [n + 1]}, the offsets a list column (Arrow)
    carries of its own, each held to its kind's offsets. Vectorised: a few comparisons per column."""
    n, bad = len(c.sample_id), []

    def sized(name, values, want, unit):
        if values is not None and len(values) != want:
            bad.append(f"{name} has {len(values)} values for {want} {unit}")

    sized("truncated", c.truncated, n, "samples")
    for name, off, col in (("input_ids", c.token_offsets, c.input_ids), ("positions", c.position_offsets,
                                                                           c.positions)):
        if len(off) != n + 1 or (len(off) and (off[0] != 0 or off[-1] != len(col) or (np.diff(off) < 0).any())):
            bad.append(f"{name}: offsets {len(off)} long, ending at {off[-1] if len(off) else None}, for {n} samples "
                       f"and {len(col)} values")
    if (c.teacher_input_ids is None) != (c.teacher_positions is None):
        bad.append("teacher_input_ids and teacher_positions come together or not at all")
    elif c.teacher_input_ids is not None:
        off, col = c.teacher_token_offsets, c.teacher_input_ids
        if off is None or len(off) != n + 1 or (len(off) and (off[0] != 0 or off[-1] != len(col)
                                                              or (np.diff(off) < 0).any())):
            bad.append(f"teacher_input_ids: offsets of {None if off is None else len(off)} for {n} samples and "
                       f"{len(col)} values")
    P = len(c.positions)
    for name in PER_POSITION + OPTIONAL:
        sized(name, getattr(c, name), P, "positions")
    if len(c.topk_counts) == P:
        E = int(np.sum(c.topk_counts, dtype=np.int64))
        for name in PER_ENTRY + SAMPLED:
            sized(name, getattr(c, name), E, "entries (the sum of topk_counts)")
        if not bad and list_offsets:
            kinds = {**{k: c.position_offsets for k in PER_POSITION + OPTIONAL},
                     **{k: c.entry_offsets for k in PER_ENTRY + SAMPLED}}
            bad += [f"{name}: its per-sample offsets differ from those of its kind (a sample's values shifted into "
                    "another's)" for name, off in list_offsets.items()
                    if name in kinds and not np.array_equal(off, kinds[name])]
    if bad:
        from .errors import ShardError
        raise ShardError(f"{where}: column lengths disagree: {'; '.join(bad)}")


class Decoded:
    """A decoded block: record(i) for its i-th sample, views into dense padded [P, k] arrays."""

    def __init__(self, cols: Columns, *, top_k, logprob_dtype, sample=0, where="shard", list_offsets=None,
                 rules: values.Rules | None = None):
        """rules: the manifest's (values.Rules.of); the block's values are checked against them before any record
        is cut (ShardError naming `where`, the sample and the position). None: lengths are checked, values not."""
        check_columns(cols, where, list_offsets)
        values.check_counts_fit(cols, top_k + sample, where)
        self.cols = cols
        self.ids, self.lps, self.draws = compact.unpack_entries(
            cols.topk_counts, cols.topk_ids, cols.topk_values, logprob_dtype, top_k + sample, by_id=bool(sample),
            extra=None if cols.sample_counts is None else cols.sample_counts.astype(np.int32))
        if rules is not None:
            values.check_block(cols, self.ids, self.lps, self.draws, logprob_dtype, rules, where)
        self.has_target = not np.isnan(cols.target_logprobs).all()

    def __len__(self):
        return len(self.cols.sample_id)

    def record(self, i):
        c = self.cols
        t0, t1, p0, p1 = c.token_offsets[i], c.token_offsets[i + 1], c.position_offsets[i], c.position_offsets[i + 1]
        t_ids = t_pos = None
        if c.teacher_input_ids is not None and c.teacher_token_offsets[i + 1] > c.teacher_token_offsets[i]:
            t_ids = c.teacher_input_ids[c.teacher_token_offsets[i]:c.teacher_token_offsets[i + 1]]
            t_pos = c.teacher_positions[p0:p1]
        return Record(int(c.sample_id[i]), c.input_ids[t0:t1], c.positions[p0:p1], self.ids[p0:p1],
                      self.lps[p0:p1], c.tail_mass[p0:p1], bool(c.truncated[i]),
                      c.target_logprobs[p0:p1] if self.has_target else None,
                      None if c.behavior_logprobs is None else c.behavior_logprobs[p0:p1],
                      None if self.draws is None else self.draws[p0:p1], t_ids, t_pos)
