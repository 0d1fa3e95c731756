"""The per-sample record every backend stores, and the checks a writer applies."""
from dataclasses import dataclass

import numpy as np

from .errors import RecordError
from .values import MAX_EXCESS_MASS, TARGET_TOL, exact_figures, target_violations

# A teacher log-prob of -inf (a masked or impossible token in the top-k, e.g. a padded vocabulary row) is
# stored as this finite floor: exp(-1000) is 0 in every float type, and float16 holds it exactly.
LOGPROB_FLOOR = -1000.0


@dataclass
class Record:
    """One sample of a logit cache.

    T tokens, P trained positions, k = top_k.
      sample_id      int     stable id: the record's index in the source dataset
      input_ids      int32 [T]     exact token ids the teacher scored, template included
      positions      int32 [P]     t such that input_ids[t+1] is a trained target; strictly increasing
      topk_ids       int32 [P, k]  teacher's top-k next-token ids at each position. Read from a cache with
                                   ragged rows (--top-p, format 2), a row's unused slots hold id -1
      topk_logprobs  float32 [P, k] their log-probabilities (full-vocabulary softmax), descending; -inf in
                                   unused slots. A sqrt8 cache reads back each row in ascending id order
                                   instead (its stored order; the losses need no order)
      tail_mass      float32 [P]   1 - sum(exp(stored log-probs)) at full precision: the mass outside the stored
                                   entries; None when handed to a writer: check_record derives it (the one place)
      truncated      bool          the sample was cut at max_length (its end-of-turn may be missing)
      target_logprobs float32 [P]  the teacher's log-prob of the target input_ids[t+1] itself, at any rank;
                                   None where unknown (format 1 caches, writers that lack it), NaN for a
                                   position where unknown
      behavior_logprobs float32 [P]  generate mode: the log-prob the generator sampled the target with (its
                                   distribution at the sampling temperature, after top-p; 0 for greedy decoding),
                                   for importance weights; None in caches without it
      sample_counts  int32 [P, k]  a sampled cache (--sample N, format 3): how many of the position's N draws gave
                                   each entry's id; 0 for the exact top entries (and unused slots). Then k is the
                                   exact top-k plus N, tail_mass the mass outside the exact entries (what the
                                   draws were taken from), and the entries come in any order. None otherwise
      teacher_input_ids int32 [U]  privileged context: the token ids the teacher scored (its own rendering, e.g.
                                   with a hint), where they differ from input_ids; None: the teacher saw input_ids
      teacher_positions int32 [P]  with teacher_input_ids: the teacher position whose next-token scores position p
                                   holds; teacher_input_ids[teacher_positions + 1] == input_ids[positions + 1]
                                   (the same trained tokens, in the same order)
      position_kinds int8 [P]      never stored: a record derived for a student of another tokenizer
                                   (--cross-tokenizer, train/cross.py) names each position's kind there
    """
    sample_id: int
    input_ids: np.ndarray
    positions: np.ndarray
    topk_ids: np.ndarray
    topk_logprobs: np.ndarray
    tail_mass: np.ndarray | None = None
    truncated: bool = False
    target_logprobs: np.ndarray | None = None
    behavior_logprobs: np.ndarray | None = None
    sample_counts: np.ndarray | None = None
    teacher_input_ids: np.ndarray | None = None
    teacher_positions: np.ndarray | None = None
    position_kinds: np.ndarray | None = None

    @property
    def targets(self):
        """int32 [P]: the token each position predicts, input_ids[positions + 1]."""
        return self.input_ids[self.positions + 1]

    @property
    def topk_counts(self):
        """int32 [P]: how many entries of each row are stored (k unless the cache is ragged)."""
        return (self.topk_ids >= 0).sum(axis=1, dtype=np.int32)


def span_positions(spans) -> np.ndarray:
    """int32 [P]: the positions that train the target spans [(a, b), ...] of token indices.

    The rule of the whole format: target j (the token input_ids[j]) is trained at position j-1, and
    token 0 has no position. A completion's span runs from its first token through its end-of-turn
    token, so the position that predicts end-of-turn is always in.
    """
    parts = [np.arange(max(a, 1) - 1, b - 1, dtype=np.int32) for a, b in spans]
    return np.concatenate(parts) if parts else np.zeros(0, np.int32)


