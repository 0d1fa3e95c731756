"""The distillation recipe: setup -> loop -> save. Reads top to bottom.

Launch: `kdcache train --config FILE` (one process), `kdcache train --nproc-per-node N ...` (N local ranks under
kdcache's own launcher, train/launch.py, which never cuts a checkpoint short), or several processes with
`deepspeed --num_gpus N -m kdcache train ...` / `torchrun --nproc_per_node N -m kdcache train ...`.
"""
import json
import math
import os
import sys
import time
from dataclasses import dataclass

import torch

from kdcache.common.atomic import atomic_write_bytes
from kdcache.common.config import dump
from kdcache.common.env import default_threads
from kdcache.common.errors import TrainDataError
from kdcache.common.progress import bar
from kdcache.common.signals import StopFlag

from . import checkpoint, counts, lora
from .batch import collate
from .checks import check_inputs, check_records, check_token_rkl_records
from .cross import KINDS, coverage_line, coverage_state, cross_converters, restore_coverage
from .data import CacheStream
from .distributed import all_reduce, deepspeed_config, init_distributed, reported_grad_norm, total_norm
from .final import save_final, stops_like_the_teacher
from .loss_config import OBJECTIVES
from .metrics import METRICS, Metrics, plot_loss_curve, read_metrics
from .mix import open_streams, streams_of
from .model import DistillModule, load_student
from .out_lock import lock_out


@dataclass
class Run:
    """What the loop needs, built once by setup()."""
    cfg: object
    rank: int
    world: int
    stream: CacheStream        # or a MultiStream over several caches
    tok: object
    engine: object
    scheduler: object
    stage: int                 # ZeRO stage
    pad_id: int
    student_vocab: int
    total_steps: int           # the schedule's length
    end_step: int = 0          # where this run stops: total_steps, or --until-step
    step: int = 0
    by_cache: list = None      # [micro-batches, positions, KD sum] of the window, per cache (several caches)
    fresh_reader: bool = True  # the reader starts at the cache's beginning (not resumed mid-cache)
    t_last: float = 0.0        # when the last step ended (throughput counts data loading too)
    objectives: list = None    # what each cache's micro-batches train, in cfg.caches' order (checks.objectives)
    out_lock: object = None    # rank 0's lock on --out (lock_out), held until the process ends
    stop: StopFlag = None      # installed by setup(): a signal during start-up stops the run before a step
    params: dict = None        # {"trainable": N, "total": M} parameter counts (LoRA trains only its adapters)
    cross: list = None         # per cache: its train/cross.CrossTokenizer (--cross-tokenizer), or None


# ---------------------------------------------------------------------------- the recipe
def train(cfg):
    return train_steps(setup(cfg))


def train_steps(run):
    """Steps from run.step to run.end_step (or a signal, or the data's end), then finish: the loop of a run set up
    by setup(), or carried on to another cache by next_cache()."""
    cfg = run.cfg
    stop, run.stop = run.stop or StopFlag().install(), None
    try:
        metrics = Metrics(cfg.out, enabled=run.rank == 0, resume_step=run.step)
        bar = _progress(cfg, run.rank, run.end_step, run.step)
        batches = run.stream.batches()
        unchecked = set(range(len(cfg.caches))) if run.fresh_reader else set()   # the first batch of each cache
        resume_cmd = _resume_hint()
        reason = "finished" if run.end_step == run.total_steps else f"until step {run.end_step}"
        flag, = all_reduce([1.0 if stop.signal else 0.0], op="max")      # a signal during start-up, on any rank
        if flag:
            reason = f"stopped by {stop.signal or 'a signal to another rank'}"
        while not flag and run.step < run.end_step:        # 2. one optimizer step per window of micro-batches
            window = next_window(run, batches, unchecked)
            if window is None:
                reason = "data exhausted"
                break
            row = optimizer_step(run, *window)
            if run.step % cfg.log_every == 0 or run.step == run.end_step:
                metrics.log(row)
            bar.update(1)
            bar.set_postfix(loss=f"{row['loss']:.4f}", tok_s=f"{row['tokens_per_s']:,.0f}")
            signalled = stop.signal or (cfg.stop_after and run.step == cfg.stop_after and "stop_after")
            flag, = all_reduce([1.0 if signalled else 0.0], op="max")     # 3. checkpoint when due or signalled
            if flag or (cfg.save_every and run.step % cfg.save_every == 0):
                save(run)
                if not flag:   # a signal that came during the save stops the run now, not after a step and a save more
                    flag, = all_reduce([1.0 if stop.signal else 0.0], op="max")
            if flag:
                reason = f"stopped by {stop.signal or ('stop_after' if signalled else 'a signal to another rank')}"
                break
        bar.close()
        metrics.close()
        return finish(run, reason, resume_cmd)              # 4. last checkpoint, final model, loss curve
    finally:
        stop.restore()


