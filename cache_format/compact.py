"""Compact storage of a position's teacher entries: adaptive k (top-p) and sqrt8 quantization, vectorised.

Adaptive k keeps, per position, the smallest prefix of the top-k whose mass reaches top_p, and the exact
mass outside it. sqrt8 stores each kept probability as a level L = round(255 * sqrt(p)) in 0..255 (a byte):
uniform steps in sqrt(p) spend precision where the KL divergence needs it (an error e in sqrt(p) costs
about 2 e^2 of KL, whatever p is). A position's entries are then stored in ascending id order, each id as
its step from the previous one: a sorted set of ids costs far fewer bits than the same ids in rank order
(the rank order is what the levels say), and sets that recur from position to position become repeated
byte strings that zstd finds. A reader undoes the steps with one cumulative sum per row. Measured choices:
bench/fidelity.py and BENCHMARKS.md. Byte layout:
SPEC.md section 4.3.
"""
import numpy as np

LOGPROB_DTYPES = ("float16", "float32", "sqrt8")
LEVELS = 255
ZERO_LEVEL = 0.25           # level 0 (p < (0.5/255)^2 ~ 3.8e-6) reads back as the middle of its sqrt interval
VALUE_DTYPES = {"float16": np.float16, "float32": np.float32, "sqrt8": np.uint8}
BOUNDS = {"float16": "float16 log-probs (p within a factor e^(+-2^-11 ln(1/p)): 0.03% at p = 0.5, 0.2% at 0.01)",
          "float32": "float32 (as the teacher computed them)",
          "sqrt8": "sqrt8 (sqrt(p) in 255 steps; |error in sqrt(p)| <= 1/510)"}


def top_p_counts(logprobs, top_p):
    """int32 [P]: per row of descending log-probs [P, k], the smallest prefix whose mass reaches top_p (>= 1)."""
    mass = np.cumsum(np.exp(np.asarray(logprobs, dtype=np.float64)), axis=1)
    n = (mass < top_p).sum(axis=1) + 1
    return np.minimum(n, logprobs.shape[1]).astype(np.int32)


def keep_prefix(ids, logprobs, counts):
    """Dense rows with slots past counts[p] emptied: id -1, log-prob -inf. Returns new arrays."""
    past = np.arange(ids.shape[1])[None, :] >= np.asarray(counts)[:, None]
    return np.where(past, -1, ids).astype(np.int32), np.where(past, -np.inf, logprobs).astype(np.float32)


def quantize(logprobs):
    """uint8 sqrt8 levels of log-probs (any shape)."""
    u = np.exp(np.asarray(logprobs, dtype=np.float64) / 2)
    return np.clip(np.rint(u * LEVELS), 0, LEVELS).astype(np.uint8)


def dequantize(levels):
    """float32 log-probs of sqrt8 levels: 2 log(L / 255), level 0 as 2 log(0.25 / 255)."""
    lv = np.asarray(levels, dtype=np.float32)
    return (2 * np.log(np.where(lv > 0, lv, ZERO_LEVEL) / LEVELS)).astype(np.float32)


def stored_logprobs(logprobs, logprob_dtype):
    """What a reader gets back for these log-probs (same shape, rank order kept): the fidelity of a dtype."""
    if logprob_dtype == "sqrt8":
        return np.where(np.isneginf(logprobs), -np.inf, dequantize(quantize(logprobs))).astype(np.float32)
    return np.asarray(logprobs).astype(VALUE_DTYPES[logprob_dtype]).astype(np.float32)


def pack_entries(ids, logprobs, counts, logprob_dtype, id_dtype=np.int32, by_id=False, extra=None):
    """Dense [P, k] rows (the first counts[p] slots used) -> flat (topk_ids, topk_values, extra) streams.

    by_id (sqrt8, or a sampled cache): entries in ascending id order, each id as its step from the previous one.
    extra: another dense [P, k] per-entry array (a sampled cache's draw counts), flattened in the same order."""
    used = np.arange(ids.shape[1])[None, :] < np.asarray(counts)[:, None]
    if logprob_dtype != "sqrt8" and not by_id:
        vals = logprobs.astype(VALUE_DTYPES[logprob_dtype])
        if used.all():
            return ids.astype(id_dtype).reshape(-1), vals.reshape(-1), None if extra is None else extra.reshape(-1)
        return ids[used].astype(id_dtype), vals[used], None if extra is None else extra[used]
    order = np.argsort(np.where(used, ids, np.iinfo(np.int32).max), axis=1, kind="stable")
    tid = np.take_along_axis(ids, order, axis=1).astype(np.int64)          # ascending ids, unused slots last
    steps = np.diff(tid, axis=1, prepend=0)                                  # id minus the previous id (first: id)
    lps = np.take_along_axis(logprobs, order, axis=1)
    vals = quantize(lps) if logprob_dtype == "sqrt8" else lps.astype(VALUE_DTYPES[logprob_dtype])
    extra = None if extra is None else np.take_along_axis(extra, order, axis=1)[used]
    return steps[used].astype(id_dtype), vals[used], extra


def id_dtype_of(records):
    """The dtype of a shard's topk_ids: uint16 where every id fits (vocabularies up to 65,536 tokens), else
    int32 (SPEC.md 4)."""
    top = max((int(r.topk_ids.max()) for r in records if r.topk_ids.size), default=0)
    return np.dtype(np.uint16) if top < 65536 else np.dtype(np.int32)


_LUT = None


def _dequantize_lut():
    global _LUT
    if _LUT is None:
        _LUT = dequantize(np.arange(LEVELS + 1))
    return _LUT


