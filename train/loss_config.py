"""The loss settings (LossConfig) and the default chunk for a vocabulary: no torch here, so that what only parses
settings (`kdcache train --help`, the launcher of --nproc-per-node ranks) does not import it. The losses are in
losses.py."""
import math
import numbers
from dataclasses import dataclass

from kdcache.common.errors import ConfigError


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


# One chunk's [chunk, V] float32 logits, at most (the default chunk's bound). Measured at V = 151,936 on CPU
# (BENCHMARKS.md): chunks of 128 / 256 / 512 / 1024 positions cost 1.72 / 1.35 / 1.23 / 1.20x an SFT step and
# 0.078 / 0.124 / 0.217 / 0.401x the dense loss's peak memory; 192 MiB (256 there) keeps memory under 0.15x.
CHUNK_LOGIT_BYTES = 192 * 2**20


def default_chunk(vocab_size: int) -> int:
    """Positions per loss chunk for a vocabulary: the largest power of two whose [chunk, V] float32 logits fit
    CHUNK_LOGIT_BYTES, within [32, 4096]: 1024 at 32,000, 256 at 151,936, 128 at 262,144. Peak loss memory is about
    six chunks of logits (the logits, their softmax and gradients) plus the hidden states (BENCHMARKS.md)."""
    rows = max(1, CHUNK_LOGIT_BYTES // (4 * max(1, int(vocab_size))))
    return int(min(4096, max(32, 2 ** (rows.bit_length() - 1))))


OBJECTIVES = ("gkd", "token-rkl")


@dataclass
class LossConfig:
    beta: float = 0.0  # 0 forward KL, 1 reverse KL, between: generalized JSD
    temperature: float = 1.0
    tail: str = "tail"  # "tail" or "renorm"
    sft_alpha: float = 0.0
    chunk_size: int = 1024  # positions per chunk in the chunked loss
    objective: str = "gkd"  # "gkd" over the cached top-k, or "token-rkl" on the sampled tokens (token_rkl_per_position)
    importance: bool = True  # token-rkl: weight by p_S / behaviour where behaviour log-probs are given

    def __post_init__(self):
        checks = [
            ("objective", self.objective in OBJECTIVES, f"one of {list(OBJECTIVES)}"),
            ("temperature", self.objective == "gkd" or self.temperature == 1.0,
             "1 with the token-rkl objective (it scores the sampled tokens at temperature 1)"),
            ("beta", self.objective == "gkd" or self.beta == 0.0,
             "0 with the token-rkl objective (it has no mixture; beta is GKD's)"),
            ("beta", _is_real(self.beta) and 0.0 <= self.beta <= 1.0, "a number in [0, 1]"),
            ("temperature", _is_real(self.temperature) and self.temperature > 0, "a finite number > 0"),
            ("tail", self.tail in ("tail", "renorm"), "'tail' or 'renorm'"),
            ("sft_alpha", _is_real(self.sft_alpha) and self.sft_alpha >= 0, "a finite number >= 0"),
            ("chunk_size", isinstance(self.chunk_size, numbers.Integral) and not isinstance(self.chunk_size, bool)
             and self.chunk_size >= 1, "an integer >= 1"),
        ]
        for name, ok, need in checks:
            if not ok:
                raise ConfigError(f"{name}: must be {need}, got {getattr(self, name)!r}")
