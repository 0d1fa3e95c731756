"""The objectives kdcache trains, written on the student's *view*: its log-probs where the objectives read them.

Every objective reads the student's full-vocabulary log-probs logp = log_softmax(z) only at a few places: the k
stored ids, the target, and the mass of the ids outside the top-k (the tail). That small view is what lets
train/losses.py take each chunk's gradient in closed form: the objective runs on the view (autograd on [N, k + 2]
tensors), and the view's own derivative with respect to z is written out once (losses.py _view_grad).

Shapes: N positions, V vocabulary, k stored entries per position, B buckets (k + 1 in "tail" mode, k in "renorm").
Everything is float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from kdcache.common.errors import ConfigError

from .loss_config import LossConfig

_NEG_INF = float("-inf")
# Reverse KL (beta == 1) divides by the teacher, and a teacher bucket can be exactly 0 (tail_mass rounds to 0 when
# the top-k holds almost everything). There only, teacher log-probs are clamped to >= log(1e-30) so the loss stays
# finite (at most ~69 nats per unit of student mass on that bucket). Buckets with p >= 1e-30 are untouched.
TEACHER_LOGP_FLOOR = math.log(1e-30)
TINY_REST = math.log(1e-30)     # below this a float32 sum of the rest's exps has lost its digits (or all of it)


@dataclass
class View:
    """The student's log-probs where the objectives read them; each [N] or [N, k], None where not needed.

    top:     logp at the stored ids, -inf at padded slots (-1)        gkd on a top-k cache, sampled at tau 1
    tail:    log of the mass outside the valid stored ids (-inf where they cover the vocabulary)   gkd "tail"
    target:  logp at the target (at id 0 where the target is -1)      the SFT term, token-rkl
    top_tau: log_softmax(z / tau) at the stored ids                     sampled at tau != 1
    """
    top: Tensor | None
    tail: Tensor | None
    target: Tensor | None
    top_tau: Tensor | None = None


def needs(cfg: LossConfig, sampled: bool) -> tuple[bool, bool, bool]:
    """Which parts of the view cfg's objective reads: (top, tail, top_tau); target is always read."""
    if cfg.objective != "gkd":
        return False, False, False
    if sampled:
        return cfg.temperature == 1.0, False, cfg.temperature != 1.0
    return True, cfg.tail == "tail", False


def valid_ids(topk_ids: Tensor) -> tuple[Tensor, Tensor]:
    """(ids as int64 [N, k], valid [N, k]: not padding)."""
    ids = topk_ids.long()
    return ids, ids >= 0


def safe_logsumexp(x: Tensor, empty: float) -> Tensor:
    """logsumexp over the last dim, [..., B] -> [...]; rows that are all -inf give `empty`.

    torch.logsumexp gives -inf there, but its backward is exp(-inf - -inf) = NaN; a finite dummy row avoids that.
    """
    is_empty = ~(x > _NEG_INF).any(-1)
    out = torch.logsumexp(x.masked_fill(is_empty.unsqueeze(-1), 0.0), dim=-1)
    return out.masked_fill(is_empty, empty)


def scatter_index(ids: Tensor, valid: Tensor) -> Tensor:
    """[N, k] column indices of the valid top-k ids; padded slots (-1) repeat the row's first valid id, so a
    scatter through them writes nothing new."""
    first = ids.gather(1, valid.long().argmax(-1, keepdim=True)).clamp_min(0)
    return torch.where(valid, ids, first).clamp_min(0)


# --------------------------------------------------------------------------- the objectives, on a view

def _log_normalize(x: Tensor, valid: Tensor) -> Tensor:
    """Log-softmax over the valid entries of the last dim, -inf elsewhere. x, valid: [N, B] -> [N, B]."""
    x = x.masked_fill(~valid, _NEG_INF)
    return x - safe_logsumexp(x, 0.0).unsqueeze(-1)


