"""Distillation losses on a cached teacher top-k: generalized JSD (GKD) over buckets, plus an optional SFT term.

Shapes: N trained positions, V student vocabulary, k cached teacher entries per position, H hidden size,
B buckets per position (k + 1 in "tail" mode, k in "renorm" mode). Everything is computed in float32.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from kdcache.common.errors import ConfigError

# The settings live in a module without torch (`kdcache train --help` and the rank launcher import them).
from .loss_config import CHUNK_LOGIT_BYTES, OBJECTIVES, LossConfig, default_chunk  # noqa: F401

_NEG_INF = float("-inf")
# Reverse KL (beta == 1) divides by the teacher, and a teacher bucket can be exactly 0 (tail_mass rounds to 0 when
# the top-k holds almost everything). There only, teacher log-probs are clamped to >= log(1e-30) so the loss stays
# finite (at most ~69 nats per unit of student mass on that bucket). Buckets with p >= 1e-30 are untouched.
TEACHER_LOGP_FLOOR = math.log(1e-30)


def _safe_logsumexp(x: Tensor, empty: float) -> Tensor:
    """logsumexp over the last dim, [..., B] -> [...]; rows that are all -inf give `empty`.

    torch.logsumexp gives -inf there, but its backward is exp(-inf - -inf) = NaN; a finite dummy row avoids that.
    """
    is_empty = ~(x > _NEG_INF).any(-1)
    out = torch.logsumexp(x.masked_fill(is_empty.unsqueeze(-1), 0.0), dim=-1)
    return out.masked_fill(is_empty, empty)


def _log_normalize(x: Tensor, valid: Tensor) -> Tensor:
    """Log-softmax over the valid entries of the last dim, -inf elsewhere. x, valid: [N, B] -> [N, B]."""
    x = x.masked_fill(~valid, _NEG_INF)
    return x - _safe_logsumexp(x, 0.0).unsqueeze(-1)


def _kl(log_p: Tensor, log_q: Tensor, valid: Tensor) -> Tensor:
    """sum_b p_b (log p_b - log q_b) over valid buckets, with 0 log 0 = 0. [N, B] -> [N]."""
    use = valid & (log_p > _NEG_INF)
    # Replace unused entries *before* the arithmetic: where() alone would still back-propagate 0 * inf = NaN.
    lp = torch.where(use, log_p, 0.0)
    lq = torch.where(use, log_q, 0.0)
    return torch.where(use, lp.exp() * (lp - lq), 0.0).sum(-1)


def _generalized_jsd(log_t: Tensor, log_s: Tensor, valid: Tensor, beta: float) -> Tensor:
    """GKD's generalized JSD between teacher T and student S, [N, B] log-probs -> [N].

    beta * KL(T || M) + (1 - beta) * KL(S || M), M = beta T + (1 - beta) S. The ends are special-cased to the KLs
    (the mixture form tends to 0 there, not to a KL): beta = 0 is KL(T || S), beta = 1 is KL(S || T).
    """
    if beta == 0.0:
        return _kl(log_t, log_s, valid)
    if beta == 1.0:
        return _kl(log_s, log_t.clamp_min(TEACHER_LOGP_FLOOR), valid)
    mix = torch.stack([log_t + math.log(beta), log_s + math.log1p(-beta)], dim=-1)  # [N, B, 2]
    log_m = _safe_logsumexp(mix, _NEG_INF)
    return beta * _kl(log_t, log_m, valid) + (1.0 - beta) * _kl(log_s, log_m, valid)


def _scatter_index(ids: Tensor, valid: Tensor) -> Tensor:
    """[N, k] column indices of the valid top-k ids; padded slots (-1) repeat the row's first valid id, so a
    scatter through them writes nothing new."""
    first = ids.gather(1, valid.long().argmax(-1, keepdim=True)).clamp_min(0)
    return torch.where(valid, ids, first).clamp_min(0)


class _LogRestMass(torch.autograd.Function):
    """log(sum of exp(logp[j]) over the ids j NOT among row n's valid top-k ids): [N, V], [N, k] -> [N].

    One exp pass, one scatter, one sum; backward is p_j / rest for j outside the top-k, 0 inside. The fast path:
    a rest below about e^-104 underflows to 0 in float32 (-inf here), and _log_rest_mass redoes those rows.
    """

    @staticmethod
    def forward(ctx, logp, ids, valid):
        e = logp.exp()  # [N, V]
        any_valid = valid.any(-1, keepdim=True)
        # Rows with no valid id write their own value back into column 0 (a no-op).
        idx = _scatter_index(ids, valid)
        src = torch.where(any_valid, torch.zeros((), dtype=e.dtype, device=e.device), e.gather(1, idx))
        e.scatter_(1, idx, src.expand_as(idx))
        rest = e.sum(-1)  # [N]
        ctx.save_for_backward(e, rest)
        return torch.where(rest > 0, rest.log(), _NEG_INF)

    @staticmethod
    def backward(ctx, g):
        e, rest = ctx.saved_tensors
        scale = torch.where(rest > 0, g / rest.clamp_min(torch.finfo(rest.dtype).tiny), 0.0)
        return e * scale[:, None], None, None


TINY_REST = math.log(1e-30)     # below this the fast path's float32 sum has lost the rest's digits (or all of it)


def _log_rest_mass(logp: Tensor, ids: Tensor, valid: Tensor, has_tail: Tensor) -> Tensor:
    """log of the student's mass on the ids NOT among row n's valid top-k ids: [N, V], [N, k], [N] -> [N].

    One exp pass for every row (_LogRestMass); the rows whose rest is tiny (a student that puts e^-200 outside
    the top-k) are done again as a masked logsumexp, in log space, so their tail is -200, not -inf. Rows
    without a tail (has_tail False: the ids cover the vocabulary) keep -inf."""
    fast = _LogRestMass.apply(logp, ids, valid)  # [N]
    low = has_tail & (fast < TINY_REST)
    if not bool(low.any()):
        return fast
    rows = low.nonzero()[:, 0]
    exact = _safe_logsumexp(logp[rows].scatter(1, _scatter_index(ids[rows], valid[rows]), _NEG_INF), _NEG_INF)
    return torch.where(low, torch.zeros_like(fast).index_put((rows,), exact), fast)


def _student_logp(student_logits: Tensor) -> Tensor:
    """log_softmax(logits) over the FULL vocabulary at temperature 1, float32 [N, V]; never top-k first."""
    return F.log_softmax(student_logits.float(), dim=-1)


def _buckets(student_logits: Tensor, topk_ids: Tensor, topk_logprobs: Tensor, tail_mass: Tensor,
             cfg: LossConfig, logp: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Teacher and student log-probs over the buckets, and which buckets exist: three [N, B] tensors.

    Tempering treats both sides alike: each side's bucket probabilities at temperature 1 are raised to 1/tau and
    renormalized over the buckets, p_b^(1/tau) / sum. For the top-k buckets that is exactly softmax(logits / tau)
    restricted to them; the tail bucket is tempered as one bucket on both sides, because the cache stores only
    the teacher's tail mass, not what tempering each tail token would need. So a student equal to the teacher
    has zero loss at every tau (tempering the student's full vocabulary against a one-bucket teacher tail did
    not keep that). At tau = 1 it is the exact bucket distribution.
    """
    tau = cfg.temperature
    logp = _student_logp(student_logits) if logp is None else logp  # [N, V]
    n, v = logp.shape
    ids = topk_ids.long()
    valid = ids >= 0  # [N, k]; -1 marks padding
    s_top = logp.gather(1, ids.clamp_min(0)).masked_fill(~valid, _NEG_INF)  # [N, k]
    t_top = topk_logprobs.float().masked_fill(~valid, _NEG_INF) / tau  # masked values may be anything, even NaN
    if cfg.tail == "renorm":
        # Both sides restricted to the support and renormalized: the student's mass outside the support is
        # ignored, so it is never pushed down. "tail" mode exists to fix that.
        return _log_normalize(t_top, valid), _log_normalize(s_top / tau, valid), valid

    # Student tail = log of the mass of the ids outside the top-k, summed directly (and in log space where it is
    # tiny), not 1 - sum(s_i), which cancels catastrophically once the top-k holds nearly all the mass.
    # Whether a tail bucket exists is a fact about the ids, not about the student's numbers: it exists unless the
    # row's (unique) valid ids cover the whole vocabulary. Then it is dropped on both sides (the teacher's
    # tail_mass is rounding noise) instead of charging KL against an impossible bucket. A student whose mass
    # outside the top-k underflows keeps its bucket, and pays for it.
    has_tail = valid.sum(-1) < v  # [N]
    s_tail = _log_rest_mass(logp, ids, valid, has_tail)  # [N]
    t_tail = tail_mass.float().clamp(0.0, 1.0).log() / tau
    valid = torch.cat([valid, has_tail[:, None]], dim=1)
    log_s = torch.cat([s_top, s_tail[:, None]], dim=1).masked_fill(~valid, _NEG_INF)
    if tau != 1.0:                     # the same tempering as the teacher's, tail as one bucket
        log_s = _log_normalize(log_s / tau, valid)
    log_t = _log_normalize(torch.cat([t_top, t_tail[:, None]], dim=1), valid)
    return log_t, log_s, valid


def sampled_kl_per_position(logp: Tensor, topk_ids: Tensor, topk_logprobs: Tensor, weights: Tensor,
                            cfg: LossConfig) -> Tensor:
    """Forward KL(T || S) per position, [N] float32, estimated from a sampled cache (--sample: SPEC.md 4.4),
    including the tau^2 factor.

    weights [N, k]: the estimator's teacher mass per entry (train/batch.py sampled_weights): p for an exact top
    entry, tail_mass * count / draws for a drawn id, 0 for an unused slot; they sum to 1 per position. topk_logprobs:
    the teacher's exact log-prob of each entry. logp: the student's full-vocabulary log-softmax, [N, V].
    tau = 1: sum_e w_e (log T(e) - log S(e)), an unbiased estimate of the full-vocabulary KL and of its gradient
    (linear in the weights, whose expectation is T); a student equal to the teacher gives exactly 0.
    tau != 1: the tempered teacher T^(1/tau) / Z is reached by self-normalised importance weights
    u_e = w_e T(e)^(1/tau - 1), Z estimated by sum_e u_e: consistent (its bias shrinks as the draws grow), not
    unbiased. The student is tempered exactly, over its full vocabulary. Reverse KL and JSD (beta > 0) need the
    teacher's log-prob wherever the student puts mass, which a sampled cache has only at the drawn ids: refused."""
    if cfg.beta != 0.0:
        raise ConfigError(f"beta: {cfg.beta} needs the teacher's log-prob wherever the student puts mass (reverse KL "
                          "and JSD); a sampled cache holds it only at its drawn ids, so no unbiased or consistent "
                          "estimate exists. Use beta 0 (forward KL) on a sampled cache, or a top-k cache")
    if cfg.tail != "tail":
        raise ConfigError(f"tail: {cfg.tail!r} has no meaning on a sampled cache: its draws already stand for the "
                          "whole distribution (no tail bucket to renormalise away); use tail 'tail'")
    ids = topk_ids.long()
    w = weights.float()
    valid = (ids >= 0) & (w > 0)
    t = torch.where(valid, topk_logprobs.float(), 0.0)       # unused slots may hold -inf: replaced before arithmetic
    tau = cfg.temperature
    if tau == 1.0:
        s = logp.gather(1, ids.clamp_min(0))
        return torch.where(valid, w * (t - s), 0.0).sum(-1)
    log_u = torch.where(valid, torch.log(torch.where(valid, w, 1.0)) + (1.0 / tau - 1.0) * t, _NEG_INF)
    log_z = _safe_logsumexp(log_u, 0.0)                        # [N]
    w_tau = torch.where(valid, (log_u - log_z[:, None]).exp(), 0.0)
    t_tau = t / tau - log_z[:, None]
    s_tau = F.log_softmax(logp / tau, dim=-1).gather(1, ids.clamp_min(0))
    return torch.where(valid, w_tau * (t_tau - s_tau), 0.0).sum(-1) * tau**2


def gkd_per_position(student_logits: Tensor, topk_ids: Tensor, topk_logprobs: Tensor, tail_mass: Tensor,
                     cfg: LossConfig, logp: Tensor | None = None) -> Tensor:
    """KD loss per position, [N] float32, including the tau^2 factor (Hinton et al. 2015).

    student_logits [N, V]; topk_ids [N, k] (-1 = masked); topk_logprobs [N, k] sorted descending; tail_mass [N];
    logp: the student's log-softmax at temperature 1 where the caller has it. Rows with no bucket at all
    (renorm mode, every entry masked) give 0.
    """
    log_t, log_s, valid = _buckets(student_logits, topk_ids, topk_logprobs, tail_mass, cfg, logp=logp)
    return _generalized_jsd(log_t, log_s, valid, cfg.beta) * cfg.temperature**2


def token_rkl_per_position(logp: Tensor, targets: Tensor, target_logprobs: Tensor,
                           behavior_logprobs: Tensor | None) -> Tensor:
    """Reverse KL(S || T) estimated on the sampled tokens, [N] float32 (on-policy distillation as in
    tinker-cookbook's train_on_policy: the per-token log-ratio as a negative advantage).

    Each position n holds a token y_n that a behaviour policy mu sampled (the student of a past round). The value
    is w_n * (log S(y_n) - log T(y_n)) with the log-ratio detached and w_n = S(y_n) / mu(y_n) (1 in value when
    S is mu), so the gradient, sum_n w_n (log S(y_n) - log T(y_n)) grad log S(y_n), is the importance-weighted
    score-function gradient of E_S[log S - log T] (the E_S[grad log S] term is zero). behavior_logprobs None:
    the tokens were sampled from this student just now (w_n = 1, gradient kept); given, every entry must be
    finite: a NaN (a token no policy is known to have drawn) is refused, never read as "the student itself".
    It estimates the per-token reverse KL of the policy that drew the tokens, not the sequence-level KL.
    Needs only T(y_n): the cache's target log-probs.
    """
    s = logp.gather(1, targets.long().clamp_min(0)[:, None]).squeeze(1)                  # [N], with grad
    mu = s.detach()
    if behavior_logprobs is not None:
        mu = behavior_logprobs.float()
        unknown = int((~torch.isfinite(mu)).sum())
        if unknown:
            raise ConfigError(f"objective token-rkl: {unknown} of {mu.numel()} positions have no behaviour "
                              "log-prob (NaN): their tokens were not sampled by a known policy, so the estimator "
                              "means nothing there. Train such data with the gkd objective")
    advantage = (s.detach() - target_logprobs.float()).nan_to_num(0.0)
    return torch.exp(s - mu) * advantage


def _loss_sums(student_logits, topk_ids, topk_logprobs, tail_mass, targets, cfg, target_logprobs=None,
               behavior_logprobs=None, topk_weights=None) -> tuple[Tensor, Tensor, Tensor]:
    """(loss sum with grad, detached KD sum, detached CE sum), each 0-dim."""
    logp = _student_logp(student_logits)
    if cfg.objective == "gkd" and topk_weights is not None:
        kd = sampled_kl_per_position(logp, topk_ids, topk_logprobs, topk_weights, cfg).sum()
    elif cfg.objective == "token-rkl":
        if target_logprobs is None:
            raise ConfigError("objective token-rkl: the batch has no teacher target log-probs (a format-1 cache?)")
        kd = token_rkl_per_position(logp, targets, target_logprobs,
                                    behavior_logprobs if cfg.importance else None).sum()
    else:
        kd = gkd_per_position(student_logits, topk_ids, topk_logprobs, tail_mass, cfg, logp=logp).sum()
    tgt = targets.long()
    # The KD log-softmax (temperature 1) is the CE one: gather instead of a second [N, V] pass.
    ce_terms = -logp.gather(1, tgt.clamp_min(0)[:, None]).squeeze(1).masked_fill(tgt < 0, 0.0)
    ce = ce_terms.sum() if cfg.sft_alpha > 0 else ce_terms.detach().sum()
    loss = kd + cfg.sft_alpha * ce if cfg.sft_alpha > 0 else kd
    return loss, kd.detach(), ce.detach()


def kd_loss_from_logits(student_logits: Tensor, topk_ids: Tensor, topk_logprobs: Tensor, tail_mass: Tensor,
                        targets: Tensor, cfg: LossConfig, target_logprobs: Tensor | None = None,
                        behavior_logprobs: Tensor | None = None,
                        topk_weights: Tensor | None = None) -> tuple[Tensor, dict]:
    """(sum_n kd_n + sft_alpha * ce_n, parts). Sums, not means: the trainer divides by the global position count.

    student_logits [N, V], topk_ids/topk_logprobs [N, k], tail_mass [N], targets [N]; target_logprobs and
    behavior_logprobs [N] (NaN where unknown): used by the token-rkl objective only. topk_weights [N, k]: a sampled
    cache's estimator weights (sampled_kl_per_position), None for a top-k cache.
    parts: {"kd": float, "sft": float (the CE sum, logged even when sft_alpha == 0), "positions": N}.
    With N == 0 the loss is a zero that is still connected to student_logits, so backward() works.
    """
    loss, kd, ce = _loss_sums(student_logits, topk_ids, topk_logprobs, tail_mass, targets, cfg, target_logprobs,
                              behavior_logprobs, topk_weights)
    return loss, {"kd": float(kd), "sft": float(ce), "positions": int(student_logits.shape[0])}


class _FusedChunks(torch.autograd.Function):
    """Head matmul + loss, chunk by chunk, with the gradient taken inside the forward pass.

    The approach of Liger-Kernel's fused linear cross-entropy: each chunk's [c, V] logits exist only
    during its own iteration; their gradient is folded into d(hidden) [N, H] and d(weight) [V, H] at
    once, so backward only scales those by the incoming gradient and nothing is recomputed.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, topk_ids, topk_logprobs, tail_mass, targets, cfg, transform, grad_mode,
                target_logprobs, behavior_logprobs, topk_weights):
        # grad_mode: whether autograd records at the call (inside forward it never does); under torch.no_grad()
        # (an eval pass) no gradient is built, whatever the inputs' requires_grad.
        need = grad_mode and any(ctx.needs_input_grad[:3])
        h32, w32 = hidden.float(), weight.float()
        b32 = None if bias is None else bias.float()
        gh = torch.zeros_like(h32) if need else None
        gw = torch.zeros_like(w32) if need else None
        gb = torch.zeros_like(b32) if need and b32 is not None else None
        sums = torch.zeros(3, dtype=torch.float32, device=hidden.device)
        for lo in range(0, hidden.shape[0], cfg.chunk_size):
            sl = slice(lo, lo + cfg.chunk_size)
            hc = h32[sl]
            z = F.linear(hc, w32, b32)  # [c, V] float32: lm_head's output
            args = (topk_ids[sl], topk_logprobs[sl], tail_mass[sl], targets[sl], cfg,
                    None if target_logprobs is None else target_logprobs[sl],
                    None if behavior_logprobs is None else behavior_logprobs[sl],
                    None if topk_weights is None else topk_weights[sl])
            if need:
                z.requires_grad_(True)
                with torch.enable_grad():
                    loss, kd, ce = _loss_sums(transform(z) if transform else z, *args)
                (dlogits,) = torch.autograd.grad(loss, z)  # [c, V] w.r.t. lm_head's output, freed after this iteration
                gh[sl] = dlogits @ w32
                gw.addmm_(dlogits.T, hc)
                if gb is not None:
                    gb += dlogits.sum(0)
            else:
                loss, kd, ce = _loss_sums(transform(z) if transform else z, *args)
            sums += torch.stack([loss.detach(), kd, ce])
        ctx.save_for_backward(gh, gw, gb)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        loss, kd, ce = sums.unbind()
        ctx.mark_non_differentiable(kd, ce)
        return loss, kd, ce

    @staticmethod
    def backward(ctx, g_loss, _g_kd, _g_ce):
        gh, gw, gb = ctx.saved_tensors
        dh, dw, db = ctx.dtypes
        return ((gh * g_loss).to(dh) if gh is not None else None, (gw * g_loss).to(dw) if gw is not None else None,
                (gb * g_loss).to(db) if gb is not None else None, None, None, None, None, None, None, None, None,
                None, None)


def chunked_kd_loss(hidden: Tensor, lm_head_weight: Tensor, topk_ids: Tensor, topk_logprobs: Tensor,
                    tail_mass: Tensor, targets: Tensor, cfg: LossConfig,
                    lm_head_bias: Tensor | None = None, logit_transform=None, target_logprobs: Tensor | None = None,
                    behavior_logprobs: Tensor | None = None,
                    topk_weights: Tensor | None = None) -> tuple[Tensor, dict]:
    """kd_loss_from_logits(f(hidden @ W.T + b), ...) computed cfg.chunk_size positions at a time.

    hidden [N, H], lm_head_weight [V, H], lm_head_bias [V] or None; the rest as in kd_loss_from_logits.
    logit_transform f: what the model's forward does after lm_head (soft-capping, scaling; see
    kdcache/common/heads.py), applied inside each chunk, or None.
    At most one chunk's [chunk, V] float32 logits (and their gradient) are alive at any moment, and the
    backward pass recomputes nothing (see _FusedChunks). Gradients accumulate in float32.
    """
    n = hidden.shape[0]
    if n == 0:
        z = F.linear(hidden.float(), lm_head_weight.float(), None if lm_head_bias is None else lm_head_bias.float())
        return kd_loss_from_logits(logit_transform(z) if logit_transform else z, topk_ids, topk_logprobs,
                                   tail_mass, targets, cfg, target_logprobs, behavior_logprobs, topk_weights)
    loss, kd, ce = _FusedChunks.apply(hidden, lm_head_weight, lm_head_bias, topk_ids, topk_logprobs, tail_mass,
                                      targets, cfg, logit_transform, torch.is_grad_enabled(), target_logprobs,
                                      behavior_logprobs, topk_weights)
    return loss, {"kd": float(kd), "sft": float(ce), "positions": int(n)}

