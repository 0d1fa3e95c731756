"""A worker lost after a signal is an interruption to resume, not a crash; without a signal it is WorkerDied."""
import signal
from types import SimpleNamespace

import pytest

from cache_format.errors import Interrupted, WorkerDied
from kdcache.signals import StopFlag
from pipeline.dispatch import _result


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
    from pipeline.dispatch import start_workers
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t")
    cfg = SimpleNamespace(worker_cpus=0.5, ray_address="10.0.0.1:6379", ray_pass_credentials=passed)
    ray = RecordingRay()
    start_workers(cfg, ray, spec=None, gpus=0, n=1, remote_out=True)
    env = ray.opts.get("runtime_env", {}).get("env_vars", {})
    assert (env.get("AWS_SECRET_ACCESS_KEY") == "s3cr3t") is passed
