"""The format's per-record rules: which positions train a span, the end-of-turn check, the tail derived once."""
import dataclasses

import numpy as np

from kdcache.cache_format import open_cache, tail_mass_from_logprobs, write_cache
from kdcache.cache_format.record import lacks_end_of_turn, span_positions
from tests.helpers.records import EOS, make_records, writer_kwargs


def test_span_positions_train_each_target_at_the_position_before_it():
    # Targets 3..5 and 8..9 (end exclusive) are predicted from positions 2..4 and 7..8.
    assert span_positions([(3, 6), (8, 10)]).tolist() == [2, 3, 4, 7, 8]
    assert span_positions([(0, 3)]).tolist() == [0, 1]            # token 0 has no position before it
    assert span_positions([]).dtype == np.int32 and len(span_positions([])) == 0


def test_lacks_end_of_turn():
    assert not lacks_end_of_turn([5, 7, EOS], False, [EOS])
    assert lacks_end_of_turn([5, 7, 9], False, [EOS])                 # would never learn to stop
    assert not lacks_end_of_turn([5, 7, 9], True, [EOS])              # truncated: the end was cut off


def test_the_writer_derives_the_tail_from_the_logprobs(tmp_path):
    recs = make_records(6, seed=3)
    bare = [dataclasses.replace(r, tail_mass=None) for r in recs]    # what a teacher hands over
    write_cache(tmp_path, bare, shard_size=4, **writer_kwargs("arrow"))
    for want, got in zip(recs, open_cache(tmp_path)):
        np.testing.assert_allclose(got.tail_mass, tail_mass_from_logprobs(want.topk_logprobs), atol=1e-7)
        assert got.tail_mass.min() > 0                                   # really the mass outside the top-k


def test_an_impossible_token_in_the_top_k_is_stored_at_the_floor(tmp_path):
    """One -inf log-prob (a masked vocabulary row) used to fail the whole job in check_record."""
    import torch

    from kdcache.cache_format.record import LOGPROB_FLOOR
    from kdcache.train.losses import LossConfig, gkd_per_position
    recs = make_records(3, seed=4)
    recs[1].topk_logprobs[:, -1] = -np.inf
    recs[1].tail_mass = None                          # the writer derives it, as from a teacher
    write_cache(tmp_path, recs, shard_size=4, **writer_kwargs("arrow"))
    got = open_cache(tmp_path)[1]
    assert (got.topk_logprobs[:, -1] == LOGPROB_FLOOR).all() and np.isfinite(got.topk_logprobs).all()
    np.testing.assert_allclose(got.tail_mass, tail_mass_from_logprobs(recs[1].topk_logprobs), atol=1e-6)
    logits = torch.randn(len(got.positions), 300)
    for beta in (0.0, 0.5, 1.0):
        loss = gkd_per_position(logits, torch.from_numpy(got.topk_ids).long(), torch.from_numpy(got.topk_logprobs),
                                torch.from_numpy(got.tail_mass), LossConfig(beta=beta))
        assert torch.isfinite(loss).all()