def next_cache(run, cfg):
    """Carry a run that finished its last stage on to cfg's cache, in the same process (`kdcache onpolicy`'s next
    round): engine, optimizer, schedule and step count stay as they are; the reader starts at the new cache's
    beginning and the RNG is set to the last checkpoint's, as a resume from that checkpoint with --new-cache would
    (so a round trained here equals one trained by a `kdcache train` of its own)."""
    _, run.objectives = check_inputs(cfg)                    # rule 2 and the objectives, on every new cache
    for objective in run.objectives:                # the loss is stateless: a new objective just joins
        if objective and objective not in run.engine.module.by_objective:
            run.engine.module.by_objective[objective] = cfg.loss_config(run.student_vocab, objective=objective)
    done = checkpoint.run_checkpoints(cfg.out)
    if not done or done[-1][0] != run.step:
        raise TrainDataError(f"{cfg.out}: no checkpoint of step {run.step} to carry on from")
    state = run.stream.state_dict()
    stream = open_streams(cfg, run.rank, run.world)
    stream.carry_over(state)
    checkpoint.restore_rng(done[-1][1], run.rank)
    run.cfg, run.stream, run.fresh_reader = cfg, stream, True
    run.cross = cross_converters(cfg, run.tok, streams_of(stream))
    run.end_step = min(cfg.until_step or run.total_steps, run.total_steps)
    if run.rank == 0:
        dump(cfg, os.path.join(cfg.out, "train_config.yaml"))
    run.t_last = time.perf_counter()
    return run


def setup(cfg):
    """Everything before the first step. A signal meanwhile (start-up takes a minute the first time DeepSpeed
    builds its extension) is kept: train_steps then stops before its first step, with a checkpoint."""
    stop = StopFlag().install()
    try:
        run = _setup(cfg)
    except BaseException:
        stop.restore()
        raise
    run.stop = stop
    return run


