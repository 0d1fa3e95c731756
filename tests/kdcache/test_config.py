"""Configs: unknown keys and out-of-range values are refused with the key named; YAML never runs code."""
import pytest

from kdcache.common.config import ConfigError, load
from kdcache.pipeline.config import PrecomputeConfig
from kdcache.train.config import TrainConfig

BASE_P = {"teacher": "t", "data": "d.jsonl", "out": "o"}
BASE_T = {"cache": "c", "student": "s", "out": "o"}


@pytest.mark.parametrize("cls,base,key,value", [
    (PrecomputeConfig, BASE_P, "top_k", -1),
    (PrecomputeConfig, BASE_P, "top_k", -1),
    (PrecomputeConfig, BASE_P, "shard_size", 0),
    (PrecomputeConfig, BASE_P, "gen_top_p", 1.5),
    (PrecomputeConfig, BASE_P, "backend", "tensorrt"),
    (PrecomputeConfig, BASE_P, "top_k", "many"),
    (TrainConfig, BASE_T, "beta", -0.1),
    (TrainConfig, BASE_T, "beta", 1.01),
    (TrainConfig, BASE_T, "temperature", 0),
    (TrainConfig, BASE_T, "tail", "bucket"),
    (TrainConfig, BASE_T, "deepspeed", "4"),
    (TrainConfig, BASE_T, "grad_accum", 0),
])
def test_bad_values_refused_naming_the_key(cls, base, key, value):
    with pytest.raises(ConfigError, match=key):
        load(cls, overrides={**base, key: value})


def test_unknown_key_in_yaml_refused(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("teacher: t\ndata: d\nout: o\ntopk: 5\n")
    with pytest.raises(ConfigError, match=r"unknown config key.*c\.yaml: topk"):
        load(PrecomputeConfig, str(f))


def test_required_keys_named():
    with pytest.raises(ConfigError, match="cache: required"):
        load(TrainConfig, overrides={"student": "s", "out": "o"})


def test_yaml_tags_never_execute(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("teacher: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(Exception) as e:
        load(PrecomputeConfig, str(f))
    assert "pwned" not in str(e.value) and "could not determine a constructor" in str(e.value)


def test_flags_override_yaml(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("cache: c\nstudent: s\nout: o\nbeta: 0.2\n")
    assert load(TrainConfig, str(f), {"beta": "0.7"}).beta == 0.7


@pytest.mark.parametrize("path,cls,command", [
    ("pipeline/configs/precompute.yaml", PrecomputeConfig, "kdcache precompute"),
    ("train/configs/train.yaml", TrainConfig, "kdcache train"),
])
def test_example_configs_load_and_start_with_their_launch_command(path, cls, command):
    import os

    import yaml

    from tests.helpers.cli import ROOT
    full = os.path.join(ROOT, path)
    first = open(full).readline().strip()
    assert first == f"# {command} --config {path}"
    cfg = load(cls, full)
    for key, value in yaml.safe_load(open(full)).items():                  # every key in the file took effect
        assert getattr(cfg, key) == value, key
