"""Where teacher workers run: how many, on which GPUs, and a teacher larger than one GPU (tensor and pipeline
parallel).

With --tensor-parallel-size T and --pipeline-parallel-size P, N = T x P > 1 (vLLM backend), each worker holds N
GPUs of one node as a Ray placement group of N one-GPU bundles (STRICT_PACK). The worker actor itself takes no
GPU: it sits in the group's first bundle and vLLM's own Ray workers, which capture the group, take one GPU each.
Everything that can be refused is refused before Ray starts (a backend other than vLLM, T that does not divide
the attention heads, more stages than layers, fewer GPUs than workers x N); a cluster named with --ray-address is
asked for its GPUs when the job joins it.
"""
from kdcache.common.errors import ConfigError

PLACEMENT_TIMEOUT_S = 60.0       # a group that cannot be placed by then: the cluster lacks what it needs


def gpus_by_node(cfg) -> list:
    """GPUs of each node the job can use: the named cluster's live nodes, else this machine's CUDA devices."""
    if cfg.ray_address:
        from .ray_start import start_ray
        nodes = start_ray(cfg.ray_address).nodes()
        return [int(n.get("Resources", {}).get("GPU", 0)) for n in nodes if n.get("Alive", True)]
    import torch
    return [torch.cuda.device_count() if torch.cuda.is_available() else 0]


def gpus_per_worker(cfg) -> int:
    """GPUs one teacher worker holds: tensor parallel x pipeline parallel."""
    return cfg.tensor_parallel_size * getattr(cfg, "pipeline_parallel_size", 1)


def resolve_workers(cfg, gpus=None) -> int:
    """--workers, else the workers of TP x PP GPUs each that fit on the nodes (`gpus`: GPUs of each node, or
    all of them as one number), else 1."""
    if cfg.workers is not None:
        return cfg.workers
    per_node = gpus_by_node(cfg) if gpus is None else gpus if isinstance(gpus, list) else [gpus]
    return max(1, sum(g // gpus_per_worker(cfg) for g in per_node))


def check_tensor_parallel(cfg, backend, model_config, gpus, workers, per_node=None):
    """Refuse, naming the setting, what cannot run: TP or PP > 1 off the vLLM backend, TP that does not divide the
    teacher's attention (or key-value) heads, more pipeline stages than layers, fewer GPUs than workers x TP x PP,
    or, with per_node (GPUs of each node), workers whose TP x PP GPUs do not fit on one node each (a worker's
    placement group is STRICT_PACK: TP 8 on two nodes of 4 GPUs would wait out PLACEMENT_TIMEOUT_S, then fail)."""
    n, pp = cfg.tensor_parallel_size, getattr(cfg, "pipeline_parallel_size", 1)
    if n == 1 and pp == 1:
        return
    if backend != "vllm":
        name, v = ("tensor_parallel_size", n) if n > 1 else ("pipeline_parallel_size", pp)
        raise ConfigError(f"{name}: {v} needs --backend vllm (the {backend} backend runs one device per worker)")
    conf = getattr(model_config, "text_config", None) or model_config
    layers = getattr(conf, "num_hidden_layers", None)
    if layers and pp > layers:
        raise ConfigError(f"pipeline_parallel_size: {pp} stages for the teacher's {layers} layers")
    for name in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(conf, name, None)
        if heads and heads % n and not (name == "num_key_value_heads" and n % heads == 0):
            raise ConfigError(f"tensor_parallel_size: {n} does not divide the teacher's {name} ({heads})")
    each = n * pp
    if workers * each > gpus:
        what = f"{n} GPUs" if pp == 1 else f"{n} x {pp} GPUs (tensor x pipeline parallel)"
        raise ConfigError(f"tensor_parallel_size: {workers} worker(s) x {what} need {workers * each} GPUs; "
                          f"{gpus} are visible (pass --workers {max(1, gpus // each)} or a smaller "
                          "--tensor-parallel-size or --pipeline-parallel-size)")
    fit = sum(g // each for g in per_node) if per_node is not None else workers
    if workers > fit:
        what = f"{n} GPUs" if pp == 1 else f"{n} x {pp} GPUs"
        raise ConfigError(f"tensor_parallel_size: each worker's {what} must be on one node, and the nodes have "
                          f"{sorted(per_node, reverse=True)} GPUs: room for {fit} such worker(s), not {workers} "
                          f"(pass --workers {fit} or a --tensor-parallel-size that fits a node)" if fit else
                          f"tensor_parallel_size: each worker's {what} must be on one node, and no node has "
                          f"{each} (the nodes have {sorted(per_node, reverse=True)} GPUs); pass a "
                          "--tensor-parallel-size that fits a node")


def worker_options(ray, cfg, gpus, n):
    """Ray actor options for each of n workers: one GPU (or `gpus`) each, or with tensor parallel a placement
    group of its own, created and placed here. Returns (options per worker, the groups made)."""
    base = dict(num_cpus=cfg.worker_cpus)
    tp = gpus_per_worker(cfg)
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