def _setup(cfg):
    tok, objs = check_inputs(cfg)
    out_lock = lock_out(cfg.out, int(os.environ.get("RANK", "0")))
    rank, world = init_distributed()
    import deepspeed
    if not torch.cuda.is_available():
        torch.set_num_threads(cfg.threads or default_threads(world))
    os.makedirs(cfg.out, exist_ok=True)
    stream = open_streams(cfg, rank, world)
    model = load_student(cfg.student, seed=cfg.seed, trust_remote_code=cfg.trust_remote_code)
    student_vocab = model.get_input_embeddings().weight.shape[0]      # before ZeRO-3 partitions it
    if cfg.lora_r:
        model = lora.wrap(model, cfg)
    params = lora.counts(model)
    if rank == 0:
        print(f"student: {params['trainable']:,} of {params['total']:,} parameters train"
              + (f" (LoRA {lora.settings(cfg)})" if cfg.lora_r else ""), flush=True)
    ds_cfg = deepspeed_config(cfg)
    stage = ds_cfg.get("zero_optimization", {}).get("stage", 0)
    module = DistillModule(model, cfg.loss_config(student_vocab), zero3=stage == 3,
                           by_objective={o: cfg.loss_config(student_vocab, objective=o) for o in objs})
    # One step count for every rank: rank shares differ by a sample, and a rank with an extra step would run a
    # schedule of its own and call collectives the others never join. Counted from the micro-batches the
    # stream really yields (under --max-tokens they hold fewer than --batch-size samples).
    if cfg.max_steps:
        total_steps = cfg.max_steps
    else:
        steps, = all_reduce([max(1, stream.count_batches(cfg.epochs) // cfg.grad_accum)], op="min")
        total_steps = int(steps)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr,
                                  weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, total_steps))
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, lr_scheduler=scheduler, config=ds_cfg)
    run = Run(cfg, rank, world, stream, tok, engine, scheduler, stage,
              pad_id=tok.pad_token_id if tok.pad_token_id is not None else 0,
              student_vocab=student_vocab, total_steps=total_steps, objectives=objs, out_lock=out_lock,
              end_step=min(cfg.until_step or total_steps, total_steps), params=params,
              cross=cross_converters(cfg, tok, streams_of(stream)))
    ckpt = checkpoint.resolve_resume(cfg.out, cfg.resume)     # engine, optimizer, scheduler, RNG, reader position
    if ckpt:
        run.fresh_reader = checkpoint.check_order(ckpt, stream.order(), new_cache=cfg.new_cache)
        lora.check_resume(checkpoint.saved_lora(ckpt), lora.settings(cfg), ckpt)
        client, reader_state = checkpoint.load(engine, ckpt, rank, adapters_only=bool(cfg.lora_r))
        run.step = int(client["step"])
        if run.fresh_reader:
            stream.carry_over(reader_state)
        else:
            stream.load_state_dict(reader_state)
            restore_coverage(run.cross, checkpoint.rank_value(ckpt, rank, "cross_coverage"))
        if rank == 0:
            print(f"resumed from {ckpt} at step {run.step}" + (" on a new cache, read from its start"
                                                              if run.fresh_reader else ""), flush=True)
    if rank == 0:
        dump(cfg, os.path.join(cfg.out, "train_config.yaml"))
    run.t_last = time.perf_counter()
    return run


def next_window(run, batches, unchecked):
    """grad_accum collated micro-batches and the reader position after them; None when any rank ran dry.
    unchecked: the caches whose first batch is still to be checked for end-of-turn positions (emptied here)."""
    cfg, window, position = run.cfg, [], None
    caches = cfg.caches
    run.by_cache = [[0, 0, 0.0] for _ in caches]
    while len(window) < cfg.grad_accum:
        nxt = next(batches, None)
        if nxt is None:
            break
        records, position = nxt
        k = getattr(position, "source", 0)          # the cache this micro-batch came from
        cross = run.cross[k] if run.cross else None
        if cross is not None:                       # the student's view of each sample (train/cross.py)
            records = cross.convert_all(records)
            if not records:                         # every sample of it skipped (counted): the next one
                continue
        if k in unchecked:
            unchecked.discard(k)
            stream = streams_of(run.stream)[k]
            ends = cross.s_ends if cross is not None else set(stream.cache.eos_token_ids)
            check_records(records, ends, cfg.require_eos, caches[k])
        objective = run.objectives[k]
        if objective == "token-rkl":
            check_token_rkl_records(records, caches[k])
        batch = collate(records, pad_id=run.pad_id, student_vocab=run.student_vocab,
                        pack_len=cfg.max_tokens if cfg.pack else 0)
        batch.objective, batch.source = objective, k
        window.append(batch)
    have, = all_reduce([1.0 if len(window) == cfg.grad_accum else 0.0], op="min")
    return (window, position) if have else None


