"""What the trainer checks before and while it trains: the inputs (rule 2 per cache, settings a sampled cache
cannot honour), which objective each cache's micro-batches train, and the records of each batch."""
import os
import sys

import numpy as np

from kdcache.cache_format.manifest import load_manifest
from kdcache.cache_format.record import lacks_end_of_turn
from kdcache.common.errors import ConfigError, TrainDataError

from . import lora
from .model import check_tokenizer, has_weights, load_tokenizer


def check_inputs(cfg):
    """The caches, the student and its tokenizer, checked before any DeepSpeed start-up (which can take a
    minute the first time): a wrong path costs seconds. Returns the student's tokenizer and the objective of
    each cache's micro-batches (objectives), in cfg.caches' order."""
    caches = cfg.caches
    manifests = [load_manifest(c) for c in caches]
    if not os.path.exists(cfg.student):
        raise ConfigError(f"student: {cfg.student} does not exist (a model directory, or a config.json for a "
                          "fresh student)")
    lora.refuse_adapter_dir(cfg.student)
    if cfg.lora_r:
        lora.check_peft()
        if not has_weights(cfg.student):
            raise ConfigError(f"lora_r: {cfg.student} has no weights (a fresh student from a config): LoRA trains "
                              "adapters on a pretrained student's frozen weights. Train it without --lora-r")
    tok = load_tokenizer(cfg)
    for cache, manifest in zip(caches, manifests):
        if getattr(cfg, "cross_tokenizer", False):
            from .cross import same_tokenizer
            if not same_tokenizer(tok, manifest):
                continue                           # train/cross.py derives the student's view (cross_converters)
            print(f"kdcache: --cross-tokenizer, but the student's tokenizer is {cache}'s own: training it on the "
                  "token-exact path", flush=True)
        check_tokenizer(tok, manifest, cache)                       # rule 2, per cache: token-exact or refused
    check_sampled(cfg, manifests)
    return tok, objectives(cfg, manifests)


