"""Teacher backends: the contract every backend meets, and the registry that names them.

Adding a backend is one module with a class meeting `Teacher` plus one line in TEACHERS.
Modules are imported only when chosen, so `hf` never imports vLLM.
"""
import importlib
from typing import Protocol

import numpy as np

from cache_format.errors import ConfigError

# name -> "module:Class"; the first one that imports is what `auto` picks.
TEACHERS = {
    "vllm": "pipeline.teacher_vllm:VLLMTeacher",
    "hf": "pipeline.teacher_hf:HFTeacher",
}


class Teacher(Protocol):
    """A teacher model loaded once per worker, given exact token ids only (never text)."""

    engine: str   # the package that runs it, imported on construction ("vllm", "transformers")

    def __init__(self, model_path: str, *, dtype: str, max_length: int, max_top_k: int, seed: int,
                 trust_remote_code: bool, batch_tokens: int, threads: int | None): ...

    def score(self, seqs: list[np.ndarray], positions: list[np.ndarray], k: int
              ) -> list[tuple[np.ndarray, np.ndarray]]:
        """The top-k of P(x[t+1] | x[:t+1]) over the full vocabulary, at every t in positions[i] of seqs[i].

        seqs[i]: int32 [T] token ids; positions[i]: int32 [P]. Returns, per sequence,
        (ids int32 [P, k], logprobs float32 [P, k]) sorted by descending log-prob. The writer derives
        the tail mass from the log-probs; a teacher does not.
        """

    def generate(self, prompts: list[np.ndarray], *, max_new_tokens: list[int], temperature: float,
                 top_p: float, seeds: list[int], eos_ids: set[int]) -> list[tuple[list[int], bool]]:
        """One sampled completion per prompt (per-prompt budget and seed), stopping at an end-of-turn id.

        Returns, per prompt, (new token ids, ended with an end-of-turn id)."""


def teacher_class(name):
    module, _, cls = TEACHERS[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def importable(name):
    """Whether backend `name`'s engine imports here (vLLM is an optional extra)."""
    try:
        importlib.import_module(teacher_class(name).engine)
        return True
    except ImportError:
        return False


def pick_backend(name):
    """`auto` -> the first registered backend whose engine imports; any other name is kept."""
    if name != "auto":
        return name
    for candidate in TEACHERS:
        if importable(candidate):
            return candidate
    raise ConfigError(f"backend: no teacher backend imports here (tried {list(TEACHERS)}); install vllm or "
                      "transformers")


def make_teacher(name, model_path, **kwargs) -> Teacher:
    return teacher_class(name)(model_path, **kwargs)
