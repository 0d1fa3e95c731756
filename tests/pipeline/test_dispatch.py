"""A worker lost after a signal is an interruption to resume, not a crash; without a signal it is WorkerDied."""
import signal
from types import SimpleNamespace

import pytest

from kdcache.common.errors import Interrupted, WorkerDied
from kdcache.common.signals import StopFlag
from kdcache.pipeline.dispatch import _result


class FakeRay:
    """ray.get raising what Ray raises when an actor's process is gone."""
    def __init__(self):
        import ray
        self.exceptions = ray.exceptions

    def get(self, ref):
        raise self.exceptions.RayActorError()


WRITER = SimpleNamespace(done_indices=lambda: {0, 1, 2})


def test_a_worker_lost_after_a_signal_is_an_interruption_with_the_shells_exit_status():
    flag = StopFlag()
    flag.signal, flag.signum = "SIGTERM", signal.SIGTERM              # as if the group got SIGTERM
    with pytest.raises(Interrupted, match=r"interrupted by SIGTERM.*shard 7.*3 shards committed.*rerun") as e:
        _result(FakeRay(), None, 7, WRITER, flag)
    assert e.value.exit_code == 143


def test_a_worker_lost_without_a_signal_is_worker_died():
    with pytest.raises(WorkerDied, match=r"died .* shard 7.*3 shards committed"):
        _result(FakeRay(), None, 7, WRITER, StopFlag())


class RecordingRay:
    """ray.remote(cls).options(**opts) recorded; actors that are ready at once."""
    def __init__(self):
        self.opts = None

    def remote(self, cls):
        ray = self

        class Actor:
            def options(self, **opts):
                ray.opts = opts
                return self

            def remote(self, spec):
                return SimpleNamespace(ready=SimpleNamespace(remote=lambda: None))
        return Actor()

    def get(self, refs):
        return refs


@pytest.mark.parametrize("passed", [False, True])
def test_credentials_reach_a_clusters_runtime_env_only_when_asked(monkeypatch, passed):
    from kdcache.pipeline.dispatch import start_workers
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t")
    cfg = SimpleNamespace(worker_cpus=0.5, ray_address="10.0.0.1:6379", ray_pass_credentials=passed,
                          tensor_parallel_size=1)
    ray = RecordingRay()
    start_workers(cfg, ray, spec=None, gpus=0, n=1, remote_out=True)
    env = ray.opts.get("runtime_env", {}).get("env_vars", {})
    assert (env.get("AWS_SECRET_ACCESS_KEY") == "s3cr3t") is passed


@pytest.mark.parametrize("address", [None, "10.0.0.1:6379"])
def test_the_jobs_kdcache_settings_reach_its_workers_on_a_cluster(monkeypatch, address):
    """KDCACHE_SERVED_RETRY_S and the like, set for a job that joins a cluster, hold for its workers there (a Ray of
    the job's own passes its whole environment); credentials still only when asked."""
    from kdcache.pipeline.dispatch import start_workers
    monkeypatch.setenv("KDCACHE_SERVED_RETRY_S", "7")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cfg = SimpleNamespace(worker_cpus=0.5, ray_address=address, ray_pass_credentials=False, tensor_parallel_size=1)
    ray = RecordingRay()
    start_workers(cfg, ray, spec=None, gpus=0, n=1, remote_out=True)
    env = ray.opts.get("runtime_env", {}).get("env_vars", {})
    assert env == ({"KDCACHE_SERVED_RETRY_S": "7"} if address else {}), env


class FakeRef:
    def __init__(self, value):
        self.value = value


class FakeActorRay:
    """Just enough Ray for the Dispatcher: actors whose ready() and run(unit) are done at once, run returning the
    manifest entry of the unit (and remembering it), and wait/get/kill on those."""
    exceptions = None

    def __init__(self):
        import ray
        self.exceptions = ray.exceptions
        self.units, self.killed, self.loaded, self.created = [], 0, 0, 0
        self.get_runtime_context = lambda: SimpleNamespace(gcs_address="127.0.0.1:1")
        fake = self

        class Method:
            def __init__(self, fn):
                self.fn = fn

            def remote(self, *a):
                return FakeRef(self.fn(*a))

        class Actor:
            def __init__(self, spec):
                fake.created += 1
                self.ready = Method(lambda: True)
                self.load = Method(fake._load)
                self.run = Method(fake._run)

        class Cls:
            def options(self, **opts):
                return self

            def remote(self, spec=None):
                return Actor(spec)
        self._cls = Cls()

    def _load(self, spec):
        self.loaded += 1
        return True

    def _run(self, unit):
        self.units.append(unit)
        entry = SimpleNamespace(index=unit.index, sample_start=unit.sample_start, sample_end=unit.sample_end,
                                num_samples=len(unit.samples))
        return {"shard": SimpleNamespace(entry=entry), "tokens": 2 * len(unit.samples), "teacher_s": 0.0}

    def remote(self, cls):
        return self._cls

    def wait(self, refs, num_returns=1, timeout=None):
        return refs[:num_returns], refs[num_returns:]

    def get(self, ref):
        return ref.value

    def kill(self, actor):
        self.killed += 1


class FakeStarter:
    def __init__(self, ray, up=True, prestarted=None):
        self.ray, self.up, self.up_at, self.closed, self.prestarted = ray, up, None, False, prestarted

    def ready(self):
        return self.up

    def get(self):
        return self.ray

    def close(self):
        self.closed = True


