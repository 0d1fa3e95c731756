"""The vLLM floor: an older vLLM is refused before any work, naming the installed and the needed versions."""
import pytest

from kdcache.common.errors import ConfigError
from kdcache.pipeline import settle as settle_mod
from kdcache.pipeline.versions import VLLM_MIN, installed_vllm, release, require


@pytest.mark.parametrize("text,want", [("0.12.0", (0, 12, 0)), ("0.32.0+cpu", (0, 32, 0)), ("0.13.0rc2", (0, 13, 0)),
                                       ("1.0", (1, 0, 0)), ("0.11.1.dev5+gabc", (0, 11, 1))])
def test_release(text, want):
    assert release(text) == want


def test_require_names_both_versions():
    require("0.12.0", "0.12.0", "x")
    require("0.32.0", "0.12.0", "x")
    with pytest.raises(ConfigError, match=r"backend vllm: vLLM 0.11.1 is installed, kdcache needs 0.12.0 or later"):
        require("0.11.1", "0.12.0", "backend vllm")
    with pytest.raises(ConfigError, match="vLLM is not installed"):
        require(None, "0.12.0", "backend vllm")


def test_the_installed_vllm_meets_the_floor_and_the_flat_logprobs_it_needs():
    """What `make setup` installs passes, and it has the field the floor exists for."""
    from vllm import SamplingParams
    assert release(installed_vllm()) >= release(VLLM_MIN)
    assert SamplingParams(flat_logprobs=True).flat_logprobs is True


def test_settle_refuses_an_old_vllm_before_loading_anything(tiny, monkeypatch, tmp_path):
    from kdcache.pipeline.config import PrecomputeConfig
    monkeypatch.setattr(settle_mod, "installed_vllm", lambda: "0.11.0")
    (tmp_path / "d.jsonl").write_text('{"text": "docker"}\n')
    cfg = PrecomputeConfig(teacher=tiny["teacher"], data=str(tmp_path / "d.jsonl"), out=str(tmp_path / "o"),
                           backend="vllm")
    with pytest.raises(ConfigError, match="vLLM 0.11.0 is installed, kdcache needs 0.12.0"):
        settle_mod.settle(cfg, 0.0)
