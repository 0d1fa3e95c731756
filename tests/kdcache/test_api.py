"""The public API (import kdcache): lazy torch, the dataset's order, split and resume, the loss functions."""
import subprocess
import sys

import numpy as np
import pytest
import torch

from kdcache.cache_format import write_cache
from kdcache.common.errors import ConfigError
from tests.helpers.cli import user_env, user_project
from tests.helpers.records import make_records, writer_kwargs


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("api")
    write_cache(d, make_records(53, seed=3), shard_size=8, **writer_kwargs("arrow"))       # 7 shards
    return str(d)


def test_importing_kdcache_does_not_import_torch_until_a_torch_name_is_used():
    code = ("import sys, kdcache; assert 'torch' not in sys.modules; kdcache.open_cache; kdcache.Record; "
            "assert 'torch' not in sys.modules, 'open_cache pulled torch'; kdcache.kd_loss; "
            "assert 'torch' in sys.modules; print(sorted(kdcache.__all__))")
    res = subprocess.run([sys.executable, "-c", code], cwd=user_project(), capture_output=True, text=True, timeout=120,
                         env=user_env())
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == str(["Batch", "CacheDataset", "CrossTokenizer", "LossConfig", "Record", "collate",
                                      "kd_loss", "kd_loss_chunked", "open_cache"])


def test_help_shows_the_api():
    import pydoc

    import kdcache
    text = pydoc.render_doc(kdcache)
    for name in kdcache.__all__:
        assert name in text
    assert set(dir(kdcache)) == set(kdcache.__all__)


def ids(dataset):
    return [r.sample_id for r in dataset]


def test_the_dataset_is_every_sample_once_per_epoch_split_over_ranks(cache_dir):
    import kdcache
    one = ids(kdcache.CacheDataset(cache_dir, seed=1, epochs=2))
    assert sorted(one[:53]) == sorted(one[53:]) == list(range(53)) and one[:53] != one[53:]
    parts = [ids(kdcache.CacheDataset(cache_dir, seed=1, rank=r, world_size=3)) for r in range(3)]
    assert [i for p in parts for i in p] == one[:53]                       # contiguous spans of one order


def tag_with_worker(record):
    return record, torch.utils.data.get_worker_info().id


def test_dataloader_workers_read_disjoint_shards(cache_dir):
    import kdcache
    cache = kdcache.open_cache(cache_dir)
    shard_of = {r.sample_id: j for j in range(cache.num_shards) for r in cache.iter_shard(j)}
    loader = torch.utils.data.DataLoader(kdcache.CacheDataset(cache, seed=2), batch_size=None, num_workers=2,
                                         collate_fn=tag_with_worker)
    seen = list(loader)
    assert sorted(r.sample_id for r, _ in seen) == list(range(53))         # every sample once, none twice
    by_worker = [set(), set()]
    for r, worker in seen:
        by_worker[worker].add(shard_of[r.sample_id])
    assert by_worker[0] and by_worker[1] and not by_worker[0] & by_worker[1]


def test_state_dict_resumes_exactly(cache_dir):
    import kdcache
    full = ids(kdcache.CacheDataset(cache_dir, seed=3, epochs=2))
    for cut in (1, 8, 30, 80):
        ds = kdcache.CacheDataset(cache_dir, seed=3, epochs=2)
        it = iter(ds)
        head = [next(it).sample_id for _ in range(cut)]
        state = ds.state_dict()
        again = kdcache.CacheDataset(cache_dir, seed=3, epochs=2)
        again.load_state_dict(state)
        assert head + ids(again) == full


def _collate(records):
    import kdcache
    return kdcache.collate(records, pad_id=0, student_vocab=300)


