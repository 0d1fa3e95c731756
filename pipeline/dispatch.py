"""Shards through teacher workers on Ray: started early, fed as the spool fills, bounded in-flight work, commit on
return, stop on a signal.

Start-up overlaps (pipeline/job.py decides when): Ray starts in a background thread (RayStarter), at the job's
start where the job will most likely need it, and the teacher actors are created the moment it is up
(prestart_workers), importing what a teacher needs while the driver settles the job; they load the teacher once
the settled spec reaches them, while the driver reads and tokenizes the dataset (job.scan), calling
Dispatcher.pump after every record: a shard whose records have all been read goes to a ready worker at once.
Results are committed only once the whole dataset has been read without error (a malformed record under
--on-bad-record fail still stops the job before anything is committed); after that, Dispatcher.run commits each
shard as it returns.

The driver holds the cache's writer lock and is the only process that commits; workers only write
shard files (pipeline/worker.py). A worker that dies fails the job with the committed shards intact.
"""
import os
import signal
import sys
import time
from collections import deque
from dataclasses import dataclass, field

from kdcache.cache_format.manifest import shard_range
from kdcache.common.env import env_seconds
from kdcache.common.errors import Interrupted, WorkerDied
from kdcache.common.signals import SIGNALS, StopFlag

from .canary import CanaryError
from .placement import gpus_per_worker, resolve_workers, worker_options
from .ray_start import own_ray, start_ray
from .worker import TeacherWorker, Unit

STOP_GRACE_S = 60.0     # after a signal, how long the shards in flight may take to come back (KDCACHE_STOP_GRACE_S)


@dataclass
class RunStats:
    tokens: int = 0          # tokens scored this run
    teacher_s: float = 0.0   # summed over workers
    retried: int = 0         # served teacher: requests retried after a transient failure (the server down, a 5xx)
    loop_s: float = 0.0      # first shard submitted -> last shard committed (start-up excluded)
    stopped: bool = False    # a signal stopped the run early
    abandoned: list = field(default_factory=list)   # shards in flight when the stop's grace ran out (not committed)
    startup: dict = field(default_factory=dict)   # seconds from the job's start: see Dispatcher
    ray: dict = field(default_factory=dict)       # the cluster the job ran on: its GCS address, whether the job's own
    engine: dict = field(default_factory=dict)    # the teacher engine's settings, as a worker reported them (vLLM)
    shards_by_node: dict = field(default_factory=dict)   # shards committed this run per Ray node (id's first 12 digits)


def worker_gpus(cfg):
    """GPUs per worker: as configured, else 1 where GPUs exist (asks the cluster only if one is named)."""
    if cfg.worker_gpus >= 0:
        return cfg.worker_gpus
    if cfg.ray_address:
        ray = start_ray(cfg.ray_address)
        return 1.0 if ray.cluster_resources().get("GPU", 0) else 0.0
    import torch
    return 1.0 if torch.cuda.is_available() else 0.0


def unit_samples(reader, j, shard_size):
    """Shard j's samples (its records, shard_range) from a SpoolReader, skipping those of earlier shards nobody
    asked for. Shards are taken in increasing order."""
    lo, hi = shard_range(j, shard_size, float("inf"))
    return [s for s in reader.take(hi) if s.sample_id >= lo]


def start_workers(cfg, ray, spec, gpus, n, remote_out):
    """(n teacher actors, created now, each loading the teacher in its constructor (wait on its ready()); the
    placement groups made for them, one each with --tensor-parallel-size (pipeline/placement.py), else none)."""
    each, groups = worker_options(ray, cfg, gpus, n)
    env = cluster_env(cfg, remote_out)
    if env:
        each = [dict(o, runtime_env={"env_vars": env}) for o in each]
    return [ray.remote(TeacherWorker).options(**o).remote(spec) for o in each], groups


