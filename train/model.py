"""The student: loading or initialising it, checking its tokenizer, and the forward used for distillation."""
import os

import torch
from torch import nn

from kdcache.cache_format.tokenizer_id import diff_identity, tokenizer_identity
from kdcache.common.errors import TokenizerMismatch
from kdcache.common.heads import check_head, decoder_of, logit_transform

from . import lora
from .batch import Batch
from .losses import LossConfig, chunked_kd_loss, kd_loss_from_logits


def has_weights(path) -> bool:
    """Whether a student path is a model directory with weights (else a config for a fresh student)."""
    return os.path.isdir(path) and any(f.endswith((".safetensors", ".bin")) for f in os.listdir(path))


def load_student(path, *, seed, trust_remote_code=False):
    """A model directory, or a config.json (file or directory without weights) for a fresh student."""
    from transformers import AutoConfig, AutoModelForCausalLM
    if has_weights(path):
        # dtype explicit: "auto" would run a float32 checkpoint in bf16 on some setups.
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, trust_remote_code=trust_remote_code)
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=trust_remote_code)


def load_tokenizer(cfg):
    from transformers import AutoTokenizer
    path = cfg.tokenizer or (cfg.student if os.path.isdir(cfg.student) else os.path.dirname(cfg.student))
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as e:
        raise TokenizerMismatch(f"cannot load the student's tokenizer from {path} ({e}); pass --tokenizer") from e


def check_tokenizer(tok, cache_manifest, cache_dir):
    """Refuse a student tokenizer that differs from the one the teacher's ids came from."""
    want = cache_manifest.get("meta", {}).get("tokenizer")
    if want is None:
        raise TokenizerMismatch(f"{cache_dir}: the manifest records no tokenizer (meta.tokenizer); "
                                "cannot prove token-exactness")
    diffs = diff_identity(want, tokenizer_identity(tok))
    if diffs:
        raise TokenizerMismatch(f"the student's tokenizer differs from the cache's ({cache_dir}): "
                                + "; ".join(diffs) + ". Distillation is token-exact: use the teacher's tokenizer.")


class DistillModule(nn.Module):
    """Wraps a causal LM: forward(batch) -> (loss_sum, parts) over the batch's trained positions.

    The loss is a SUM over positions; the trainer normalises by the number of
    positions across accumulation and ranks.
    """

    def __init__(self, model, loss_cfg: LossConfig, chunked=True, zero3=False,
                 by_objective: dict | None = None):
        """chunked: the fused, chunked head + loss (at most one [chunk, V] block of logits at a time). Where
        lm_head plus the known transform is not what the model's forward returns (heads.check_head, asked once
        here, before DeepSpeed partitions anything), the loss takes the model's own logits instead: [R, T, V]
        for every token of the micro-batch, in the model's dtype, plus their gradient.
        zero3: the fused head reads lm_head's weight outside lm_head's forward, where ZeRO-3 holds only this
        rank's partition of it; registered as this module's external parameter, ZeRO-3 gathers it for this
        forward (and backward) and partitions its gradient as it does any other.
        by_objective: {objective: LossConfig} for batches that name their objective (Batch.objective: a token-rkl
        run's off-policy micro-batches train GKD); a batch that names none trains loss_cfg."""
        super().__init__()
        self.model, self.loss_cfg, self.by_objective = model, loss_cfg, dict(by_objective or {})
        self.transform = logit_transform(model.config)   # soft-capping, scaling: the model's own logits
        self.own_forward = check_head(model, self.transform)
        if self.own_forward:
            print(f"kdcache: student {type(model).__name__}: {self.own_forward}; training on the model's own "
                  "forward ([R, T, V] logits per micro-batch, not --loss-chunk rows at a time)", flush=True)
        self.chunked = chunked and not self.own_forward
        if zero3 and self.chunked:
            import deepspeed
            head = model.get_output_embeddings()
            for p in (head.weight, head.bias):
                if p is not None:
                    deepspeed.zero.register_external_parameter(self, p)
        self.path = ("the model's own logits" if self.own_forward else
                     f"fused head, {loss_cfg.chunk_size} rows at a time" if self.chunked else "dense head logits")

    def state_dict(self, *args, **kwargs):
        """A LoRA student's state is its adapters: DeepSpeed's checkpoints then hold those alone (the frozen base,
        tied head included, is reloaded from --student), and load them back with strict=False."""
        sd = super().state_dict(*args, **kwargs)
        if not lora.is_lora(self.model):
            return sd
        prefix = kwargs.get("prefix", "")
        keep = {prefix + n for n, p in self.named_parameters() if p.requires_grad}
        return type(sd)((k, v) for k, v in sd.items() if k in keep)

    def forward(self, b: Batch):
        cfg = self.by_objective[b.objective] if b.objective else self.loss_cfg
        # use_cache=False: no KV cache in training, and transformers only detects packed rows without one.
        if self.own_forward:
            out = self.model(input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=b.position_ids,
                             use_cache=False).logits                                           # (R, T, V)
            rows = out[b.batch_index, b.positions]
        else:
            hidden = decoder_of(self.model)(input_ids=b.input_ids, attention_mask=b.attention_mask,
                                            position_ids=b.position_ids, use_cache=False).last_hidden_state
            rows = hidden[b.batch_index, b.positions]                                          # (N, H)
        if b.position_kinds is None:
            return self._loss(rows, b, cfg)
        return self._loss_by_kind(rows, b, cfg)

    def _loss(self, rows, b: Batch, cfg, keep=None):
        """The loss over `rows` (hidden states, or logits on the model's own forward) of the batch's positions,
        or of those `keep` selects."""
        def sel(t):
            return t if keep is None or t is None else t[keep]
        args = (sel(b.topk_ids), sel(b.topk_logprobs), sel(b.tail_mass), sel(b.targets))
        extra = dict(target_logprobs=sel(b.target_logprobs), behavior_logprobs=sel(b.behavior_logprobs),
                     topk_weights=sel(b.topk_weights))
        if self.own_forward:
            return kd_loss_from_logits(rows, *args, cfg, *extra.values())
        head = self.model.get_output_embeddings()
        if self.chunked:
            return chunked_kd_loss(rows, head.weight, *args, cfg, lm_head_bias=head.bias,
                                   logit_transform=self.transform, **extra)
        logits = head(rows) if self.transform is None else self.transform(head(rows))
        return kd_loss_from_logits(logits, *args, cfg, *extra.values())

    def _loss_by_kind(self, rows, b: Batch, cfg):
        """--cross-tokenizer (train/cross.py loss_by_kind): per kind of position, its own loss."""
        from .cross import loss_by_kind
        return loss_by_kind(b.position_kinds, cfg, lambda keep, c: self._loss(rows[keep], b, c, keep))
