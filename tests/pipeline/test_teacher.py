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


def test_the_hf_teacher_scores_a_long_sample_a_bounded_block_of_positions_at_a_time(tiny):
    """A 32k-token sample at a 152k vocabulary would need 19.5 GB of float32 log-probs at once: the hf backend
    takes `rows` positions per log_softmax (96 MiB of them). Chunked and whole give the same numbers."""
    import numpy as np

    from kdcache.pipeline.teacher_hf import HFTeacher
    hf = HFTeacher(tiny["teacher"], dtype="float32")
    assert hf.rows == (96 << 20) // (4 * 400)                          # ~96 MiB of [rows, V] float32
    seqs = [np.arange(3, 60) % 300, np.arange(10, 30)]
    pos = [np.arange(0, 56), np.array([2, 5, 18])]
    whole = hf.score(seqs, pos, 8)
    hf.rows = 5                                                       # 12 blocks for the first sample
    for a, b in zip(whole, hf.score(seqs, pos, 8)):
        np.testing.assert_array_equal(a.ids, b.ids)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-6)
        np.testing.assert_allclose(a.target_logprobs, b.target_logprobs, atol=1e-6)
    assert whole[0].ids.shape == (56, 8) and whole[1].ids.shape == (3, 8)