def test_a_loop_that_fetches_ahead_resumes_at_what_it_trained(cache_dir):
    """Accelerate and the HF Trainer fetch the next batch before the step on this one is done: the dataset's own
    position is then one batch past what was trained (issue 23, item 7). mark_trained makes it exact."""
    import kdcache
    full = ids(kdcache.CacheDataset(cache_dir, seed=4, epochs=1))
    ds = kdcache.CacheDataset(cache_dir, seed=4, epochs=1)
    loader = iter(torch.utils.data.DataLoader(ds, batch_size=4, collate_fn=_collate))
    trained, ahead = [], next(loader)
    for _ in range(3):                                 # train a batch while the next one is already fetched
        batch, ahead = ahead, next(loader)
        trained += batch.sample_ids
        ds.mark_trained(batch)
    assert ds.state_dict() != kdcache.CacheDataset(cache_dir).state_dict()
    again = kdcache.CacheDataset(cache_dir, seed=4, epochs=1)
    again.load_state_dict(ds.state_dict())
    assert trained + ids(again) == full                 # nothing lost (the fetched-ahead batch), nothing twice


def test_each_iteration_is_the_next_epoch(cache_dir):
    import kdcache
    ds = kdcache.CacheDataset(cache_dir, seed=5, epochs=1)
    first, second = ids(ds), ids(ds)                    # iterating again used to yield nothing
    both = ids(kdcache.CacheDataset(cache_dir, seed=5, epochs=2))
    assert first + second == both and first != second and sorted(second) == list(range(53))
    ds.set_epoch(5)                                     # the HF Trainer and Accelerate call set_epoch
    assert sorted(ids(ds)) == list(range(53)) and ids(ds) != first


def test_dataloader_workers_resume_exactly_or_are_refused(cache_dir):
    import kdcache
    ds = kdcache.CacheDataset(cache_dir, seed=6, epochs=1)
    trained = []
    for n, batch in enumerate(torch.utils.data.DataLoader(ds, batch_size=3, num_workers=2, collate_fn=_collate)):
        if n < 5:
            trained += batch.sample_ids
            ds.mark_trained(batch)
    state = ds.state_dict()
    assert state["workers"] == 2 and set(state["positions"]) == {"0", "1"}
    again = kdcache.CacheDataset(cache_dir, seed=6, epochs=1)
    again.load_state_dict(state)
    rest = [i for b in torch.utils.data.DataLoader(again, batch_size=3, num_workers=2, collate_fn=_collate)
            for i in b.sample_ids]
    assert sorted(trained + rest) == list(range(53)) and not set(trained) & set(rest)
    other = kdcache.CacheDataset(cache_dir, seed=6, epochs=1)
    other.load_state_dict(state)
    with pytest.raises(ConfigError, match="saved with 2 DataLoader worker"):
        ids(other)                                      # without workers: refused, not all samples again


def test_kd_loss_is_the_trainers_loss_mean_and_chunked_agrees(cache_dir):
    import kdcache
    from kdcache.train.losses import LossConfig, kd_loss_from_logits
    recs = list(kdcache.open_cache(cache_dir))[:4]
    b = kdcache.collate(recs, pad_id=0, student_vocab=300)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(*b.input_ids.shape, 16, generator=g, requires_grad=True)       # (R, T, H)
    head = torch.nn.Linear(16, 300, bias=False)
    logits = head(hidden)                                                              # (R, T, V)
    loss = kdcache.kd_loss(logits, b, beta=0.5, temperature=2.0, sft_alpha=0.1)
    at = logits[b.batch_index, b.positions]
    want, _ = kd_loss_from_logits(at, b.topk_ids, b.topk_logprobs, b.tail_mass, b.targets,
                                  LossConfig(beta=0.5, temperature=2.0, sft_alpha=0.1))
    torch.testing.assert_close(loss, want / b.n_positions)
    torch.testing.assert_close(kdcache.kd_loss(at, b, beta=0.5, temperature=2.0, sft_alpha=0.1), loss)
    chunked = kdcache.kd_loss_chunked(hidden, head, b, beta=0.5, temperature=2.0, sft_alpha=0.1, chunk_size=5)
    torch.testing.assert_close(chunked, loss, rtol=1e-5, atol=1e-6)
    g1 = torch.autograd.grad(loss, hidden)[0]
    g2 = torch.autograd.grad(kdcache.kd_loss_chunked(hidden, head, b, beta=0.5, temperature=2.0, sft_alpha=0.1,
                                                     chunk_size=5), hidden)[0]
    torch.testing.assert_close(g1, g2, rtol=1e-4, atol=1e-6)
    assert np.isfinite(float(loss.detach()))


