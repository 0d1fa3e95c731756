"""A served teacher's canary (SPEC.md 3, meta.canary): held to the weights its cache was started with.

A served teacher's fingerprint sees the served name, context length and vLLM version, never the weights. So a few
hundred positions of the job's own data (picked by its seed) are scored when a job starts, when it resumes or finds
its cache complete, and when each teacher worker starts. The first scores are kept in the manifest; later ones that
differ from them by more than the tolerance (the mean absolute difference of the actual next token's log-prob, in
nats) are refused, naming the positions that differ most, before any of that server's scores reach the cache.
"""
import itertools
from dataclasses import dataclass

import numpy as np

from kdcache.common.errors import DataError, KdcacheError

from .data import iter_rows, parse_row

POOL = 2              # the canary's N positions are drawn from the first records that encode with POOL x N...
MAX_READ = 1024       # ...or fewer, found among the dataset's first MAX_READ records
FLOOR = -1e4          # log-probs kept in JSON are clipped here (-inf is no JSON number; vLLM sends -9999.0)


class CanaryError(KdcacheError):
    """The teacher now scores the canary otherwise than when the cache was started."""


@dataclass
class Canary:
    """The canary positions: per record, the ids the teacher scores (its own view) and where."""
    sample_ids: list[int]
    seqs: list[np.ndarray]          # int32 [T_i]
    positions: list[np.ndarray]     # int32 [P_i]: canary positions in seqs[i] (position t predicts seqs[i][t + 1])

    @property
    def where(self) -> list[list[int]]:
        """[sample id, position] of every canary position, in scoring order."""
        return [[sid, int(p)] for sid, pos in zip(self.sample_ids, self.positions) for p in pos]


def pick(cfg, encoder, n: int) -> Canary | None:
    """Up to n positions drawn with cfg.seed from the first records of cfg.data that encode, as many as hold POOL x n
    positions (their trained positions; in generate mode, their prompts' positions). None if none encodes."""
    encode = encoder.encode_prompt if cfg.mode == "generate" else encoder.encode
    found, pooled = [], 0
    for raw in itertools.islice(iter_rows(cfg.data), MAX_READ):
        if raw.error or raw.skip:
            continue
        try:
            s = encode(parse_row(raw.data), raw.index)
        except DataError:         # a bad or skipped record: the scan names it; the canary takes the next
            continue
        ids, pos = s.scored
        if cfg.mode == "generate":
            pos = np.arange(len(ids) - 1, dtype=np.int32)
        if len(pos):
            found.append((raw.index, np.asarray(ids, dtype=np.int32), np.asarray(pos, dtype=np.int32)))
            pooled += len(pos)
        if pooled >= POOL * n:
            break
    pairs = [(i, int(p)) for i, (_, _, pos) in enumerate(found) for p in pos]
    if not pairs or n <= 0:
        return None
    chosen = sorted(np.random.default_rng(cfg.seed).choice(len(pairs), size=min(n, len(pairs)), replace=False))
    keep = {}
    for c in chosen:
        i, p = pairs[c]
        keep.setdefault(i, []).append(p)
    return Canary([found[i][0] for i in keep], [found[i][1] for i in keep],
                  [np.asarray(ps, dtype=np.int32) for ps in keep.values()])


def score(teacher, canary: Canary) -> np.ndarray:
    """float64 [N]: the teacher's log-prob of the actual next token at each canary position (any rank)."""
    scored = teacher.score(canary.seqs, canary.positions, 1)
    return np.maximum(np.concatenate([s.target_logprobs for s in scored]).astype(np.float64), FLOOR)


def entry(canary: Canary, logprobs: np.ndarray, tolerance: float) -> dict:
    """The manifest's meta.canary."""
    return {"positions": canary.where, "target_logprobs": [float(x) for x in logprobs],
            "statistic": "mean |difference| of target_logprobs, nats", "tolerance": float(tolerance)}


def check(reference: dict, canary: Canary, logprobs: np.ndarray, tolerance: float, teacher: str, who: str) -> float:
    """The mean difference of logprobs from reference (a meta.canary); CanaryError beyond tolerance, naming the
    positions that differ most. who: what scored them ("this job", "a new teacher worker")."""
    if reference.get("positions") != canary.where:
        raise CanaryError(f"the canary positions of this job differ from those its cache was started with "
                          f"({len(canary.where)} now, {len(reference.get('positions') or [])} in the manifest): the "
                          "dataset or its encoding changed under the same fingerprint; use a new --out")
    want = np.asarray(reference["target_logprobs"], dtype=np.float64)
    diff = np.abs(logprobs - want)
    mean = float(diff.mean())
    if not mean <= tolerance:
        worst = np.argsort(-diff, kind="stable")[:5]
        named = "; ".join(f"record {canary.where[j][0]} position {canary.where[j][1]}: {want[j]:.4f} then, "
                          f"{logprobs[j]:.4f} now" for j in worst)
        raise CanaryError(
            f"the teacher server at {teacher} no longer scores like the one this cache was started with: on its "
            f"{len(diff)} canary positions the log-prob of the next token differs by {mean:.4f} nats on average (max "
            f"{float(diff.max()):.4f}; tolerance {tolerance:g}), measured by {who}. Most different: {named}. It "
            "serves other weights or another engine under the same name; none of its scores went into the cache. "
            "Serve the weights the cache was started with, or name the new ones with --teacher-revision (a new "
            "cache), or pass --canary-tolerance if the difference is expected")
    return mean
