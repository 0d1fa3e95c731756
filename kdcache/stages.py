"""How `kdcache onpolicy` runs each round's stages: kept up in its own process, or as commands of their own.

kept:  the precompute and training stages run in the loop's process and stay up across rounds: Ray and the teacher
       workers (pipeline/pool.py: the teacher loaded once, the student loaded again each round as the generator),
       and the trainer's engine, optimizer and schedule (train.trainer.next_cache). A round then costs its work,
       not a Ray start, a teacher load and a DeepSpeed start-up (about 20 of a 30 s round on 2 cores, measured).
fresh: each stage is `kdcache precompute` or `kdcache train` in a process of its own, which frees its memory and
       GPUs when it ends: for a teacher and a student that share GPUs, and for --nproc-per-node above 1.

Both leave the same files and commit at the same points, so a rerun resumes either one with either one.
"""
import ctypes
import signal
import subprocess
import sys
import time

from kdcache.common.config import load
from kdcache.common.errors import ConfigError, Interrupted, KdcacheError

PR_SET_PDEATHSIG = 1


def make_stages(how, train, lock):
    """`how` ("auto", "kept", "fresh") resolved for these training settings: auto keeps them up unless a GPU is
    visible (the teacher's workers would hold it while the student trains) or training runs several ranks."""
    ranks = int(train.get("nproc_per_node") or 1)
    if how == "kept" and ranks > 1:
        raise ConfigError("stages: 'kept' trains in the loop's own process, one rank; with --nproc-per-node "
                          f"{ranks} use --stages fresh (or auto)")
    if how == "auto":
        import torch
        how = "fresh" if ranks > 1 or torch.cuda.is_available() else "kept"
    return KeptStages() if how == "kept" else FreshStages(lock)


class KeptStages:
    name = "kept"

    def __init__(self):
        self.pool, self.run = None, None

    def precompute(self, path, stop, what):
        from kdcache.pipeline.config import PrecomputeConfig
        from kdcache.pipeline.job import run_precompute
        from kdcache.pipeline.pool import WorkerPool
        cfg = load(PrecomputeConfig, path)
        self.pool = self.pool or WorkerPool(eager=True)
        try:
            run_precompute(cfg, pool=self.pool)
        except Interrupted:
            if not stop:
                raise
        except KdcacheError:
            _say(f"{what}: its precompute stage ({path}) failed (below). Rerun this command to resume.")
            raise

    def train(self, path, stop, what):
        from kdcache.train import trainer
        from kdcache.train.config import TrainConfig
        cfg = load(TrainConfig, path)
        if stop:
            return
        try:
            self.run = trainer.setup(cfg) if self.run is None else trainer.next_cache(self.run, cfg)
            trainer.train_steps(self.run)
        except KdcacheError:
            _say(f"{what}: its training stage ({path}) failed (below). Rerun this command to resume.")
            raise

    def close(self):
        try:
            if self.pool is not None:
                self.pool.close()
        finally:
            if self.run is not None and self.run.out_lock is not None:
                self.run.out_lock.release()


class FreshStages:
    name = "fresh"

    def __init__(self, lock):
        self.lock = lock

    def precompute(self, path, stop, what):
        self._command("precompute", path, stop, what)

    def train(self, path, stop, what):
        self._command("train", path, stop, what)

    def _command(self, name, path, stop, what):
        code = _stage([name, "--config", path], stop, self.lock)
        if code != 0 and not stop.signal:
            raise KdcacheError(f"{what}: `kdcache {name} --config {path}` failed (exit {code}; its output is "
                               "above). Rerun this command to resume.")

    def close(self):
        pass


def _die_with_loop():
    """In each stage, before exec: SIGTERM when this process dies, kill -9 included (Linux), so a stage never runs
    on alone: it finishes the shard or step in hand, commits and exits."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM))
    except (OSError, AttributeError):
        pass


def _stage(args, stop, lock):
    """Run `kdcache ARGS` in its own session (a terminal's signals reach the loop, which forwards them once) with
    the run's lock inherited, so a rerun waits for it. Returns its exit status."""
    proc = subprocess.Popen([sys.executable, "-m", "kdcache", *args], start_new_session=True,
                            preexec_fn=_die_with_loop, pass_fds=(lock.fd,))
    sent = False
    while proc.poll() is None:
        if stop.signal and not sent:
            proc.send_signal(stop.signum)
            sent = True
        time.sleep(0.2)
    return proc.returncode


def _say(msg):
    print(f"[onpolicy] {msg}", flush=True)