def lacks_end_of_turn(targets, truncated, eos_token_ids) -> bool:
    """True if a sample that was not truncated has no trained position predicting an end-of-turn token:
    a student trained on it would not learn to stop (rule 1)."""
    return not truncated and not np.isin(np.asarray(targets), list(eos_token_ids)).any()


def check_record(rec: Record, top_k: int, vocab_size: int, ranked: bool = True, ragged: bool = False,
                 mass_tol: float | None = MAX_EXCESS_MASS, sample: int = 0, _exact=None) -> Record:
    """Coerce dtypes, derive a missing tail_mass, check shapes and invariants; raise RecordError naming the sample.

    The one rule for every teacher backend and for verify: ids in [0, vocab_size) and unique within a row, -1
    (an unused slot) only in a ragged cache (ragged: its manifest's top_p is set), log-probs finite and <= 0
    whose probabilities sum to at most 1 + mass_tol (None: not checked here; verify checks stored rows with the
    rounding of their dtype). ranked: entries must be in descending log-prob order (what writers take; a sqrt8
    cache reads back by id). sample: a sampled cache's draws per position (0: not sampled); top_k is then the
    row width, the exact top entries plus `sample`, and the rows are ragged and unranked.

    The target rule (with mass_tol set): a known target log-prob whose target is not among the exact entries must
    not exceed the smallest exact log-prob (+ values.TARGET_TOL), and the exact entries' mass plus its probability
    must not exceed 1 + mass_tol; a given tail_mass plus the exact entries' mass must be 1 within mass_tol.
    _exact: bool [P, top_k], the exact entries (a sampled row's are not all of its entries; default: every used
    slot)."""
    if sample:
        return _check_sampled(rec, top_k, vocab_size, mass_tol, sample)
    sid = rec.sample_id
    ids = np.ascontiguousarray(rec.input_ids, dtype=np.int32)
    pos = np.ascontiguousarray(rec.positions, dtype=np.int32)
    tid = np.ascontiguousarray(rec.topk_ids, dtype=np.int32)
    tlp = np.ascontiguousarray(rec.topk_logprobs, dtype=np.float32)
    used = tid >= 0                                   # a ragged row's unused slots (id -1) come last
    tlp = np.where(used & np.isneginf(tlp), np.float32(LOGPROB_FLOOR), tlp)   # impossible tokens: the floor
    tail = tail_mass_from_logprobs(np.where(used, tlp, -np.inf)) if rec.tail_mass is None else \
        np.ascontiguousarray(rec.tail_mass, dtype=np.float32)
    target = None if rec.target_logprobs is None else np.ascontiguousarray(rec.target_logprobs, dtype=np.float32)
    behavior = None if rec.behavior_logprobs is None else \
        np.ascontiguousarray(rec.behavior_logprobs, dtype=np.float32)
    T, P = ids.shape[0] if ids.ndim == 1 else -1, pos.shape[0] if pos.ndim == 1 else -1

    def bad(msg):
        raise RecordError(f"sample {sid}: {msg}")

    if T < 2:
        bad(f"input_ids must be 1-D with at least 2 tokens, got shape {rec.input_ids.shape}")
    if P < 1:
        bad(f"positions must be 1-D and non-empty, got shape {np.shape(rec.positions)}")
    if tid.shape != (P, top_k) or tlp.shape != (P, top_k):
        bad(f"topk_ids/topk_logprobs must be [{P}, {top_k}], got {tid.shape} and {tlp.shape}")
    if tail.shape != (P,):
        bad(f"tail_mass must be [{P}], got {tail.shape}")
    if pos[0] < 0 or pos[-1] > T - 2 or (P > 1 and np.any(np.diff(pos) <= 0)):
        bad(f"positions must be strictly increasing within [0, {T - 2}]")
    if top_k == 0 and (rec.target_logprobs is None or not np.isfinite(rec.target_logprobs).all()):
        bad("a cache with top_k 0 stores only the target log-probs: every position needs one")
    if top_k and (not used[:, 0].all() or (top_k > 1 and np.any(used[:, 1:] & ~used[:, :-1])) or np.any(tid < -1)):
        bad("every position needs at least one top-k entry, and only trailing slots may be unused (id -1)")
    if not ragged and not used.all():
        p = int(np.flatnonzero(~used.all(axis=1))[0])
        bad(f"position {pos[p]} has an unused slot (id -1), but this cache keeps all {top_k} entries (no top_p)")
    if top_k > 1:
        srt = np.sort(tid, axis=1)
        dup = (srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)
        if dup.any():
            p = int(np.flatnonzero(dup.any(axis=1))[0])
            bad(f"position {pos[p]} lists token id {int(srt[p, 1:][dup[p]][0])} twice in its top-{top_k}")
    if ids.min() < 0 or ids.max() >= vocab_size or (top_k and tid.max() >= vocab_size):
        bad(f"token ids must lie in [0, {vocab_size})")
    if top_k and (not np.all(np.isfinite(tlp[used])) or tlp[used].max() > 1e-4):
        bad("topk_logprobs must be finite and <= 0")
    mass = np.exp(np.where(used, tlp, -np.inf).astype(np.float64)).sum(axis=1)
    if mass_tol is not None and mass.max() > 1 + mass_tol:
        p = int(np.argmax(mass))
        bad(f"position {pos[p]}: its top-{top_k} probabilities sum to {mass[p]:.6f}, more than 1 (+{mass_tol:g}): "
            "not log-probs of one distribution")
    with np.errstate(invalid="ignore"):               # -inf - -inf in unused slots, masked out below
        steps = np.diff(tlp, axis=1)
    if ranked and top_k > 1 and np.any(steps[used[:, 1:]] > 1e-6):
        bad("topk_logprobs must be sorted descending along k")
    if not np.all(np.isfinite(tail)) or tail.min() < -1e-4 or tail.max() > 1 + 1e-4:
        bad("tail_mass must lie in [0, 1]")
    target = _per_position_logprobs("target_logprobs", target, P, bad)
    behavior = _per_position_logprobs("behavior_logprobs", behavior, P, bad)
    if mass_tol is not None:
        _check_target_and_tail(ids[pos + 1], pos, tid, tlp, used if _exact is None else _exact, target,
                               None if rec.tail_mass is None else tail, mass_tol, bad)
    t_ids, t_pos = _teacher_view(rec, ids, pos, vocab_size, bad)
    return Record(int(sid), ids, pos, tid, tlp, np.clip(tail, 0.0, 1.0), bool(rec.truncated), target, behavior,
                  teacher_input_ids=t_ids, teacher_positions=t_pos)


