"""Teachers larger than one GPU: --tensor-parallel-size checks, worker counts, and placement groups on a Ray whose
GPUs are fake (`num_gpus=4`): what a tensor-parallel vLLM worker is given, without a GPU."""
import os
from types import SimpleNamespace

import pytest

from kdcache.common.errors import ConfigError
from kdcache.pipeline import placement
from kdcache.pipeline.placement import check_tensor_parallel, resolve_workers, worker_options
from tests.helpers.cli import precompute, write_jsonl


def _cfg(**kw):
    return SimpleNamespace(**{"tensor_parallel_size": 1, "pipeline_parallel_size": 1, "workers": None,
                              "worker_cpus": 0.25, "ray_address": None, **kw})


def test_workers_default_to_the_gpus_over_the_tensor_parallel_size():
    assert resolve_workers(_cfg(tensor_parallel_size=2), gpus=8) == 4
    assert resolve_workers(_cfg(tensor_parallel_size=4), gpus=6) == 1
    assert resolve_workers(_cfg(), gpus=0) == 1                     # CPU: one worker
    assert resolve_workers(_cfg(workers=3, tensor_parallel_size=2), gpus=8) == 3


def test_what_cannot_run_is_refused_naming_the_setting():
    conf = SimpleNamespace(num_attention_heads=14, num_key_value_heads=2)      # Qwen2.5-0.5B's heads
    with pytest.raises(ConfigError, match="needs --backend vllm"):
        check_tensor_parallel(_cfg(tensor_parallel_size=2), "hf", conf, 8, 1)
    with pytest.raises(ConfigError, match=r"4 does not divide the teacher's num_attention_heads \(14\)"):
        check_tensor_parallel(_cfg(tensor_parallel_size=4), "vllm", conf, 8, 1)
    check_tensor_parallel(_cfg(tensor_parallel_size=2), "vllm", conf, 8, 4)     # 2 divides 14 and 2
    kv1 = SimpleNamespace(text_config=SimpleNamespace(num_attention_heads=8, num_key_value_heads=1))
    check_tensor_parallel(_cfg(tensor_parallel_size=4), "vllm", kv1, 4, 1)      # one KV head, replicated
    with pytest.raises(ConfigError, match=r"2 worker\(s\) x 4 GPUs need 8 GPUs; 4 are visible \(pass --workers 1"):
        check_tensor_parallel(_cfg(tensor_parallel_size=4), "vllm", kv1, 4, 2)


def test_a_worker_s_gpus_must_fit_on_one_node_not_only_in_the_cluster():
    """TP 8 on two nodes of 4 GPUs: 8 GPUs in the cluster, none on one node (issue 42, item 15); it used to pass
    the check and fail after the placement group's 60 s timeout."""
    conf = SimpleNamespace(num_attention_heads=16, num_key_value_heads=8)
    with pytest.raises(ConfigError, match=r"no node has 8 \(the nodes have \[4, 4\] GPUs\)"):
        check_tensor_parallel(_cfg(tensor_parallel_size=8), "vllm", conf, 8, 1, per_node=[4, 4])
    check_tensor_parallel(_cfg(tensor_parallel_size=8), "vllm", conf, 8, 1, per_node=[8])
    with pytest.raises(ConfigError, match=r"room for 2 such worker\(s\), not 3 \(pass --workers 2"):
        check_tensor_parallel(_cfg(tensor_parallel_size=4), "vllm", conf, 12, 3, per_node=[6, 6])
    assert resolve_workers(_cfg(tensor_parallel_size=4), gpus=[6, 6]) == 2      # not 12 // 4 = 3


