"""Checkpoints that are complete or invisible.

A checkpoint is written into `checkpoints/.tmp-step-NNNNNNNN/` (DeepSpeed's
engine state plus one small file per rank with its RNG and reader state);
when every rank has finished, rank 0 writes `complete.json` and renames the
directory to `checkpoints/step-NNNNNNNN`. Resume picks the highest step whose
directory has `complete.json`; a half-written checkpoint is never chosen.
"""
import json
import os
import random
import re
import shutil

import numpy as np
import torch

from cache_format.atomic import atomic_write_bytes, fsync_path, fsync_tree
from cache_format.errors import TrainDataError

CKPT_DIR = "checkpoints"
TAG = "state"
_NAME = re.compile(r"^step-(\d{8})$")


def step_dir(out, step):
    return os.path.join(out, CKPT_DIR, f"step-{step:08d}")


def complete_checkpoints(out):
    """[(step, path)] of complete checkpoints, oldest first."""
    root = os.path.join(out, CKPT_DIR)
    found = []
    if os.path.isdir(root):
        for name in os.listdir(root):
            m = _NAME.match(name)
            path = os.path.join(root, name)
            if m and os.path.isfile(os.path.join(path, "complete.json")):
                found.append((int(m.group(1)), path))
    return sorted(found)


def resolve_resume(out, resume):
    """The checkpoint directory to resume from, or None."""
    if resume == "never":
        return None
    if resume == "auto":
        done = complete_checkpoints(out)
        return done[-1][1] if done else None
    if not os.path.isfile(os.path.join(resume, "complete.json")):
        raise FileNotFoundError(f"{resume} is not a complete checkpoint (no complete.json); "
                                "pick a checkpoints/step-* directory or use --resume auto")
    return resume


def rng_state():
    """RNG states as plain JSON data (no pickle in our own files)."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"python": [version, list(internal), gauss],
            "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
            "torch": torch.get_rng_state().tolist()}


def set_rng_state(st):
    version, internal, gauss = st["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = st["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(st["torch"], dtype=torch.uint8))


def check_plan(path, plan):
    """Refuse to resume from `path` if its reader positions mean other samples here: another cache, another
    shard list, another world size, seed or shuffle (the saved positions would skip or repeat samples)."""
    meta = json.load(open(os.path.join(path, "complete.json")))
    saved = dict(meta.get("data", {}), world_size=meta["world_size"])   # checkpoints before 'data': ranks only
    differ = [f"{k}: {saved[k]!r} in the checkpoint, {plan[k]!r} now" for k in sorted(saved) if saved[k] != plan[k]]
    if not differ:
        return
    hint = (f"relaunch with {saved['world_size']} rank(s) (--nproc-per-node {saved['world_size']})"
            if [d for d in differ if d.startswith("world_size")] and len(differ) == 1 else
            "resume against the same cache and settings, or start over with a new --out (or --resume never)")
    raise TrainDataError(f"{path} cannot be resumed by this run: " + "; ".join(differ) + f". To go on, {hint}.")


def save(engine, out, step, *, rank, world, client_state, rank_state, barrier, keep, plan):
    """Save on every rank (collective), then commit on rank 0. plan: what the reader positions mean."""
    tmp = os.path.join(out, CKPT_DIR, f".tmp-step-{step:08d}")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)      # left by a crash during an earlier save
        os.makedirs(tmp)
    barrier()
    engine.save_checkpoint(tmp, tag=TAG, client_state=client_state)
    # Per-rank state: RNG (python/numpy/torch) and the reader's position, as JSON.
    atomic_write_bytes(os.path.join(tmp, f"rank-{rank:05d}.json"),
                       json.dumps({"rng": rng_state(), "reader": rank_state}).encode())
    barrier()
    if rank == 0:
        fsync_tree(tmp)
        atomic_write_bytes(os.path.join(tmp, "complete.json"),
                           json.dumps({"step": step, "world_size": world, "data": plan}).encode())
        final = step_dir(out, step)
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_path(os.path.dirname(final))
        for _step, old in complete_checkpoints(out)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    barrier()
    return step_dir(out, step)


def load(engine, path, rank):
    """Restore engine, optimizer and scheduler; return (client_state, this rank's saved state)."""
    meta = json.load(open(os.path.join(path, "complete.json")))
    _, client_state = engine.load_checkpoint(path, tag=TAG, load_optimizer_states=True,
                                             load_lr_scheduler_states=True)
    own = os.path.join(path, f"rank-{rank:05d}.json")
    if not os.path.isfile(own):
        raise FileNotFoundError(f"{path} was saved with {meta['world_size']} rank(s); rank {rank} has no state "
                                "there. Resume with the same number of processes.")
    with open(own) as f:
        state = json.load(f)
    set_rng_state(state["rng"])
    return client_state, state["reader"]
