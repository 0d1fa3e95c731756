"""Distillation losses on a cached teacher top-k: generalized JSD (GKD) over buckets, the sampled estimator,
token-rkl, and the SFT term; the reference on dense logits and the fused, chunked head with closed-form gradients.

Shapes: N trained positions, V student vocabulary, k cached teacher entries per position, H hidden size.
Everything is computed in float32. The objectives themselves are in objectives.py, written on the student's view.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from . import objectives as obj

# The settings live in a module without torch (`kdcache train --help` and the rank launcher import them).
from .loss_config import CHUNK_LOGIT_BYTES, OBJECTIVES, LossConfig, default_chunk  # noqa: F401
from .objectives import TEACHER_LOGP_FLOOR, TINY_REST  # noqa: F401

_NEG_INF = float("-inf")


def _student_logp(student_logits: Tensor) -> Tensor:
    """log_softmax(logits) over the FULL vocabulary at temperature 1, float32 [N, V]; never top-k first."""
    return F.log_softmax(student_logits.float(), dim=-1)


def gkd_per_position(student_logits: Tensor, topk_ids: Tensor, topk_logprobs: Tensor, tail_mass: Tensor,
                     cfg: LossConfig, logp: Tensor | None = None) -> Tensor:
    """KD loss per position, [N] float32, including the tau^2 factor (Hinton et al. 2015).

    student_logits [N, V]; topk_ids [N, k] (-1 = masked); topk_logprobs [N, k] sorted descending; tail_mass [N];
    logp: the student's log-softmax at temperature 1 where the caller has it. Rows with no bucket at all
    (renorm mode, every entry masked) give 0.
    """
    logp = _student_logp(student_logits) if logp is None else logp
    view = obj.dense_view(None, topk_ids, None, cfg, sampled=False, logp=logp)
    return obj.gkd(view, topk_ids, topk_logprobs, tail_mass, cfg, logp.shape[-1])


def sampled_kl_per_position(logp: Tensor, topk_ids: Tensor, topk_logprobs: Tensor, weights: Tensor,
                            cfg: LossConfig) -> Tensor:
    """Forward KL(T || S) per position from a sampled cache, [N] (objectives.sampled_kl); logp: [N, V]."""
    obj.check_sampled(cfg)
    return obj.sampled_kl(obj.dense_view(None, topk_ids, None, cfg, sampled=True, logp=logp), topk_ids,
                          topk_logprobs, weights, cfg)


def token_rkl_per_position(logp: Tensor, targets: Tensor, target_logprobs: Tensor,
                           behavior_logprobs: Tensor | None) -> Tensor:
    """Reverse KL(S || T) on the sampled tokens, [N] (objectives.token_rkl); logp: [N, V]."""
    s = logp.gather(1, targets.long().clamp_min(0)[:, None]).squeeze(1)
    return obj.token_rkl(s, target_logprobs, behavior_logprobs)


def _loss_sums(student_logits, topk_ids, topk_logprobs, tail_mass, targets, cfg, target_logprobs=None,
               behavior_logprobs=None, topk_weights=None) -> tuple[Tensor, Tensor, Tensor]:
    """(loss sum with grad, detached KD sum, detached CE sum), each 0-dim, through autograd on [N, V]."""
    logp = _student_logp(student_logits)
    view = obj.dense_view(None, topk_ids, targets, cfg, topk_weights is not None, logp=logp)
    return obj.sums(view, topk_ids, topk_logprobs, tail_mass, targets, cfg, logp.shape[-1], target_logprobs,
                    behavior_logprobs, topk_weights)


def kd_loss_from_logits(student_logits: Tensor, topk_ids: Tensor, topk_logprobs: Tensor, tail_mass: Tensor,
                        targets: Tensor, cfg: LossConfig, target_logprobs: Tensor | None = None,
                        behavior_logprobs: Tensor | None = None,
                        topk_weights: Tensor | None = None) -> tuple[Tensor, dict]:
    """(sum_n kd_n + sft_alpha * ce_n, parts). Sums, not means: the trainer divides by the global position count.

    student_logits [N, V], topk_ids/topk_logprobs [N, k], tail_mass [N], targets [N]; target_logprobs and
    behavior_logprobs [N] (NaN where unknown): used by the token-rkl objective only. topk_weights [N, k]: a sampled
    cache's estimator weights (objectives.sampled_kl), None for a top-k cache. Objective "sft": the CE sum alone.
    parts: {"kd": float, "sft": float (the CE sum, logged even when sft_alpha == 0), "positions": N}.
    With N == 0 the loss is a zero that is still connected to student_logits, so backward() works.
    This is the reference: autograd through the dense [N, V] log-softmax.
    """
    loss, kd, ce = _loss_sums(student_logits, topk_ids, topk_logprobs, tail_mass, targets, cfg, target_logprobs,
                              behavior_logprobs, topk_weights)
    return loss, {"kd": float(kd), "sft": float(ce), "positions": int(student_logits.shape[0])}


# --------------------------------------------------------------------------- the closed-form chunk

def _chunk(z: Tensor, ids: Tensor, valid: Tensor, targets: Tensor, cfg: LossConfig, need: bool, extra: tuple):
    """One chunk's (loss, kd, ce, dL/dz or None) from its [c, V] logits z, without autograd on [c, V].

    The view (objectives.View) is computed from one exp pass; the objective runs on it as small autograd leaves,
    giving g = dL/dview; then, with S = softmax(z), R the mass outside the valid ids, and Q = softmax(z / tau):
      top[m] = logp[id_m], target = logp[y]  ->  dz += onehot(col) g - S sum(g)
      tail = log R                            ->  dz_j += g_tail (S_j / R [j not stored] - S_j)
      top_tau[m] = log Q[id_m]                ->  dz += (onehot(id_m) g_tau - Q sum(g_tau)) / tau
    The rest term is formed only where j is not stored (the ids' entries are zeroed first, then get their own
    value), so no large S_j / R is ever cancelled. Rows whose R is below 1e-30 take it in log space.
    """
    topk_logprobs, tail_mass, target_logprobs, behavior_logprobs, topk_weights = extra
    sampled = topk_weights is not None
    want_top, want_tail, want_tau = obj.needs(cfg, sampled)
    v = z.shape[1]
    m = z.amax(-1, keepdim=True)
    e = (z - m).exp_()                                        # [c, V]: S * total
    total = e.sum(-1)
    lse = m.squeeze(1) + total.log()
    cols = ids.clamp_min(0)
    top = (z.gather(1, cols) - lse[:, None]).masked_fill(~valid, _NEG_INF) if want_top else None
    tgt = targets.long().clamp_min(0)
    target = z.gather(1, tgt[:, None]).squeeze(1) - lse
    tail = top_tau = low_rows = None
    if want_tail:
        idx = obj.scatter_index(ids, valid)
        e_ids = e.gather(1, idx)
        e.scatter_(1, idx, torch.where(valid.any(-1, keepdim=True), 0.0, e_ids))   # e now holds only the rest
        rest = e.sum(-1)
        has_tail = valid.sum(-1) < v
        tail = torch.where(has_tail & (rest > 0), rest.log() - total.log(), _NEG_INF)
        low = has_tail & (tail < TINY_REST)
        if bool(low.any()):
            low_rows = low.nonzero()[:, 0]
            z_rest = z[low_rows].scatter(1, idx[low_rows], _NEG_INF)
            rest_lse = obj.safe_logsumexp(z_rest, _NEG_INF)
            tail = tail.index_put((low_rows,), rest_lse - lse[low_rows])
    if want_tau:
        q = ((z - m) / cfg.temperature).exp_()
        q_total = q.sum(-1)
        top_tau = (z.gather(1, cols) - m) / cfg.temperature - q_total.log()[:, None]
    view = obj.View(top, tail, target, top_tau)
    args = (ids, topk_logprobs, tail_mass, targets, cfg, v, target_logprobs, behavior_logprobs, topk_weights)
    if not need:
        loss, kd, ce = obj.sums(view, *args)
        return loss, kd, ce, None

    names = [n for n in ("top", "tail", "target", "top_tau") if getattr(view, n) is not None]
    leaves = {n: getattr(view, n).detach().requires_grad_(True) for n in names}
    with torch.enable_grad():
        loss, kd, ce = obj.sums(obj.View(**{n: leaves.get(n) for n in ("top", "tail", "target", "top_tau")}), *args)
    used = [leaves[n] for n in names]
    grads = torch.autograd.grad(loss, used, allow_unused=True) if loss.requires_grad else [None] * len(used)
    g = {n: torch.zeros_like(leaves[n]) if d is None else d for n, d in zip(names, grads)}
    g_top = g["top"].masked_fill(~valid, 0.0) if want_top else None
    g_tail = g["tail"].masked_fill(~torch.isfinite(view.tail), 0.0) if want_tail else None
    g_sum = g["target"] + (g_top.sum(-1) if want_top else 0.0) + (g_tail if want_tail else 0.0)
    coef = -g_sum / total
    if want_tail:
        fast = (rest > 0) if low_rows is None else (rest > 0).index_fill(0, low_rows, False)
        coef = coef + _rest_coef(g_tail, rest, fast)
    dz = e.mul_(coef[:, None])
    if want_tail:
        dz.scatter_add_(1, idx, torch.where(valid, e_ids * (-g_sum / total)[:, None], 0.0))
        if low_rows is not None:
            dz[low_rows] += (z_rest - rest_lse[:, None]).exp() * g_tail[low_rows, None]
    dz.scatter_add_(1, tgt[:, None], g["target"][:, None])
    if want_top:
        dz.scatter_add_(1, cols, g_top)
    if want_tau:
        dz.add_(_tempered_grad(q, q_total, g["top_tau"].masked_fill(~valid, 0.0), cols, cfg.temperature))
    return loss, kd, ce, dz


def _rest_coef(g_tail: Tensor, rest: Tensor, fast: Tensor) -> Tensor:
    """[c]: the tail's share of dz_j / e_j for j outside the stored ids, g_tail / R (in e's units), where the
    fast path holds."""
    return torch.where(fast, g_tail / torch.where(fast, rest, 1.0), 0.0)


def _tempered_grad(q: Tensor, q_total: Tensor, g_tau: Tensor, cols: Tensor, tau: float) -> Tensor:
    """d(sum_m g_tau[m] log Q[id_m])/dz, Q = softmax(z / tau) = q / q_total: (onehot g_tau - Q sum g_tau) / tau.
    Overwrites q."""
    q.mul_((-g_tau.sum(-1) / q_total)[:, None]).scatter_add_(1, cols, g_tau)
    return q.div_(tau)


def _chunk_autograd(u, transform, ids, targets, cfg, need, extra):
    """_chunk through autograd on [c, V], from lm_head's output u (kdcache before issue 43: the reference for the
    tests and bench/train_step.py's "old" column). Returns (loss, kd, ce, dL/du or None)."""
    topk_logprobs, tail_mass, target_logprobs, behavior_logprobs, topk_weights = extra
    args = (ids, topk_logprobs, tail_mass, targets, cfg, target_logprobs, behavior_logprobs, topk_weights)
    if not need:
        return (*_loss_sums(transform(u) if transform else u, *args), None)
    u = u.detach().requires_grad_(True)
    with torch.enable_grad():
        loss, kd, ce = _loss_sums(transform(u) if transform else u, *args)
    return loss.detach(), kd, ce, torch.autograd.grad(loss, u)[0]


