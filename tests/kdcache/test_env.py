"""Sizes and durations from the environment: one parser each, every variable read through it, a value it cannot
read refused with the variable named (issue 23, item 13: KDCACHE_FETCH_BYTES=8G and KDCACHE_LEASE_TTL=2m gave
tracebacks, the TTL one in every command; KDCACHE_SERVED_RETRY_S=2m silently became 120)."""
import pytest

from kdcache.common.env import default_threads, env_seconds, env_size, parse_seconds, parse_size
from kdcache.common.errors import ConfigError
from tests.helpers.cli import kdcache, user_env


@pytest.mark.parametrize("text,want", [("8G", 8 * 2**30), ("512M", 512 * 2**20), ("1.5GiB", int(1.5 * 2**30)),
                                       ("65536", 65536), ("8e9", 8 * 10**9), ("4kb", 4096), (" 2 T ", 2 * 2**40)])
def test_sizes(text, want):
    assert parse_size(text) == want


@pytest.mark.parametrize("text,want", [("120", 120.0), ("30s", 30.0), ("2m", 120.0), ("1.5h", 5400.0),
                                       ("1d", 86400.0), ("500ms", 0.5), ("3 min", 180.0)])
def test_durations(text, want):
    assert parse_seconds(text) == want


def test_what_cannot_be_read_is_refused_with_the_variable_named(monkeypatch):
    monkeypatch.setenv("KDCACHE_FETCH_BYTES", "lots")
    with pytest.raises(ConfigError, match="KDCACHE_FETCH_BYTES: 'lots' is not a size"):
        env_size("KDCACHE_FETCH_BYTES", 1)
    monkeypatch.setenv("KDCACHE_LEASE_TTL", "2 fortnights")
    with pytest.raises(ConfigError, match="KDCACHE_LEASE_TTL: '2 fortnights' is not a duration"):
        env_seconds("KDCACHE_LEASE_TTL", 1)
    monkeypatch.delenv("KDCACHE_LEASE_TTL")
    assert env_seconds("KDCACHE_LEASE_TTL", 7) == 7.0


def test_the_served_client_reads_minutes(monkeypatch):
    from kdcache.pipeline.teacher_served import Client
    monkeypatch.setenv("KDCACHE_SERVED_RETRY_S", "2m")
    monkeypatch.setenv("KDCACHE_SERVED_TIMEOUT_S", "90s")
    c = Client("http://127.0.0.1:9/v1")
    assert (c.retry_s, c.timeout_s) == (120.0, 90.0)


def test_a_bad_ttl_breaks_no_command_that_does_not_need_it(tmp_path):
    """Read when a lease is made, not at import: `kdcache --help` and `kdcache ls` of a plain directory still run;
    a command that takes a lease says what is wrong, without a traceback."""
    from kdcache.cache_format import write_cache
    from tests.helpers.records import make_records, writer_kwargs
    write_cache(tmp_path / "c", make_records(4, seed=1), shard_size=4, **writer_kwargs("arrow"))
    env = user_env(KDCACHE_LEASE_TTL="2m", KDCACHE_FETCH_BYTES="8G")
    assert kdcache("--help", env=env).returncode == 0
    res = kdcache("inspect", tmp_path / "c", env=env)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr



def test_a_reader_that_takes_a_lease_names_a_bad_ttl(tmp_path, monkeypatch):
    from kdcache.cache_format import open_cache, write_cache
    from tests.helpers.records import make_records, writer_kwargs
    write_cache(tmp_path / "c", make_records(4, seed=1), shard_size=4, **writer_kwargs("arrow"))
    monkeypatch.setenv("KDCACHE_LEASE_TTL", "soon")
    with pytest.raises(ConfigError, match="KDCACHE_LEASE_TTL: 'soon' is not a duration"):
        open_cache(tmp_path / "c", track_use=True)


def test_the_lease_ttl_and_the_spool_dir_take_effect(tmp_path, monkeypatch):
    """KDCACHE_LEASE_TTL: a lease written while it is set expires that long after it was written (others may take
    over then); KDCACHE_SPOOL_DIR: precompute's spool of encoded samples lives under it."""
    import json
    import time

    from kdcache.cache_format.lease import Lease
    from kdcache.cache_format.location import Location
    from kdcache.pipeline.spool import Spool
    monkeypatch.setenv("KDCACHE_LEASE_TTL", "45s")
    lease = Lease(Location(str(tmp_path / "c")), "writer.lease", exclusive=True)
    t0 = time.time()
    lease.acquire()
    try:
        body = json.loads((tmp_path / "c" / "writer.lease").read_text())
        assert lease.ttl == 45.0 and 44 <= body["expires"] - t0 <= 46
    finally:
        lease.release()
    monkeypatch.setenv("KDCACHE_SPOOL_DIR", str(tmp_path / "spools"))
    spool = Spool()
    try:
        assert spool.dir.startswith(str(tmp_path / "spools")) and (tmp_path / "spools").is_dir()
    finally:
        spool.close_writing()
        spool.delete()


def test_default_threads_follow_omp_num_threads_then_the_cores_this_process_may_use(monkeypatch):
    """kdcache's torch threads where --threads is 0: OMP_NUM_THREADS as PyTorch's tools set it, else the cores of
    this process's CPU affinity (a container or taskset share, not the host's count) divided among the processes."""
    import os
    import subprocess
    import sys
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert default_threads() == 3 and default_threads(4) == 3         # a per-process setting, as torchrun's
    monkeypatch.setenv("OMP_NUM_THREADS", "two")
    with pytest.raises(ConfigError, match="OMP_NUM_THREADS: 'two'"):
        default_threads()
    monkeypatch.delenv("OMP_NUM_THREADS")
    cores = len(os.sched_getaffinity(0))
    assert default_threads() == cores and default_threads(cores + 1) == 1
    code = "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); " \
           "from kdcache.common.env import default_threads; print(default_threads())"
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "1"