def check_sampled(cfg, manifests):
    """Settings a sampled cache (--sample, SPEC.md 4.4) cannot honour, refused by name before any start-up."""
    caches, manifest = cfg.caches, manifests[0]
    for cache, other in zip(caches[1:], manifests[1:]):
        if bool(manifest.sample) != bool(other.sample):
            key = "mix_cache" if cache == cfg.mix_cache else "cache"
            raise ConfigError(f"{key}: {cache} is {'' if other.sample else 'not '}a sampled cache and "
                              f"{caches[0]} is {'' if manifest.sample else 'not '}one; their losses differ, so "
                              "they cannot be trained in one run")
    if not manifest.sample or cfg.objective != "gkd":
        return
    if cfg.beta != 0:
        raise ConfigError(f"beta: {cfg.beta} on the sampled cache {caches[0]}: reverse KL and JSD need the teacher's "
                          "log-prob wherever the student puts mass, and a sampled cache holds it only at its drawn "
                          "ids (no unbiased or consistent estimate exists). Use --beta 0 (forward KL), or a top-k "
                          "cache")
    if cfg.tail != "tail":
        raise ConfigError(f"tail: {cfg.tail!r} on the sampled cache {caches[0]}: its draws already stand for the "
                          "whole distribution (no tail bucket to renormalise away); leave --tail at its default")
    if cfg.temperature != 1 and not manifest.top_k:
        raise ConfigError(f"temperature: {cfg.temperature} on the sampled cache {caches[0]}, which stores no exact "
                          "top-k: the tempered teacher is reached by self-normalised weights, biased at practical "
                          "draw counts (bench/estimator_bias.py: at tau 2 and --sample 12, +95% in value and a 105% "
                          "gradient error). Use --temperature 1, or a cache written with --top-k M --sample N")
    if cfg.temperature != 1:
        print(f"kdcache: warning: temperature {cfg.temperature} on the sampled cache {caches[0]}: the estimate is "
              "consistent, not unbiased (bench/estimator_bias.py: at tau 2, --top-k 8 --sample 16, gradient errors "
              "of 21-67%); tau 1 is exact in expectation", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- which objective trains which cache
def _capture(manifest) -> dict:
    return manifest.get("fingerprint_parts", {}).get("capture", {}) or {}


def not_sampled_by_a_policy(manifest) -> str | None:
    """Why token-rkl cannot train on this cache's completions, or None when it can: they were sampled by a
    `--generator` (a student) at a temperature > 0, with the log-prob of each sampled token stored
    (behavior_logprobs). The estimator's expectation is the per-token reverse KL of the policy that drew the
    tokens; on tokens anybody else chose it estimates nothing (BENCHMARKS.md: on teacher-drawn tokens its
    expected gradient's cosine to the reverse-KL gradient has median 0.39, negative in 5% of cases)."""
    cap = _capture(manifest)
    if cap.get("mode") != "generate":
        return ("its completions are the dataset's (score mode), not tokens a policy sampled; token-rkl estimates "
                "the reverse KL only on tokens the student drew")
    if not cap.get("generator"):
        return ("the teacher wrote its completions (generate mode without --generator); token-rkl estimates the "
                "reverse KL only on tokens the student drew")
    if float(cap.get("temperature") or 0.0) <= 0:
        return ("its completions are greedy (--gen-temperature 0): a point mass is no distribution to weight by, "
                "and the estimate on greedy tokens is not the reverse KL (its gradient's cosine to the exact one "
                "has median 0.68 and is negative in 22% of cases); generate at a temperature > 0")
    return None


def sampled_completions(manifest) -> bool:
    """Whether the cache's completions were sampled by a policy whose log-probs it stores (not_sampled_by_a_policy)."""
    return not_sampled_by_a_policy(manifest) is None


def nucleus_note(manifest) -> str | None:
    """The bias a nucleus (--gen-top-p < 1) leaves in token-rkl, or None: the behaviour policy never draws tokens
    outside the nucleus, so the per-token reverse KL it estimates is that of the truncated policy (median gradient
    error 8% at top-p 0.9 against the full student's)."""
    top_p = float(_capture(manifest).get("top_p") or 1.0)
    if top_p >= 1.0:
        return None
    return (f"completions drawn with --gen-top-p {top_p}: token-rkl then estimates the reverse KL of the "
            "nucleus-truncated student, not the student's (median gradient error 8% at top-p 0.9, measured); "
            "generate with --gen-top-p 1 for an unbiased per-token estimate")


def objectives(cfg, manifests) -> list[str]:
    """What each cache's micro-batches train, in cfg.caches' order.

    gkd and sft runs train their objective everywhere. A token-rkl run needs a first cache whose completions a
    policy sampled (refused otherwise, saying why); a further cache that is not such a cache (GKD's off-policy
    data, a --mix-cache) trains GKD over the buckets at the run's --beta (0 forward KL, 1 reverse KL), as GKD
    does with off-policy data."""
    manifest, cache = manifests[0], cfg.caches[0]
    if cfg.objective != "token-rkl":
        return [cfg.objective] * len(manifests)
    why = not_sampled_by_a_policy(manifest)
    if why:
        raise ConfigError(f"objective: token-rkl on {cache}: {why}. Use --objective gkd on this cache, or a "
                          "cache written by `kdcache onpolicy` / `kdcache precompute --mode generate --generator "
                          "STUDENT --gen-temperature 1`")
    note = nucleus_note(manifest)
    if note:
        print(f"kdcache: warning: {cache}: {note}", file=sys.stderr, flush=True)
    out = ["token-rkl"] + ["token-rkl" if sampled_completions(m) else "gkd" for m in manifests[1:]]
    if cfg.beta != 0 and "gkd" not in out:
        raise ConfigError(f"beta: {cfg.beta} with --objective token-rkl and no off-policy cache (--mix-cache): beta "
                          "is the divergence of off-policy (GKD) micro-batches, and this run has none")
    return out


# --------------------------------------------------------------------------- per batch
def check_records(records, turn_ends, require_eos, cache_dir):
    """Every sample has trained positions; the end-of-turn target is among them (unless truncated)."""
    for rec in records:
        if len(rec.positions) == 0:
            raise TrainDataError(f"{cache_dir}: sample {rec.sample_id} has no trained positions")
        if require_eos and lacks_end_of_turn(rec.targets, rec.truncated, turn_ends):
            raise TrainDataError(
                f"{cache_dir}: sample {rec.sample_id} has no position predicting an end-of-turn token "
                f"{sorted(turn_ends)}; a student trained on this cache will not learn to stop. Pass --no-require-eos "
                "to train anyway.")


def check_token_rkl_records(records, cache_dir):
    """The token-rkl objective needs, at every trained position, the teacher's log-prob of the target and the
    log-prob the policy sampled it with: a position without either would train an estimator of nothing."""
    for rec in records:
        for name, what in (("target_logprobs", "the teacher's log-prob of some targets (a format-1 cache, or a "
                                                "writer that did not know them)"),
                           ("behavior_logprobs", "the log-prob some targets were sampled with")):
            lp = getattr(rec, name, None)
            if lp is None or not np.isfinite(lp).all():
                raise TrainDataError(f"{cache_dir}: sample {rec.sample_id} lacks {what} ({name}); --objective "
                                     "token-rkl needs them at every position. Use --objective gkd, or a cache "
                                     "written by kdcache precompute --mode generate --generator.")