def _teacher_view(rec, ids, pos, vocab_size, bad):
    """(teacher_input_ids, teacher_positions), checked, or (None, None): both or neither; the teacher's positions
    strictly increasing inside its ids, each followed by the same token as the student's position (token-equal)."""
    if rec.teacher_input_ids is None and rec.teacher_positions is None:
        return None, None
    if rec.teacher_input_ids is None or rec.teacher_positions is None:
        bad("teacher_input_ids and teacher_positions come together (a teacher view) or not at all")
    t_ids = np.ascontiguousarray(rec.teacher_input_ids, dtype=np.int32)
    t_pos = np.ascontiguousarray(rec.teacher_positions, dtype=np.int32)
    U = t_ids.shape[0] if t_ids.ndim == 1 else -1
    if U < 2 or t_ids.min() < 0 or t_ids.max() >= vocab_size:
        bad(f"teacher_input_ids must be 1-D, at least 2 ids, each in [0, {vocab_size})")
    if t_pos.shape != pos.shape:
        bad(f"teacher_positions must be [{len(pos)}] like positions, got {t_pos.shape}")
    if t_pos[0] < 0 or t_pos[-1] > U - 2 or (len(t_pos) > 1 and np.any(np.diff(t_pos) <= 0)):
        bad(f"teacher_positions must be strictly increasing within [0, {U - 2}]")
    differ = np.flatnonzero(t_ids[t_pos + 1] != ids[pos + 1])
    if len(differ):
        p = int(differ[0])
        bad(f"position {pos[p]} trains token {int(ids[pos[p] + 1])}, but its teacher position {t_pos[p]} is "
            f"followed by {int(t_ids[t_pos[p] + 1])}: the teacher must score the same tokens ({len(differ)} differ)")
    return t_ids, t_pos


