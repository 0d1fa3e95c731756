"""Where teacher workers run: how many, on which GPUs, and a teacher larger than one GPU (tensor parallel).

With --tensor-parallel-size N > 1 (vLLM backend) each worker holds N GPUs of one node as a Ray placement group of N
one-GPU bundles (STRICT_PACK). The worker actor itself takes no GPU: it sits in the group's first bundle and
vLLM's own Ray workers, which capture the group, take one GPU each. Everything that can be refused is refused
before Ray starts (a backend other than vLLM, N that does not divide the attention heads, fewer GPUs than
workers x N); a cluster named with --ray-address is asked for its GPUs when the job joins it.
"""
from kdcache.common.errors import ConfigError

PLACEMENT_TIMEOUT_S = 60.0       # a group that cannot be placed by then: the cluster lacks what it needs


def visible_gpus(cfg) -> int:
    """GPUs the job can use: the named cluster's, else this machine's CUDA devices."""
    if cfg.ray_address:
        from .dispatch import start_ray
        return int(start_ray(cfg.ray_address).cluster_resources().get("GPU", 0))
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_workers(cfg, gpus=None) -> int:
    """--workers, else GPUs / --tensor-parallel-size where GPUs are visible (a local teacher), else 1."""
    if cfg.workers is not None:
        return cfg.workers
    gpus = visible_gpus(cfg) if gpus is None else gpus
    return max(1, gpus // cfg.tensor_parallel_size) if gpus else 1


def check_tensor_parallel(cfg, backend, model_config, gpus, workers):
    """Refuse, naming the setting, what cannot run: N > 1 off the vLLM backend, N that does not divide the
    teacher's attention (or key-value) heads, fewer GPUs than workers x N."""
    n = cfg.tensor_parallel_size
    if n == 1:
        return
    if backend != "vllm":
        raise ConfigError(f"tensor_parallel_size: {n} needs --backend vllm (the {backend} backend runs one device "
                          "per worker)")
    conf = getattr(model_config, "text_config", None) or model_config
    for name in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(conf, name, None)
        if heads and heads % n and not (name == "num_key_value_heads" and n % heads == 0):
            raise ConfigError(f"tensor_parallel_size: {n} does not divide the teacher's {name} ({heads})")
    if workers * n > gpus:
        raise ConfigError(f"tensor_parallel_size: {workers} worker(s) x {n} GPUs need {workers * n} GPUs; "
                          f"{gpus} are visible (pass --workers {max(1, gpus // n)} or a smaller "
                          "--tensor-parallel-size)")


def worker_options(ray, cfg, gpus, n):
    """Ray actor options for each of n workers: one GPU (or `gpus`) each, or with tensor parallel a placement
    group of its own, created and placed here. Returns (options per worker, the groups made)."""
    base = dict(num_cpus=cfg.worker_cpus)
    tp = cfg.tensor_parallel_size
    if tp == 1:
        return [dict(base, num_gpus=gpus) for _ in range(n)], []
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    groups = [placement_group([{"GPU": 1.0, "CPU": cfg.worker_cpus}] + [{"GPU": 1.0}] * (tp - 1),
                              strategy="STRICT_PACK") for _ in range(n)]
    for i, g in enumerate(groups):
        if not g.wait(PLACEMENT_TIMEOUT_S):
            for made in groups:
                ray.util.remove_placement_group(made)
            raise ConfigError(f"tensor_parallel_size: worker {i}'s {tp} GPUs could not be placed on one node within "
                              f"{PLACEMENT_TIMEOUT_S:.0f} s (cluster: {ray.cluster_resources().get('GPU', 0):g} GPUs)")
    opts = [dict(base, num_gpus=0, scheduling_strategy=PlacementGroupSchedulingStrategy(
        g, placement_group_bundle_index=0, placement_group_capture_child_tasks=True)) for g in groups]
    return opts, groups
