"""Issue 42: every reader runs verify's value checks on each block it decodes (cache_format/values.py) and refuses a
shard whose values are wrong, naming the shard, sample and position; verify names it and goes on. The shards here
are damaged after commit and re-signed, so their checksums pass and only the value checks can find the damage."""
import re

import numpy as np
import pytest

from kdcache.cache_format import ShardError, Storage, open_cache, verify_cache, write_cache
from tests.cache_format.damage import EOS, consistent_records, edit, put, resign, rows_of, shard

V = 300


def _cache(tmp_path, backend="arrow", dtype="float16", k=8, n=12, shard_size=4, **storage):
    write_cache(tmp_path, consistent_records(n, k=k, seed=5), shard_size=shard_size,
                storage=Storage(backend, k, dtype, **storage), vocab_size=V, eos_token_ids=[EOS],
                fingerprint_parts={"t": 1})
    assert verify_cache(tmp_path).ok
    return tmp_path


def _refused_everywhere(cache, rel, pattern, j=1):
    """verify names shard `rel` alone (and checks the others); the reader refuses it by name, reads the others,
    and reads it without value checks (the checks alone refuse it)."""
    rep = verify_cache(cache)
    assert [w for w, _ in rep.problems] == [rel], rep.problems
    assert re.search(pattern, rep.problems[0][1]), rep.problems
    assert rep.shards_checked == 3
    cache_ = open_cache(cache)
    with pytest.raises(ShardError, match=re.escape(rel) + ".*" + pattern):
        list(cache_)
    others = [i for i in range(cache_.num_shards) if i != j]
    assert all(len(list(cache_.iter_shard(i))) == cache_.shards[i].num_samples for i in others)
    assert len(list(open_cache(cache, check_values=False))) == len(cache_)


@pytest.mark.parametrize("backend", ["arrow", "zarr"])
def test_a_nan_tail_mass_is_refused_naming_shard_sample_and_position(tmp_path, backend):
    cache = _cache(tmp_path, backend)
    rel, path = shard(cache, 1)
    row, _, rec = rows_of(cache, 1, 1)                       # the shard's second sample, its third position
    edit(path, "tail_mass", put(row + 2, np.nan))
    resign(cache)
    _refused_everywhere(cache, rel, rf"sample {rec.sample_id} position {rec.positions[2]}: tail_mass NaN")


def test_a_positive_log_prob_is_refused(tmp_path):
    cache = _cache(tmp_path, "arrow", "float32")
    rel, path = shard(cache, 1)
    _, entry, rec = rows_of(cache, 1, 0)
    edit(path, "topk_values", put(entry, 0.5))
    resign(cache)
    _refused_everywhere(cache, rel, rf"sample {rec.sample_id} position {rec.positions[0]}: top-k log-prob 0.5 "
                                    r"of id \d+: log-probs must be finite and <= 0")


def _sampled(tmp_path, k=2, draws=8):
    from tests.cache_format.test_sampled import sampled_records
    recs, _ = sampled_records(9, k, draws, seed=2)
    write_cache(tmp_path, recs, shard_size=3, storage=Storage("zarr", k, "float16", sample=draws), vocab_size=V,
                eos_token_ids=[EOS], fingerprint_parts={"t": 1})
    assert verify_cache(tmp_path).ok
    return tmp_path


@pytest.mark.parametrize("change", ["x50", "one fewer"])
def test_draw_counts_that_do_not_sum_to_n_are_refused(tmp_path, change):
    """x50: the review's inflated counts. one fewer: a position with fewer draws than N (SPEC.md 4.4: the counts of a
    position sum to N); a check that only catches too many draws lets it through."""
    cache = _sampled(tmp_path)
    rel, path = shard(cache, 1)
    _, entry, rec = rows_of(cache, 1, 2)
    least = 1 if change == "x50" else 2                     # one fewer of a single draw would make it exact
    p = next(p for p in range(len(rec.positions)) if (rec.sample_counts[p] >= least).any())
    counts = rec.sample_counts[p][rec.topk_ids[p] >= 0]     # the position's entries as stored (ascending ids)
    e = int(np.flatnonzero(counts >= least)[0])
    at = entry + int(rec.topk_counts[:p].sum()) + e
    edit(path, "sample_counts", put(at, min(counts[e] * 50, 255) if change == "x50" else counts[e] - 1))
    resign(cache)
    _refused_everywhere(cache, rel, rf"sample {rec.sample_id} position {rec.positions[p]}: its draw counts sum to "
                                    rf"{'[0-9]+' if change == 'x50' else 7}; they must sum to the 8 draws")


