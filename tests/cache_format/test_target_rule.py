"""Issue 42, item 2: the writer refuses target log-probs no teacher can report (SPEC.md section 1): a target outside
the top-k more probable than the k-th entry, or whose probability with the top-k mass passes 1; and a given
tail_mass that does not complete the top-k mass to 1. The read side is in test_read_checks.py."""
import dataclasses
import json

import numpy as np
import pytest

from kdcache.cache_format import RecordError, Storage, write_cache
from kdcache.cache_format.record import check_record
from kdcache.cache_format.values import TARGET_TOL
from tests.cache_format.damage import EOS, consistent_records
from tests.cache_format.test_read_checks import V, _three_entry_records


def _with_target(rec, p, lp):
    target = rec.target_logprobs.copy()
    target[p] = lp
    return dataclasses.replace(rec, target_logprobs=target)


def _outside(rec):
    """A position whose target is outside its top-k, with a tail that a target tied with the k-th fits in."""
    for p, t in enumerate(rec.targets):
        lp = rec.topk_logprobs[p].astype(np.float64)
        if t not in rec.topk_ids[p] and 1 - np.exp(lp).sum() >= np.exp(lp[-1]) + 1e-3:
            return p
    raise AssertionError("no such position")


def test_a_target_outside_the_top_k_above_the_kth_is_refused():
    rec = consistent_records(1, k=8, seed=1)[0]
    check_record(rec, 8, V)                                               # as the teacher gave it
    p = _outside(rec)
    kth = float(rec.topk_logprobs[p, -1])
    where = rf"sample 0: position {rec.positions[p]}: target id {rec.targets[p]} is not among its 8 top entries"
    for lp in (np.log(0.99), kth + 0.01):                                # the review's p = 0.99; just above the k-th
        with pytest.raises(RecordError, match=where + ", yet its target_logprobs"):
            check_record(_with_target(rec, p, lp), 8, V)
    for lp in (kth, kth + TARGET_TOL / 2):                               # a tie, and the rounding allowed
        check_record(_with_target(rec, p, lp), 8, V)


def test_a_target_among_the_top_k_may_be_its_most_probable():
    rec = consistent_records(1, k=8, seed=1)[0]
    t = rec.targets[0]
    ids = rec.topk_ids.copy()
    ids[0, 0] = t if t not in ids[0] else ids[0, 0]                     # the target ranked first at position 0
    check_record(_with_target(dataclasses.replace(rec, topk_ids=ids), 0, float(rec.topk_logprobs[0, 0])), 8, V)


def test_a_target_that_overfills_the_distribution_is_refused():
    rec = _three_entry_records(1)[0]                                      # top-3 0.4, 0.3, 0.2; target 0.1
    check_record(rec, 3, V)
    with pytest.raises(RecordError, match=rf"position {rec.positions[1]}: the mass of its 3 top entries plus the "
                                          rf"probability of target id {rec.targets[1]}, outside them, is 1.05\d*, "
                                          "more than 1"):
        check_record(_with_target(rec, 1, np.log(0.15)), 3, V)           # below the k-th (0.2), above the tail


def test_a_given_tail_mass_must_complete_the_top_k_mass():
    rec = _three_entry_records(1)[0]
    check_record(dataclasses.replace(rec, tail_mass=np.full(len(rec.positions), 0.1, np.float32)), 3, V)
    tail = np.full(len(rec.positions), 0.1, np.float32)
    tail[2] = 0.5
    with pytest.raises(RecordError, match=rf"position {rec.positions[2]}: the mass of its 3 top entries plus "
                                          "tail_mass is 1.4"):
        check_record(dataclasses.replace(rec, tail_mass=tail), 3, V)


def test_a_drawn_target_more_probable_than_the_exact_entries_is_refused():
    """A sampled record: the exact entries are the top-k, so no target outside them (drawn or not) is above the
    smallest of them."""
    from tests.cache_format.test_sampled import sampled_records
    rec = sampled_records(1, 3, 8, seed=1)[0][0]
    check_record(rec, 11, V, sample=8)
    exact = (rec.topk_ids >= 0) & (rec.sample_counts == 0)
    p = next(p for p, t in enumerate(rec.targets) if t not in rec.topk_ids[p][exact[p]])
    kth = float(rec.topk_logprobs[p][exact[p]].min())
    with pytest.raises(RecordError, match=rf"position {rec.positions[p]}: target id {rec.targets[p]} is not among "
                                          "its 3 top entries"):
        check_record(_with_target(rec, p, kth + 0.1), 11, V, sample=8)


def test_the_writer_refuses_the_record_by_sample_and_commits_nothing(tmp_path):
    recs = consistent_records(6, k=8, seed=2)
    p = _outside(recs[1])
    recs[1] = _with_target(recs[1], p, np.log(0.99))
    with pytest.raises(RecordError, match=rf"sample 1: position {recs[1].positions[p]}: target id"):
        write_cache(tmp_path, recs, shard_size=3, storage=Storage("arrow", 8), vocab_size=V, eos_token_ids=[EOS],
                    fingerprint_parts={"t": 1})
    assert json.loads((tmp_path / "manifest.json").read_text())["shards"] == []
