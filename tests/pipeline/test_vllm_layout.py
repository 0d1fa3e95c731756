"""Reading vLLM's flat prompt-logprob layout, without starting vLLM."""
import numpy as np
import pytest

from pipeline.teacher_vllm import _topk_from_flat


class Flat:
    """vLLM FlatLogprobs: per prompt position, [prompt token (any rank), rank 1, ..., rank k]; position 0 empty."""

    def __init__(self, T, k, V, rng, shuffle=False):
        self.start_indices, self.end_indices, self.token_ids, self.logprobs, self.ranks = [0], [0], [], [], []
        self.want_ids, self.want_lp, self.want_target, self.seq = [], [], [], [0]
        for _ in range(1, T):
            lp = np.log(rng.dirichlet(np.ones(V)))
            order = np.argsort(-lp)
            tok = int(rng.integers(V))
            entries = [(tok, lp[tok], int(np.flatnonzero(order == tok)[0]) + 1)]
            self.seq.append(tok)
            self.want_target.append(lp[tok])
            entries += [(int(order[r]), lp[order[r]], r + 1) for r in range(k)]
            if shuffle:                                   # an unexpected order forces the per-position path
                entries = [entries[i] for i in rng.permutation(len(entries))]
            self.start_indices.append(len(self.token_ids))
            for t, v, r in entries:
                self.token_ids.append(t)
                self.logprobs.append(float(v))
                self.ranks.append(r)
            self.end_indices.append(len(self.token_ids))
            self.want_ids.append(order[:k])
            self.want_lp.append(lp[order[:k]])


@pytest.mark.parametrize("shuffle", [False, True])
def test_topk_from_flat_layout(shuffle):
    T, k = 15, 6
    flat = Flat(T, k, 40, np.random.default_rng(1), shuffle=shuffle)
    pos = np.array([0, 3, 4, T - 2])                      # position t reads entry t + 1
    ids, lps, target = _topk_from_flat(flat, pos, k, np.array(flat.seq))
    assert ids.dtype == np.int32 and lps.dtype == np.float32 and ids.shape == lps.shape == (len(pos), k)
    np.testing.assert_array_equal(ids, np.array(flat.want_ids)[pos])
    np.testing.assert_allclose(lps, np.array(flat.want_lp)[pos], rtol=1e-6)
    np.testing.assert_allclose(target, np.array(flat.want_target)[pos], rtol=1e-6)   # the token itself, any rank


def test_wrong_length_is_an_error():
    flat = Flat(5, 3, 20, np.random.default_rng(0))
    with pytest.raises(RuntimeError, match="expected 6"):
        _topk_from_flat(flat, np.array([0]), 3, np.zeros(6, np.int32))
