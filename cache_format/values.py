"""The value rules of stored rows (SPEC.md sections 1, 4.3, 4.4), checked vectorised over a decoded block.

Every reader runs `check_block` on each block of samples it decodes (a record batch, a Zarr read block), before it
hands out a record: `verify`, `open_cache`, `kdcache train` and `kdcache.CacheDataset` see the same rules. A
checksum proves only that a shard's bytes are the ones its writer committed; these rules catch a writer (or a
re-signed shard) whose values are wrong: a NaN tail mass, a positive log-prob, draw counts that do not add up,
a target ranked outside the top-k yet more probable than its k-th entry. The writer applies the same rules to the
records it is handed (record.check_record); `target_violations` is the one implementation of the target rule.

Shapes: R rows (positions) of a block, W = top_k + sample slots per row; ids int32 [R, W] and lps float32 [R, W]
dense, a row's first topk_counts[r] slots used (compact.unpack_entries).
"""
from dataclasses import dataclass

import numpy as np

from .compact import LEVELS

# How far above 0 a stored log-prob (or target/behavior log-prob) may read: float32 rounding of a log-softmax.
LOGPROB_SLACK = 1e-4
# How far a teacher's target log-prob may lie above its k-th top-k log-prob when the target is not among the top-k:
# two float32 paths through one log-softmax (a gather and a top-k) differ by rounding only. The writer allows this;
# readers allow it plus the storage rounding of the k-th log-prob (stored_upper).
TARGET_TOL = 1e-3
# How far above 1 the probabilities a teacher hands the writer may sum (float32 rounding of a log-softmax over
# the top-k); a float32 cache is read with the same allowance. More is not a distribution.
MAX_EXCESS_MASS = 1e-3
# |sum(p_topk) + tail - 1| allowed after storage rounding.
MASS_TOL = {"float16": 2e-2, "float32": MAX_EXCESS_MASS, "sqrt8": 1e-3}


@dataclass(frozen=True)
class Rules:
    """What a cache's manifest says its rows must satisfy. top_k: the exact entries per position (k); sample: a
    sampled cache's draws per position (N, 0 if not sampled); ragged: the manifest's top_p is set (n_p <= k)."""
    vocab_size: int
    top_k: int
    sample: int = 0
    ragged: bool = False

    @classmethod
    def of(cls, manifest) -> "Rules":
        return cls(int(manifest.vocab_size), int(manifest.top_k), int(manifest.sample or 0),
                   manifest.top_p is not None)


def sqrt8_mass_error(p, logprob_dtype):
    """[R]: the most that sqrt8 rounding can move a row's stored mass: |sqrt(p) error| <= 1/510 per entry, so
    |p error| <= (1/255) sqrt(p) + 1/(4 * 255^2) (SPEC.md 4.3); 0 for float dtypes (MASS_TOL covers them)."""
    if logprob_dtype != "sqrt8":
        return np.zeros(len(p))
    return (np.sqrt(p).sum(-1) + (p > 0).sum(-1) / 1020) / 255


def stored_upper(lp, logprob_dtype):
    """The largest exact log-prob that the stored (read-back) log-prob `lp` can stand for: float32 as stored,
    float16 within 2^-11 relative (2^-25 absolute when subnormal), sqrt8 within half a level of sqrt(p)."""
    lp = np.asarray(lp, np.float64)
    if logprob_dtype == "sqrt8":
        level = np.rint(np.exp(lp / 2) * LEVELS)          # level 0 reads back as 0.25 of a level: rounds to 0
        return 2 * np.log((level + 0.5) / LEVELS)
    if logprob_dtype == "float16":
        return lp + np.abs(lp) * 2.0 ** -10 + 2.0 ** -24
    return lp