def cluster_env(cfg, remote_out) -> dict:
    """What a job's workers on a cluster get from the job's environment (a Ray of the job's own passes them all).
    Its KDCACHE_* settings (served retries and timeouts, spool, fetch budget, lease): set for the job, they
    hold for its workers wherever they run. With --ray-pass-credentials and a URL --out, its credentials too;
    only when asked, as a runtime_env is visible to everyone who can use the cluster (by default the workers on
    other machines use the credentials those machines have: instance roles, profiles)."""
    if own_ray(cfg.ray_address):
        return {}
    prefixes = ("KDCACHE_",) + (("AWS_", "GOOGLE_", "FSSPEC_") if remote_out and cfg.ray_pass_credentials else ())
    return {k: v for k, v in os.environ.items() if k.startswith(prefixes)}


def prestart_workers(cfg):
    """A prestart for RayStarter: the job's teacher actors, created the moment Ray is up, before the job is settled,
    with the options settle will give them (--worker-cpus, else 1; --worker-gpus, else 1 where CUDA is visible).
    Each imports what a local teacher needs meanwhile (TeacherWorker without a spec) and loads the teacher once the
    Dispatcher sends the settled spec (load). For a local teacher and a Ray of the job's own."""
    if gpus_per_worker(cfg) > 1:
        return None                   # its GPUs go to placement groups, made once the job is settled

    def prestart(ray):
        opts = dict(num_cpus=cfg.worker_cpus if cfg.worker_cpus is not None else 1.0, num_gpus=worker_gpus(cfg))
        actor = ray.remote(TeacherWorker).options(**opts)
        return [actor.remote() for _ in range(resolve_workers(cfg))], opts
    return prestart


