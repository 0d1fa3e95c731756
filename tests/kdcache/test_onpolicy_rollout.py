"""A round's rollout counts as scored only when its cache is complete: a precompute stopped with one of its two
shards committed leaves the round to be rerun, not trained on half its prompts (issue 42, section 4)."""
import json
import os

from kdcache import onpolicy
from kdcache.cache_format.writer import CacheWriter
from kdcache.common.signals import StopFlag
from tests.helpers.records import make_records, writer_kwargs


class _Stages:
    """A precompute stage that commits `shards` of the two shards its cache plans, then stops."""

    def __init__(self, shards):
        self.shards = shards

    def precompute(self, config, stop, label):
        import yaml
        stage = yaml.safe_load(open(config))
        cache = os.path.join(stage["out"], "c")
        recs = make_records(8, seed=1)
        with CacheWriter(cache, shard_size=4, num_records=8, **writer_kwargs("arrow")) as w:
            for j in range(self.shards):
                w.write_shard(j, recs[4 * j:4 * j + 4], sample_start=4 * j, sample_end=4 * j + 4)
        with open(stage["location_file"], "w") as f:
            f.write(cache)


def _round(tmp_path, shards):
    cfg = onpolicy.OnpolicyConfig(teacher="t", student="s", data="d", out=str(tmp_path), prompts_per_round=2,
                                  steps_per_round=1)
    entry = {"round": 1, "stage": "new", "cache": None}
    prompts = [json.dumps({"messages": []})] * 2
    done = onpolicy._rollout(cfg, {}, 0, prompts, entry, StopFlag(), _Stages(shards))
    return done, entry


def test_a_rollout_with_half_its_shards_is_not_scored(tmp_path):
    done, entry = _round(tmp_path / "half", 1)
    assert not done and entry["stage"] == "new"
    done, entry = _round(tmp_path / "whole", 2)
    assert done and entry["stage"] == "scored" and entry["teacher_tokens"] > 0
