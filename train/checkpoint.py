"""Checkpoints that are complete or invisible.

A checkpoint is written into `checkpoints/.tmp-step-NNNNNNNN/` (DeepSpeed's
engine state plus one small file per rank with its RNG and reader state);
when every rank has finished, rank 0 writes `complete.json` and renames the
directory to `checkpoints/step-NNNNNNNN`. A half-written checkpoint is never chosen.

Several runs can leave checkpoints in one --out (a `--resume never` restart, a rewind with
`--resume PATH`, a copied directory). So each run has an id, made at its first start and kept in
`OUT/run_id.json` across resumes, and `complete.json` records it: `--resume auto` takes the latest
checkpoint of the current run, refuses when another run's checkpoints are newer, and pruning only
removes the current run's older checkpoints. Checkpoints from before run ids resume as before.
"""
import json
import os
import random
import re
import shutil
import uuid

import numpy as np
import torch

from kdcache.common.atomic import atomic_write_bytes, fsync_path, fsync_tree
from kdcache.common.errors import TrainDataError

CKPT_DIR = "checkpoints"
RUN_FILE = "run_id.json"     # beside checkpoints/, not in it: that directory holds only step-* entries
TAG = "state"
# step-00000012, or step-00000012-1a2b3c4d where another run's checkpoint of that step already has the name.
_NAME = re.compile(r"^step-(\d{8})(?:-[0-9a-f]{8})?$")


def step_dir(out, step, run_id=None):
    return os.path.join(out, CKPT_DIR, f"step-{step:08d}" + (f"-{run_id[:8]}" if run_id else ""))


def _run_of(path):
    try:
        with open(os.path.join(path, "complete.json")) as f:
            return json.load(f).get("run_id")
    except (OSError, ValueError):
        return None


def _final_dir(out, step, run_id):
    """Where this run's checkpoint of `step` goes: step-N, unless another run's checkpoint is there (a run started
    with --resume PATH from an older step reaches steps the old run saved): then step-N-<run id>. Nothing of
    another run is ever replaced."""
    plain = step_dir(out, step)
    if not os.path.lexists(plain) or (run_id and _run_of(plain) == run_id):
        return plain
    return step_dir(out, step, run_id or "00000000")


def _checkpoints(out):
    """[(step, path, run_id)] of complete checkpoints, oldest first; run_id None for those from before run ids."""
    root = os.path.join(out, CKPT_DIR)
    found = []
    if os.path.isdir(root):
        for name in os.listdir(root):
            m = _NAME.match(name)
            path = os.path.join(root, name)
            if not m:
                continue
            try:
                with open(os.path.join(path, "complete.json")) as f:
                    run_id = json.load(f).get("run_id")
            except (OSError, ValueError):       # no complete.json (half-written) or unreadable: not complete
                continue
            found.append((int(m.group(1)), path, run_id))
    return sorted(found)


def run_checkpoints(out):
    """[(step, path)] of the current run's complete checkpoints, oldest first."""
    run_id = read_run_id(out)
    return [(step, path) for step, path, rid in _checkpoints(out) if run_id and rid == run_id]


