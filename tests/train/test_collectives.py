"""Tensors handed to a collective live on the device the process group serves (issue 24): NCCL refuses CPU
tensors, so the first GPU step would fail in all_reduce. No GPU needed: the NCCL case is checked by placement,
the gloo case by a real one-rank group."""
import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from kdcache.train import distributed


@pytest.fixture
def gloo_group():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_on_nccl_a_collective_gets_the_current_gpu(monkeypatch):
    monkeypatch.setattr(dist, "get_backend", lambda *a: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert distributed.collective_device() == torch.device("cuda", 3)


def test_every_all_reduce_argument_is_on_the_collective_device(gloo_group, monkeypatch):
    """A backend that refuses tensors off its device, the way NCCL refuses CPU ones: here the group's device is
    declared to be 'meta', so a CPU tensor is refused; all_reduce must build its tensor where it is told."""
    seen = []
    real_tensor = torch.tensor

    def tensor(data, *, dtype=None, device=None):
        seen.append(torch.device(device) if device is not None else torch.device("cpu"))
        return real_tensor(data, dtype=dtype)            # computed on the CPU gloo group all the same

    def refusing(t, op=None):
        if seen[-1].type == "cpu":
            raise RuntimeError("No backend type associated with device type cpu")
        return real_all_reduce(t, op=op)
    real_all_reduce = dist.all_reduce
    monkeypatch.setattr(distributed, "collective_device", lambda: torch.device("meta"))
    monkeypatch.setattr(distributed.torch, "tensor", tensor)
    monkeypatch.setattr(dist, "all_reduce", refusing)
    assert distributed.all_reduce([2.0, 3.0], op="max") == [2.0, 3.0]
    assert seen == [torch.device("meta")]


def test_on_gloo_the_collective_device_is_the_cpu(gloo_group):
    assert distributed.collective_device() == torch.device("cpu")
    assert distributed.all_reduce([1.5], op="min") == [1.5]


def test_a_one_rank_world_whose_free_port_was_taken_meanwhile_takes_another(tmp_path):
    """init_distributed finds a free port, then the store binds it; another process can take it in between (two
    trainings started at once: EADDRINUSE under pytest-xdist). Here the first port it finds is held, listening."""
    script = tmp_path / "world.py"
    script.write_text(
        "import os, socket\n"
        "from kdcache.train import distributed\n"
        "held = socket.socket(); held.bind(('127.0.0.1', 0)); held.listen()\n"
        "taken = held.getsockname()[1]\n"
        "ports = [taken]\n"
        "real = distributed._free_port\n"
        "distributed._free_port = lambda: ports.pop() if ports else real()\n"
        "print(distributed.init_distributed(), taken, os.environ['MASTER_PORT'])\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    *world, taken, used = res.stdout.strip().splitlines()[-1].split()
    assert " ".join(world) == "(0, 1)" and used != taken