def target_violations(among, kth, exact_mass, target_lp, *, upper, mass_limit):
    """The target rule (SPEC.md section 1), over per-position figures: bool masks [R] of the positions whose known
    target (target_lp finite) is not among the exact top-k entries (among [R] False) and yet (a) has a log-prob
    above upper(kth) + TARGET_TOL, kth [R] being the smallest exact log-prob (inf where there is none), or (b) has a
    probability that, added to the exact entries' mass exact_mass [R], exceeds mass_limit (scalar or [R]). The
    exact entries: the stored ones, or a sampled cache's count-0 ones (its draws are not the top-k).
    Returns (above_kth, over_mass, the exact mass plus the target's probability [R])."""
    target_lp = np.asarray(target_lp, np.float32)
    outside = np.isfinite(target_lp) & ~np.asarray(among)
    has_top = kth < np.inf
    with np.errstate(invalid="ignore", over="ignore"):
        above = outside & has_top & (target_lp > upper(np.where(has_top, kth, 0.0)) + TARGET_TOL)
        mass = exact_mass + np.exp(np.where(outside, target_lp, -np.inf).astype(np.float64))
    return above, outside & (mass > mass_limit), mass


def exact_figures(ids, exact_lps, targets, ranked_counts=None, probs=None):
    """(among [R], kth [R], exact mass [R]) of target_violations from dense rows: exact_lps [R, W] holds -inf in every
    slot without an exact entry. ranked_counts: the rows are in descending order with their first counts[r] slots
    used (checked before), so the k-th is the last used one (one gather instead of a row-wise minimum).
    probs: exp(exact_lps), where the caller has it already."""
    exact = exact_lps > -np.inf
    among = ((ids == np.asarray(targets)[:, None]) & exact).any(axis=1)
    if ranked_counts is not None:
        last = np.maximum(np.asarray(ranked_counts, np.int64) - 1, 0)
        kth = np.where(np.asarray(ranked_counts) > 0, exact_lps[np.arange(len(last)), last], np.inf) \
            if exact_lps.shape[1] else np.full(len(last), np.inf)
    else:
        kth = np.where(exact, exact_lps, np.inf).min(axis=1, initial=np.inf)
    # a row sum as a matrix-vector product: numpy's reduction along short rows is 2x slower (bench/read_checks.py)
    mass = (np.exp(exact_lps) if probs is None else probs) @ np.ones(exact_lps.shape[1], exact_lps.dtype)
    return among, kth, mass.astype(np.float64)


def _first_col(mask):
    """int [R]: each row's first True column (0 where none, or where rows have no columns)."""
    return np.argmax(mask, axis=1) if mask.shape[1] else np.zeros(len(mask), np.int64)


def _v(x):
    x = float(x)
    return "NaN" if np.isnan(x) else f"{x:.6g}"


class _Block:
    """Naming a sample or a position of a block in messages."""

    def __init__(self, c):
        self.c = c
        self.row_sample = np.repeat(np.arange(len(c.sample_id)), np.diff(c.position_offsets))

    def sample(self, mask, what):
        """'sample S: what(i)' for the first sample i where mask holds (and how many more), else None."""
        hits = np.flatnonzero(mask)
        if not len(hits):
            return None
        i = int(hits[0])
        more = f" (and {len(hits) - 1} more samples of this block)" if len(hits) > 1 else ""
        return f"sample {int(self.c.sample_id[i])}: {what(i)}{more}"

    def row(self, mask, what):
        """'sample S position t: what(r)' for the first row r where mask holds, else None."""
        hits = np.flatnonzero(mask)
        if not len(hits):
            return None
        r = int(hits[0])
        more = f" (and {len(hits) - 1} more positions of this block)" if len(hits) > 1 else ""
        return (f"sample {int(self.c.sample_id[self.row_sample[r]])} position {int(self.c.positions[r])}: "
                f"{what(r)}{more}")


