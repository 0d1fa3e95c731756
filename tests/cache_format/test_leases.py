"""Who owns a lease or a temp directory (boot, host, pid namespace, pid, start time), and fencing of
writer leases on object stores: a writer whose lease lapsed and was taken over commits nothing more."""
import os
import re
import socket
import subprocess
import time

import pytest

import kdcache.cache_format.lease as lease_mod
from kdcache.cache_format import CacheWriter, LockedError, ManifestError, open_cache, verify_cache, write_shard_file
from kdcache.cache_format.lease import Lease, is_live, pid_namespace, process_dir, process_tag
from kdcache.cache_format.location import Location
from kdcache.cache_format.manifest import load_manifest
from tests.helpers.records import make_records, shard_kwargs, writer_kwargs

BOOT_ID = "/proc/sys/kernel/random/boot_id"
linux_only = pytest.mark.skipif(not os.path.exists(BOOT_ID), reason="needs /proc (boot id, process start times)")
PREFIX = "kdcache-shards-"


def dead_pid():
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def this_boot():
    with open(BOOT_ID) as f:
        return f.read().strip()


def start_of(pid):
    """Field 22 of /proc/<pid>/stat (read here, not through the code under test)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        data = f.read()
    return int(data[data.rindex(b")") + 2:].split()[19])


def lease_body(*, pid, pid_start, boot, expires_in=3600):
    return {"owner": "old", "host": socket.gethostname(), "boot_id": boot, "pidns": pid_namespace(),
            "pid": pid, "pid_start": pid_start, "generation": 3, "started": 0, "expires": time.time() + expires_in}


# -- temp directories (spools, fetch directories) ----------------------------------------------------

@linux_only
def test_directories_of_other_hosts_boots_and_old_names_are_not_swept(tmp_path):
    """The PID-namespace inode is the same on every Linux host: on a shared $TMPDIR a dead-looking pid
    proves nothing unless the name says the directory was made on this very boot of this host."""
    dead = dead_pid()
    ns = re.sub(r"\D", "", pid_namespace() or "") or "0"
    old_style = tmp_path / f"{PREFIX}{ns}-{dead}-abcd1234"              # what any host made before
    other_boot = tmp_path / f"{PREFIX}k0123456789ab-{dead}-0-abcd1234"   # another boot/host/namespace
    old_style.mkdir()
    other_boot.mkdir()
    made = process_dir(str(tmp_path), PREFIX)
    assert old_style.exists() and other_boot.exists() and os.path.isdir(made)


@linux_only
def test_directory_of_a_dead_process_of_this_boot_is_swept(tmp_path):
    left = tmp_path / f"{PREFIX}{process_tag(dead_pid())}-abcd1234"
    (left / "shards").mkdir(parents=True)
    mine = tmp_path / f"{PREFIX}{process_tag()}-live0000"
    mine.mkdir()
    process_dir(str(tmp_path), PREFIX)
    assert not left.exists() and mine.exists()


@linux_only
def test_directory_of_a_reused_pid_is_swept(tmp_path):
    """Same pid as a live process (this one), other start time: its maker is gone, the pid was reused."""
    me, start = os.getpid(), start_of(os.getpid())
    assert process_tag() == f"k{lease_mod.boot_key()}-{me}-{start}"
    reused = tmp_path / f"{PREFIX}k{lease_mod.boot_key()}-{me}-{start + 1}-abcd1234"
    mine = tmp_path / f"{PREFIX}k{lease_mod.boot_key()}-{me}-{start}-live0000"
    reused.mkdir()
    mine.mkdir()
    process_dir(str(tmp_path), PREFIX)
    assert not reused.exists() and mine.exists()


# -- lease liveness ------------------------------------------------------------------------------------

@linux_only
def test_lease_naming_this_host_but_another_boot_stays_live_until_it_expires():
    """Same host name, dead-looking pid, but another boot (a cloned VM, a container elsewhere)."""
    body = lease_body(pid=dead_pid(), pid_start=0, boot="00000000-another-boot")
    assert is_live(body)
    assert not is_live(body, now=body["expires"] + 1)
    old_format = {k: v for k, v in body.items() if k not in ("boot_id", "pid_start", "generation")}
    assert is_live(old_format)                            # cannot be proven dead: waits for the TTL
    url = f"memory://leases-{time.time_ns()}/c"
    Location(url).write_json(".writer.lock", body)
    with pytest.raises(LockedError, match=f"pid {body['pid']} on {socket.gethostname()}"):
        CacheWriter(url, num_shards_planned=1, **writer_kwargs("arrow")).open()


@linux_only
def test_lease_of_a_dead_local_process_is_dead_at_once():
    dead = dead_pid()
    body = lease_body(pid=dead, pid_start=12345, boot=this_boot())
    assert not is_live(body)
    url = f"memory://leases-{time.time_ns()}/c"
    Location(url).write_json(".writer.lock", body)
    w = CacheWriter(url, num_shards_planned=1, **writer_kwargs("arrow")).open()     # taken over at once
    held = Location(url).read_json(".writer.lock")
    assert held["pid"] == os.getpid() and held["generation"] == body["generation"] + 1
    w.close()


@linux_only
def test_lease_of_a_reused_pid_counts_as_dead():
    me = os.getpid()
    assert not is_live(lease_body(pid=me, pid_start=start_of(me) + 1, boot=this_boot()))
    assert is_live(lease_body(pid=me, pid_start=start_of(me), boot=this_boot()))


# -- fencing the manifest ------------------------------------------------------------------------------

def _plan(n=12, size=4):
    return dict(shard_size=size, num_records=n, **writer_kwargs("arrow"))


def _stall(writer):
    """The writing process stalls (a long GC pause, SIGSTOP, a hung mount): its heartbeat stops too."""
    writer._lock._stop.set()
    writer._lock._thread.join()


def _wait_until_lapsed(url):
    expires = Location(url).read_json(".writer.lock")["expires"]
    while time.time() <= expires + 0.05:
        time.sleep(0.05)


def _finish(w, recs, size=4):
    for j in range(len(recs) // size):
        if j not in w.done_indices():
            w.write_shard(j, recs[j * size:(j + 1) * size], sample_start=j * size, sample_end=(j + 1) * size)


def _assert_sound(url, n):
    loc = Location(url)
    m = load_manifest(loc)
    assert m["complete"] and all(loc.exists(s["path"]) for s in m["shards"])
    assert verify_cache(url).ok
    assert [r.sample_id for r in open_cache(url)] == list(range(n))
    return m


@pytest.mark.parametrize("when", ["before the new owner commits", "after the new owner finished"])
def test_a_stalled_writer_whose_lease_was_taken_over_commits_nothing(when):
    url = f"memory://leases-{time.time_ns()}/c"
    recs = make_records(12, seed=21)
    w1 = CacheWriter(url, **_plan())
    w1._lock.ttl = 0.4                              # lapses soon once its heartbeat stops
    w1.open()
    w1.write_shard(0, recs[0:4], sample_start=0, sample_end=4)
    late = write_shard_file(url, 1, recs[4:8], **shard_kwargs("arrow"),
                            sample_start=4, sample_end=8, tag=w1.shard_tag)
    _stall(w1)
    _wait_until_lapsed(url)
    w2 = CacheWriter(url, **_plan()).open()         # takes the lapsed lease over, sweeps the upload
    assert not Location(url).exists(late.entry.path)
    if when.startswith("before"):
        with pytest.raises(LockedError, match="stopping without committing anything more"):
            w1.commit(late)
    _finish(w2, recs)
    w2.close()
    if when.startswith("after"):
        with pytest.raises(LockedError, match="stopping without committing anything more"):
            w1.commit(late)
    w1.close()
    m = _assert_sound(url, 12)
    assert m["writer_generation"] == w2._lock.generation == w1._lock.generation + 1


def test_a_writer_whose_clock_says_its_lease_holds_is_stopped_by_the_lease_object(monkeypatch):
    """Even if the stalled writer's own bookkeeping says the lease is current (clock skew), the lease
    object on the store names the new owner and generation: the commit is refused."""
    url = f"memory://leases-{time.time_ns()}/c"
    recs = make_records(8, seed=22)
    w1 = CacheWriter(url, **_plan(8))
    w1._lock.ttl = 0.4
    w1.open()
    late = write_shard_file(url, 0, recs[0:4], **shard_kwargs("arrow"),
                            sample_start=0, sample_end=4, tag=w1.shard_tag)
    _stall(w1)
    _wait_until_lapsed(url)
    monkeypatch.setattr(w1._lock, "check", lambda: None)
    w2 = CacheWriter(url, **_plan(8)).open()
    with pytest.raises(LockedError, match=r"\.writer\.lock.*stopping without committing anything more"):
        w1.commit(late)
    _finish(w2, recs)
    w2.close()
    _assert_sound(url, 8)


def test_a_manifest_of_a_later_generation_stops_the_writer():
    url = f"memory://leases-{time.time_ns()}/c"
    recs = make_records(8, seed=23)
    with CacheWriter(url, **_plan(8)) as w:
        w.write_shard(0, recs[:4], sample_start=0, sample_end=4)
        loc = Location(url)
        m = loc.read_json("manifest.json")
        assert m["writer_generation"] == w._lock.generation
        loc.write_json("manifest.json", dict(m, writer_generation=w._lock.generation + 1))
        with pytest.raises(LockedError, match=f"manifest.json was written by a later owner.*generation "
                                              f"{w._lock.generation + 1}"):
            w.write_shard(1, recs[4:], sample_start=4, sample_end=8)


def test_generation_grows_across_writers_even_after_a_clean_release():
    url = f"memory://leases-{time.time_ns()}/c"
    recs = make_records(8, seed=24)
    with CacheWriter(url, **_plan(8)) as w:
        w.write_shard(0, recs[:4], sample_start=0, sample_end=4)
        first = w._lock.generation
    assert not Location(url).exists(".writer.lock")          # released: the lease object is gone
    with CacheWriter(url, **_plan(8)) as w:
        assert w._lock.generation == first + 1
        assert Location(url).read_json("manifest.json")["writer_generation"] == first + 1   # written at once
        _finish(w, recs)
    _assert_sound(url, 8)


def test_writer_generation_is_validated():
    url = f"memory://leases-{time.time_ns()}/c"
    with CacheWriter(url, **_plan(4)) as w:
        _finish(w, make_records(4, seed=25))
    loc = Location(url)
    loc.write_json("manifest.json", dict(loc.read_json("manifest.json"), writer_generation="7"))
    with pytest.raises(ManifestError, match="writer_generation must be absent or a non-negative integer"):
        load_manifest(loc)


# -- the heartbeat -------------------------------------------------------------------------------------

def _wait_lost(lease, seconds=5):
    deadline = time.time() + seconds
    while not lease.lost and time.time() < deadline:
        time.sleep(0.02)
    return lease.lost


def test_a_heartbeat_that_fails_unexpectedly_loses_the_lease_and_stops_the_writer(monkeypatch, capsys):
    url = f"memory://leases-{time.time_ns()}/c"
    recs = make_records(8, seed=26)
    w = CacheWriter(url, **_plan(8))
    w._lock.ttl = 1.0
    w.open()
    w.write_shard(0, recs[:4], sample_start=0, sample_end=4)

    def broken():
        raise RuntimeError("a bug in the renewal")
    monkeypatch.setattr(w._lock, "_body", broken)
    assert _wait_lost(w._lock)
    with pytest.raises(LockedError, match="lost the writer lease .*failed unexpectedly"):
        w.write_shard(1, recs[4:], sample_start=4, sample_end=8)
    w.close()
    assert "a bug in the renewal" in capsys.readouterr().err
    assert [s["index"] for s in load_manifest(url)["shards"]] == [0]


def test_a_lease_not_renewed_for_its_ttl_is_lost_for_good(monkeypatch):
    """Renewal failing (OSError) for longer than the TTL: others may have taken it; it is never renewed
    again, and acquire() refuses instead of taking it back silently."""
    loc = Location(f"memory://leases-{time.time_ns()}/c")
    lease = Lease(loc, ".writer.lock", exclusive=True, ttl=0.4).acquire()

    def unreachable():
        raise OSError("store unreachable")
    monkeypatch.setattr(lease, "_body", unreachable)
    assert _wait_lost(lease)
    monkeypatch.undo()                                       # the store is back
    expires = loc.read_json(".writer.lock")["expires"]
    time.sleep(0.3)
    assert loc.read_json(".writer.lock")["expires"] == expires  # not renewed behind anyone's back
    with pytest.raises(LockedError, match="lost the writer lease .*not renewed"):
        lease.check()
    with pytest.raises(LockedError, match="never taken again silently"):
        lease.acquire()
    lease.release()
