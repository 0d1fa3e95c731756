"""A checkpoint's reader positions only mean something for the cache and settings they were saved with."""
import json

import pytest

from kdcache.common.errors import TrainDataError
from kdcache.train.checkpoint import check_order

ORDER = {"cache_fingerprint": "f" * 64, "shards_sha256": "a" * 64, "num_shards": 2, "world_size": 2, "seed": 0,
        "shuffle": True}


def saved(tmp_path, **meta):
    (tmp_path / "complete.json").write_text(json.dumps({"step": 4, **meta}))
    return str(tmp_path)


def test_the_same_order_resumes(tmp_path):
    check_order(saved(tmp_path, world_size=2, data=ORDER), dict(ORDER))


def test_a_grown_cache_is_refused_naming_what_changed(tmp_path):
    path = saved(tmp_path, world_size=2, data=ORDER)
    with pytest.raises(TrainDataError, match=r"num_shards: 2 in the checkpoint, 4 now.*same cache"):
        check_order(path, dict(ORDER, num_shards=4, shards_sha256="b" * 64))


@pytest.mark.parametrize("key,value", [("seed", 1), ("shuffle", False), ("cache_fingerprint", "e" * 64)])
def test_another_order_or_cache_is_refused(tmp_path, key, value):
    with pytest.raises(TrainDataError, match=key):
        check_order(saved(tmp_path, world_size=2, data=ORDER), dict(ORDER, **{key: value}))


def test_another_world_size_is_refused_with_the_relaunch(tmp_path):
    with pytest.raises(TrainDataError, match=r"world_size: 2 in the checkpoint, 1 now.*--nproc-per-node 2"):
        check_order(saved(tmp_path, world_size=2, data=ORDER), dict(ORDER, world_size=1))


def test_an_older_checkpoint_without_an_order_still_checks_the_ranks(tmp_path):
    check_order(saved(tmp_path, world_size=2), dict(ORDER))
    with pytest.raises(TrainDataError, match="world_size"):
        check_order(saved(tmp_path, world_size=2), dict(ORDER, world_size=3))


def test_new_cache_takes_another_caches_checkpoint_with_a_fresh_reader_but_no_other_change(tmp_path):
    """--new-cache (kdcache onpolicy's rounds): another cache's checkpoint resumes with the reader at the start;
    the same cache's resumes its reader as usual; another seed, shuffle or world size is still refused."""
    path = saved(tmp_path, world_size=2, data=ORDER)
    other = dict(ORDER, cache_fingerprint="e" * 64, shards_sha256="b" * 64, num_shards=3)
    assert check_order(path, other, new_cache=True) is True
    assert check_order(path, dict(ORDER), new_cache=True) is False
    assert not check_order(path, dict(ORDER))
    for key, value in (("seed", 1), ("shuffle", False), ("world_size", 1)):
        with pytest.raises(TrainDataError, match=key):
            check_order(path, dict(other, **{key: value}), new_cache=True)


@pytest.mark.parametrize("added", [{"caches": [dict(ORDER, cache_fingerprint="e" * 64)],
                                    "cache_weights": "positions-left"},
                                   {"mix": dict(ORDER, cache_fingerprint="e" * 64), "mix_lambda": 0.5}],
                         ids=["second-cache", "mix-cache"])
def test_a_one_cache_checkpoint_resumed_with_more_caches_is_refused_naming_them(tmp_path, added):
    """The saved order of a one-cache run has no `caches` (or `mix`) key: a resume that adds a cache would
    start the added stream from nothing while the first skips on, so it is refused, naming the key."""
    path = saved(tmp_path, world_size=2, data=ORDER)
    key = next(iter(added))
    with pytest.raises(TrainDataError, match=rf"{key}: None in the checkpoint"):
        check_order(path, dict(ORDER, **added))