def check_counts_fit(c, width, where):
    """A position may hold at most `width` entries (top_k + sample): refuse a block that says more before it is
    unpacked into [R, width] rows (which would fail inside numpy, naming nothing)."""
    counts = np.asarray(c.topk_counts)
    if len(counts) and int(counts.max()) > width:
        from .errors import ShardError
        msg = _Block(c).row(counts > width, lambda r: f"topk_counts is {int(counts[r])}, more than the {width} "
                            "entries a position holds (top_k + sample)")
        raise ShardError(f"{where}: {msg}")


def check_block(c, ids, lps, draws, logprob_dtype, rules: Rules, where):
    """Raise ShardError "{where}: sample S position t: what" at the first rule a decoded block breaks (the order:
    samples, positions, entries, masses, targets). c: the block's layout.Columns; ids, lps, draws: its dense rows
    (draws None unless sampled)."""
    problem = block_problem(c, ids, lps, draws, logprob_dtype, rules)
    if problem:
        from .errors import ShardError
        raise ShardError(f"{where}: {problem}")


def block_problem(c, ids, lps, draws, logprob_dtype, rules: Rules):
    """The first rule the block breaks, as "sample S position t: what", or None. See check_block."""
    b = _Block(c)
    return (_samples(b, c, rules) or _teacher_view(b, c, rules) or _entries(b, c, ids, lps, draws, logprob_dtype, rules)
            or _masses(b, c, ids, lps, draws, logprob_dtype, rules))


def _teacher_view(b, c, rules):
    """A teacher view (privileged context): teacher ids in range; a sample with one has its positions strictly
    increasing inside its teacher ids, each followed by the student's trained token; one without has -1 there."""
    if c.teacher_input_ids is None:
        return None
    V, U = rules.vocab_size, np.diff(c.teacher_token_offsets)
    bad_at = np.flatnonzero((c.teacher_input_ids < 0) | (c.teacher_input_ids >= V))
    bad_sample = np.zeros(len(U), bool)
    bad_sample[np.searchsorted(c.teacher_token_offsets, bad_at, side="right") - 1] = True
    has = U[b.row_sample] > 0
    tp = np.asarray(c.teacher_positions, np.int64)
    out = ~has & (tp != -1) | has & ((tp < 0) | (tp > U[b.row_sample] - 2))
    step_ok = np.ones(len(tp), bool)
    step_ok[1:] = (np.diff(tp) > 0) | (b.row_sample[1:] != b.row_sample[:-1]) | ~has[1:]
    problem = (b.sample(bad_sample, lambda i: f"teacher input id {int(c.teacher_input_ids[bad_at[0]])} outside "
                        f"[0, {V})")
               or b.row(out, lambda r: f"teacher position {tp[r]} outside [0, {U[b.row_sample[r]] - 2}] (-1 "
                        "where the sample has no teacher view)")
               or b.row(~step_ok, lambda r: f"teacher positions not strictly increasing ({tp[r - 1]} then {tp[r]})"))
    if problem:
        return problem
    start = c.teacher_token_offsets[:-1][b.row_sample] + tp + 1
    tok = c.input_ids[c.token_offsets[:-1][b.row_sample] + c.positions + 1]
    differ = has & (c.teacher_input_ids[np.where(has, start, 0)] != tok) if len(c.teacher_input_ids) else has & False
    return b.row(differ, lambda r: f"trains token {int(tok[r])}, but its teacher position {tp[r]} is followed by "
                 f"{int(c.teacher_input_ids[start[r]])}: the teacher view must score the same tokens")