def unpack_entries(counts, topk_ids, topk_values, logprob_dtype, top_k, by_id=False, extra=None):
    """Flat streams -> dense (ids int32 [P, k], logprobs float32 [P, k], extra [P, k] or None); unused slots id -1,
    log-prob -inf, extra 0. by_id: the ids are steps (sqrt8 always; see pack_entries)."""
    counts = np.asarray(counts, dtype=np.int64)
    P = len(counts)
    full = bool(P) and bool(np.all(counts == top_k))         # a cache without top-p: a reshape, no scatter
    if full:
        used, ids, vals = None, topk_ids.reshape(P, top_k), topk_values.reshape(P, top_k)
        extra = None if extra is None else extra.reshape(P, top_k)
    else:
        used = np.arange(top_k)[None, :] < counts[:, None]
        ids = np.zeros((P, top_k), dtype=topk_ids.dtype)
        vals = np.zeros((P, top_k), dtype=topk_values.dtype)
        ids[used], vals[used] = topk_ids, topk_values
        if extra is not None:
            dense = np.zeros((P, top_k), dtype=extra.dtype)
            dense[used] = extra
            extra = dense
    ids = np.cumsum(ids, axis=1, dtype=np.int32) if logprob_dtype == "sqrt8" or by_id else \
        ids.astype(np.int32, copy=False)
    lps = _dequantize_lut()[vals] if logprob_dtype == "sqrt8" else vals.astype(np.float32)
    if not full:
        ids[~used], lps[~used] = -1, -np.inf
    return ids, lps, extra


def kl_to_exact(exact_lp, stored_lp, stored_tail, vocab_size):
    """float64 [P]: KL(exact || stored), both renormalised over the exact top-k ids.

    exact_lp [P, k]: the teacher's top-k log-probs. stored_lp [P, k]: what a reader gets for the same ids in
    the same order (-inf where dropped by top-p). A dropped id is given an equal share of the stored tail
    mass, spread over the vocab_size - n ids a reader knows nothing about.
    """
    p = np.exp(np.asarray(exact_lp, dtype=np.float64))
    q = np.exp(np.asarray(stored_lp, dtype=np.float64))
    n = np.isfinite(stored_lp).sum(axis=1)
    share = np.asarray(stored_tail, dtype=np.float64) / np.maximum(vocab_size - n, 1)
    # a slot without an exact value (a sampled row's unused slots) is no entry at all: it gets nothing
    q = np.where(np.isfinite(stored_lp), q, np.where(np.isfinite(exact_lp), share[:, None], 0.0))
    p, q = p / p.sum(1, keepdims=True), q / q.sum(1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(p > 0, p * (np.log(p) - np.log(np.maximum(q, 1e-300))), 0.0)
    return np.maximum(terms.sum(axis=1), 0.0)


def to_store(rec, *, top_p, logprob_dtype, vocab_size):
    """(the record to write, KL [P] of what a reader will get against rec's exact top-k).

    rec is checked and dense. top_p (or None) keeps each row's smallest prefix reaching that mass, and the
    tail mass becomes the exact mass outside what is kept (from rec's full-precision log-probs).
    """
    from dataclasses import replace

    from .record import tail_mass_from_logprobs
    ids, lps, tail = rec.topk_ids, rec.topk_logprobs, rec.tail_mass
    if top_p is not None:
        ids, lps = keep_prefix(ids, lps, top_p_counts(lps, top_p))
        tail = tail_mass_from_logprobs(lps)
    kl = kl_to_exact(rec.topk_logprobs, stored_logprobs(lps, logprob_dtype), tail, vocab_size)
    return replace(rec, topk_ids=ids, topk_logprobs=lps, tail_mass=tail), kl


def sampled_rows(top_ids, top_logprobs, draw_ids, draw_logprobs):
    """A sampled cache's dense rows (--sample N, SPEC.md 4.4): the exact top-M entries, then each distinct drawn
    id once with how many of the N draws gave it.

    top_ids/top_logprobs [P, M] (M may be 0); draw_ids/draw_logprobs [P, N]: the draws, each with the teacher's
    log-prob of the drawn id. Returns (ids int32 [P, M + N], logprobs float32 [P, M + N], counts int32
    [P, M + N]); slots past a row's distinct draws hold id -1, log-prob -inf, count 0."""
    top_ids, draw_ids = np.asarray(top_ids, np.int64), np.asarray(draw_ids, np.int64)
    P, N = draw_ids.shape
    order = np.argsort(draw_ids, axis=1, kind="stable")
    d = np.take_along_axis(draw_ids, order, axis=1)
    lp = np.take_along_axis(np.asarray(draw_logprobs, np.float32), order, axis=1)
    first = np.ones((P, N), dtype=bool)
    first[:, 1:] = d[:, 1:] != d[:, :-1]
    slot = np.cumsum(first, axis=1) - 1                       # each draw's place among its row's distinct ids
    rows = np.repeat(np.arange(P), N).reshape(P, N)
    counts = np.zeros((P, N), np.int32)
    np.add.at(counts, (rows, slot), 1)
    ids = np.full((P, N), -1, np.int64)
    lps = np.full((P, N), -np.inf, np.float32)
    ids[rows[first], slot[first]] = d[first]
    lps[rows[first], slot[first]] = lp[first]
    M = top_ids.shape[1]
    return (np.concatenate([top_ids, ids], axis=1).astype(np.int32),
            np.concatenate([np.asarray(top_logprobs, np.float32).reshape(P, M), lps], axis=1),
            np.concatenate([np.zeros((P, M), np.int32), counts], axis=1))