class Dispatcher:
    """The shards in `todo` through min(workers, shards) teacher actors, for one job.

    During the scan, pump(records read) starts the actors once Ray is up, hands each ready worker the next shard
    whose records have all been read, and keeps what comes back; after the scan, run() commits those and the rest
    as they return. stats.startup records, in seconds from the job's start: ray_s (Ray up), workers_ready_s (the
    first teacher loaded), first_submit_s, scan_s (the dataset read), first_commit_s.
    """

    POLL_S = 0.05       # how often pump looks at Ray while the scan runs
    WAIT_S = 1.0        # the longest run() waits on Ray before it looks at the stop flag again

    def __init__(self, cfg, writer, starter, spec, gpus, todo, n_records, spool, t_start, pool=None):
        """pool: a pipeline.pool.WorkerPool whose Ray (the starter's) and workers outlive this job, else None."""
        self.cfg, self.writer, self.starter, self.spec, self.gpus = cfg, writer, starter, spec, gpus
        self.pool, self.clean = pool, False
        self.units = deque(sorted(todo))              # still to submit, in order
        self.n_workers = min(cfg.workers, len(todo))
        self.n_records, self.spool, self.reader = n_records, spool, spool.reader()
        self.t_start = t_start
        self.scanned, self.scan_done, self.hold_back = 0, False, False
        self.ray, self.workers, self.groups = None, None, []
        self.starting, self.pending, self.free, self.held = {}, {}, [], []
        self.stats, self.bar = RunStats(), None
        self._t0, self._last_poll, self._flag_seen = None, 0.0, None
        self.flag = StopFlag("finishing the shards in flight, then stopping (rerun the same command to resume).",
                             exit_on_second=True).install()

    def _grace_over(self):
        """After a signal, whether the shards in flight have had their STOP_GRACE_S to come back (a served teacher
        that stopped answering, a shard of an hour's work): the job then stops without them."""
        now = time.monotonic()
        if self._flag_seen is None:
            self._flag_seen = now
            grace = env_seconds("KDCACHE_STOP_GRACE_S", STOP_GRACE_S)
            print(f"{self.flag.signal}: waiting up to {grace:g} s for the {len(self.pending)} shard(s) in flight "
                  "(KDCACHE_STOP_GRACE_S); a second signal stops at once", file=sys.stderr, flush=True)
        return now - self._flag_seen >= env_seconds("KDCACHE_STOP_GRACE_S", STOP_GRACE_S)

    def _mark(self, what):
        self.stats.startup.setdefault(what, round(time.time() - self.t_start, 2))

    # -- during the scan
    def pump(self, scanned, hold_back=False):
        """The scan has read `scanned` records (spooled); hold_back: it found a record that will fail the job, so
        submit nothing more. Never waits on Ray."""
        self.scanned, self.hold_back = scanned, hold_back
        if self.flag:
            raise Interrupted(f"interrupted by {self.flag.signal} while reading the dataset, before this run "
                              f"committed anything. {self._safe()}; rerun the same command to resume.",
                              self.flag.signal, self.flag.signum)
        now = time.perf_counter()
        if now - self._last_poll < self.POLL_S and not (self.free and self._next_unit_read()):
            return
        self._last_poll = now
        if self.workers is None and self.starter.ready():
            self._start_workers()
        if self.workers is not None:
            self._collect(timeout=0)
            self._submit()

    def scan_finished(self):
        """The whole dataset was read without error: from now on results are committed."""
        self.scan_done = True
        self._mark("scan_s")

    # -- after the scan
    def run(self, bar):
        """Commit what came back during the scan, then run the remaining shards; returns RunStats."""
        self.bar = bar
        for res in self.held:
            self._commit(res)
        self.held = []
        if self.workers is None:
            self._start_workers()
        while True:
            self._submit()
            if not self.pending and (not self.units or self.flag):
                break
            if self.flag and self._grace_over():
                self.stats.abandoned = sorted(j for _, j in self.pending.values())
                self.pending = {}          # close() kills the workers; the resume scores these shards again
                break
            self._collect(timeout=self.WAIT_S)      # back in Python every WAIT_S: signals are handled there
        if self._t0 is not None:
            self.stats.loop_s = time.perf_counter() - self._t0    # the last commit: Ray's shutdown is not scoring
        self.stats.stopped = bool(self.flag)
        self.clean = not self.flag
        return self.stats

    def close(self):
        """Stop the workers and the job's Ray (or, from a clean end, hand them back to the pool), then give the
        signals back. Idempotent."""
        try:
            if self.pool is not None and self.clean and self.workers:
                self.pool.keep(self._pool_key(), self.workers, self.groups)
                self.workers, self.groups = [], []
            for w in self.workers or []:
                self.ray.kill(w)
            self.workers = []
            for g in self.groups:         # on a cluster of someone else's, the GPUs they held are given back
                self.ray.util.remove_placement_group(g)
            self.groups = []
            if self.pool is None:
                self.starter.close()  # while our handlers stand: Ray's own SIGTERM handler would exit mid-shutdown
        finally:
            self.flag.restore()

    # -- the parts
    def _start_workers(self):
        self.ray = self.starter.get()
        _reassert_handlers()
        up = self.starter.up_at or time.time()
        if up < self.t_start:                      # a pool's Ray, up since an earlier job
            self.stats.startup["kept"] = True
        else:
            self.stats.startup.setdefault("ray_s", round(up - self.t_start, 2))
        self.stats.ray = {"gcs_address": self.ray.get_runtime_context().gcs_address,
                          "own": own_ray(self.cfg.ray_address)}
        warm, groups = self.pool.take(self._pool_key(), self.n_workers) if self.pool is not None else ([], [])
        if warm:
            self.stats.startup["kept_workers"] = len(warm)
        if not warm:
            warm, opts = self.starter.prestarted or ([], None)
            self.starter.prestarted = None
            if opts != dict(num_cpus=self.cfg.worker_cpus, num_gpus=self.gpus):
                warm = []             # not what settle decided: start afresh (ray.shutdown takes the others)
            warm, extra = warm[:self.n_workers], warm[self.n_workers:]
            for w in extra:
                self.ray.kill(w)
        fresh, more = start_workers(self.cfg, self.ray, self.spec, self.gpus, self.n_workers - len(warm),
                                    self.writer.location.remote)
        self.workers, self.groups = warm + fresh, groups + more
        self.starting = {(w.load.remote(self.spec) if i < len(warm) else w.ready.remote()): i
                         for i, w in enumerate(self.workers)}

    def _pool_key(self):
        """What kept workers must have been started with to serve this job."""
        c = self.cfg
        return (c.worker_cpus, self.gpus, c.tensor_parallel_size, c.pipeline_parallel_size,
                tuple(sorted(cluster_env(c, self.writer.location.remote).items())))

    def _next_unit_read(self):
        """Whether every record of the next shard to submit has been read."""
        if not self.units:
            return False
        return self.scan_done or self.scanned >= shard_range(self.units[0], self.cfg.shard_size, self.n_records)[1]

    def _submit(self):
        size = self.cfg.shard_size
        while self.free and not self.flag and not self.hold_back and self._next_unit_read():
            j = self.units.popleft()
            if not self.scan_done:
                self.spool.flush()            # the shard's last samples may still be buffered
            i = self._pick_worker()
            lo, hi = shard_range(j, size, self.n_records)
            unit = Unit(self.writer.directory, self.writer.shard_tag, j, sample_start=lo, sample_end=hi,
                        samples=unit_samples(self.reader, j, size))
            self.pending[self.workers[i].run.remote(unit)] = (i, j)
            if self._t0 is None:
                self._t0 = time.perf_counter()
                self._mark("first_submit_s")

    def _pick_worker(self):
        """A free slot of the ready worker with the fewest shards in flight (round robin as they start)."""
        busy = {}
        for i, _ in self.pending.values():
            busy[i] = busy.get(i, 0) + 1
        i = min(self.free, key=lambda w: busy.get(w, 0))
        self.free.remove(i)
        return i

    def _collect(self, timeout):
        """Take what is done (everything ready, or, with timeout None, wait for one): ready workers get slots,
        results are committed (kept while the scan runs)."""
        refs = list(self.starting) + list(self.pending)
        if not refs:
            return
        done, _ = self.ray.wait(refs, num_returns=len(refs) if timeout == 0 else 1, timeout=timeout)
        for ref in done:
            if ref in self.starting:
                i = self.starting.pop(ref)
                node = _loaded(self.ray, ref, self.flag)     # raises here if the teacher failed to load
                if node:
                    by_node = self.stats.ray.setdefault("workers_by_node", {})
                    by_node[node] = by_node.get(node, 0) + 1
                self.free.extend([i] * self.cfg.max_in_flight)
                self._mark("workers_ready_s")
                continue
            i, j = self.pending.pop(ref)
            self.free.append(i)
            res = _result(self.ray, ref, j, self.writer, self.flag)
            if self.scan_done:
                self._commit(res)
            else:
                self.held.append(res)

    def _commit(self, res):
        self.writer.commit(res["shard"])
        self._mark("first_commit_s")
        st = self.stats
        st.tokens += res["tokens"]
        st.teacher_s += res["teacher_s"]
        st.retried += res.get("retried", 0)
        if res.get("node"):
            st.shards_by_node[res["node"]] = st.shards_by_node.get(res["node"], 0) + 1
        st.engine = st.engine or dict(res.get("engine") or {})
        if self.bar is not None:
            self.bar.update(res["shard"].entry.num_samples)
            self.bar.set_postfix(tok_s=f"{st.tokens / (time.perf_counter() - self._t0):,.0f}",
                                 shards=f"{len(self.writer.manifest.shards)}/{self.writer.manifest.num_shards_planned}")

    def _safe(self):
        return f"The {len(self.writer.done_indices())} shards committed so far are safe"


def _reassert_handlers():
    """Ray's core worker installs C-level handlers (SIGTERM's among them: it logs and aborts) when it connects,
    possibly after the job's StopFlag was installed (Ray starts in the background): Python still lists the flag's
    handlers, but the signals no longer reach them. Registering them again puts them back in front."""
    for sig in SIGNALS:
        handler = signal.getsignal(sig)
        if handler is not None:
            signal.signal(sig, handler)


def _loaded(ray, ref, flag):
    """Wait for a worker's teacher to load: WorkerDied naming the cause if it failed (Interrupted after a signal)."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayActorError as e:
        if flag:
            raise Interrupted(f"interrupted by {flag.signal} while the teacher workers started; rerun the same "
                              "command to resume.", flag.signal, flag.signum) from e
        raise WorkerDied(f"a teacher worker died while loading the teacher: {e}") from e
    except ray.exceptions.RayTaskError as e:
        cause = e.cause if getattr(e, "cause", None) is not None else e
        if isinstance(cause, CanaryError):
            raise CanaryError(str(cause)) from None
        raise WorkerDied(f"a teacher worker could not load the teacher: {type(cause).__name__}: {cause}") from e


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
