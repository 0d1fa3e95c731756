"""A precompute on a Ray cluster of two nodes, tested on one machine (two `ray start` on 127.0.0.1, a head and a
node joining it, one CPU each; ray.cluster_utils.Cluster binds its GCS to 127.0.0.1 only, which a driver joining
by address cannot reach here): the job joins it with --ray-address, its two one-CPU workers run one on each node
(the summary says which node each worker and shard was on), and the cache equals a one-node run's, record for
record."""
import json

import numpy as np
import pytest

from kdcache.cache_format import open_cache, verify_cache
from tests.helpers.cli import precompute, write_jsonl
from tests.helpers.raycluster import ENV, RayHead

pytestmark = [pytest.mark.ray, pytest.mark.slow]

N = 400


def test_precompute_on_two_ray_nodes_uses_both_and_equals_a_one_node_run(tiny, tmp_path):
    from kdcache.demo.task import make_splits
    # enough work (about 10 s of scoring) that the worker that loads last still scores some of it
    data = write_jsonl(tmp_path / "d.jsonl", make_splits(N, 0, seed=3)[0])
    args = ["--teacher", tiny["teacher"], "--data", data, "--backend", "hf", "--top-k", 8, "--shard-size", 8,
            "--threads", 1]
    ref = precompute(*args, "--out", tmp_path / "ref", shared_ray=True)
    assert ref.returncode == 0, ref.stderr[-3000:]
    cluster = RayHead(num_cpus=1).start()
    try:
        cluster.add_node(num_cpus=1)
        res = precompute(*args, "--out", tmp_path / "c", "--ray-address", cluster.address, "--workers", 2,
                         "--worker-cpus", 1, timeout=600, extra_env=ENV)
    finally:
        cluster.stop()
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    summary = json.loads((tmp_path / "c" / "report" / "summary.json").read_text())
    assert summary["ray"]["own"] is False and summary["ray"]["gcs_address"].endswith(f":{cluster.port}"), summary["ray"]
    workers, shards = summary["ray"]["workers_by_node"], summary["shards_by_node"]
    assert sorted(workers.values()) == [1, 1], workers   # one worker on each node (one CPU each)
    assert set(shards) == set(workers) and sum(shards.values()) == N // 8, shards
    assert "Ray nodes" in res.stdout                     # the summary says where the shards were scored
    assert verify_cache(tmp_path / "c").ok
    a, b = open_cache(tmp_path / "ref"), open_cache(tmp_path / "c")
    assert len(a) == len(b) == N
    for ra, rb in zip(a, b):
        for f in ("sample_id", "input_ids", "positions", "topk_ids", "topk_logprobs", "tail_mass"):
            np.testing.assert_array_equal(getattr(ra, f), getattr(rb, f))
