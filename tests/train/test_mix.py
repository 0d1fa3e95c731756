"""Two caches in one stream (GKD's lambda): each micro-batch from the first with probability lambda, the draws
seeded so a resumed stream continues as an uninterrupted one, and a new round's cache read from its start while
the mixed-in cache reads on."""
import dataclasses
import itertools

import pytest

from kdcache.cache_format import write_cache
from kdcache.train.data import CacheStream
from kdcache.train.mix import MixedStream
from tests.helpers.records import make_records, writer_kwargs


def _cache(path, first_id, n=40):
    recs = make_records(n, seed=first_id)
    recs = [dataclasses.replace(r, sample_id=first_id + i) for i, r in enumerate(recs)]
    write_cache(path, recs, shard_size=10, **writer_kwargs("arrow"))
    return str(path)


def _stream(main, mix, lam, seed=0):
    kw = dict(batch_size=4, seed=seed, epochs=None)
    return MixedStream(CacheStream(main, **kw), CacheStream(mix, **kw), lam, seed)


def _ids(batches, n):
    return [[r.sample_id for r in recs] for recs, _ in itertools.islice(batches, n)]


@pytest.fixture
def caches(tmp_path):
    return _cache(tmp_path / "on", 0), _cache(tmp_path / "off", 1000), _cache(tmp_path / "next", 2000)


@pytest.mark.parametrize("lam", [0.0, 0.3, 1.0])
def test_each_micro_batch_comes_from_one_cache_with_probability_lambda(caches, lam):
    on, off, _ = caches
    got = _ids(_stream(on, off, lam).batches(), 400)
    assert all(all(i < 1000 for i in b) or all(i >= 1000 for i in b) for b in got)    # one cache per batch
    from_on = [b[0] < 1000 for b in got]
    share = sum(from_on) / len(got)
    assert abs(share - lam) < 0.08, share      # 400 draws: 3.5 standard errors at lambda 0.3
    # and each side is its own stream, in its own order: the batches from each are that cache's stream alone
    alone = _ids(CacheStream(on, batch_size=4, seed=0, epochs=None).batches(), 400)
    assert [b for b, f in zip(got, from_on) if f] == alone[:sum(from_on)]


def test_a_resumed_mixed_stream_continues_as_an_uninterrupted_one(caches):
    on, off, _ = caches
    straight = _ids(_stream(on, off, 0.5).batches(), 30)
    first = _stream(on, off, 0.5)
    batches = first.batches()
    for _ in range(13):
        _, position = next(batches)
    first.position = position
    state = first.state_dict()
    resumed = _stream(on, off, 0.5)
    resumed.load_state_dict(state)
    assert _ids(resumed.batches(), 17) == straight[13:]


def test_a_new_round_reads_its_cache_from_the_start_and_the_mixed_in_cache_reads_on(caches):
    on, off, nxt = caches
    first = _stream(on, off, 0.5)
    batches = first.batches()
    seen_off = []
    for _ in range(12):
        recs, position = next(batches)
        if recs[0].sample_id >= 1000:
            seen_off += [r.sample_id for r in recs]
    first.position = position
    carried = _stream(nxt, off, 0.5)
    carried.carry_over(first.state_dict())
    got = _ids(carried.batches(), 20)
    nxt_batches = [b for b in got if b[0] >= 2000]
    off_batches = [b for b in got if 1000 <= b[0] < 2000]
    assert nxt_batches and off_batches
    assert nxt_batches == _ids(CacheStream(nxt, batch_size=4, seed=0, epochs=None).batches(), len(nxt_batches))
    alone_off = [i for b in _ids(CacheStream(off, batch_size=4, seed=0, epochs=None).batches(), 40) for i in b]
    assert [i for b in off_batches for i in b] == alone_off[len(seen_off):len(seen_off) + 4 * len(off_batches)]