def _kl(log_p: Tensor, log_q: Tensor, valid: Tensor) -> Tensor:
    """sum_b p_b (log p_b - log q_b) over valid buckets, with 0 log 0 = 0. [N, B] -> [N]."""
    use = valid & (log_p > _NEG_INF)
    # Replace unused entries *before* the arithmetic: where() alone would still back-propagate 0 * inf = NaN.
    lp = torch.where(use, log_p, 0.0)
    lq = torch.where(use, log_q, 0.0)
    return torch.where(use, lp.exp() * (lp - lq), 0.0).sum(-1)


def generalized_jsd(log_t: Tensor, log_s: Tensor, valid: Tensor, beta: float) -> Tensor:
    """GKD's generalized JSD between teacher T and student S, [N, B] log-probs -> [N].

    beta * KL(T || M) + (1 - beta) * KL(S || M), M = beta T + (1 - beta) S. The ends are special-cased to the KLs
    (the mixture form tends to 0 there, not to a KL): beta = 0 is KL(T || S), beta = 1 is KL(S || T).
    """
    if beta == 0.0:
        return _kl(log_t, log_s, valid)
    if beta == 1.0:
        return _kl(log_s, log_t.clamp_min(TEACHER_LOGP_FLOOR), valid)
    mix = torch.stack([log_t + math.log(beta), log_s + math.log1p(-beta)], dim=-1)  # [N, B, 2]
    log_m = safe_logsumexp(mix, _NEG_INF)
    return beta * _kl(log_t, log_m, valid) + (1.0 - beta) * _kl(log_s, log_m, valid)


def buckets(view: View, topk_ids: Tensor, topk_logprobs: Tensor, tail_mass: Tensor, cfg: LossConfig,
            vocab: int) -> tuple[Tensor, Tensor, Tensor]:
    """Teacher and student log-probs over the buckets, and which buckets exist: three [N, B] tensors.

    Tempering treats both sides alike: each side's bucket probabilities at temperature 1 are raised to 1/tau and
    renormalized over the buckets, p_b^(1/tau) / sum. For the top-k buckets that is exactly softmax(logits / tau)
    restricted to them; the tail bucket is tempered as one bucket on both sides, because the cache stores only
    the teacher's tail mass, not what tempering each tail token would need. So a student equal to the teacher
    has zero loss at every tau. At tau = 1 it is the exact bucket distribution.
    """
    tau = cfg.temperature
    _, valid = valid_ids(topk_ids)
    s_top = view.top
    t_top = topk_logprobs.float().masked_fill(~valid, _NEG_INF) / tau  # masked values may be anything, even NaN
    if cfg.tail == "renorm":
        # Both sides restricted to the support and renormalized: the student's mass outside the support is
        # ignored, so it is never pushed down. "tail" mode exists to fix that.
        return _log_normalize(t_top, valid), _log_normalize(s_top / tau, valid), valid
    # Whether a tail bucket exists is a fact about the ids, not about the student's numbers: it exists unless the
    # row's (unique) valid ids cover the whole vocabulary. Then it is dropped on both sides (the teacher's
    # tail_mass is rounding noise) instead of charging KL against an impossible bucket.
    has_tail = valid.sum(-1) < vocab  # [N]
    t_tail = tail_mass.float().clamp(0.0, 1.0).log() / tau
    valid = torch.cat([valid, has_tail[:, None]], dim=1)
    log_s = torch.cat([s_top, view.tail[:, None]], dim=1).masked_fill(~valid, _NEG_INF)
    if tau != 1.0:                     # the same tempering as the teacher's, tail as one bucket
        log_s = _log_normalize(log_s / tau, valid)
    log_t = _log_normalize(torch.cat([t_top, t_tail[:, None]], dim=1), valid)
    return log_t, log_s, valid


def gkd(view: View, topk_ids: Tensor, topk_logprobs: Tensor, tail_mass: Tensor, cfg: LossConfig,
        vocab: int) -> Tensor:
    """GKD per position over the buckets, [N], including the tau^2 factor (Hinton et al. 2015)."""
    log_t, log_s, valid = buckets(view, topk_ids, topk_logprobs, tail_mass, cfg, vocab)
    return generalized_jsd(log_t, log_s, valid, cfg.beta) * cfg.temperature**2