def optimizer_step(run, window, position):
    """Forward/backward every micro-batch of the window, step, advance the reader. Returns the metrics row."""
    engine = run.engine
    n_total, = all_reduce([float(sum(b.n_positions for b in window))])
    # DeepSpeed divides by grad_accum and averages over ranks; undo both so the gradient is
    # sum(loss over every position of the step) / n_total.
    scale = run.cfg.grad_accum * run.world / n_total
    sums, grad_norm = [0.0, 0.0, 0.0], None
    per_objective = {o: [0.0, 0.0] for o in OBJECTIVES}     # positions, KD sum of the micro-batches of each
    by_kind = {kind: [0, 0.0] for kind in KINDS}             # --cross-tokenizer: positions, loss sum of each kind
    for i, b in enumerate(window):
        loss_sum, parts = engine(b.to(engine.device))
        engine.backward(loss_sum * scale)
        if run.stage == 0 and i == len(window) - 1:      # ZeRO-0 does not report it; grads are reduced by now
            grad_norm = total_norm(engine.module)
        engine.step()
        sums = [sums[0] + float(loss_sum.detach()), sums[1] + parts["kd"], sums[2] + parts["sft"]]
        per_objective[b.objective or run.cfg.objective][0] += b.n_positions
        per_objective[b.objective or run.cfg.objective][1] += parts["kd"]
        run.by_cache[b.source] = [run.by_cache[b.source][0] + 1, run.by_cache[b.source][1] + b.n_positions,
                                  run.by_cache[b.source][2] + parts["kd"]]
        for kind, (n, total) in parts.get("by_kind", {}).items():
            by_kind[kind] = [by_kind[kind][0] + n, by_kind[kind][1] + total]
    loss, kd, sft = (v / n_total for v in all_reduce(sums))
    kinds = {}
    if any(run.cross or ()):
        flat = all_reduce([v for kind in KINDS for v in by_kind[kind]])
        for i, kind in enumerate(KINDS):
            kinds[f"positions_{kind}"] = int(flat[2 * i])
            kinds[f"loss_{kind}"] = flat[2 * i + 1] / flat[2 * i] if flat[2 * i] else None
    by_objective = counts.by_objective(run.objectives, per_objective)
    run.step += 1
    run.stream.position = position
    now = time.perf_counter()
    tok_s, rows, computed, outside = all_reduce([sum(b.n_tokens for b in window) / max(now - run.t_last, 1e-9),
                                                 float(sum(b.input_ids.shape[0] for b in window)),
                                                 float(sum(b.input_ids.numel() for b in window)),
                                                 float(sum(b.n_outside_vocab for b in window))])
    run.t_last = now
    if run.stage > 0:
        grad_norm = reported_grad_norm(engine)
    return {"step": run.step, "loss": loss, "kd": kd, "sft": sft, "positions": int(n_total),
            "lr": run.scheduler.get_last_lr()[0], "grad_norm": grad_norm, "tokens_per_s": round(tok_s, 1),
            # teacher entries naming ids the student has no row for (a padded teacher): moved to the tail bucket
            "epoch": run.stream.position.epoch, "outside_vocab": int(outside),
            # what the forward passes held, every rank's: rows and tokens with padding (--pack lowers both)
            "rows": int(rows), "batch_tokens": int(computed),
            **counts.by_cache(run.cfg, run.by_cache), **by_objective, **kinds}


