"""Tensors handed to a collective live on the device the process group serves (issue 24): NCCL refuses CPU
tensors, so the first GPU step would fail in all_reduce. No GPU needed: the NCCL case is checked by placement,
the gloo case by a real one-rank group."""
import socket

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
