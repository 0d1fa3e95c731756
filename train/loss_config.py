"""The loss settings (LossConfig) and the default chunk for a vocabulary: no torch here, so that what only parses
settings (`kdcache train --help`, the launcher of --nproc-per-node ranks) does not import it. The losses are in
losses.py."""
import math
import numbers
from dataclasses import dataclass

from kdcache.common.errors import ConfigError


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


# The default chunk (issue 43): the fused loss holds at most about four [chunk, V] float32 blocks at once (logits,
# their exps, the gradient; a soft-capped head or sampled tempering adds one), measured 2.5-3.5 plus the head's
# [V, H] gradient (BENCHMARKS.md). 4 x 512 rows is 0.125x the dense [N, V] float32 logits of a micro-batch of
# 8 x 2,048 tokens, under the 0.15x goal at every vocabulary; the closed-form loss costs the same per position
# at 256, 512 and 1,024 rows. One block is also kept under 1 GiB, which only binds past 524,288 ids.
DEFAULT_CHUNK = 512
CHUNK_LOGIT_BYTES = 2**30


def default_chunk(vocab_size: int) -> int:
    """Positions per loss chunk for a vocabulary: 512, or fewer (a power of two, at least 32) where one [chunk, V]
    float32 block would pass CHUNK_LOGIT_BYTES (V > 524,288)."""
    rows = max(1, CHUNK_LOGIT_BYTES // (4 * max(1, int(vocab_size))))
    return int(min(DEFAULT_CHUNK, max(32, 2 ** (rows.bit_length() - 1))))


OBJECTIVES = ("gkd", "token-rkl", "sft")


@dataclass
class LossConfig:
    beta: float = 0.0  # 0 forward KL, 1 reverse KL, between: generalized JSD
    temperature: float = 1.0
    tail: str = "tail"  # "tail" or "renorm"
    sft_alpha: float = 0.0
    chunk_size: int = 1024  # positions per chunk in the chunked loss
    objective: str = "gkd"  # "gkd" over the cached top-k, "token-rkl" on the sampled tokens, "sft": cross-entropy alone
    importance: bool = True  # token-rkl: weight by p_S / behaviour where behaviour log-probs are given

    def __post_init__(self):
        checks = [
            ("objective", self.objective in OBJECTIVES, f"one of {list(OBJECTIVES)}"),
            ("temperature", self.objective == "gkd" or self.temperature == 1.0,
             f"1 with the {self.objective} objective (it scores the tokens at temperature 1)"),
            ("beta", self.objective == "gkd" or self.beta == 0.0,
             f"0 with the {self.objective} objective (it has no mixture; beta is GKD's)"),
            ("sft_alpha", self.objective != "sft" or self.sft_alpha == 0.0,
             "0 with the sft objective (it trains the cross-entropy alone, at weight 1; --sft-alpha weighs it "
             "beside a KD term)"),
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