def test_a_parallel_worker_unblanks_the_cuda_devices_ray_blanked():
    from kdcache.pipeline.worker import unblank_cuda_devices
    env = {"CUDA_VISIBLE_DEVICES": ""}
    assert not unblank_cuda_devices({"tensor_parallel_size": 1}, env) and env == {"CUDA_VISIBLE_DEVICES": ""}
    assert unblank_cuda_devices({"tensor_parallel_size": 2}, env) and env == {}
    env = {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert not unblank_cuda_devices({"pipeline_parallel_size": 2}, env) and env == {"CUDA_VISIBLE_DEVICES": "0,1"}


def test_pipeline_parallel_multiplies_the_gpus_of_a_worker_and_is_checked_against_the_layers():
    assert resolve_workers(_cfg(tensor_parallel_size=2, pipeline_parallel_size=2), gpus=8) == 2
    assert placement.gpus_per_worker(_cfg(tensor_parallel_size=2, pipeline_parallel_size=3)) == 6
    conf = SimpleNamespace(num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=4)
    check_tensor_parallel(_cfg(pipeline_parallel_size=4), "vllm", conf, 4, 1)          # a stage per layer
    with pytest.raises(ConfigError, match=r"pipeline_parallel_size: 5 stages for the teacher's 4 layers"):
        check_tensor_parallel(_cfg(pipeline_parallel_size=5), "vllm", conf, 8, 1)
    with pytest.raises(ConfigError, match=r"pipeline_parallel_size: 2 needs --backend vllm"):
        check_tensor_parallel(_cfg(pipeline_parallel_size=2), "hf", conf, 8, 1)
    with pytest.raises(ConfigError, match=r"2 worker\(s\) x 2 x 2 GPUs \(tensor x pipeline parallel\) need 8 GPUs; "
                                          r"4 are visible \(pass --workers 1"):
        check_tensor_parallel(_cfg(tensor_parallel_size=2, pipeline_parallel_size=2), "vllm", conf, 4, 2)


def test_the_command_refuses_tensor_parallel_off_vllm_before_any_work(tiny, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", tiny["train"][:2])
    res = precompute("--teacher", tiny["teacher"], "--data", data, "--out", tmp_path / "o", "--backend", "hf",
                     "--tensor-parallel-size", 2)
    assert res.returncode == 2 and "tensor_parallel_size: 2 needs --backend vllm" in res.stderr
    assert not (tmp_path / "o").exists()


@pytest.fixture(scope="module")
def fake_gpus():
    """A Ray in this test process. ray.init sets RAY_AUTH_MODE=token in os.environ for its own cluster: restored
    after, so that later tests' commands get the environment a user's shell gives them."""
    import ray
    saved = os.environ.get("RAY_AUTH_MODE")
    ray.init(address="local", num_cpus=2, num_gpus=4, include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1", configure_logging=False)
    yield ray
    ray.shutdown()
    if saved is None:
        os.environ.pop("RAY_AUTH_MODE", None)
    else:
        os.environ["RAY_AUTH_MODE"] = saved


@pytest.mark.ray
def test_each_worker_gets_a_placement_group_of_its_gpus_that_its_children_run_in(fake_gpus, monkeypatch):
    """Two workers of 2 GPUs on a 4-GPU node: each actor sits in its own group, holding no GPU itself; what it
    starts (vLLM's per-GPU workers) runs inside that group, one GPU each; a third worker cannot be placed and is
    refused naming why, its group given back."""
    ray = fake_gpus
    cfg = _cfg(tensor_parallel_size=2)
    opts, groups = worker_options(ray, cfg, 1.0, 2)
    assert len(groups) == 2 and all(o["num_gpus"] == 0 for o in opts)

    @ray.remote(num_gpus=1, num_cpus=0)
    def shard_worker():
        return ray.get_runtime_context().get_placement_group_id(), ray.get_gpu_ids()

    @ray.remote
    class Teacher:
        def group_and_children(self):
            here = ray.get_runtime_context().get_placement_group_id()
            return here, ray.get([shard_worker.remote() for _ in range(2)])

    for o, g in zip(opts, groups):
        here, children = ray.get(Teacher.options(**o).remote().group_and_children.remote(), timeout=60)
        assert here == g.id.hex()
        assert [c[0] for c in children] == [here, here]
        assert all(len(c[1]) == 1 for c in children)
    assert ray.available_resources().get("GPU", 0) == 0                         # all 4 held by the two groups
    monkeypatch.setattr(placement, "PLACEMENT_TIMEOUT_S", 2.0)
    with pytest.raises(ConfigError, match=r"worker 0's 2 GPUs could not be placed on one node within 2 s"):
        worker_options(ray, cfg, 1.0, 1)
    for g in groups:
        ray.util.remove_placement_group(g)
    # Tensor x pipeline parallel: one worker's group holds all 2 x 2 GPUs.
    opts, groups = worker_options(ray, _cfg(tensor_parallel_size=2, pipeline_parallel_size=2), 1.0, 1)
    assert len(groups) == 1 and len(groups[0].bundle_specs) == 4
    assert ray.available_resources().get("GPU", 0) == 0
    ray.util.remove_placement_group(groups[0])
