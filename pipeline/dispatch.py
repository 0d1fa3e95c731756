"""Shards through teacher workers on Ray: bounded in-flight work, commit on return, stop on a signal.

The driver holds the cache's writer lock and is the only process that commits; workers only write
shard files (pipeline/worker.py). A worker that dies fails the job with the committed shards intact.
"""
import os
import time
from dataclasses import dataclass

from cache_format.errors import Interrupted, WorkerDied
from kdcache.signals import StopFlag

from .worker import TeacherWorker, Unit


@dataclass
class RunStats:
    tokens: int = 0          # tokens scored this run
    teacher_s: float = 0.0   # summed over workers
    loop_s: float = 0.0      # first shard submitted -> last shard committed (start-up excluded)
    stopped: bool = False    # a signal stopped the run early


def start_ray(ray_address):
    """Connect to ray_address (or $RAY_ADDRESS), else start a Ray for this job on 127.0.0.1, even if
    another one runs on this machine."""
    import ray
    if not ray.is_initialized():
        address = ray_address or os.environ.get("RAY_ADDRESS")
        if address:
            ray.init(address=address, log_to_driver=False)
        else:
            ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,
                     _node_ip_address="127.0.0.1", configure_logging=False)
    return ray


def worker_gpus(cfg):
    """GPUs per worker: as configured, else 1 where GPUs exist (asks the cluster only if one is named)."""
    if cfg.worker_gpus >= 0:
        return cfg.worker_gpus
    if cfg.ray_address:
        ray = start_ray(cfg.ray_address)
        return 1.0 if ray.cluster_resources().get("GPU", 0) else 0.0
    import torch
    return 1.0 if torch.cuda.is_available() else 0.0


def iter_units(shard_size, spool, todo):
    """Yield (shard index, [Sample]) for the shards in `todo`, from the spooled samples (empty shards too)."""
    pending = sorted(todo)
    current, items = None, []
    for sample in spool:
        j = sample.sample_id // shard_size
        if j != current:
            while pending and pending[0] < j:          # shards before j, including ones whose records were all skipped
                k = pending.pop(0)
                yield k, (items if k == current else [])
            current, items = j, []
        if pending and pending[0] == j:
            items.append(sample)
    while pending:
        k = pending.pop(0)
        yield k, (items if k == current else [])


def start_workers(cfg, ray, spec, gpus, n, remote_out):
    opts = dict(num_cpus=cfg.worker_cpus, num_gpus=gpus)
    if cfg.ray_address and remote_out and cfg.ray_pass_credentials:
        # Only when asked: a runtime_env is visible to everyone who can use the cluster. By default the
        # workers on other machines use the credentials those machines have (instance roles, profiles).
        creds = {k: v for k, v in os.environ.items() if k.startswith(("AWS_", "GOOGLE_", "FSSPEC_"))}
        opts["runtime_env"] = {"env_vars": creds}
    actor = ray.remote(TeacherWorker).options(**opts)
    workers = [actor.remote(spec) for _ in range(n)]
    ray.get([w.ready.remote() for w in workers])
    return workers


def run_shards(cfg, writer, spool, todo, spec, gpus, n_records, bar):
    """Run the shards in `todo` through min(workers, shards) teacher actors; commit each as it returns."""
    ray = start_ray(cfg.ray_address)
    workers = start_workers(cfg, ray, spec, gpus, min(cfg.workers, len(todo)), writer.location.remote)
    flag = StopFlag("finishing the shards in flight, then stopping (rerun the same command to resume).",
                    exit_on_second=True).install()
    pending, free = {}, list(workers) * cfg.max_in_flight
    stats, t0 = RunStats(), time.perf_counter()
    units = iter_units(cfg.shard_size, spool, todo)
    try:
        while True:
            while free and not flag:
                nxt = next(units, None)
                if nxt is None:
                    break
                j, samples = nxt
                w = free.pop(0)
                unit = Unit(writer.directory, writer.shard_tag, j, sample_start=j * cfg.shard_size,
                            sample_end=min((j + 1) * cfg.shard_size, n_records), samples=samples)
                pending[w.run.remote(unit)] = (w, j)
            if not pending:
                break
            done, _ = ray.wait(list(pending), num_returns=1)
            for ref in done:
                w, j = pending.pop(ref)
                free.append(w)
                res = _result(ray, ref, j, writer, flag)
                writer.commit(res["info"])
                stats.tokens += res["tokens"]
                stats.teacher_s += res["teacher_s"]
                bar.update(res["info"]["num_samples"])
                bar.set_postfix(tok_s=f"{stats.tokens / (time.perf_counter() - t0):,.0f}",
                                shards=f"{len(writer.manifest['shards'])}/{writer.manifest['num_shards_planned']}")
        stats.loop_s = time.perf_counter() - t0      # the last commit: Ray's shutdown below is not scoring
    finally:
        for w in workers:
            ray.kill(w)
        if not (cfg.ray_address or os.environ.get("RAY_ADDRESS")):
            ray.shutdown()     # while our handlers stand: Ray's own SIGTERM handler would exit mid-shutdown
        flag.restore()
    stats.stopped = bool(flag)
    return stats


def _result(ray, ref, j, writer, flag):
    """A worker's result for shard j, or WorkerDied (Interrupted after a signal) naming the shard and saying the
    committed ones are safe."""
    safe = f"The {len(writer.done_indices())} shards committed so far are safe"
    try:
        return ray.get(ref)
    except ray.exceptions.RayActorError as e:
        if flag:               # the signal reached the whole process group: Ray's processes stopped with us
            raise Interrupted(f"interrupted by {flag.signal}: the teacher workers stopped with this job while on "
                              f"shard {j}. {safe}; rerun the same command to resume.", flag.signal,
                              flag.signum) from e
        raise WorkerDied(f"a teacher worker died ({type(e).__name__}) while on shard {j}. {safe}; rerun the "
                         "same command to resume.") from e
    except ray.exceptions.RayTaskError as e:   # e.g. the disk filled up while writing the shard
        cause = e.cause if getattr(e, "cause", None) is not None else e
        raise WorkerDied(f"shard {j} failed in its worker: {type(cause).__name__}: {cause}. {safe}; fix the "
                         "cause and rerun the same command to resume.") from e