def check_sampled(cfg: LossConfig) -> None:
    if cfg.beta != 0.0:
        raise ConfigError(f"beta: {cfg.beta} needs the teacher's log-prob wherever the student puts mass (reverse KL "
                          "and JSD); a sampled cache holds it only at its drawn ids, so no unbiased or consistent "
                          "estimate exists. Use beta 0 (forward KL) on a sampled cache, or a top-k cache")
    if cfg.tail != "tail":
        raise ConfigError(f"tail: {cfg.tail!r} has no meaning on a sampled cache: its draws already stand for the "
                          "whole distribution (no tail bucket to renormalise away); use tail 'tail'")


def sampled_kl(view: View, topk_ids: Tensor, topk_logprobs: Tensor, weights: Tensor, cfg: LossConfig) -> Tensor:
    """Forward KL(T || S) per position, [N], estimated from a sampled cache (--sample: SPEC.md 4.4), with tau^2.

    weights [N, k]: the estimator's teacher mass per entry (train/batch.py sampled_weights): p for an exact top
    entry, tail_mass * count / draws for a drawn id, 0 for an unused slot; they sum to 1 per position. topk_logprobs:
    the teacher's exact log-prob of each entry.
    tau = 1: sum_e w_e (log T(e) - log S(e)), an unbiased estimate of the full-vocabulary KL and of its gradient
    (linear in the weights, whose expectation is T); a student equal to the teacher gives exactly 0.
    tau != 1: the tempered teacher T^(1/tau) / Z is reached by self-normalised importance weights
    u_e = w_e T(e)^(1/tau - 1), Z estimated by sum_e u_e: consistent (its bias shrinks as the draws grow), not
    unbiased. The student is tempered exactly, over its full vocabulary (view.top_tau). Reverse KL and JSD
    (beta > 0) need the teacher's log-prob wherever the student puts mass, which a sampled cache has only at the
    drawn ids: refused."""
    check_sampled(cfg)
    ids, _ = valid_ids(topk_ids)
    w = weights.float()
    valid = (ids >= 0) & (w > 0)
    t = torch.where(valid, topk_logprobs.float(), 0.0)       # unused slots may hold -inf: replaced before arithmetic
    tau = cfg.temperature
    if tau == 1.0:
        return torch.where(valid, w * (t - view.top.masked_fill(~valid, 0.0)), 0.0).sum(-1)
    log_u = torch.where(valid, torch.log(torch.where(valid, w, 1.0)) + (1.0 / tau - 1.0) * t, _NEG_INF)
    log_z = safe_logsumexp(log_u, 0.0)                        # [N]
    w_tau = torch.where(valid, (log_u - log_z[:, None]).exp(), 0.0)
    t_tau = t / tau - log_z[:, None]
    return torch.where(valid, w_tau * (t_tau - view.top_tau.masked_fill(~valid, 0.0)), 0.0).sum(-1) * tau**2


def token_rkl(s: Tensor, target_logprobs: Tensor, behavior_logprobs: Tensor | None) -> Tensor:
    """Reverse KL(S || T) estimated on the sampled tokens, [N] (on-policy distillation as in tinker-cookbook's
    train_on_policy: the per-token log-ratio as a negative advantage). s: the student's logp at the tokens.

    Each position n holds a token y_n that a behaviour policy mu sampled (the student of a past round). The value
    is w_n * (log S(y_n) - log T(y_n)) with the log-ratio detached and w_n = S(y_n) / mu(y_n) (1 in value when
    S is mu), so the gradient, sum_n w_n (log S(y_n) - log T(y_n)) grad log S(y_n), is the importance-weighted
    score-function gradient of E_S[log S - log T] (the E_S[grad log S] term is zero). behavior_logprobs None:
    the tokens were sampled from this student just now (w_n = 1, gradient kept); given, every entry must be
    finite: a NaN (a token no policy is known to have drawn) is refused, never read as "the student itself".
    It estimates the per-token reverse KL of the policy that drew the tokens, not the sequence-level KL.
    Needs only T(y_n): the cache's target log-probs.
    """
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


