"""Several caches in one stream (train/mix.py MultiStream): each micro-batch from one cache; by default drawn in
proportion to the positions each has left, so one epoch trains every sample of every cache once and the caches
run out together; fixed weights (--cache-weights, GKD's lambda of --mix-cache) cycle. The draws are seeded, so a
resumed stream continues as an uninterrupted one, and a new round's cache is read from its start while a
cache carried over reads on."""
import dataclasses
import itertools

import numpy as np
import pytest

from kdcache.cache_format import write_cache
from kdcache.train.data import CacheStream
from kdcache.train.mix import MultiStream
from tests.helpers.records import make_records, writer_kwargs


def _cache(path, first_id, n=40):
    recs = make_records(n, seed=first_id)
    recs = [dataclasses.replace(r, sample_id=first_id + i) for i, r in enumerate(recs)]
    kw = writer_kwargs("arrow")
    kw["fingerprint_parts"] = {"teacher": f"t{first_id}", "data": f"d{first_id}"}
    write_cache(path, recs, shard_size=10, **kw)
    return str(path)


def _stream(caches, weights, seed=0, epochs=None):
    kw = dict(batch_size=4, seed=seed, epochs=epochs)
    return MultiStream([CacheStream(c, **kw) for c in caches], weights, seed)


def _ids(batches, n=None):
    return [[r.sample_id for r in recs] for recs, _ in itertools.islice(batches, n)]


def _positions(cache):
    s = CacheStream(cache, batch_size=4, epochs=1, shuffle=False)
    return sum(len(r.positions) for r, _ in s.samples())


@pytest.fixture
def caches(tmp_path):
    return _cache(tmp_path / "on", 0), _cache(tmp_path / "off", 1000), _cache(tmp_path / "next", 2000)


@pytest.fixture
def uneven(tmp_path):
    """Three caches of 60, 30 and 10 samples."""
    return _cache(tmp_path / "a", 0, 60), _cache(tmp_path / "b", 1000, 30), _cache(tmp_path / "c", 2000, 10)


@pytest.mark.parametrize("lam", [0.0, 0.3, 1.0])
def test_each_micro_batch_comes_from_one_cache_with_probability_lambda(caches, lam):
    on, off, _ = caches
    got = _ids(_stream([on, off], [lam, 1 - lam]).batches(), 400)
    assert all(all(i < 1000 for i in b) or all(i >= 1000 for i in b) for b in got)    # one cache per batch
    from_on = [b[0] < 1000 for b in got]
    share = sum(from_on) / len(got)
    assert abs(share - lam) < 0.08, share      # 400 draws: 3.5 standard errors at lambda 0.3
    # and each side is its own stream, in its own order: the batches from each are that cache's stream alone
    alone = _ids(CacheStream(on, batch_size=4, seed=0, epochs=None).batches(), 400)
    assert [b for b, f in zip(got, from_on) if f] == alone[:sum(from_on)]