# -- the target rule (SPEC.md section 1) --------------------------------------------------------------------

def _outside_row(rec, k):
    """The first position whose target is not among its top-k, and whose tail holds at least its k-th entry's
    probability (so a target tied with the k-th is possible there)."""
    for p, t in enumerate(rec.targets):
        lp = rec.topk_logprobs[p]
        if t not in rec.topk_ids[p] and 1 - np.exp(lp.astype(np.float64)).sum() >= np.exp(float(lp[k - 1])):
            return p
    raise AssertionError("no such position")


def test_a_served_target_above_the_kth_is_refused_on_read_and_by_verify(tmp_path):
    """The review's case: p = 0.99 for a target ranked outside the top-k, written by a buggy writer."""
    cache = _cache(tmp_path, "arrow", "float16")
    rel, path = shard(cache, 1)
    row, _, rec = rows_of(cache, 1, 1)
    p = _outside_row(rec, 8)
    edit(path, "target_logprobs", put(row + p, np.log(0.99)))
    resign(cache)
    _refused_everywhere(cache, rel, rf"sample {rec.sample_id} position {rec.positions[p]}: target id "
                                    rf"{rec.targets[p]} is not among the top-k entries, yet its target_logprobs "
                                    r"-0.01005\d* exceeds the k-th \(smallest\) one")


def _three_entry_records(n=6, seed=3):
    """Positions with top-3 probabilities 0.4, 0.3, 0.2 (tail 0.1) and a target outside them holding the tail."""
    from kdcache.cache_format import Record
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        T = int(rng.integers(5, 12))
        ids = rng.integers(3, V, size=T).astype(np.int32)
        ids[-1] = EOS
        pos = np.arange(T - 1, dtype=np.int32)
        top = np.stack([rng.choice(np.setdiff1d(np.arange(V), [t]), 3, replace=False) for t in ids[pos + 1]])
        lps = np.log(np.tile([0.4, 0.3, 0.2], (len(pos), 1))).astype(np.float32)
        out.append(Record(i, ids, pos, top.astype(np.int32), lps, None, False,
                          np.full(len(pos), np.log(0.1), np.float32)))
    return out


def test_a_target_whose_probability_overfills_the_distribution_is_refused_on_read(tmp_path):
    """Below the k-th log-prob (0.15 < 0.2) but more probable than all the mass outside the top-k (0.1):
    top-k mass + p(target) = 1.05 > 1."""
    write_cache(tmp_path, _three_entry_records(), shard_size=2, storage=Storage("zarr", 3, "float32"), vocab_size=V,
                eos_token_ids=[EOS], fingerprint_parts={"t": 1})
    assert verify_cache(tmp_path).ok                      # p(target) = the tail: mass exactly 1 passes
    rel, path = shard(tmp_path, 1)
    row, _, rec = rows_of(tmp_path, 1, 1)
    edit(path, "target_logprobs", put(row + 1, np.log(0.15)))
    resign(tmp_path)
    _refused_everywhere(tmp_path, rel, rf"sample {rec.sample_id} position {rec.positions[1]}: the top-k mass "
                                       rf"0.9\d* plus the probability 0.15\d* of target id {rec.targets[1]}, outside "
                                       r"the top-k, is 1.05\d*, more than 1")


def _edge_records(k, n=6):
    """Targets at the edge of the rule, which must pass in every storage dtype: outside the top-k and tied with the
    k-th entry (another token of equal probability), or holding the whole tail (mass exactly 1)."""
    recs = consistent_records(n, k=k, seed=9)
    for r in recs:
        for p in range(len(r.positions)):
            lp = r.topk_logprobs[p].astype(np.float64)
            tail = 1 - np.exp(lp).sum()
            if r.targets[p] in r.topk_ids[p]:
                continue
            r.target_logprobs[p] = lp[-1] if tail >= np.exp(lp[-1]) else np.log(tail)
    return recs