def _check_sampled(rec, width, vocab_size, mass_tol, sample):
    """check_record for a sampled cache: the common checks on ragged, unranked rows, then the draws. The exact
    entries (count 0) number width - sample on every row; the counts of the drawn ones sum to `sample`; tail_mass
    is the mass outside the exact entries (derived from them when not given)."""
    tid = np.asarray(rec.topk_ids)
    counts = None if rec.sample_counts is None else np.asarray(rec.sample_counts)

    def bad(msg):
        raise RecordError(f"sample {rec.sample_id}: {msg}")

    if counts is None or counts.shape != tid.shape:
        bad(f"a sampled cache needs sample_counts shaped like topk_ids {tid.shape}, got "
            f"{None if counts is None else counts.shape}")
    counts = counts.astype(np.int32)
    exact = (tid >= 0) & (counts == 0)
    tail = rec.tail_mass
    if tail is None:
        lp = np.asarray(rec.topk_logprobs, np.float32)
        tail = tail_mass_from_logprobs(np.where(exact, np.maximum(lp, LOGPROB_FLOOR), -np.inf))
    out = check_record(Record(rec.sample_id, rec.input_ids, rec.positions, tid, rec.topk_logprobs, tail,
                              rec.truncated, rec.target_logprobs, rec.behavior_logprobs,
                              teacher_input_ids=rec.teacher_input_ids, teacher_positions=rec.teacher_positions),
                       width, vocab_size, ranked=False, ragged=True, mass_tol=mass_tol,
                       _exact=exact)
    used = out.topk_ids >= 0
    wrong = (counts < 0).any(axis=1) | (np.where(used, 0, counts) != 0).any(axis=1) | (counts.sum(axis=1) != sample)
    if wrong.any():
        bad(f"position {out.positions[int(np.flatnonzero(wrong)[0])]}: its draw counts must be >= 0, 0 in unused "
            f"slots, and sum to the {sample} draws")
    if np.any(exact.sum(axis=1) != width - sample):
        bad(f"every position needs exactly {width - sample} exact (count 0) entries")
    out.sample_counts = counts
    return out


def _check_target_and_tail(targets, pos, tid, tlp, exact, target, tail, mass_tol, bad):
    """check_record's target rule (values.target_violations, exact log-probs: no storage rounding) and, where the
    caller gave tail_mass, exact mass + tail = 1 within mass_tol."""
    if tail is not None:
        mass = np.exp(np.where(exact, tlp, -np.inf).astype(np.float64)).sum(axis=1) + tail
        off = np.abs(mass - 1) > mass_tol
        if off.any():
            p = int(np.flatnonzero(off)[0])
            bad(f"position {pos[p]}: the mass of its {int(exact[p].sum())} top entries plus tail_mass is "
                f"{mass[p]:.6f}, not 1 (+-{mass_tol:g})")
    if target is None:
        return
    among, kth, exact_mass = exact_figures(tid, np.where(exact, tlp, -np.inf), targets)
    above, over, mass = target_violations(among, kth, exact_mass, target, upper=lambda lp: lp,
                                          mass_limit=1 + mass_tol)
    if above.any():
        p = int(np.flatnonzero(above)[0])
        bad(f"position {pos[p]}: target id {int(targets[p])} is not among its {int(exact[p].sum())} top entries, "
            f"yet its target_logprobs {float(target[p]):.6g} exceeds the k-th (smallest) one {float(kth[p]):.6g} "
            f"(+{TARGET_TOL:g}): a teacher that ranks it outside them cannot give it more")
    if over.any():
        p = int(np.flatnonzero(over)[0])
        bad(f"position {pos[p]}: the mass of its {int(exact[p].sum())} top entries plus the probability of target "
            f"id {int(targets[p])}, outside them, is {mass[p]:.6f}, more than 1 (+{mass_tol:g})")


def _per_position_logprobs(name, values, P, bad):
    """An optional float32 [P] log-prob column, checked: <= 0 or NaN (unknown), -inf stored as the floor."""
    if values is None:
        return None
    if values.shape != (P,):
        bad(f"{name} must be [{P}], got {values.shape}")
    values = np.where(np.isneginf(values), np.float32(LOGPROB_FLOOR), values)
    if np.nanmax(values, initial=-np.inf) > 1e-4:
        bad(f"{name} must be <= 0 (NaN where unknown)")
    return values


def tail_mass_from_logprobs(topk_logprobs) -> np.ndarray:
    """float32 [P]: mass outside the top-k, from full-precision log-probs (float64 sum)."""
    s = np.exp(np.asarray(topk_logprobs, dtype=np.float64)).sum(axis=-1)
    return np.clip(1.0 - s, 0.0, 1.0).astype(np.float32)