class FakeWriter:
    directory, shard_tag = "/nowhere", "t"
    location = SimpleNamespace(remote=False)

    def __init__(self):
        self.manifest = {"shards": [], "num_shards_planned": 4}

    def commit(self, written):
        self.manifest["shards"].append(written.entry)

    def done_indices(self):
        return {s.index for s in self.manifest["shards"]}


def test_shards_go_out_as_their_records_are_read_and_are_committed_after_the_scan(tmp_path):
    """7 records, shards of 2 (record 3 skipped): shard j leaves once records [2j, 2j+2) are read, not before;
    nothing is committed until the scan is over; then every shard once, with its plan's range."""
    import numpy as np

    from kdcache.pipeline.dispatch import Dispatcher
    from kdcache.pipeline.encode import Sample
    from kdcache.pipeline.spool import Spool
    ray = FakeActorRay()
    writer, spool = FakeWriter(), Spool(str(tmp_path))
    cfg = SimpleNamespace(workers=2, shard_size=2, max_in_flight=1, worker_cpus=0.5, ray_address=None,
                          ray_pass_credentials=False, tensor_parallel_size=1)
    d = Dispatcher(cfg, writer, FakeStarter(ray), spec=None, gpus=0, todo={0, 1, 2, 3}, n_records=7, spool=spool,
                   t_start=0.0)
    d.POLL_S = 0.0
    try:
        sent = []
        for n in range(1, 8):
            if n != 4:                                     # record 3 was skipped: it is read, nothing is spooled
                spool.add(Sample(n - 1, np.array([1, 2], np.int32), np.array([0], np.int32), False))
            d.pump(n)
            sent.append([u.index for u in ray.units])
        # Two workers, one shard in flight each, results taken back at every pump: shard j goes out once record
        # 2j+1 is read, the last one (a single record, 6) at the end of the dataset.
        assert sent == [[], [0], [0], [0, 1], [0, 1], [0, 1, 2], [0, 1, 2, 3]]
        assert writer.manifest["shards"] == [] and len(d.held) == 3       # done, but not committed yet
        spool.close_writing()
        d.scan_finished()
        stats = d.run(bar=None)
        assert [(u.index, u.sample_start, u.sample_end, [s.sample_id for s in u.samples]) for u in ray.units] == \
            [(0, 0, 2, [0, 1]), (1, 2, 4, [2]), (2, 4, 6, [4, 5]), (3, 6, 7, [6])]
        assert sorted(s.index for s in writer.manifest["shards"]) == [0, 1, 2, 3]
        assert stats.tokens == 12 and set(stats.startup) >= {"workers_ready_s", "first_submit_s", "scan_s",
                                                             "first_commit_s"}
    finally:
        d.close()
        spool.delete()
    assert ray.killed == 2


def test_a_scan_that_will_fail_holds_back_every_further_shard(tmp_path):
    import numpy as np

    from kdcache.pipeline.dispatch import Dispatcher
    from kdcache.pipeline.encode import Sample
    from kdcache.pipeline.spool import Spool
    ray = FakeActorRay()
    spool = Spool(str(tmp_path))
    cfg = SimpleNamespace(workers=1, shard_size=2, max_in_flight=2, worker_cpus=0.5, ray_address=None,
                          ray_pass_credentials=False, tensor_parallel_size=1)
    d = Dispatcher(cfg, FakeWriter(), FakeStarter(ray), spec=None, gpus=0, todo={0, 1, 2}, n_records=6, spool=spool,
                   t_start=0.0)
    d.POLL_S = 0.0
    try:
        for n in range(1, 7):
            spool.add(Sample(n - 1, np.array([1, 2], np.int32), np.array([0], np.int32), False))
            d.pump(n, hold_back=n >= 3)                  # record 2 was malformed under --on-bad-record fail
        assert [u.index for u in ray.units] == [0]
    finally:
        d.close()
        spool.delete()


def test_actors_started_before_the_job_was_settled_load_the_settled_teacher(tmp_path):
    """prestart_workers made cfg.workers actors the moment Ray was up; the Dispatcher sends them the spec (load)
    rather than starting others, and stops the ones it does not need; actors made with other options are not used."""
    from kdcache.pipeline.dispatch import Dispatcher, prestart_workers
    from kdcache.pipeline.spool import Spool
    cfg = SimpleNamespace(workers=3, shard_size=2, max_in_flight=1, worker_cpus=0.5, worker_gpus=0.0,
                          ray_address=None, ray_pass_credentials=False, tensor_parallel_size=1)
    for gpus, reused in ((0.0, True), (1.0, False)):
        ray = FakeActorRay()
        warm = prestart_workers(cfg)(ray)
        assert ray.created == 3 and warm[1] == {"num_cpus": 0.5, "num_gpus": 0.0}
        spool = Spool(str(tmp_path))
        d = Dispatcher(cfg, FakeWriter(), FakeStarter(ray, prestarted=warm), spec="SPEC", gpus=gpus, todo={0, 1},
                       n_records=4, spool=spool, t_start=0.0)
        try:
            d.pump(0)
            assert len(d.workers) == 2
            if reused:
                assert (ray.created, ray.loaded, ray.killed) == (3, 2, 1)
            else:
                assert (ray.created, ray.loaded, ray.killed) == (5, 0, 0)
        finally:
            d.close()
            spool.delete()
