"""The distributed pieces the trainer uses: a one-rank world without a launcher, the DeepSpeed config, and
small collectives on the device the backend needs."""
import json
import os
import socket

import torch

from .extensions import build_guard, skip_cpu_comm_op

PORT_TRIES = 8      # a one-rank world's free port can be taken by another process before its store binds it


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed():
    """Single process without a launcher gets a one-rank world on a free local port (another, if that one was
    taken between finding it and binding it: two trainings started at once, seen under pytest-xdist)."""
    own_world = "RANK" not in os.environ
    if own_world:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    import deepspeed
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":                 # each rank on its own GPU before NCCL or DeepSpeed touch one
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    load_extensions()
    for attempt in range(PORT_TRIES if own_world else 1):
        if own_world:
            os.environ["MASTER_PORT"] = str(_free_port())
        try:
            deepspeed.init_distributed(dist_backend=backend, verbose=False)
            break
        except torch.distributed.DistNetworkError as e:
            if not own_world or "EADDRINUSE" not in str(e) or attempt == PORT_TRIES - 1:
                raise
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def load_extensions():
    """Before DeepSpeed's init_distributed: build locks that killed starts left behind are cleared instead of slept
    on, and on CPU its shared-memory comm op is skipped (train/extensions.py: a 30-70 s build that training never
    calls)."""
    with build_guard():
        pass
    if not torch.cuda.is_available():
        skip_cpu_comm_op()


def collective_device():
    """The device a collective's tensors must live on: NCCL refuses CPU tensors ("No backend type associated with
    device type cpu"), gloo takes them."""
    import torch.distributed as dist
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def deepspeed_config(cfg):
    if cfg.deepspeed.endswith(".json"):
        with open(cfg.deepspeed) as f:
            ds = json.load(f)
    else:
        ds = {"zero_optimization": {"stage": int(cfg.deepspeed)}}
    ds.setdefault("train_micro_batch_size_per_gpu", cfg.batch_size)
    ds["gradient_accumulation_steps"] = cfg.grad_accum
    ds["gradient_clipping"] = cfg.grad_clip
    ds.setdefault("zero_allow_untested_optimizer", True)
    ds.setdefault("steps_per_print", 10 ** 9)
    ds.setdefault("wall_clock_breakdown", False)
    # bf16 by default on a GPU that has it (fp32 master weights; the loss is computed in float32 either way), fp32
    # on CPU; never beside a config's own fp16 (DeepSpeed refuses both at once).
    fp16 = bool(ds.get("fp16", {}).get("enabled", False))
    if torch.cuda.is_available() and torch.cuda.is_bf16_supported() and not fp16:
        ds.setdefault("bf16", {"enabled": True})
    return ds


def all_reduce(values, op="sum"):
    import torch.distributed as dist
    t = torch.tensor(values, dtype=torch.float64, device=collective_device())
    dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op])
    return t.cpu().tolist()


def total_norm(module):
    """The L2 norm of the module's gradients (ZeRO-0, where DeepSpeed does not report it), or None."""
    grads = [p.grad.detach().float().norm() for p in module.parameters() if p.grad is not None]
    return float(torch.stack(grads).norm()) if grads else None


def reported_grad_norm(engine):
    """The global gradient norm DeepSpeed reports (ZeRO-1 to 3), or None."""
    g = engine.get_global_grad_norm()
    return float(g) if g is not None else None
