"""The loss on format 2's ragged rows (top-p, sqrt8 order) and the target-token bucket, against dense references."""
import numpy as np
import pytest
import torch

from kdcache.cache_format import Record, compact, open_cache, write_cache
from kdcache.train.batch import collate, with_target
from kdcache.train.losses import LossConfig, kd_loss_from_logits
from tests.helpers.records import make_records, writer_kwargs

V, K = 50, 8


def bucket_kl(student_logits, rows, beta):
    """Reference, one position at a time in float64: buckets = the row's entries (any order) + one bucket for
    every other id; teacher (ids, logprobs, tail) per row. Generalized JSD with the ends as KLs."""
    out = []
    for z, (ids, lps, tail) in zip(student_logits.double(), rows):
        s = torch.softmax(z, -1)
        ids = torch.as_tensor(ids, dtype=torch.long)
        t = torch.cat([torch.as_tensor(lps, dtype=torch.float64).exp(), torch.tensor([tail], dtype=torch.float64)])
        q = torch.cat([s[ids], (1 - s[ids].sum()).reshape(1)])
        t, q = t / t.sum(), q / q.sum()

        def kl(a, b):
            return (torch.xlogy(a, a) - torch.xlogy(a, b)).sum()
        if beta == 0:
            out.append(kl(t, q))
        elif beta == 1:
            out.append(kl(q, t))
        else:
            m = beta * t + (1 - beta) * q
            out.append(beta * kl(t, m) + (1 - beta) * kl(q, m))
    return torch.stack(out)


@pytest.mark.parametrize("dtype,top_p", [("float16", 0.8), ("sqrt8", None), ("sqrt8", 0.9)])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_ragged_rows_from_a_cache_give_the_dense_per_row_loss(tmp_path, dtype, top_p, beta):
    recs = make_records(6, seed=4, k=K, vocab=V)
    write_cache(tmp_path, recs, shard_size=6, **writer_kwargs("arrow", k=K, vocab=V, logprob_dtype=dtype, top_p=top_p))
    got = list(open_cache(tmp_path))
    assert top_p is None or any((r.topk_ids < 0).any() for r in got)         # rows really are ragged
    b = collate(got, pad_id=0, student_vocab=V)
    z = torch.randn(b.n_positions, V, generator=torch.Generator().manual_seed(0)) * 2
    loss, _ = kd_loss_from_logits(z, b.topk_ids, b.topk_logprobs, b.tail_mass, b.targets, LossConfig(beta=beta))
    rows = [(r.topk_ids[p][r.topk_ids[p] >= 0], r.topk_logprobs[p][r.topk_ids[p] >= 0], r.tail_mass[p])
            for r in got for p in range(len(r.positions))]
    want = bucket_kl(z, rows, beta).sum()
    torch.testing.assert_close(loss.double(), want, rtol=2e-5, atol=2e-6)


def test_the_target_becomes_one_more_bucket_carved_from_the_tail():
    tid = np.array([[3, 4, -1], [5, 6, 7]], dtype=np.int64)
    tlp = np.log(np.array([[0.5, 0.2, 0.0], [0.4, 0.3, 0.1]])).astype(np.float32)
    tail = np.array([0.3, 0.2], dtype=np.float32)
    targets = np.array([9, 6])                                  # outside row 0's entries, inside row 1's
    ids, lps, rest = with_target(tid, tlp, tail, targets, np.log(np.array([0.1, 0.3])).astype(np.float32))
    assert ids.tolist() == [[3, 4, -1, 9], [5, 6, 7, -1]]
    np.testing.assert_allclose(np.exp(lps[0, 3]), 0.1, rtol=1e-6)
    np.testing.assert_allclose(rest, [0.2, 0.2], rtol=1e-6)      # row 1 unchanged: its target is stored
    ids, _, rest = with_target(tid, tlp, tail, targets, np.array([np.nan, np.nan], np.float32))
    assert (ids[:, 3] == -1).all() and np.allclose(rest, tail)   # unknown target log-probs: nothing added


def test_the_target_bucket_changes_the_loss_as_the_reference_says():
    """A student that puts the tail's mass on the true token: with the target's log-prob known, the loss sees
    whether the teacher agrees; a cache without it (format 1) cannot."""
    rng = np.random.default_rng(0)
    ids = np.arange(1, 9, dtype=np.int32)[None, :].repeat(3, 0)
    lps = np.log(np.full((3, K), 0.08)).astype(np.float32)                  # 0.64 in the top-k, 0.36 outside
    inp = np.array([0, 20, 21, 22, 23], dtype=np.int32)
    rec = Record(0, inp, np.arange(3, dtype=np.int32), ids, lps, np.full(3, 0.36, np.float32),
                 target_logprobs=np.log(np.full(3, 0.3)).astype(np.float32))
    z = torch.as_tensor(rng.normal(size=(3, V)), dtype=torch.float32)
    cfg = LossConfig()
    with_t = collate([rec], pad_id=0, student_vocab=V)
    no_t = collate([Record(**{**rec.__dict__, "target_logprobs": None})], pad_id=0, student_vocab=V)
    a, _ = kd_loss_from_logits(z, with_t.topk_ids, with_t.topk_logprobs, with_t.tail_mass, with_t.targets, cfg)
    b, _ = kd_loss_from_logits(z, no_t.topk_ids, no_t.topk_logprobs, no_t.tail_mass, no_t.targets, cfg)
    rows = [(np.r_[ids[p], inp[p + 1]], np.r_[lps[p], np.log(0.3)], 0.06) for p in range(3)]
    torch.testing.assert_close(a.double(), bucket_kl(z, rows, 0.0).sum(), rtol=2e-5, atol=2e-6)
    assert abs(float(a) - float(b)) > 1e-3


def test_sqrt8_storage_moves_the_loss_by_little(tmp_path):
    """The same positions through float32 and sqrt8 storage: the loss a student sees differs by about the
    stored KL, not more."""
    recs = make_records(8, seed=9, k=K, vocab=V)
    losses = {}
    for dtype in ("float32", "sqrt8"):
        write_cache(tmp_path / dtype, recs, shard_size=8, **writer_kwargs("zarr", k=K, vocab=V, logprob_dtype=dtype))
        b = collate(list(open_cache(tmp_path / dtype)), pad_id=0, student_vocab=V)
        z = torch.randn(b.n_positions, V, generator=torch.Generator().manual_seed(1))
        losses[dtype] = float(kd_loss_from_logits(z, b.topk_ids, b.topk_logprobs, b.tail_mass, b.targets,
                                                  LossConfig())[0]) / b.n_positions
    assert compact.LEVELS == 255 and abs(losses["sqrt8"] - losses["float32"]) < 5e-3 * losses["float32"]