def read_run_id(out):
    """The current run's id from OUT/run_id.json, or None before the first start of a run there."""
    try:
        with open(os.path.join(out, RUN_FILE)) as f:
            return json.load(f)["run_id"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise TrainDataError(f"{os.path.join(out, RUN_FILE)} is unreadable ({e}); delete it to start a new run "
                             "in this --out, or use a new --out") from e


def _start_run(out, rank):
    """A new run id for the checkpoints written from now on (rank 0 only: all ranks share the directory)."""
    if rank == 0:
        os.makedirs(out, exist_ok=True)
        atomic_write_bytes(os.path.join(out, RUN_FILE), json.dumps({"run_id": uuid.uuid4().hex}).encode())


def _other_runs(out, run_id, mine, others):
    """The refusal of `--resume auto` when the newest checkpoints here are not the current run's."""
    ours = f"steps {', '.join(str(c[0]) for c in mine)}" if mine else "no checkpoint yet"
    theirs = ", ".join(f"{step} (run {rid or 'without id'})" for step, _p, rid in others)
    return TrainDataError(
        f"{os.path.join(out, CKPT_DIR)} holds checkpoints of another run, newer than this run's (run "
        f"{run_id or 'not recorded'} in {os.path.join(out, RUN_FILE)}: {ours}); other runs' steps: {theirs}. "
        "--resume auto will not continue another run's step. Use a new --out, or --resume PATH with the "
        "checkpoints/step-* directory to continue from.")


def _resume_auto(out, rank):
    """The latest complete checkpoint of the current run; refuse when another run's are newer or the only ones."""
    run_id, found = read_run_id(out), _checkpoints(out)
    mine = [c for c in found if run_id and c[2] == run_id]
    others = [c for c in found if c not in mine]
    if mine:
        if others and others[-1][0] > mine[-1][0]:
            raise _other_runs(out, run_id, mine, others)
        return mine[-1][1]
    if any(rid for _s, _p, rid in others):
        raise _other_runs(out, run_id, mine, others)
    if run_id is None:
        _start_run(out, rank)           # the first start of a run here (or of the first one after an upgrade)
    return others[-1][1] if others else None      # checkpoints from before run ids: resumable as before


def resolve_resume(out, resume, rank=None):
    """The checkpoint directory to resume from, or None. Also fixes which run the next checkpoints belong to:
    `never` starts a new run; a PATH continues its run only when it is that run's latest checkpoint here
    (otherwise the run's newer checkpoints would later win `auto`: a rewind starts a new run)."""
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    if resume == "never":
        _start_run(out, rank)
        return None
    if resume == "auto":
        return _resume_auto(out, rank)
    if not os.path.isfile(os.path.join(resume, "complete.json")):
        raise FileNotFoundError(f"{resume} is not a complete checkpoint (no complete.json); "
                                "pick a checkpoints/step-* directory or use --resume auto")
    with open(os.path.join(resume, "complete.json")) as f:
        meta = json.load(f)
    current = read_run_id(out)
    mine = [step for step, _p, rid in _checkpoints(out) if current and rid == current]
    if not (meta.get("run_id") and meta["run_id"] == current and meta["step"] >= max(mine, default=-1)):
        _start_run(out, rank)
    return resume


def rng_state():
    """RNG states as plain JSON data (no pickle in our own files)."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    st = {"python": [version, list(internal), gauss],
          "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
          "torch": torch.get_rng_state().tolist()}
    if torch.cuda.is_available():   # dropout on the GPU draws from these: without them a resume is another run
        st["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return st


def set_rng_state(st):
    version, internal, gauss = st["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = st["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(st["torch"], dtype=torch.uint8))
    if st.get("cuda") and torch.cuda.is_available():    # absent in checkpoints from before it, or saved on CPU
        # One state per visible device; restore those that exist here (set_rng_state_all fails past the last).
        states = st["cuda"][:torch.cuda.device_count()]
        torch.cuda.set_rng_state_all([torch.tensor(x, dtype=torch.uint8) for x in states])


CACHE_KEYS = ("cache_fingerprint", "shards_sha256", "num_shards")    # what names the cache in a saved order


def check_order(path, order, new_cache=False):
    """Refuse to resume from `path` if its reader positions mean other samples here: another cache, another
    shard list, another world size, seed or shuffle (the saved positions would skip or repeat samples).

    new_cache: a checkpoint of another cache is taken too (its reader position is then not used). Returns
    whether the reader starts afresh: True only for a checkpoint of another cache under new_cache."""
    meta = json.load(open(os.path.join(path, "complete.json")))
    saved = dict(meta.get("data", {}), world_size=meta["world_size"])   # checkpoints before 'data': ranks only
    differ = [k for k in sorted(saved) if saved[k] != order.get(k)]
    # caches added on a resume (mixing begun, a second --cache): their keys are not in the saved order
    differ += [k for k in ("mix", "mix_lambda", "caches", "cache_weights") if k in order and k not in saved]
    other_cache = any(k in CACHE_KEYS for k in differ)
    if new_cache and other_cache:      # a new round's caches (routed teachers: one or several) read from their start
        differ = [k for k in differ if k not in CACHE_KEYS + ("caches", "cache_weights")]
    differ = [f"{k}: {saved.get(k)!r} in the checkpoint, {order.get(k)!r} now" for k in differ]
    if not differ:
        return new_cache and other_cache
    hint = (f"relaunch with {saved['world_size']} rank(s) (--nproc-per-node {saved['world_size']})"
            if [d for d in differ if d.startswith("world_size")] and len(differ) == 1 else
            "resume against the same cache and settings, or start over with a new --out (or --resume never)")
    raise TrainDataError(f"{path} cannot be resumed by this run: " + "; ".join(differ) + f". To go on, {hint}.")


def save(engine, out, step, *, rank, world, client_state, rank_state, barrier, keep, order, lora=None, extra=None):
    """Save on every rank (collective), then commit on rank 0. order: what the reader positions refer to.
    extra: more of this rank's state, as JSON values by key (rank_value reads one back).
    lora: a LoRA run's settings (train/lora.py): the checkpoint then holds the adapters and their optimizer state
    only, not the frozen base weights (the run reloads those from --student)."""
    tmp = os.path.join(out, CKPT_DIR, f".tmp-step-{step:08d}")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)      # left by a crash during an earlier save
        os.makedirs(tmp)
    barrier()
    try:
        # A LoRA run's module state is its adapters alone (train/model.py DistillModule.state_dict).
        engine.save_checkpoint(tmp, tag=TAG, client_state=client_state)
        # Per-rank state: RNG (python/numpy/torch) and the reader's position, as JSON.
        atomic_write_bytes(os.path.join(tmp, f"rank-{rank:05d}.json"),
                           json.dumps({"rng": rng_state(), "reader": rank_state, **(extra or {})}).encode())
    except (OSError, RuntimeError) as e:        # torch reports a full disk as "file write failed", no path
        raise TrainDataError(write_failure(out, tmp, step, e)) from e
    barrier()
    if rank == 0:
        run_id = read_run_id(out)
        if run_id is None:              # saved without resolve_resume first: this is the run's first start
            _start_run(out, rank)
            run_id = read_run_id(out)
        fsync_tree(tmp)
        atomic_write_bytes(os.path.join(tmp, "complete.json"),
                           json.dumps({"step": step, "world_size": world, "data": order, "run_id": run_id,
                                       "lora": lora}).encode())
        final = _final_dir(out, step, run_id)
        if os.path.lexists(final):      # this run's own step, saved again: the old copy aside first, never a gap
            old = f"{final}.old-{os.getpid()}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        fsync_path(os.path.dirname(final))
        _prune(out, run_id, step, keep)
    barrier()
    return _final_dir(out, step, read_run_id(out))


LOW_SPACE = 64 * 2**20     # free bytes below which a failed write is reported as a full disk


def write_failure(out, tmp, step, error) -> str:
    """What to say when checkpoint `step` could not be written into `tmp`: the path, whether the disk is full,
    and that nothing was lost (the last complete checkpoint stays; the same command resumes from it)."""
    import errno
    try:
        free = shutil.disk_usage(out).free
    except OSError:
        free = None
    full = getattr(error, "errno", None) == errno.ENOSPC or (free is not None and free < LOW_SPACE)
    done = [p for _, p, _ in _checkpoints(out)]
    last = f"the last complete checkpoint, {done[-1]}, is kept" if done else "no earlier checkpoint exists"
    return (f"checkpoint of step {step}: writing {tmp} failed"
            + (f": disk full ({free if free is not None else '?'} bytes free)" if full else f": {error}")
            + f". Nothing committed was lost ({last}); " + ("free space, then " if full else "")
            + "rerun the same command to resume")


def _prune(out, run_id, step, keep):
    """Keep the checkpoint just written and this run's keep-1 newest before it. Other runs' checkpoints (and
    those from before run ids) stay: their step numbers say nothing about their age next to ours."""
    older = [path for s, path, rid in _checkpoints(out) if rid == run_id and s < step]
    for old in older[:max(0, len(older) - (max(1, keep) - 1))]:
        shutil.rmtree(old, ignore_errors=True)


def saved_lora(path):
    """The LoRA settings checkpoint `path` was saved with (None: full fine-tuning)."""
    with open(os.path.join(path, "complete.json")) as f:
        return json.load(f).get("lora")


def load(engine, path, rank, adapters_only=False):
    """Restore engine, optimizer and scheduler; return (client_state, this rank's saved state).
    adapters_only: a LoRA checkpoint, which holds only the trainable weights (the rest is --student's)."""
    meta = json.load(open(os.path.join(path, "complete.json")))
    lenient = {"load_module_strict": False} if adapters_only else {}
    _, client_state = engine.load_checkpoint(path, tag=TAG, load_optimizer_states=True,
                                             load_lr_scheduler_states=True, **lenient)
    own = os.path.join(path, f"rank-{rank:05d}.json")
    if not os.path.isfile(own):
        raise FileNotFoundError(f"{path} was saved with {meta['world_size']} rank(s); rank {rank} has no state "
                                "there. Resume with the same number of processes.")
    state = _rank_state(path, rank)
    set_rng_state(state["rng"])
    return client_state, state["reader"]


def restore_rng(path, rank):
    """Set this rank's RNG to what checkpoint `path` saved (a run carried on in its own process, trainer.next_cache,
    draws as one resumed from the checkpoint would)."""
    set_rng_state(_rank_state(path, rank)["rng"])


def rank_value(path, rank, key):
    """What save's `extra` held under key for this rank, or None."""
    return _rank_state(path, rank).get(key)


def _rank_state(path, rank):
    with open(os.path.join(path, f"rank-{rank:05d}.json")) as f:
        return json.load(f)
