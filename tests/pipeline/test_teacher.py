"""The teacher registry: one dict names the backends; auto picks by the machine; config follows it."""
import pytest

from kdcache.common.config import load
from kdcache.common.errors import ConfigError
from kdcache.pipeline import teacher
from kdcache.pipeline.config import PrecomputeConfig


def test_registry_names_importable_classes():
    for name in teacher.TEACHERS:
        cls = teacher.teacher_class(name)
        assert callable(cls.score) and callable(cls.generate) and isinstance(cls.engine, str)


def test_auto_picks_an_importable_backend(monkeypatch):
    """The rule by machine (GPU, CPU, URL) is tested in test_served.py; here: only what imports is picked."""
    monkeypatch.setattr(teacher, "importable", lambda name: name == "hf")
    monkeypatch.setattr(teacher, "cuda_visible", lambda: True)
    assert teacher.choose_backend("auto")[0] == "hf"
    assert teacher.choose_backend("vllm")[0] == "vllm"                # a named backend is kept
    monkeypatch.setattr(teacher, "importable", lambda name: False)
    with pytest.raises(ConfigError, match="no teacher backend imports"):
        teacher.choose_backend("auto")


def test_a_registered_backend_is_a_valid_config_choice(monkeypatch):
    base = {"teacher": "t", "data": "d.jsonl", "out": "o"}
    with pytest.raises(ConfigError, match="backend: 'mine' is not one of"):
        load(PrecomputeConfig, overrides={**base, "backend": "mine"})
    monkeypatch.setitem(teacher.TEACHERS, "mine", "kdcache.pipeline.teacher_hf:HFTeacher")
    import importlib

    import kdcache.pipeline.config
    fresh = importlib.reload(kdcache.pipeline.config)
    try:
        assert load(fresh.PrecomputeConfig, overrides={**base, "backend": "mine"}).backend == "mine"
    finally:
        monkeypatch.undo()
        importlib.reload(kdcache.pipeline.config)