def finish(run, reason, resume_cmd):
    """A last checkpoint; then, unless stopped, the final model (save_pretrained), the loss curve, a summary."""
    cfg, rank, stream = run.cfg, run.rank, run.stream
    done = checkpoint.run_checkpoints(cfg.out)     # ours only: another run's step N is not our step N
    if not done or done[-1][0] != run.step:
        save(run)
    stream.close()
    if reason.startswith("stopped"):
        if rank == 0:
            print(f"\n{reason} at step {run.step}; checkpoint saved. Resume with:\n  {resume_cmd}", flush=True)
        return {"step": run.step, "reason": reason}
    untrained = _untrained(run)
    rows = read_metrics(os.path.join(cfg.out, METRICS)) if rank == 0 else []
    outside = sum(int(r.get("outside_vocab") or 0) for r in rows)
    by_cache = counts.cache_totals(cfg, rows)
    final = os.path.join(cfg.out, "final")
    cross = next((c for c in run.cross or () if c is not None), None)
    stops_like_the_teacher(run.engine.module.model, run.tok, stream.cache.manifest,
                           own_ends=cross.s_ends if cross is not None else None)
    coverage = {cache: c.reduced() for cache, c in zip(cfg.caches, run.cross or ()) if c is not None}
    save_final(run.engine.module.model, run.tok, final, rank, run.stage)
    if rank == 0:
        # drawn when the schedule ends (a stage that stops at --until-step leaves it to the last stage: 0.4 s of a
        # 4 s on-policy round on 2 cores)
        curve = plot_loss_curve(cfg.out) if run.step >= run.total_steps or reason == "data exhausted" else None
        atomic_write_bytes(os.path.join(cfg.out, "train_summary.json"),
                           json.dumps({"step": run.step, "reason": reason, "final_model": final,
                                       "damaged_shards_skipped": stream.damaged,
                                       "samples_untrained": untrained, "outside_vocab": outside,
                                       "loss_path": run.engine.module.path,
                                       "parameters": run.params, "lora": lora.settings(cfg),
                                       **({"caches": by_cache} if by_cache else {}),
                                       **({"cross_tokenizer": coverage} if coverage else {}),
                                       "loss_chunk": run.engine.module.loss_cfg.chunk_size,
                                       "loss_chunk_from": "--loss-chunk" if cfg.loss_chunk else
                                       "the default for the student's vocabulary"}).encode())
        print(f"loss: {run.engine.module.path} ("
              f"{'--loss-chunk' if cfg.loss_chunk else 'the default chunk for this vocabulary'})", flush=True)
        for cache, n in (by_cache or {}).items():
            print(f"{cache}: {n['positions']:,} positions in {n['batches']} micro-batches"
                  + (f", KD {n['kd']:.4f}" if n["kd"] is not None else ""), flush=True)
        for cache, cov in coverage.items():
            print(coverage_line(cache, cov), flush=True)
        if outside:
            print(f"{outside} teacher top-k entries named ids the student has no embedding row for (a teacher "
                  "vocabulary padded past the student's); their mass was trained as the tail bucket", flush=True)
        if untrained:
            print(f"{untrained} sample(s) of the {cfg.epochs} epoch(s) were not trained: every rank runs the "
                  "same number of steps, the fewest any rank's share fills", flush=True)
        if stream.damaged:
            print(f"skipped {len(stream.damaged)} damaged shard(s), {sum(stream.damaged.values())} samples per "
                  f"epoch: {sorted(stream.damaged)}", flush=True)
        print(f"\ntraining {reason} at step {run.step}; student saved to {final}"
              + (f"; loss curve {curve}" if curve else ""), flush=True)
    return {"step": run.step, "reason": reason}


# ---------------------------------------------------------------------------- the pieces
def lr_lambda(cfg, total_steps):
    """Linear warmup, then cosine decay to min_lr_ratio * lr."""
    def f(step):
        if step < cfg.warmup_steps:
            return (step + 1) / (cfg.warmup_steps + 1)
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return f


def save(run):
    import torch.distributed as dist
    checkpoint.save(run.engine, run.cfg.out, run.step, rank=run.rank, world=run.world,
                    client_state={"step": run.step}, rank_state=run.stream.state_dict(), barrier=dist.barrier,
                    keep=run.cfg.keep_checkpoints, order=run.stream.order(), lora=lora.settings(run.cfg),
                    extra={"cross_coverage": coverage_state(run.cross)} if any(run.cross or ()) else None)


def _untrained(run):
    """Samples of the epochs no step took (epoch mode with whole batches: a rank's share beyond the agreed step
    count); None where not counted (max_steps, a token budget, packing)."""
    cfg = run.cfg
    if cfg.max_steps or cfg.pack or cfg.max_tokens:
        return None
    left, = all_reduce([max(0, run.stream.samples_per_epoch() * cfg.epochs
                            - run.step * cfg.batch_size * cfg.grad_accum)])
    return int(left)


def _resume_hint():
    """The command that resumes this run, as it was launched (kdcache's launcher, torchrun, or one process)."""
    args, skip = [], False
    for a in sys.argv[1:]:
        if skip:
            skip = False
        elif a == "--stop-after":
            skip = True
        elif not a.startswith(("--stop-after=", "--local_rank", "--local-rank")):
            args.append(a)
    if os.environ.get("KDCACHE_LAUNCH"):                       # train/launch.py
        args.append(os.environ["KDCACHE_LAUNCH"])
        prefix = ["kdcache"]
    elif os.environ.get("TORCHELASTIC_RUN_ID"):                # torchrun
        prefix = ["torchrun", "--nproc_per_node", os.environ.get("LOCAL_WORLD_SIZE", "?"), "-m", "kdcache"]
    else:
        prefix = ["kdcache"]
    return " ".join([*prefix, *args]) + "   (the same command: --resume auto is the default)"


def _progress(cfg, rank, total, initial):
    return bar(total=total, initial=initial, unit="step", desc="train",
               disable=rank != 0 or not cfg.progress)