def sums(view: View, topk_ids, topk_logprobs, tail_mass, targets, cfg: LossConfig, vocab: int,
         target_logprobs=None, behavior_logprobs=None, topk_weights=None) -> tuple[Tensor, Tensor, Tensor]:
    """(loss sum with grad, detached KD sum, detached CE sum) of cfg's objective on the view, each 0-dim."""
    if cfg.objective == "sft":
        kd = view.target.new_zeros(())
    elif cfg.objective == "gkd" and topk_weights is not None:
        kd = sampled_kl(view, topk_ids, topk_logprobs, topk_weights, cfg).sum()
    elif cfg.objective == "token-rkl":
        if target_logprobs is None:
            raise ConfigError("objective token-rkl: the batch has no teacher target log-probs (a format-1 cache?)")
        kd = token_rkl(view.target, target_logprobs, behavior_logprobs if cfg.importance else None).sum()
    else:
        kd = gkd(view, topk_ids, topk_logprobs, tail_mass, cfg, vocab).sum()
    ce_terms = -view.target.masked_fill(targets.long() < 0, 0.0)
    ce = ce_terms.sum()
    weight = 1.0 if cfg.objective == "sft" else cfg.sft_alpha
    loss = kd + weight * ce if weight > 0 else kd
    return loss, kd.detach(), ce.detach()


# --------------------------------------------------------------------------- the view from dense log-probs

class _LogRestMass(torch.autograd.Function):
    """log(sum of exp(logp[j]) over the ids j NOT among row n's valid top-k ids): [N, V], [N, k] -> [N].

    One exp pass, one scatter, one sum; backward is p_j / rest for j outside the top-k, 0 inside. The fast path:
    a rest below about e^-104 underflows to 0 in float32 (-inf here), and log_rest_mass redoes those rows.
    """

    @staticmethod
    def forward(ctx, logp, ids, valid):
        e = logp.exp()  # [N, V]
        any_valid = valid.any(-1, keepdim=True)
        # Rows with no valid id write their own value back into column 0 (a no-op).
        idx = scatter_index(ids, valid)
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


def log_rest_mass(logp: Tensor, ids: Tensor, valid: Tensor) -> Tensor:
    """log of the student's mass on the ids NOT among row n's valid top-k ids: [N, V], [N, k] -> [N].

    Summed directly, not 1 - sum(s_i) (which cancels once the top-k holds nearly all the mass). One exp pass for
    every row; the rows whose rest is tiny (a student that puts e^-200 outside the top-k) are done again as a
    masked logsumexp, so their tail is -200, not -inf. Rows whose ids cover the vocabulary keep -inf."""
    has_tail = valid.sum(-1) < logp.shape[-1]
    fast = _LogRestMass.apply(logp, ids, valid)  # [N]
    low = has_tail & (fast < TINY_REST)
    if not bool(low.any()):
        return fast
    rows = low.nonzero()[:, 0]
    exact = safe_logsumexp(logp[rows].scatter(1, scatter_index(ids[rows], valid[rows]), _NEG_INF), _NEG_INF)
    return torch.where(low, torch.zeros_like(fast).index_put((rows,), exact), fast)


def dense_view(logits: Tensor | None, topk_ids: Tensor, targets: Tensor | None, cfg: LossConfig, sampled: bool,
               logp: Tensor | None = None) -> View:
    """The view from the full [N, V] logits, through autograd: the reference the closed form is tested against."""
    logp = F.log_softmax(logits.float(), dim=-1) if logp is None else logp
    ids, valid = valid_ids(topk_ids)
    want_top, want_tail, want_tau = needs(cfg, sampled)
    top = logp.gather(1, ids.clamp_min(0)).masked_fill(~valid, _NEG_INF) if want_top else None
    tail = log_rest_mass(logp, ids, valid) if want_tail else None
    top_tau = F.log_softmax(logp / cfg.temperature, -1).gather(1, ids.clamp_min(0)) if want_tau else None
    target = None if targets is None else logp.gather(1, targets.long().clamp_min(0)[:, None]).squeeze(1)
    return View(top, tail, target, top_tau)
