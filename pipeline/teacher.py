"""Teacher backends: the contract every backend meets, and the registry that names them.

Adding a backend is one module with a class meeting `Teacher` plus one line in TEACHERS.
Modules are imported only when chosen, so `hf` never imports vLLM.
`auto` picks by what the machine is: see choose_backend.
"""
import importlib
from typing import NamedTuple, Protocol

import numpy as np

from kdcache.common.errors import ConfigError, KdcacheError

# name -> "module:Class". `auto` chooses among them by the machine (choose_backend).
TEACHERS = {
    "vllm": "kdcache.pipeline.teacher_vllm:VLLMTeacher",
    "hf": "kdcache.pipeline.teacher_hf:HFTeacher",
    "served": "kdcache.pipeline.teacher_served:ServedTeacher",     # a vLLM server at an http(s):// URL
}


class Scored(NamedTuple):
    """One sequence's scores at its P positions, sorted by descending log-prob along k."""
    ids: np.ndarray               # int32 [P, k]: top-k token ids over the full vocabulary
    logprobs: np.ndarray          # float32 [P, k]: their log-probs
    target_logprobs: np.ndarray   # float32 [P]: log-prob of the token that actually follows (any rank)


class Draws(NamedTuple):
    """--sample N: one sequence's N draws per position from the teacher's distribution outside its top-k."""
    ids: np.ndarray               # int32 [P, N]
    logprobs: np.ndarray          # float32 [P, N]: the teacher's log-prob of each drawn id


class SampleFailed(KdcacheError):
    """One sequence of a score/generate call failed on its own (a server refused it, ...). A backend sets `index`,
    the sequence's place in the call; the worker names the sample (named)."""

    def __init__(self, message, index=None):
        super().__init__(message)
        self.index = index

    def named(self, samples):
        """This failure with the sample's id in front, samples being the call's pipeline.encode.Sample list."""
        if self.index is None or not 0 <= self.index < len(samples):
            return self
        s = samples[self.index]
        return SampleFailed(f"sample {s.sample_id} (record {s.sample_id} of the dataset, counting from 0, "
                            f"{len(s.input_ids)} tokens): {self}")


class Teacher(Protocol):
    """A teacher model loaded once per worker, given exact token ids only (never text)."""

    engine: str   # the package that runs it, imported on construction ("vllm", "transformers")

    def __init__(self, model_path: str, *, dtype: str, max_length: int, max_top_k: int, seed: int,
                 trust_remote_code: bool, batch_tokens: int, threads: int | None): ...

    def score(self, seqs: list[np.ndarray], positions: list[np.ndarray], k: int) -> list[Scored]:
        """The top-k of P(x[t+1] | x[:t+1]) over the full vocabulary, at every t in positions[i] of seqs[i],
        and the log-prob of x[t+1] itself.

        seqs[i]: int32 [T] token ids; positions[i]: int32 [P]. Returns one Scored per sequence. The
        writer derives the tail mass from the log-probs; a teacher does not.
        """

    def generate(self, prompts: list[np.ndarray], *, max_new_tokens: list[int], temperature: float,
                 top_p: float, seeds: list[int], turn_ends: set[int]) -> list[tuple[list[int], bool]]:
        """One sampled completion per prompt (per-prompt budget and seed), stopping at an end-of-turn id.

        Returns, per prompt, (new token ids, ended with an end-of-turn id).

    A backend that sees the whole distribution also offers score_sampled(seqs, positions, k, n, seeds) ->
    [(Scored, Draws)]: score() plus n draws per position from outside the top-k (pipeline/draws.py), sequence i's
    seeded with seeds[i]; --sample needs it (settle refuses the served teacher, which has none).

    A backend may also offer generate_scored(prompts, k=..., <generate's keywords>) -> [(new ids, ended, Scored)]:
    the completion and the top-k at each generated step from the same pass (the served teacher: one request per
    prompt instead of a generation and a scoring request). The worker uses it where present."""


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


def is_url(teacher):
    """A teacher named by URL is a served one (pipeline.teacher_served)."""
    return isinstance(teacher, str) and teacher.startswith(("http://", "https://"))


def cuda_visible():
    try:
        import torch
        return bool(torch.cuda.is_available())
    except Exception:          # no torch, or a broken CUDA install: treat as CPU
        return False


def choose_backend(name, teacher=None):
    """(backend, why). A named backend is kept. `auto`: a URL teacher -> served; a CUDA GPU here and vLLM
    importable -> vllm; CPU only -> hf, unless vLLM is the only one that imports (measured on 2 cores, a
    4.5M-parameter float32 teacher, 2,000 chats, k=64: hf 63 s, vllm 104-120 s, as vLLM on CPU reserves a
    core and pays about 60 s of start-up)."""
    if name != "auto":
        return name, "named with --backend"
    if is_url(teacher):
        return "served", "the teacher is a URL (a vLLM server)"
    vllm, hf = importable("vllm"), importable("hf")
    if cuda_visible():
        if vllm:
            return "vllm", "a CUDA GPU is visible and vLLM imports"
        if hf:
            return "hf", "a CUDA GPU is visible but vLLM does not import"
    elif hf:
        return "hf", ("CPU only: transformers is faster than vLLM's CPU engine for a job here (vLLM reserves a core "
                      "and pays about a minute of start-up)")
    if vllm:
        return "vllm", "vLLM is the only backend that imports here"
    raise ConfigError("backend: no teacher backend imports here (tried vllm, hf); install vllm or transformers")


def make_teacher(name, model_path, **kwargs) -> Teacher:
    return teacher_class(name)(model_path, **kwargs)
