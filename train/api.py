"""kdcache.kd_loss and kdcache.kd_loss_chunked: the trainer's loss for any training loop.

The mean over the batch's trained positions of the per-position loss `kdcache train` uses (train/losses.py):
generalized JSD (beta 0: forward KL(T || S), 1: reverse KL(S || T)) over the teacher's top-k plus a tail
bucket (tail="tail") or renormalised over the top-k (tail="renorm"), temperature tau (loss times tau^2),
plus sft_alpha times the cross-entropy of the cached targets. On a sampled cache (--sample), forward KL from
the draws (train/losses.py sampled_kl_per_position): the batch's topk_weights say so. A batch of records that
kdcache.CrossTokenizer derived for a student of another tokenizer (Batch.position_kinds) trains that loss where the
teacher's mapped distribution applies and the student's cross-entropy at its other positions (train/cross.py).
"""
import torch

from .batch import Batch
from .losses import LossConfig, chunked_kd_loss, default_chunk, kd_loss_from_logits


def _at_positions(x, batch):
    """(N, ...) rows of x at the batch's trained positions: x is (R, T, ...) per token, or already (N, ...)."""
    return x[batch.batch_index, batch.positions] if x.dim() == 3 else x


def kd_loss(logits: torch.Tensor, batch: Batch, *, beta=0.0, temperature=1.0, tail="tail", sft_alpha=0.0,
            reduction="mean", objective="gkd"):
    """The distillation loss of the student's logits against the cached teacher.

    logits: (R, T, V) as the model returns them for batch.input_ids, or (N, V) at the trained positions.
    reduction: "mean" over the N positions (0 when N is 0) or "sum" (the trainer divides sums by the number
    of positions of the whole optimizer step, across accumulation and ranks).
    objective: "gkd", "token-rkl" (reverse KL on the sampled tokens, importance-weighted by the batch's
    behavior_logprobs where it has them; train/objectives.py token_rkl), or "sft" (the cross-entropy alone).
    """
    cfg = LossConfig(beta=beta, temperature=temperature, tail=tail, sft_alpha=sft_alpha, objective=objective)
    dev = logits.device
    rows = _at_positions(logits, batch)

    def loss_of(keep, c):
        f = _fields(batch, dev, keep)
        return kd_loss_from_logits(rows if keep is None else rows[keep], *f[:4], c, *f[4:])
    return _reduce(_by_kind(batch, cfg, loss_of), batch, reduction)


def kd_loss_chunked(hidden: torch.Tensor, lm_head: torch.nn.Module, batch: Batch, *, beta=0.0, temperature=1.0,
                    tail="tail", sft_alpha=0.0, chunk_size=0, logit_transform=None, reduction="mean",
                    objective="gkd"):
    """kd_loss of lm_head(hidden), fused and chunked: at most one [chunk_size, V] block of float32 logits exists
    at a time, in the forward pass and the backward (the gradient is taken chunk by chunk in the forward).

    hidden: (R, T, H) final hidden states (the model's `.model(...).last_hidden_state`) or (N, H).
    lm_head: the model's output layer (weight (V, H), optional bias). logit_transform: what the model's forward
    applies after lm_head (see kdcache.heads.logit_transform(model.config): Gemma 2 soft-capping, Cohere and
    Granite scaling), or None. chunk_size 0: `kdcache train`'s default for the head's vocabulary (512 rows).
    Each chunk's gradient is taken in closed form (train/losses.py _chunk): one dense pass over its logits, as
    cross-entropy's, whatever the objective.
    """
    cfg = LossConfig(beta=beta, temperature=temperature, tail=tail, sft_alpha=sft_alpha,
                     chunk_size=chunk_size or default_chunk(lm_head.weight.shape[0]), objective=objective)
    dev = hidden.device
    rows = _at_positions(hidden, batch)

    def loss_of(keep, c):
        f = _fields(batch, dev, keep)
        return chunked_kd_loss(rows if keep is None else rows[keep], lm_head.weight, *f[:4], c,
                               lm_head_bias=getattr(lm_head, "bias", None), logit_transform=logit_transform,
                               target_logprobs=f[4], behavior_logprobs=f[5], topk_weights=f[6])
    return _reduce(_by_kind(batch, cfg, loss_of), batch, reduction)


def _fields(batch, dev, keep):
    """The batch's per-position tensors on `dev`, at the positions `keep` selects (None: all)."""
    out = []
    for name in ("topk_ids", "topk_logprobs", "tail_mass", "targets", "target_logprobs", "behavior_logprobs",
                 "topk_weights"):
        x = getattr(batch, name)
        out.append(None if x is None else (x if keep is None else x[keep.to(x.device)]).to(dev))
    return out


def _by_kind(batch, cfg, loss_of):
    """The loss sum: per kind of position for a --cross-tokenizer batch (train/cross.py), else over them all."""
    if batch.position_kinds is None:
        return loss_of(None, cfg)[0]
    from .cross import loss_by_kind
    return loss_by_kind(batch.position_kinds, cfg, loss_of)[0]


def _reduce(loss_sum, batch, reduction):
    if reduction == "sum":
        return loss_sum
    if reduction != "mean":
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    return loss_sum / max(batch.n_positions, 1)