@pytest.mark.parametrize("epochs", [1, 2])
def test_an_epoch_over_several_caches_trains_every_sample_of_each_once_and_they_end_together(uneven, epochs):
    got = _ids(_stream(uneven, None, epochs=epochs).batches())
    flat = [i for b in got for i in b]
    want = list(range(60)) + list(range(1000, 1030)) + list(range(2000, 2010))
    assert sorted(flat) == sorted(want * epochs)          # every sample of every cache, `epochs` times, no more
    assert all(len({i // 1000 for i in b}) == 1 for b in got)   # one cache per micro-batch
    assert len(got) == sum(CacheStream(c, batch_size=4, epochs=epochs).count_batches(epochs) for c in uneven)
    # in proportion to the positions left: each cache's last batch is near the end, the small one's included
    # (drawn uniformly, the 10-sample cache would be done a third of the way in)
    last = {c: max(n for n, b in enumerate(got) if b[0] // 1000 == c) for c in (0, 1, 2)}
    assert min(last.values()) >= 0.7 * len(got), (last, len(got))
    if epochs == 2:      # each epoch interleaves the caches: every cache's first epoch ends before the middle+
        first = {c: [n for n, b in enumerate(got) if b[0] // 1000 == c] for c in (0, 1, 2)}
        ends = {c: first[c][len(first[c]) // 2 - 1] for c in first}
        assert max(ends.values()) < 0.65 * len(got), (ends, len(got))


def test_the_draws_follow_the_positions_left_not_the_sample_counts(tmp_path):
    """A cache of few long samples and one of many short ones: shares by positions, not by samples."""
    rng_long = [dataclasses.replace(r, sample_id=i) for i, r in enumerate(make_records(20, seed=1, min_len=50,
                                                                                       max_len=60))]
    rng_short = [dataclasses.replace(r, sample_id=1000 + i) for i, r in enumerate(make_records(80, seed=2, min_len=6,
                                                                                               max_len=10))]
    a, b = str(tmp_path / "long"), str(tmp_path / "short")
    for path, recs, tag in ((a, rng_long, "l"), (b, rng_short, "s")):
        kw = writer_kwargs("arrow")
        kw["fingerprint_parts"] = {"teacher": tag, "data": tag}
        write_cache(path, recs, shard_size=10, **kw)
    stream = _stream([a, b], None)         # cycling (max-steps): shares over many passes
    got = list(itertools.islice(stream.batches(), 600))
    pos = [0, 0]
    for recs, p in got:
        pos[p.source] += sum(len(r.positions) for r in recs)
    share = pos[0] / sum(pos)
    want = _positions(a) / (_positions(a) + _positions(b))
    assert abs(share - want) < 0.05, (share, want)
    samples_share = 20 / 100
    assert abs(want - samples_share) > 0.2       # the two rules differ on these caches


def test_fixed_weights_over_three_caches(caches):
    got = _ids(_stream(list(caches), [0.5, 0.3, 0.2]).batches(), 600)
    share = np.bincount([b[0] // 1000 for b in got], minlength=3) / len(got)
    assert np.abs(share - [0.5, 0.3, 0.2]).max() < 0.07, share


@pytest.mark.parametrize("weights,epochs,cut", [([0.5, 0.5], None, 13), (None, 1, 7), (None, 1, 20), (None, 2, 33)])
def test_a_resumed_stream_continues_as_an_uninterrupted_one(uneven, weights, epochs, cut):
    caches = uneven[:len(weights)] if weights else uneven
    straight = _ids(_stream(caches, weights, epochs=epochs).batches(), 60)
    first = _stream(caches, weights, epochs=epochs)
    batches = first.batches()
    for _ in range(cut):
        _, position = next(batches)
    first.position = position
    resumed = _stream(caches, weights, epochs=epochs)
    resumed.load_state_dict(first.state_dict())
    assert _ids(resumed.batches(), 60 - cut) == straight[cut:]


def test_a_new_round_reads_its_cache_from_the_start_and_the_mixed_in_cache_reads_on(caches):
    on, off, nxt = caches
    first = _stream([on, off], [0.5, 0.5])
    batches = first.batches()
    seen_off = []
    for _ in range(12):
        recs, position = next(batches)
        if recs[0].sample_id >= 1000:
            seen_off += [r.sample_id for r in recs]
    first.position = position
    carried = _stream([nxt, off], [0.5, 0.5])
    carried.carry_over(first.state_dict())
    got = _ids(carried.batches(), 20)
    nxt_batches = [b for b in got if b[0] >= 2000]
    off_batches = [b for b in got if 1000 <= b[0] < 2000]
    assert nxt_batches and off_batches
    assert nxt_batches == _ids(CacheStream(nxt, batch_size=4, seed=0, epochs=None).batches(), len(nxt_batches))
    alone_off = [i for b in _ids(CacheStream(off, batch_size=4, seed=0, epochs=None).batches(), 40) for i in b]
    assert [i for b in off_batches for i in b] == alone_off[len(seen_off):len(seen_off) + 4 * len(off_batches)]


def test_a_two_cache_state_saved_before_several_caches_still_resumes(caches):
    on, off, nxt = caches
    first = _stream([on, off], [0.5, 0.5])
    batches = first.batches()
    for _ in range(9):
        _, position = next(batches)
    first.position = position
    new = first.state_dict()
    old = {"main": new["streams"][0], "mix": new["streams"][1], "draws": new["draws"]}   # the earlier layout
    for k in ("cache", "used"):
        old["main"].pop(k), old["mix"].pop(k)
    a, b = _stream([on, off], [0.5, 0.5]), _stream([on, off], [0.5, 0.5])
    a.load_state_dict(new)
    b.load_state_dict(old)
    assert _ids(a.batches(), 15) == _ids(b.batches(), 15)
    c = _stream([nxt, off], [0.5, 0.5])
    c.carry_over(old)
    assert c.position.streams[1] == first.position.streams[1] and c.position.streams[0].to_dict()["epoch"] == 0


def test_the_config_takes_mix_cache_beside_one_cache_and_refuses_it_beside_several():
    from kdcache.common.errors import ConfigError
    from kdcache.train.config import TrainConfig
    cfg = TrainConfig(cache="A", student="S", out="O", mix_cache="B", mix_lambda=0.25, max_steps=4)
    assert cfg.caches == ["A", "B"] and cfg.weights() == [0.25, 0.75]
    with pytest.raises(ConfigError, match="mix_cache.*two-cache case"):
        TrainConfig(cache=["A", "C"], student="S", out="O", mix_cache="B", max_steps=4)
    with pytest.raises(ConfigError, match="cache_weights.*--mix-lambda"):
        TrainConfig(cache="A", student="S", out="O", mix_cache="B", cache_weights="1,1", max_steps=4)
    three = TrainConfig(cache=["A", "B", "C"], student="S", out="O", cache_weights="1,1,2", max_steps=4)
    assert three.weights() == [0.25, 0.25, 0.5]