def _samples(b, c, rules):
    """Per sample and per position: token counts, token ids, positions, stored entry counts."""
    V, k, N = rules.vocab_size, rules.top_k, rules.sample
    T, P = np.diff(c.token_offsets), np.diff(c.position_offsets)
    bad_tok = (c.input_ids < 0) | (c.input_ids >= V)
    bad_at = np.flatnonzero(bad_tok)
    bad_sample = np.zeros(len(T), bool)
    bad_sample[np.searchsorted(c.token_offsets, bad_at, side="right") - 1] = True
    t_max = T[b.row_sample] - 2
    step_ok = np.ones(len(c.positions), bool)
    step_ok[1:] = (np.diff(c.positions) > 0) | (b.row_sample[1:] != b.row_sample[:-1])
    counts = np.asarray(c.topk_counts, np.int64)
    return (b.sample(T < 2, lambda i: f"holds {T[i]} tokens, at least 2 needed")
            or b.sample(P < 1, lambda i: "has no trained positions")
            or b.sample(bad_sample, lambda i: f"input id {int(c.input_ids[bad_at[0]])} outside [0, {V})")
            or b.row((c.positions < 0) | (c.positions > t_max), lambda r: f"position outside [0, {t_max[r]}] (the "
                     "sample's tokens but the last)")
            or b.row(~step_ok, lambda r: f"positions not strictly increasing ({int(c.positions[r - 1])} then "
                     f"{int(c.positions[r])})")
            or (None if N else
                b.row(counts != k, lambda r: f"holds {counts[r]} entries, this cache keeps all {k} (no top_p)")
                if not rules.ragged else b.row((counts < min(k, 1)) | (counts > k), lambda r: f"holds {counts[r]} "
                                              f"entries, a position holds 1..{k}")))


def _entries(b, c, ids, lps, draws, dtype, rules):
    """Per entry: ids in range, log-probs finite and <= 0, ids unique and in the stored order; a sampled row's draws.
    Each rule is one reduction over the block first; the rows that break it are found only when one does."""
    V, N = rules.vocab_size, rules.sample
    counts = np.asarray(c.topk_counts)
    full = not len(counts) or bool((counts == ids.shape[1]).all())
    used = None if full else np.arange(ids.shape[1])[None, :] < counts[:, None]   # unused: id -1, log-prob -inf
    problem = None
    if ids.size and (ids.max() >= V or (ids.min() < 0 if full else (ids[used] < 0).any())):
        bad_id = ((ids < 0) | (ids >= V)) if full else used & ((ids < 0) | (ids >= V))
        first = _first_col(bad_id)
        problem = b.row(bad_id.any(axis=1), lambda r: f"top-k id {int(ids[r, first[r]])} outside [0, {V})")
    if not problem and lps.size and not (lps.max() <= LOGPROB_SLACK and (full and lps.min() > -np.inf
                                                                          or not full and _finite_where(lps, used))):
        bad_lp = ~(np.isfinite(lps) & (lps <= LOGPROB_SLACK))
        bad_lp = bad_lp if full else bad_lp & used
        e = _first_col(bad_lp)
        problem = b.row(bad_lp.any(axis=1), lambda r: f"top-k log-prob {_v(lps[r, e[r]])} of id "
                        f"{int(ids[r, e[r]])}: log-probs must be finite and <= 0")
    if problem or ids.shape[1] < 2:
        return problem or (_draws(b, c, ids, draws, used, rules) if N else None)
    if N or dtype == "sqrt8":            # ascending ids (SPEC.md 4.3, 4.4): strictly, so no id twice
        down = np.diff(ids, axis=1) <= 0
        down = down if full else down & used[:, 1:]
        if down.any():
            e = _first_col(down)
            return b.row(down.any(axis=1), lambda r: f"entry ids not strictly ascending ({int(ids[r, e[r]])} then "
                         f"{int(ids[r, e[r] + 1])}), as a {'sampled' if N else 'sqrt8'} cache stores them")
    else:
        srt = np.sort(ids, axis=1)       # unused slots (-1) sort first
        dup = srt[:, 1:] == srt[:, :-1]
        dup = dup if full else dup & (srt[:, 1:] >= 0)
        with np.errstate(invalid="ignore"):                          # -inf - -inf in unused slots: NaN, not up
            up = np.diff(lps, axis=1) > 1e-6
        if dup.any() or up.any():
            e = _first_col(dup)
            return (b.row(dup.any(axis=1), lambda r: f"lists token id {int(srt[r, e[r] + 1])} twice")
                    or b.row(up.any(axis=1), lambda r: "top-k log-probs not in descending order"))
    return _draws(b, c, ids, draws, used, rules) if N else None


