"""A precompute on a Ray cluster of two nodes, tested on one machine (two `ray start` on 127.0.0.1, a head and a
node joining it, one CPU each; ray.cluster_utils.Cluster binds its GCS to 127.0.0.1 only, which a driver joining
by address cannot reach here): the job joins it with --ray-address, its two one-CPU workers run one on each node
(the summary says which node each worker and shard was on), and the cache equals a one-node run's, record for
record."""
import json
import shutil

import numpy as np
import pytest

from kdcache.cache_format import open_cache, verify_cache
from tests.helpers.cli import precompute, write_jsonl
from tests.helpers.raycluster import ENV, RayHead

pytestmark = [pytest.mark.ray, pytest.mark.slow]


# The tiny teacher with a pause in every forward pass (its own modelling code, loaded with --trust-remote-code): a
# job long enough in wall time, at little CPU, that the worker whose teacher loads last, on a loaded machine,
# still scores some shards. Same weights, same scores.
SLOW_MODEL = """
import time
from transformers import Qwen2ForCausalLM


class SlowQwen2ForCausalLM(Qwen2ForCausalLM):
    def __init__(self, config):
        super().__init__(config)
        body = self.model.forward          # the hf teacher runs the body and applies the head itself

        def forward(*args, **kwargs):
            time.sleep(PAUSE_S)
            return body(*args, **kwargs)
        self.model.forward = forward
"""
PAUSE_S = 0.8
N = 200


def _slow_teacher(teacher, out):
    shutil.copytree(teacher, out)
    (out / "slow_model.py").write_text(SLOW_MODEL.replace("PAUSE_S", str(PAUSE_S)))
    config = json.loads((out / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "slow_model.SlowQwen2ForCausalLM"}
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_precompute_on_two_ray_nodes_uses_both_and_equals_a_one_node_run(tiny, tmp_path):
    from kdcache.demo.task import make_splits
    data = write_jsonl(tmp_path / "d.jsonl", make_splits(N, 0, seed=3)[0])
    args = ["--data", data, "--backend", "hf", "--top-k", 8, "--shard-size", 8, "--threads", 1]
    ref = precompute("--teacher", tiny["teacher"], *args, "--out", tmp_path / "ref", shared_ray=True)
    assert ref.returncode == 0, ref.stderr[-3000:]
    slow = _slow_teacher(tiny["teacher"], tmp_path / "slow-teacher")
    cluster = RayHead(num_cpus=1).start()
    try:
        cluster.add_node(num_cpus=1)
        res = precompute("--teacher", slow, "--trust-remote-code", *args, "--out", tmp_path / "c",
                         "--ray-address", cluster.address, "--workers", 2, "--worker-cpus", 1, timeout=600,
                         extra_env=ENV)
    finally:
        cluster.stop()
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    summary = json.loads((tmp_path / "c" / "report" / "summary.json").read_text())
    assert summary["ray"]["own"] is False and summary["ray"]["gcs_address"].endswith(f":{cluster.port}"), summary["ray"]
    workers, shards = summary["ray"]["workers_by_node"], summary["shards_by_node"]
    assert sorted(workers.values()) == [1, 1], workers   # one worker on each node (one CPU each)
    assert set(shards) == set(workers) and sum(shards.values()) == N // 8, shards
    assert summary["teacher_s"] >= PAUSE_S * N // 8, summary["teacher_s"]     # the slow teacher ran
    assert "Ray nodes" in res.stdout                     # the summary says where the shards were scored
    assert verify_cache(tmp_path / "c").ok
    a, b = open_cache(tmp_path / "ref"), open_cache(tmp_path / "c")
    assert len(a) == len(b) == N
    for ra, rb in zip(a, b):
        for f in ("sample_id", "input_ids", "positions", "topk_ids", "topk_logprobs", "tail_mass"):
            np.testing.assert_array_equal(getattr(ra, f), getattr(rb, f))
