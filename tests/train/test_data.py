import numpy as np
import pytest

from kdcache.cache_format import write_cache
from kdcache.common.errors import TrainDataError
from kdcache.train.batch import collate
from kdcache.train.data import CacheStream
from tests.helpers.records import make_records, writer_kwargs


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("c")
    write_cache(d, make_records(53, seed=3), shard_size=8, **writer_kwargs("arrow"))   # 7 shards, last has 5
    return d


def order(stream, n=None):
    out = []
    for rec, _ in stream.samples():
        out.append(rec.sample_id)
        if n and len(out) == n:
            break
    return out


def test_order_is_a_function_of_seed_and_epoch(cache_dir):
    a = order(CacheStream(cache_dir, seed=1, epochs=2))
    assert a == order(CacheStream(cache_dir, seed=1, epochs=2))
    assert a != order(CacheStream(cache_dir, seed=2, epochs=2))
    e0, e1 = a[:53], a[53:]
    assert sorted(e0) == sorted(e1) == list(range(53)) and e0 != e1      # every sample once per epoch, reshuffled
    assert order(CacheStream(cache_dir, shuffle=False, epochs=1)) == list(range(53))


def test_shuffled_within_shards_not_only_across(cache_dir):
    a = order(CacheStream(cache_dir, seed=0, epochs=1))
    first_shard = a[:8]
    assert len({s // 8 for s in first_shard}) == 1 and first_shard != sorted(first_shard)


@pytest.mark.parametrize("world", [2, 3, 8, 53])
def test_ranks_read_disjoint_equal_parts_that_cover_the_cache(cache_dir, world):
    """Any world size, even more ranks than shards (7 here): every sample once, ranks within one of each other."""
    parts = [order(CacheStream(cache_dir, rank=r, world=world, seed=4, epochs=1)) for r in range(world)]
    assert sorted(s for p in parts for s in p) == list(range(53))
    assert max(map(len, parts)) - min(map(len, parts)) <= 1
    assert [p for q in parts for p in q] == order(CacheStream(cache_dir, seed=4, epochs=1))   # spans of one order
    streams = [CacheStream(cache_dir, rank=r, world=world) for r in range(world)]
    assert [s.samples_per_epoch() for s in streams] == list(map(len, parts))


def test_a_rank_resumes_exactly_in_the_middle_of_its_span(cache_dir):
    ref = CacheStream(cache_dir, rank=1, world=3, seed=6, epochs=2, batch_size=4)
    batches = list(ref.batches())
    flat = [r.sample_id for b, _ in batches for r in b]
    for cut in (1, 3, len(batches) - 1):
        s = CacheStream(cache_dir, rank=1, world=3, seed=6, epochs=2, batch_size=4)
        s.load_state_dict(batches[cut - 1][1].to_dict())
        assert [r.sample_id for b, _ in s.batches() for r in b] == flat[sum(len(b) for b, _ in batches[:cut]):]


def test_resume_from_any_state_continues_with_exactly_the_next_samples(cache_dir):
    ref = CacheStream(cache_dir, seed=5, epochs=2, batch_size=3)
    batches = list(ref.batches())
    flat = [r.sample_id for b, _ in batches for r in b]
    for cut in (1, 2, 7, 17, len(batches) - 1):
        s = CacheStream(cache_dir, seed=5, epochs=2, batch_size=3)
        s.load_state_dict(batches[cut - 1][1].to_dict())
        rest = [r.sample_id for b, _ in s.batches() for r in b]
        done = sum(len(b) for b, _ in batches[:cut])
        assert rest == flat[done:]


def test_more_ranks_than_samples_is_refused(cache_dir):
    with pytest.raises(TrainDataError, match="53 sample.*54 ranks"):
        CacheStream(cache_dir, world=54)


def test_token_budget_limits_padded_batch(cache_dir):
    s = CacheStream(cache_dir, seed=0, epochs=1, batch_size=100, max_tokens=200)
    for batch, _ in s.batches():
        longest = max(len(r.input_ids) for r in batch)
        assert len(batch) == 1 or longest * len(batch) <= 200


def test_collate_aligns_positions_and_targets():
    recs = make_records(3, seed=9)
    b = collate(recs, pad_id=0, student_vocab=300)
    assert b.input_ids.shape == (3, max(len(r.input_ids) for r in recs))
    assert b.n_positions == sum(len(r.positions) for r in recs)
    want = np.concatenate([r.targets for r in recs])
    np.testing.assert_array_equal(b.targets.numpy(), want)
    assert int(b.attention_mask.sum()) == sum(len(r.input_ids) for r in recs)


def test_teacher_ids_outside_student_vocab_move_to_tail():
    """Padded vocabularies differ (e.g. 152064 vs 151936): such teacher ids leave the support, mass -> tail."""
    recs = make_records(2, seed=1, vocab=300)
    for r in recs:
        r.input_ids = np.minimum(r.input_ids, 149).astype(np.int32)   # inputs fit a 150-row student
    assert collate(recs, pad_id=0, student_vocab=300).n_outside_vocab == 0
    b = collate(recs, pad_id=0, student_vocab=150)
    tid = np.concatenate([r.topk_ids for r in recs])
    outside = tid >= 150
    assert b.n_outside_vocab == int(outside.sum()) > 0
    assert (b.topk_ids.numpy()[outside] == -1).all() and (b.topk_ids.numpy()[~outside] == tid[~outside]).all()
    tlp = np.concatenate([r.topk_logprobs for r in recs])
    tail = np.concatenate([r.tail_mass for r in recs])
    np.testing.assert_allclose(b.tail_mass.numpy(), tail + np.where(outside, np.exp(tlp), 0).sum(1), atol=1e-6)


def test_input_ids_outside_student_vocab_is_an_error():
    recs = make_records(1, seed=1, vocab=300)
    with pytest.raises(TrainDataError, match="tokenizers differ"):
        collate(recs, pad_id=0, student_vocab=int(recs[0].input_ids.max()))


def test_damaged_shard_stops_training_or_is_skipped_and_counted(tmp_path):
    from kdcache.cache_format import ShardError
    manifest = write_cache(tmp_path, make_records(30, seed=6), shard_size=10, **writer_kwargs("arrow"))
    rel = manifest["shards"][1]["path"]                      # names come from the manifest (job-tagged)
    victim = tmp_path / rel
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    with pytest.raises(ShardError, match=f"{victim.name}.*--skip-damaged-shards"):
        order(CacheStream(tmp_path, shuffle=False, epochs=1))
    s = CacheStream(tmp_path, shuffle=False, epochs=1, skip_damaged=True)
    assert order(s) == list(range(10)) + list(range(20, 30))
    assert s.damaged == {rel: 10}


def test_a_stream_position_steps_through_rows_segments_and_epochs():
    from kdcache.train.data import StreamPosition
    p = StreamPosition(2, 1, 0)
    assert p.after_row(0, 3, 4) == StreamPosition(2, 1, 1)
    assert p.after_row(2, 3, 4) == StreamPosition(2, 2, 0)            # the segment's last row
    assert StreamPosition(2, 3, 0).after_row(2, 3, 4) == StreamPosition(3, 0, 0)   # the epoch's last
    assert StreamPosition.from_dict(p.to_dict()) == p
    assert p.to_dict() == {"epoch": 2, "shard_cursor": 1, "row_cursor": 0}      # the checkpoint's keys


@pytest.mark.parametrize("max_tokens,batch", [(0, 4), (0, 5), (90, 8), (200, 3), (60, 16)])
def test_count_batches_is_what_batches_yields(cache_dir, max_tokens, batch):
    for world, rank in ((1, 0), (3, 2)):
        s = CacheStream(cache_dir, rank=rank, world=world, seed=2, batch_size=batch, max_tokens=max_tokens,
                        epochs=2)
        assert s.count_batches(2) == sum(1 for _ in s.batches()), (max_tokens, batch, world)
        s.close()


@pytest.mark.parametrize("backend", ["arrow", "zarr"])
def test_a_shard_reports_its_sample_lengths(tmp_path, backend):
    from kdcache.cache_format import open_cache
    recs = make_records(300, seed=4)                     # more than one Arrow record batch
    write_cache(tmp_path, recs, shard_size=300, **writer_kwargs(backend))
    assert open_cache(tmp_path).shard(0).lengths().tolist() == [len(r.input_ids) for r in recs]
