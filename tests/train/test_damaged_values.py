"""Issue 42, item 1: training on a cache whose values are damaged (a re-signed shard: its checksum passes) stops,
naming the shard and what is wrong, or with --skip-damaged-shards skips that shard and counts it exactly as a shard
that fails its checksum is counted (tests/train/test_data.py)."""
import numpy as np
import pytest

from kdcache.cache_format import ShardError, Storage, write_cache
from kdcache.train.data import CacheStream
from tests.cache_format.damage import EOS, consistent_records, edit, put, resign, rows_of, shard

V = 300


def _order(stream):
    return [rec.sample_id for rec, _ in stream.samples()]


def _nan_tail(tmp_path, backend="arrow"):
    """30 samples in 3 shards; shard 1's sample 12 gets a NaN tail_mass at its second position, re-signed."""
    write_cache(tmp_path, consistent_records(30, k=8, seed=6), shard_size=10, storage=Storage(backend, 8),
                vocab_size=V, eos_token_ids=[EOS], fingerprint_parts={"t": 1})
    rel, path = shard(tmp_path, 1)
    row, _, rec = rows_of(tmp_path, 1, 2)
    edit(path, "tail_mass", put(row + 1, np.nan))
    resign(tmp_path)
    return rel, path, rec


@pytest.mark.parametrize("backend", ["arrow", "zarr"])
def test_a_nan_tail_mass_stops_the_stream_naming_the_shard(tmp_path, backend):
    rel, path, rec = _nan_tail(tmp_path, backend)
    with pytest.raises(ShardError, match=rf"{path.name}.*sample 12 position {rec.positions[1]}: tail_mass NaN.*"
                                         r"kdcache verify.*--skip-damaged-shards"):
        _order(CacheStream(tmp_path, shuffle=False, epochs=1))


def test_with_skip_damaged_the_shard_is_skipped_and_counted_each_epoch(tmp_path):
    rel, _, _ = _nan_tail(tmp_path)
    s = CacheStream(tmp_path, shuffle=False, epochs=2, skip_damaged=True)
    assert _order(s) == (list(range(10)) + list(range(20, 30))) * 2
    assert s.damaged == {rel: 10}                          # as for a checksum failure: this epoch's share of it
    assert s._refused == {1}                               # decoded once: not again in the second epoch


def test_a_rank_counts_only_its_share_of_the_damaged_shard(tmp_path):
    rel, _, _ = _nan_tail(tmp_path)
    spans = []
    for rank in (0, 1):
        s = CacheStream(tmp_path, shuffle=False, epochs=1, skip_damaged=True, rank=rank, world=2)
        spans.append((_order(s), s.damaged))
    assert spans[0] == (list(range(10)), {rel: 5}) and spans[1] == (list(range(20, 30)), {rel: 5})


def test_a_shard_whose_counts_overflow_its_rows_stops_or_is_skipped(tmp_path):
    """Item 3 on the training path: column damage (a position counting 9 entries where k = 8) is a ShardError naming
    the shard, handled like any damaged shard."""
    write_cache(tmp_path, consistent_records(30, k=8, seed=6), shard_size=10, storage=Storage("arrow", 8),
                vocab_size=V, eos_token_ids=[EOS], fingerprint_parts={"t": 1})
    rel, path = shard(tmp_path, 2)

    def fn(counts):
        counts[0] += 1
        counts[1] -= 1
        return counts
    edit(path, "topk_counts", fn)
    resign(tmp_path)
    with pytest.raises(ShardError, match=rf"{path.name}.*topk_counts is 9.*--skip-damaged-shards"):
        _order(CacheStream(tmp_path, shuffle=False, epochs=1))
    s = CacheStream(tmp_path, shuffle=False, epochs=1, skip_damaged=True)
    assert _order(s) == list(range(20)) and s.damaged == {rel: 10}


def test_the_public_dataset_refuses_the_shard_by_name(tmp_path):
    from kdcache.train.dataset import CacheDataset
    _, path, rec = _nan_tail(tmp_path)
    with pytest.raises(ShardError, match=rf"{path.name}.*sample 12 position {rec.positions[1]}: tail_mass NaN"):
        list(CacheDataset(str(tmp_path), shuffle=False))


def test_positive_log_probs_stop_the_stream(tmp_path):
    write_cache(tmp_path, consistent_records(20, k=8, seed=6), shard_size=10, storage=Storage("arrow", 8, "float32"),
                vocab_size=V, eos_token_ids=[EOS], fingerprint_parts={"t": 1})
    _, path = shard(tmp_path, 0)
    _, entry, rec = rows_of(tmp_path, 0, 0)
    edit(path, "topk_values", lambda v: np.abs(v))                   # every log-prob made positive
    resign(tmp_path)
    with pytest.raises(ShardError, match=rf"{path.name}.*sample 0 position {rec.positions[0]}: top-k log-prob "):
        _order(CacheStream(tmp_path, shuffle=False, epochs=1))


@pytest.mark.deepspeed
@pytest.mark.slow
def test_kdcache_train_on_a_nan_tail_mass_exits_non_zero_naming_the_shard(tiny, tmp_path):
    """The review's run: a re-signed shard with a NaN tail_mass trained a student of NaNs and printed "student
    saved". Now `kdcache train` stops before any step on it, naming the shard, the sample and the position."""
    from transformers import AutoTokenizer

    from kdcache.cache_format.tokenizer_id import tokenizer_identity
    from kdcache.demo.models import make_model
    from tests.train.common import run, train_cmd
    student = make_model(tiny["tok"], "test", seed=5)
    student.config.save_pretrained(str(tmp_path / "student"))
    tiny["tok"].save_pretrained(str(tmp_path / "student"))
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "student"))        # as precompute and train load it
    vocab, eot = len(tok), int(tok.convert_tokens_to_ids("<|im_end|>"))
    write_cache(tmp_path / "cache", consistent_records(12, vocab=vocab, k=8, seed=3, eos=eot), shard_size=4,
                storage=Storage("arrow", 8), vocab_size=vocab, eos_token_ids=[eot], fingerprint_parts={"t": 1},
                meta={"tokenizer": tokenizer_identity(tok), "chat_template": tok.chat_template})
    rel, path = shard(tmp_path / "cache", 0)
    row, _, rec = rows_of(tmp_path / "cache", 0, 1)
    edit(path, "tail_mass", put(row, np.nan))
    resign(tmp_path / "cache")
    res = run(train_cmd({"cache": tmp_path / "cache", "student": tmp_path / "student"}, tmp_path / "out",
                        "--max-steps", 2, "--batch-size", 2, "--no-shuffle", "--save-every", 0))
    assert res.returncode != 0, res.stdout[-2000:]
    assert f"{path.name} (record batch 0): sample {rec.sample_id} position {rec.positions[0]}: tail_mass NaN" \
        in res.stderr, res.stderr[-3000:]
    assert "student saved" not in res.stdout and not (tmp_path / "out" / "final").exists()
