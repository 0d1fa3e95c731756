"""The GPU side of the trainer's settings, checked without a GPU (issue 24): the DeepSpeed config a run gets."""
import json

import pytest
import torch

from kdcache.train import distributed
from kdcache.train.config import TrainConfig


@pytest.fixture
def gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)


def config(tmp_path, **kw):
    return TrainConfig(cache=str(tmp_path), student=str(tmp_path), out=str(tmp_path / "o"), **kw)


def test_a_bf16_gpu_trains_in_bf16_by_default_and_a_cpu_in_fp32(tmp_path, gpu, monkeypatch):
    assert distributed.deepspeed_config(config(tmp_path, deepspeed="2"))["bf16"] == {"enabled": True}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "bf16" not in distributed.deepspeed_config(config(tmp_path, deepspeed="2"))


def test_a_configs_own_fp16_is_never_joined_by_the_default_bf16(tmp_path, gpu):
    """DeepSpeed refuses bf16 and fp16 at once: a user's fp16 config used to get bf16 added beside it."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}, "fp16": {"enabled": True, "loss_scale": 0}}))
    ds = distributed.deepspeed_config(config(tmp_path, deepspeed=str(path)))
    assert ds["fp16"]["enabled"] and "bf16" not in ds
    path.write_text(json.dumps({"bf16": {"enabled": False}}))          # the user's own choice stands
    assert distributed.deepspeed_config(config(tmp_path, deepspeed=str(path)))["bf16"] == {"enabled": False}