def _transform_grad(transform, u: Tensor, z: Tensor, dz: Tensor) -> Tensor:
    """dL/du from dL/dz where z = transform(u): the transform's own closed form where it has one (heads.py),
    else a vector-Jacobian product through autograd."""
    if transform is None:
        return dz
    if getattr(transform, "grad_in_place", None) is not None:
        return transform.grad_in_place(z, dz)
    u = u.detach().requires_grad_(True)
    with torch.enable_grad():
        return torch.autograd.grad(transform(u), u, dz)[0]


class _FusedChunks(torch.autograd.Function):
    """Head matmul + loss, chunk by chunk, with the gradient taken inside the forward pass.

    The approach of Liger-Kernel's fused linear cross-entropy: each chunk's [c, V] logits exist only during its
    own iteration; their gradient (closed form, _chunk) is folded into d(hidden) [N, H] and d(weight) [V, H] at
    once, so backward only scales those by the incoming gradient and nothing is recomputed.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, topk_ids, topk_logprobs, tail_mass, targets, cfg, transform, grad_mode,
                target_logprobs, behavior_logprobs, topk_weights, closed_form):
        # grad_mode: whether autograd records at the call (inside forward it never does); under torch.no_grad()
        # (an eval pass) no gradient is built, whatever the inputs' requires_grad.
        # A frozen head (a LoRA student's) gets no [V, H] gradient: a third of the head's matrix work saved.
        want_h, want_w, want_b = (grad_mode and bool(x) for x in ctx.needs_input_grad[:3])
        need = want_h or want_w or want_b
        h32, w32 = hidden.float(), weight.float()
        b32 = None if bias is None else bias.float()
        gh = torch.zeros_like(h32) if want_h else None
        gw = torch.zeros_like(w32) if want_w else None
        gb = torch.zeros_like(b32) if want_b and b32 is not None else None
        ids_all, valid_all = obj.valid_ids(topk_ids)
        sums = torch.zeros(3, dtype=torch.float32, device=hidden.device)
        for lo in range(0, hidden.shape[0], cfg.chunk_size):
            sl = slice(lo, lo + cfg.chunk_size)
            hc = h32[sl]
            u = F.linear(hc, w32, b32)                        # [c, V] float32: lm_head's output
            extra = tuple(None if x is None else x[sl] for x in (topk_logprobs, tail_mass, target_logprobs,
                                                                 behavior_logprobs, topk_weights))
            if closed_form:
                z = transform(u) if transform else u
                loss, kd, ce, dz = _chunk(z, ids_all[sl], valid_all[sl], targets[sl], cfg, need, extra)
                du = _transform_grad(transform, u, z, dz) if need else None
                del z, dz
            else:
                loss, kd, ce, du = _chunk_autograd(u, transform, ids_all[sl], targets[sl], cfg, need, extra)
            del u
            if need:
                if gh is not None:
                    gh[sl] = du @ w32
                if gw is not None:
                    gw.addmm_(du.T, hc)
                if gb is not None:
                    gb += du.sum(0)
                del du
            sums += torch.stack([loss.detach(), kd, ce])
        # Kept on ctx, not save_for_backward: backward drops ctx's reference before it returns them, so autograd
        # takes each gradient as the parameter's .grad instead of copying it (one [V, H] float32 less at H = 1,024).
        ctx.grads = [gh, gw, gb]
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        loss, kd, ce = sums.unbind()
        ctx.mark_non_differentiable(kd, ce)
        return loss, kd, ce

    @staticmethod
    def backward(ctx, g_loss, _g_kd, _g_ce):
        # Scaled in place and handed over: a second [V, H] copy of the head's gradient would be the loss's
        # largest tensor at a hidden size of 1,024 and more. So the graph is good for one backward.
        grads, ctx.grads = ctx.grads, None
        if grads is None:
            raise RuntimeError("kdcache's fused loss was back-propagated twice (retain_graph=True): its gradients "
                               "were taken in the forward pass and handed over by the first backward")
        out = [None if g is None else g.mul_(g_loss).to(dt) for g, dt in zip(grads, ctx.dtypes)]
        del grads
        return (*out, *([None] * 11))


def chunked_kd_loss(hidden: Tensor, lm_head_weight: Tensor, topk_ids: Tensor, topk_logprobs: Tensor,
                    tail_mass: Tensor, targets: Tensor, cfg: LossConfig,
                    lm_head_bias: Tensor | None = None, logit_transform=None, target_logprobs: Tensor | None = None,
                    behavior_logprobs: Tensor | None = None, topk_weights: Tensor | None = None,
                    closed_form: bool = True) -> tuple[Tensor, dict]:
    """kd_loss_from_logits(f(hidden @ W.T + b), ...) computed cfg.chunk_size positions at a time.

    hidden [N, H], lm_head_weight [V, H], lm_head_bias [V] or None; the rest as in kd_loss_from_logits.
    logit_transform f: what the model's forward does after lm_head (soft-capping, scaling; see
    kdcache/common/heads.py), applied inside each chunk, or None.
    At most one chunk's [chunk, V] float32 logits (and their gradient) are alive at any moment, and the
    backward pass recomputes nothing (see _FusedChunks). Gradients accumulate in float32.
    closed_form False: each chunk's gradient through autograd instead (the reference, and the old cost).
    """
    n = hidden.shape[0]
    if n == 0:
        z = F.linear(hidden.float(), lm_head_weight.float(), None if lm_head_bias is None else lm_head_bias.float())
        return kd_loss_from_logits(logit_transform(z) if logit_transform else z, topk_ids, topk_logprobs,
                                   tail_mass, targets, cfg, target_logprobs, behavior_logprobs, topk_weights)
    if topk_weights is not None:
        obj.check_sampled(cfg)
    loss, kd, ce = _FusedChunks.apply(hidden, lm_head_weight, lm_head_bias, topk_ids, topk_logprobs, tail_mass,
                                      targets, cfg, logit_transform, torch.is_grad_enabled(), target_logprobs,
                                      behavior_logprobs, topk_weights, closed_form)
    return loss, {"kd": float(kd), "sft": float(ce), "positions": int(n)}
