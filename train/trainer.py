"""The distillation recipe: setup -> loop -> save. Reads top to bottom.

Launch: `kdcache train --config FILE` (one process), or several processes with
`deepspeed --num_gpus N -m kdcache train ...` / `torchrun --nproc_per_node N -m kdcache train ...`.
"""
import json
import math
import os
import signal
import socket
import sys
import time

import torch

from cache_format.atomic import atomic_write_bytes

from . import checkpoint
from .data import CacheStream, DataStateError, collate
from .losses import LossConfig
from .metrics import Metrics, plot_loss_curve
from .model import DistillModule, check_tokenizer, load_student, load_tokenizer

MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids", "batch_index", "positions", "topk_ids",
                "topk_logprobs", "tail_mass", "targets")


# ---------------------------------------------------------------------------- setup helpers
def init_distributed():
    """Single process without a launcher gets a one-rank world on a free local port."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import deepspeed
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    deepspeed.init_distributed(dist_backend=backend, verbose=False)
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def deepspeed_config(cfg):
    if cfg.deepspeed.endswith(".json"):
        with open(cfg.deepspeed) as f:
            ds = json.load(f)
    else:
        ds = {"zero_optimization": {"stage": int(cfg.deepspeed)}}
    ds.setdefault("train_micro_batch_size_per_gpu", cfg.batch_size)
    ds["gradient_accumulation_steps"] = cfg.grad_accum
    ds["gradient_clipping"] = cfg.grad_clip
    ds.setdefault("zero_allow_untested_optimizer", True)
    ds.setdefault("steps_per_print", 10 ** 9)
    ds.setdefault("wall_clock_breakdown", False)
    if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        ds.setdefault("bf16", {"enabled": True})        # fp32 on CPU
    return ds


def lr_lambda(cfg, total_steps):
    """Linear warmup, then cosine decay to min_lr_ratio * lr."""
    def f(step):
        if step < cfg.warmup_steps:
            return (step + 1) / (cfg.warmup_steps + 1)
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return f


class StopFlag:
    """SIGHUP, SIGTERM, SIGINT: finish the current step, checkpoint, exit 0."""
    def __init__(self):
        self.signal = None
        for sig in (signal.SIGHUP, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.signal = signal.Signals(signum).name


def all_reduce(values, op="sum"):
    import torch.distributed as dist
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.MIN)
    return t.tolist()


# ---------------------------------------------------------------------------- the recipe
def train(cfg):
    # 1. Setup: processes, threads, data, student, safety checks.
    rank, world = init_distributed()
    import deepspeed
    import torch.distributed as dist
    if not torch.cuda.is_available():
        torch.set_num_threads(cfg.threads or max(1, (os.cpu_count() or 1) // world))
    os.makedirs(cfg.out, exist_ok=True)
    stream = CacheStream(cfg.cache, rank=rank, world=world, seed=cfg.seed, shuffle=cfg.shuffle,
                         batch_size=cfg.batch_size, max_tokens=0 if cfg.pack else cfg.max_tokens, prefetch=cfg.prefetch,
                         epochs=None if cfg.max_steps else cfg.epochs, skip_damaged=cfg.skip_damaged_shards,
                         track_use=True)   # a lease on the cache: `kdcache gc` keeps it while this run reads
    tok = load_tokenizer(cfg)
    check_tokenizer(tok, stream.cache.manifest, cfg.cache)
    model = load_student(cfg.student, seed=cfg.seed, trust_remote_code=cfg.trust_remote_code)
    student_vocab = model.get_input_embeddings().weight.shape[0]
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
    eos_ids = set(stream.cache.eos_token_ids)

    loss_cfg = LossConfig(beta=cfg.beta, temperature=cfg.temperature, tail=cfg.tail, sft_alpha=cfg.sft_alpha,
                          chunk_size=cfg.loss_chunk)
    ds_cfg = deepspeed_config(cfg)
    stage = ds_cfg.get("zero_optimization", {}).get("stage", 0)
    module = DistillModule(model, loss_cfg, chunked=stage < 3)   # ZeRO-3 shards lm_head: use the module call
    steps_per_epoch = max(1, stream.samples_per_epoch() // (cfg.batch_size * cfg.grad_accum))
    total_steps = cfg.max_steps or steps_per_epoch * cfg.epochs
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, total_steps))
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, lr_scheduler=scheduler, config=ds_cfg)

    # 2. Resume: engine, optimizer, scheduler, RNG and the reader's position.
    step = 0
    ckpt = checkpoint.resolve_resume(cfg.out, cfg.resume)
    if ckpt:
        client, reader_state = checkpoint.load(engine, ckpt, rank)
        step = int(client["step"])
        stream.load_state_dict(reader_state)
        if rank == 0:
            print(f"resumed from {ckpt} at step {step}", flush=True)
    if rank == 0:
        from kdcache.config import dump
        dump(cfg, os.path.join(cfg.out, "train_config.yaml"))
    metrics = Metrics(cfg.out, enabled=rank == 0, resume_step=step)
    stop = StopFlag()
    bar = _progress(cfg, rank, total_steps, step)

    # 3. Loop: one optimizer step per window of grad_accum micro-batches.
    batches = stream.batches()
    first_checked = step > 0
    t_last, tokens_since, resume_cmd = time.perf_counter(), 0, _resume_hint()
    reason = "finished"
    while step < total_steps:
        window, state = [], None
        for _ in range(cfg.grad_accum):
            nxt = next(batches, None)
            if nxt is None:
                break
            records, state = nxt
            window.append(collate(records, pad_id=pad_id, student_vocab=student_vocab,
                                  pack_len=cfg.max_tokens if cfg.pack else 0))
        have, = all_reduce([1.0 if len(window) == cfg.grad_accum else 0.0], op="min")
        if not have:
            reason = "data exhausted"
            break
        if not first_checked:
            _check_first_batch(window[0], eos_ids, cfg.require_eos, cfg.cache)
            first_checked = True
        n_local = sum(b["n_positions"] for b in window)
        n_total, = all_reduce([float(n_local)])
        # DeepSpeed divides by grad_accum and averages over ranks; undo both so the gradient is
        # sum(loss over every position of the step) / n_total.
        scale = cfg.grad_accum * world / n_total
        sums, grad_norm = [0.0, 0.0, 0.0], None
        for i, b in enumerate(window):
            loss_sum, parts = engine(**{k: b[k] for k in MODEL_INPUTS})
            engine.backward(loss_sum * scale)
            if stage == 0 and i == len(window) - 1:      # ZeRO-0 does not report it; grads are reduced by now
                grad_norm = _total_norm(engine.module)
            engine.step()
            sums[0] += float(loss_sum.detach())
            sums[1] += parts["kd"]
            sums[2] += parts["sft"]
            tokens_since += b["n_tokens"]
        loss, kd, sft = (v / n_total for v in all_reduce(sums))
        step += 1
        stream.load_state_dict(state)
        # 4. Log, then checkpoint when due or when a signal arrived (all ranks agree).
        now = time.perf_counter()
        tok_s, = all_reduce([tokens_since / max(now - t_last, 1e-9)])
        if stage > 0:
            grad_norm = _grad_norm(engine)
        row = {"step": step, "loss": loss, "kd": kd, "sft": sft, "positions": int(n_total),
               "lr": scheduler.get_last_lr()[0], "grad_norm": grad_norm, "tokens_per_s": round(tok_s, 1),
               "epoch": stream.state["epoch"], "outside_vocab": sum(b["n_outside_vocab"] for b in window)}
        if step % cfg.log_every == 0 or step == total_steps:
            metrics.log(row)
        t_last, tokens_since = now, 0
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tok_s:,.0f}")
        signalled = stop.signal or (cfg.stop_after and step == cfg.stop_after and "stop_after")
        flag, = all_reduce([1.0 if signalled else 0.0], op="max")
        if flag or (cfg.save_every and step % cfg.save_every == 0):
            _save(engine, cfg, step, rank, world, stream, dist)
        if flag:
            reason = f"stopped by {stop.signal or 'stop_after'}"
            break

    # 5. Save: a last checkpoint, the final model (save_pretrained), the loss curve.
    bar.close()
    if not checkpoint.complete_checkpoints(cfg.out) or checkpoint.complete_checkpoints(cfg.out)[-1][0] != step:
        _save(engine, cfg, step, rank, world, stream, dist)
    metrics.close()
    stream.close()
    if reason.startswith("stopped"):
        if rank == 0:
            print(f"\n{reason} at step {step}; checkpoint saved. Resume with:\n  {resume_cmd}", flush=True)
        return {"step": step, "reason": reason}
    final = os.path.join(cfg.out, "final")
    _save_final(engine.module.model, tok, final, rank, stage)
    if rank == 0:
        curve = plot_loss_curve(cfg.out)
        atomic_write_bytes(os.path.join(cfg.out, "train_summary.json"),
                           json.dumps({"step": step, "reason": reason, "final_model": final,
                                       "damaged_shards_skipped": stream.damaged}).encode())
        if stream.damaged:
            print(f"skipped {len(stream.damaged)} damaged shard(s), {sum(stream.damaged.values())} samples per "
                  f"epoch: {sorted(stream.damaged)}", flush=True)
        print(f"\ntraining {reason} at step {step}; student saved to {final}"
              + (f"; loss curve {curve}" if curve else ""), flush=True)
    return {"step": step, "reason": reason}


def _save_final(model, tok, path, rank, stage):
    """save_pretrained on rank 0; under ZeRO-3 every rank first gathers the partitioned weights."""
    import contextlib

    import deepspeed
    gather = deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None) if stage == 3 \
        else contextlib.nullcontext()
    with gather:
        if rank == 0:
            model.save_pretrained(path, safe_serialization=True)
            tok.save_pretrained(path)


def _save(engine, cfg, step, rank, world, stream, dist):
    checkpoint.save(engine, cfg.out, step, rank=rank, world=world, client_state={"step": step},
                    rank_state=stream.state_dict(), barrier=dist.barrier, keep=cfg.keep_checkpoints)


def _check_first_batch(batch, eos_ids, require_eos, cache_dir):
    """Every sample has trained positions; the end-of-turn target is among them (unless truncated)."""
    idx = batch["sample_index"]
    for b, (sid, trunc) in enumerate(zip(batch["sample_ids"], batch["truncated"])):
        mine = idx == b
        if not bool(mine.any()):
            raise DataStateError(f"{cache_dir}: sample {sid} has no trained positions")
        has_eos = any(int(t) in eos_ids for t in batch["targets"][mine])
        if not has_eos and not trunc and require_eos:
            raise DataStateError(
                f"{cache_dir}: sample {sid} has no position predicting an end-of-turn token {sorted(eos_ids)}; "
                "a student trained on this cache will not learn to stop. Pass --no-require-eos to train anyway.")


def _total_norm(module):
    grads = [p.grad.detach().float().norm() for p in module.parameters() if p.grad is not None]
    return float(torch.stack(grads).norm()) if grads else None


def _grad_norm(engine):
    g = engine.get_global_grad_norm()
    return float(g) if g is not None else None


def _resume_hint():
    args, skip = [], False
    for a in sys.argv[1:]:
        if skip:
            skip = False
        elif a == "--stop-after":
            skip = True
        elif not a.startswith(("--stop-after=", "--local_rank", "--local-rank")):
            args.append(a)
    return " ".join(["kdcache", *args]) + "   (the same command: --resume auto is the default)"


def _progress(cfg, rank, total, initial):
    from tqdm import tqdm
    return tqdm(total=total, initial=initial, unit="step", desc="train", dynamic_ncols=True,
                disable=rank != 0 or not cfg.progress)
