"""--max-tokens where --batch-size binds first: micro-batches of batch_size samples, counted as they are yielded
(the trainer's step count comes from count_batches)."""
import dataclasses

import pytest

from kdcache.cache_format import write_cache
from kdcache.train.data import CacheStream
from tests.helpers.records import make_records, writer_kwargs


@pytest.mark.parametrize("max_tokens", [0, 10**6, 150])
def test_batch_size_binds_under_a_loose_token_budget(tmp_path, max_tokens):
    recs = [dataclasses.replace(r, sample_id=i) for i, r in enumerate(make_records(23, seed=4))]
    write_cache(tmp_path / "c", recs, shard_size=10, **writer_kwargs("arrow"))
    stream = CacheStream(str(tmp_path / "c"), batch_size=3, max_tokens=max_tokens, shuffle=False, epochs=1)
    batches = [b for b, _ in stream.batches()]
    sizes = [len(b) for b in batches]
    assert sum(sizes) == 23 and stream.count_batches(1) == len(sizes)
    assert [r.sample_id for b in batches for r in b] == list(range(23))
    if max_tokens != 150:
        assert sizes == [3] * 7 + [2]                    # the budget never binds: batch_size does
    else:                                                # a tight budget binds on long samples: fewer per batch
        assert max(sizes) <= 3 and len(sizes) > 8
        assert all(len(b) == 1 or len(b) * max(len(r.input_ids) for r in b) <= 150 for b in batches)