# ---------------------------------------------------------------------------- several caches
@pytest.fixture(scope="module")
def two_caches(tmp_path_factory, cache_dir):
    """cache_dir (53 samples, ids 0-52) and a second teacher's cache of 21 samples (ids 1000-1020)."""
    import dataclasses
    d = tmp_path_factory.mktemp("api-second")
    recs = [dataclasses.replace(r, sample_id=1000 + i) for i, r in enumerate(make_records(21, seed=9))]
    kw = writer_kwargs("arrow")
    kw["fingerprint_parts"] = {"teacher": "second", "data": "second"}
    write_cache(d, recs, shard_size=5, **kw)
    return [cache_dir, str(d)]


WANT = list(range(53)) + list(range(1000, 1021))


def test_a_dataset_over_several_caches_is_every_sample_of_each_once_per_epoch_as_the_trainer_draws(two_caches):
    import kdcache
    from kdcache.train.data import CacheStream
    from kdcache.train.mix import MultiStream
    got = ids(kdcache.CacheDataset(two_caches, seed=1, epochs=2))
    assert sorted(got[:74]) == sorted(got[74:]) == WANT                 # each epoch: every sample of both, once
    # the trainer's draws, one sample a micro-batch: the same order
    trainer = MultiStream([CacheStream(c, batch_size=1, seed=1, epochs=2) for c in two_caches], None, 1)
    assert got == [r.sample_id for recs, _ in trainer.batches() for r in recs]
    small = [n for n, i in enumerate(got[:74]) if i >= 1000]
    assert small[-1] > 60 and small[0] < 15                           # interleaved in proportion, to the end
    parts = [ids(kdcache.CacheDataset(two_caches, seed=1, rank=r, world_size=2)) for r in range(2)]
    assert sorted(parts[0] + parts[1]) == WANT


def test_a_dataset_over_several_caches_resumes_exactly(two_caches):
    import kdcache
    full = ids(kdcache.CacheDataset(two_caches, seed=3, epochs=2))
    for cut in (1, 30, 74, 100):
        ds = kdcache.CacheDataset(two_caches, seed=3, epochs=2)
        it = iter(ds)
        head = [next(it).sample_id for _ in range(cut)]
        again = kdcache.CacheDataset(two_caches, seed=3, epochs=2)
        again.load_state_dict(ds.state_dict())
        assert head + ids(again) == full


def test_several_caches_with_dataloader_workers_and_mark_trained(two_caches):
    import kdcache
    ds = kdcache.CacheDataset(two_caches, seed=6, epochs=1)
    trained = []
    for n, batch in enumerate(torch.utils.data.DataLoader(ds, batch_size=3, num_workers=2, collate_fn=_collate)):
        if n < 7:
            trained += batch.sample_ids
            ds.mark_trained(batch)
    again = kdcache.CacheDataset(two_caches, seed=6, epochs=1)
    again.load_state_dict(ds.state_dict())
    rest = [i for b in torch.utils.data.DataLoader(again, batch_size=3, num_workers=2, collate_fn=_collate)
            for i in b.sample_ids]
    assert sorted(trained + rest) == WANT


def test_weighted_caches_cycle_and_bad_weights_are_refused(two_caches):
    import itertools

    import kdcache
    ds = kdcache.CacheDataset(two_caches, seed=2, epochs=None, weights=[0.2, 0.8])
    got = [r.sample_id for r in itertools.islice(iter(ds), 500)]
    share = sum(i >= 1000 for i in got) / len(got)
    assert abs(share - 0.8) < 0.06, share
    with pytest.raises(ConfigError, match="epochs=None"):
        kdcache.CacheDataset(two_caches, weights=[0.5, 0.5])
    with pytest.raises(ConfigError, match="one weight per cache"):
        kdcache.CacheDataset(two_caches, epochs=None, weights=[1.0])
    with pytest.raises(ConfigError, match="given twice"):
        kdcache.CacheDataset([two_caches[0], two_caches[0]])
