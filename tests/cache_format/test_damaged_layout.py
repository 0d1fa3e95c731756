"""Issue 42, item 3: a re-signed shard whose columns disagree (counts against entries, draw counts short, offsets
that do not match) is a ShardError naming the shard in the readers and a problem of that shard in verify, which goes
on to the other shards: never a traceback. (test_column_lengths.py covers two Arrow cuts.)"""
import re

import pytest

from kdcache.cache_format import ShardError, Storage, open_cache, verify_cache, write_cache
from tests.cache_format.damage import EOS, consistent_records, edit, resign, shard
from tests.cache_format.test_read_checks import V


def _cache(tmp_path, backend, k=8, sample=0):
    if sample:
        from tests.cache_format.test_sampled import sampled_records
        recs = sampled_records(9, k, sample, seed=2)[0]
    else:
        recs = consistent_records(9, k=k, seed=6)
    write_cache(tmp_path, recs, shard_size=3, storage=Storage(backend, k, "float16", sample=sample), vocab_size=V,
                eos_token_ids=[EOS], fingerprint_parts={"t": 1})
    return tmp_path


def _named_and_skipped(cache, rel, pattern):
    rep = verify_cache(cache)
    assert [w for w, _ in rep.problems] == [rel], rep.problems
    assert re.search(pattern, rep.problems[0][1]), rep.problems
    assert rep.shards_checked == 3 and rep.samples_checked == 6            # the other two shards, checked
    c = open_cache(cache)
    with pytest.raises(ShardError, match=rel):
        list(c)
    assert [r.sample_id for r in c.iter_shard(0)] == [0, 1, 2] and len(list(c.iter_shard(2))) == 3


@pytest.mark.parametrize("backend", ["arrow", "zarr"])
def test_a_position_counting_more_entries_than_a_row_holds_is_named(tmp_path, backend):
    """topk_counts 9 then 7 where k = 8: the sum still matches the entries, so only the width check sees it (it
    used to fail inside numpy's boolean assignment, naming nothing)."""
    cache = _cache(tmp_path, backend)
    rel, path = shard(cache, 1)

    def fn(counts):
        counts[0] += 1
        counts[1] -= 1
        return counts
    edit(path, "topk_counts", fn)
    resign(cache)
    _named_and_skipped(cache, rel, r"sample 3 position \d+: topk_counts is 9, more than the 8 entries a position "
                                   r"holds")


def test_draw_counts_short_of_the_entries_are_named(tmp_path):
    cache = _cache(tmp_path, "zarr", k=2, sample=6)
    rel, path = shard(cache, 1)
    edit(path, "sample_counts", lambda c: c[:-1])
    resign(cache)
    _named_and_skipped(cache, rel, "column lengths disagree: sample_counts has")


def test_token_offsets_past_the_tokens_are_named(tmp_path):
    cache = _cache(tmp_path, "zarr")
    rel, path = shard(cache, 1)

    def fn(off):
        off[-1] += 1
        return off
    edit(path, "token_offsets", fn)
    resign(cache)
    _named_and_skipped(cache, rel, "column lengths disagree: input_ids: offsets")


def test_position_offsets_that_move_a_position_into_another_sample_are_named(tmp_path):
    """The lengths still agree (the offsets end where the positions do), but sample 3 gets sample 4's first
    position: outside its tokens, or not after its own last one. The reader used to hand it out."""
    cache = _cache(tmp_path, "zarr")
    rel, path = shard(cache, 1)

    def fn(off):
        off[1] += 1
        return off
    edit(path, "position_offsets", fn)
    resign(cache)
    _named_and_skipped(cache, rel, r"sample 3 position \d+: (position outside|positions not strictly increasing)")