def _finite_where(lps, used):
    """Every used slot's log-prob is finite (unused slots hold -inf)."""
    return bool(np.isfinite(lps[used]).all())


def _draws(b, c, ids, draws, used, rules):
    """A sampled row: exactly top_k exact (count 0) entries, and draw counts that sum to N."""
    k, N = rules.top_k, rules.sample
    exact = ((draws == 0) if used is None else used & (draws == 0)).sum(axis=1)
    total = draws.sum(axis=1, dtype=np.int64)
    return (b.row(exact != k, lambda r: f"{exact[r]} exact (count 0) entries, the cache keeps {k}")
            or b.row(total != N, lambda r: f"its draw counts sum to {total[r]}; they must sum to the {N} draws"))


def _per_position(b, name, values, need):
    """An optional per-position log-prob column: finite and <= 0, or NaN (unknown) unless `need`."""
    if values is None:
        return None
    with np.errstate(invalid="ignore"):
        bad = ~np.isnan(values) & ~(np.isfinite(values) & (values <= LOGPROB_SLACK))
    return (b.row(bad, lambda r: f"{name} {_v(values[r])}: must be finite and <= 0 (NaN where unknown)")
            or (b.row(np.isnan(values), lambda r: f"{name} NaN: a cache with top_k 0 stores only the target "
                      "log-probs, every position needs one") if need else None))


def _masses(b, c, ids, lps, draws, dtype, rules):
    """Per position: tail_mass in [0, 1], stored mass + tail = 1, target and behavior log-probs, the target rule."""
    tail = np.asarray(c.tail_mass)
    with np.errstate(invalid="ignore"):
        bad = ~((tail >= -LOGPROB_SLACK) & (tail <= 1 + LOGPROB_SLACK))      # NaN fails both
    problem = (b.row(bad, lambda r: f"tail_mass {_v(tail[r])}, not in [0, 1]")
               or _per_position(b, "target_logprobs", c.target_logprobs, rules.top_k == 0 and not rules.sample)
               or _per_position(b, "behavior_logprobs", c.behavior_logprobs, False))
    if problem:
        return problem
    exact_lps = lps if draws is None else np.where(draws == 0, lps, -np.inf)   # unused slots are -inf already
    targets = c.input_ids[c.token_offsets[b.row_sample] + c.positions + 1]
    ranked = draws is None and dtype != "sqrt8"                                 # descending: checked in _entries
    probs = np.exp(exact_lps)
    among, kth, stored = exact_figures(ids, exact_lps, targets, c.topk_counts if ranked else None, probs)
    tol = MASS_TOL[dtype] + (sqrt8_mass_error(probs, dtype) if dtype == "sqrt8" else 0.0)
    tol = np.broadcast_to(tol, stored.shape)
    off = np.abs(stored + tail - 1) > tol
    problem = b.row(off, lambda r: f"top-k mass {stored[r]:.6f} + tail_mass {tail[r]:.6f} = "
                    f"{stored[r] + tail[r]:.6f}, expected 1 (+-{tol[r]:.3g})")
    if problem:
        return problem
    above, over, mass = target_violations(among, kth, stored, c.target_logprobs,
                                          upper=lambda lp: stored_upper(lp, dtype), mass_limit=1 + tol)
    return (b.row(above, lambda r: f"target id {int(targets[r])} is not among the top-k entries, yet its "
                  f"target_logprobs {_v(c.target_logprobs[r])} exceeds the k-th (smallest) one {_v(kth[r])}")
            or b.row(over, lambda r: f"the top-k mass {stored[r]:.6f} plus the probability "
                     f"{np.exp(float(c.target_logprobs[r])):.6f} of target id {int(targets[r])}, outside the top-k, "
                     f"is {mass[r]:.6f}, more than 1 (+{tol[r]:.3g})"))