@pytest.mark.parametrize("dtype", ["float16", "float32", "sqrt8"])
@pytest.mark.parametrize("top_p", [None, 0.6])
def test_targets_at_the_edge_of_the_rule_are_written_and_read_in_every_dtype(tmp_path, dtype, top_p):
    write_cache(tmp_path, _edge_records(4), shard_size=3, storage=Storage("arrow", 4, dtype, top_p=top_p),
                vocab_size=V, eos_token_ids=[EOS], fingerprint_parts={"t": 1})
    rep = verify_cache(tmp_path)
    assert rep.ok, rep.problems
    assert len(list(open_cache(tmp_path))) == 6


# -- sampled and sqrt8 entries are stored by ascending id (SPEC.md 4.3, 4.4) ---------------------------------

BIG_V = 70_000            # ids past 65535: the shard stores its id steps as int32, so a step can be negative


def _big_vocab_records(n=3, k=4, draws=0, seed=4):
    """Records over BIG_V tokens with ids on both sides of 65536 (the shard's steps are then int32)."""
    from kdcache.cache_format.compact import sampled_rows
    rng = np.random.default_rng(seed)
    out = consistent_records(n, vocab=BIG_V, k=k + draws, seed=seed, max_len=10)
    for r in out:
        r.topk_ids[0, 0] = 65_600 + r.sample_id          # a big exact id at the first position of every record
        r.target_logprobs[:] = np.nan                    # the edits below move log-probs; targets stay out of it
        if draws:                                        # the exact top-k, then `draws` draws among the next ids
            pick = rng.integers(k, k + draws, size=(len(r.positions), draws))
            ids, lps, counts = sampled_rows(r.topk_ids[:, :k], r.topk_logprobs[:, :k],
                                            np.take_along_axis(r.topk_ids, pick, 1),
                                            np.take_along_axis(r.topk_logprobs, pick, 1))
            r.topk_ids, r.topk_logprobs, r.sample_counts = ids, lps, counts
            tail = 1 - np.exp(r.topk_logprobs[:, :k].astype(np.float64)).sum(1)
            r.tail_mass = tail.astype(np.float32)
        else:
            r.topk_ids, r.topk_logprobs = r.topk_ids[:, :k], r.topk_logprobs[:, :k]
    return out


@pytest.mark.parametrize("layout", ["sampled", "sqrt8"])
def test_entries_out_of_ascending_id_order_are_refused(tmp_path, layout):
    """Swap a position's last two entries (ids, values and counts alike): every value is still right, only the order
    SPEC.md requires is broken. The old verify took it (ids unique, log-probs in range)."""
    draws = 3 if layout == "sampled" else 0
    recs = _big_vocab_records(draws=draws)
    write_cache(tmp_path, recs, shard_size=1, vocab_size=BIG_V, eos_token_ids=[EOS], fingerprint_parts={"t": 1},
                storage=Storage("zarr", 4, "float16" if draws else "sqrt8", sample=draws))
    assert verify_cache(tmp_path).ok
    rel, path = shard(tmp_path, 1)
    _, entry, rec = rows_of(tmp_path, 1, 0)
    n = int(rec.topk_counts[0])
    ids = rec.topk_ids[0][:n].astype(np.int64)             # ascending, as stored
    a, b = entry + n - 2, entry + n - 1
    before = ids[n - 3] if n > 2 else 0

    def steps(values):
        values[a], values[b] = ids[n - 1] - before, ids[n - 2] - ids[n - 1]      # ..., y, z -> ..., z, y
        return values

    def swap(values):
        values[[a, b]] = values[[b, a]]
        return values
    edit(path, "topk_ids", steps)
    edit(path, "topk_values", swap)
    if draws:
        edit(path, "sample_counts", swap)
    resign(tmp_path)
    _refused_everywhere(tmp_path, rel, rf"sample {rec.sample_id} position {rec.positions[0]}: entry ids not strictly "
                                       rf"ascending \({ids[n - 1]} then {ids[n - 2]}\)")
