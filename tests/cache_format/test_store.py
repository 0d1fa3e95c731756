"""The store: caches found by fingerprint, `kdcache ls`, and `kdcache gc` that never removes a cache in use."""
import json
import os
import time

import pytest

from kdcache.cache_format import CacheError, CacheWriter, Storage, open_cache, write_cache
from kdcache.cache_format import store as store_mod
from kdcache.cache_format.cli import gc_main, ls_main
from kdcache.cache_format.lease import LAST_USED
from kdcache.cache_format.location import Location
from kdcache.cache_format.store import gc, list_caches, remove_cache, resolve
from kdcache.cache_format.writer import cache_fingerprint
from tests.helpers.cli import kdcache
from tests.helpers.records import make_records, writer_kwargs

DAY = 86400.0


@pytest.fixture(params=["local", "s3"])
def root(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "store")
    return request.getfixturevalue("bucket") + "/store"


def add_cache(root, alias, data, n=12, shards_done=None, meta=None):
    """A cache of inputs `data` placed in the store by fingerprint; shards_done < planned leaves it incomplete."""
    kw = writer_kwargs("arrow", fingerprint_parts={"teacher": "t", "data": data},
                       meta=meta or {"teacher": "tiny-teacher", "dataset": data})
    fp, _ = cache_fingerprint(kw["fingerprint_parts"], Storage("arrow", 8))
    where, _ = resolve(root, fp, alias)
    recs = make_records(n, seed=len(data))
    if shards_done is None:
        write_cache(where, recs, shard_size=4, **kw)
    else:
        with CacheWriter(where, num_shards_planned=-(-n // 4), **kw) as w:
            for j in range(shards_done):
                w.write_shard(j, recs[4 * j:4 * j + 4], sample_start=4 * j, sample_end=4 * j + 4)
    return where, fp


def names(root):
    return sorted(e.name for e in list_caches(root))


def test_found_by_fingerprint_whatever_the_alias(root):
    where, fp = add_cache(root, "first name", "d1")
    assert where.endswith("/first-name--" + fp[:16])
    again, found = resolve(root, fp, "another alias")
    assert found and again == where                                   # same inputs: the same cache
    other_fp, _ = cache_fingerprint({"teacher": "t", "data": "d2"}, Storage("arrow", 8))
    new, found = resolve(root, other_fp, "first name")
    assert not found and new != where and new.endswith(other_fp[:16])


def test_ls_shows_state_teacher_dataset_k_and_size(root, capsys):
    add_cache(root, "done", "d1")
    add_cache(root, "half", "d2", shards_done=1)
    assert ls_main([root]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines()[1:]}
    done = next(v for k, v in lines.items() if k.startswith("done--"))
    half = next(v for k, v in lines.items() if k.startswith("half--"))
    assert "complete" in done and "tiny-teacher" in done and " d1 " in done and " 8 " in done and " 12 " in done
    assert "incomplete 1/3" in half and " 4 " in half
    assert ls_main([root, "--json"]) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert sorted((r["state"], r["counts"]["samples"]) for r in rows) == [("complete", 12), ("incomplete 1/3", 4)]


def test_gc_removes_old_incomplete_and_unused_caches_only(root):
    add_cache(root, "done", "d1")
    add_cache(root, "half", "d2", shards_done=1)
    plan = gc(root, incomplete_older_than=7 * DAY)                    # both were just written: nothing is old
    assert plan == [] and len(names(root)) == 2
    plan = gc(root, incomplete_older_than=7 * DAY, now=time.time() + 8 * DAY, dry_run=True)
    assert [(e.name.split("--")[0], a) for e, a, _ in plan] == [("half", "would remove")]
    assert len(names(root)) == 2                                      # a dry run removes nothing
    plan = gc(root, incomplete_older_than=7 * DAY, now=time.time() + 8 * DAY)
    assert [(e.name.split("--")[0], a) for e, a, _ in plan] == [("half", "removed")]
    assert [n.split("--")[0] for n in names(root)] == ["done"]        # the complete one is untouched
    assert not Location(plan[0][0].url).exists()                      # and nothing of the other is left
    plan = gc(root, unused_since=time.time() + 60)                    # "not used since a minute from now"
    assert [(e.name.split("--")[0], a) for e, a, _ in plan] == [("done", "removed")] and names(root) == []


def backdate(where, written, read):
    """Make the cache at `where` look committed at unix time `written` and last read at `read`: the manifest's
    timestamps and the `.last_used.json` stamp a reading run leaves (lease.stamp_use), written directly."""
    loc = Location(where)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(written))
    loc.write_json("manifest.json", dict(loc.read_json("manifest.json"), created=stamp, updated=stamp))
    loc.write_json(LAST_USED, {"time": read, "host": "trainer", "pid": 1})


def two_caches_written_a_month_ago(root):
    """'recent' and 'old', both committed 30 days ago; only the last-use stamp tells them apart: 'recent' was
    read yesterday, 'old' 30 days ago. Without the stamp both would look unused for a month."""
    now = time.time()
    recent, _ = add_cache(root, "recent", "d1")
    old, _ = add_cache(root, "old", "d2")
    backdate(recent, now - 30 * DAY, now - 1 * DAY)
    backdate(old, now - 30 * DAY, now - 30 * DAY)
    return recent, old


def test_gc_unused_since_goes_by_the_last_read_and_a_dry_run_removes_nothing(root):
    """The `.last_used.json` stamp, not the commit time, decides what is unused; dry_run only reports."""
    two_caches_written_a_month_ago(root)
    plan = gc(root, unused_since=time.time() - 7 * DAY, dry_run=True)
    assert [(e.name.split("--")[0], a) for e, a, _ in plan] == [("old", "would remove")]
    assert [n.split("--")[0] for n in names(root)] == ["old", "recent"]        # nothing removed
    plan = gc(root, unused_since=time.time() - 7 * DAY)
    assert [(e.name.split("--")[0], a) for e, a, _ in plan] == [("old", "removed")]
    assert [n.split("--")[0] for n in names(root)] == ["recent"]


def test_gc_cli_unused_for_and_unused_since_remove_only_the_cache_not_read_lately(tmp_path):
    """`kdcache gc --unused-for 7d --dry-run` lists the month-old cache and removes nothing; `--unused-since` a
    week ago picks the same one; without --dry-run only that one goes and the one read yesterday stays."""
    root = str(tmp_path / "store")
    recent, old = two_caches_written_a_month_ago(root)
    old_name = os.path.basename(old)
    res = kdcache("gc", root, "--unused-for", "7d", "--dry-run")
    assert res.returncode == 0, res.stderr
    assert f"would remove  {old_name}" in res.stdout and os.path.basename(recent) not in res.stdout, res.stdout
    assert "would remove 1 cache(s)" in res.stdout and os.path.exists(old) and os.path.exists(recent)
    week_ago = time.strftime("%Y-%m-%d", time.gmtime(time.time() - 7 * DAY))
    res = kdcache("gc", root, "--unused-since", week_ago, "--dry-run")
    assert res.returncode == 0 and res.stdout.count("would remove  ") == 1 and old_name in res.stdout, res.stdout
    res = kdcache("gc", root, "--unused-for", "7d")
    assert res.returncode == 0 and f"removed       {old_name}" in res.stdout, res.stdout + res.stderr
    assert names(root) == [os.path.basename(recent)] and not os.path.exists(old)
    assert len(list(open_cache(recent))) == 12                                 # the recent one is intact


def test_gc_never_removes_a_cache_being_read_or_written(root):
    done, _ = add_cache(root, "done", "d1")
    half, _ = add_cache(root, "half", "d2", shards_done=1)
    reader = open_cache(done, track_use=True)                         # a training run reading it
    kw = writer_kwargs("arrow", fingerprint_parts={"teacher": "t", "data": "d2"},
                       meta={"teacher": "tiny-teacher", "dataset": "d2"})
    writer = CacheWriter(half, num_shards_planned=3, **kw).open()     # a precompute resuming it
    try:
        plan = gc(root, incomplete_older_than=0, unused_since=time.time() + 60)
        why = {e.name.split("--")[0]: (a, r) for e, a, r in plan}
        assert why["done"][0] == "kept" and "reading" in why["done"][1]
        assert why["half"][0] == "kept" and "writing" in why["half"][1]
        assert len(names(root)) == 2 and len(list(open_cache(done))) == 12
    finally:
        reader.close()
        writer.close()
    plan = gc(root, incomplete_older_than=0, unused_since=time.time() + 60)
    assert sorted(a for _, a, _ in plan) == ["removed", "removed"] and names(root) == []


def test_reader_arriving_mid_gc_keeps_the_cache(root, monkeypatch):
    """A run that announces itself after gc's first look makes gc put the manifest back and stop."""
    done, _ = add_cache(root, "done", "d1")
    real = store_mod.live_readers
    calls = []

    def late_reader(loc):
        calls.append(1)
        if len(calls) == 1:                        # gc's first look: nobody yet; then a run starts
            late_reader.run = open_cache(done, track_use=True)
            return []
        return real(loc)

    monkeypatch.setattr(store_mod, "live_readers", late_reader)
    assert remove_cache(Location(done)) == "being read"
    late_reader.run.close()
    assert [r.sample_id for r in open_cache(done)] == list(range(12))   # manifest restored, shards intact


def test_gc_cli_needs_a_criterion_and_reports(tmp_path, capsys):
    root = str(tmp_path / "store")
    add_cache(root, "half", "d2", shards_done=1)
    with pytest.raises(SystemExit):
        gc_main([root])
    assert "say what to remove" in capsys.readouterr().err
    assert gc_main([root, "--incomplete-older-than", "0s"]) == 0
    out = capsys.readouterr().out
    assert "removed       half--" in out and "removed 1 cache(s)" in out and names(root) == []


def test_a_read_only_cache_is_still_readable(tmp_path, monkeypatch):
    """Without write access (a shared read-only mount, read-only credentials) a run reads anyway, with a warning."""
    d = tmp_path / "ro"
    write_cache(d, make_records(8, seed=3), shard_size=4, **writer_kwargs("arrow"))

    def refuse(self, rel, data, **kw):
        raise PermissionError(13, "Permission denied", self.path(rel))

    monkeypatch.setattr(Location, "write_bytes", refuse)
    with pytest.warns(UserWarning, match="cannot announce this reader"):
        cache = open_cache(d, track_use=True)
    assert len(list(cache)) == 8
    cache.close()


def test_gc_refuses_a_directory_that_is_not_a_store(tmp_path):
    (tmp_path / "data" / "x--0123456789abcdef" / "shards").mkdir(parents=True)
    with pytest.raises(CacheError, match="not a kdcache store"):
        gc(str(tmp_path / "data"), incomplete_older_than=0)
    assert (tmp_path / "data" / "x--0123456789abcdef").exists()


def test_same_inputs_started_twice_under_two_aliases_share_one_cache(root):
    fp, _ = cache_fingerprint({"teacher": "t", "data": "d9"}, Storage("arrow", 8))
    a, found_a = resolve(root, fp, "first job")
    b, found_b = resolve(root, fp, "second job")        # before the first has written anything
    assert a == b and not found_a and found_b            # so the writer lock lets only one run the teacher


def test_looking_writes_nothing_and_bookkeeping_is_not_activity(tmp_path):
    root = str(tmp_path / "store")
    where, _ = add_cache(root, "half", "d2", shards_done=1)
    lock = os.path.join(where, ".writer.lock")
    before = open(lock, "rb").read()
    old = time.time() - 10 * DAY
    for d, _, files in os.walk(where):
        for f in files:
            os.utime(os.path.join(d, f), (old, old))
    os.remove(os.path.join(where, "manifest.json"))     # killed before its first commit: no manifest
    assert ls_main([root]) == 0 and open(lock, "rb").read() == before and os.path.getmtime(lock) == old
    os.utime(lock)                                       # a fresh lock file is not content
    plan = gc(root, incomplete_older_than=7 * DAY)
    assert [(e.state, a) for e, a, _ in plan] == [("empty", "removed")] and not os.path.exists(where)


def test_remove_cache_checks_readers_itself(root):
    done, _ = add_cache(root, "done", "d1")
    run = open_cache(done, track_use=True)
    try:
        assert remove_cache(Location(done)) == "being read"
    finally:
        run.close()
    assert remove_cache(Location(done)) is None and not Location(done).exists()


@pytest.mark.parametrize("where", ["s3", "memory"])
def test_a_writer_that_loses_its_lease_stops(where, request):
    from kdcache.cache_format import LockedError
    from kdcache.cache_format.lease import Lease
    base = request.getfixturevalue("bucket") if where == "s3" else f"memory://lease-{time.time_ns()}"
    loc = Location(f"{base}/c")
    lease = Lease(loc, ".writer.lock", exclusive=True, ttl=0.4).acquire()
    held = loc.read_json(".writer.lock")
    loc.write_json(".writer.lock", dict(held, owner="someone else"))   # taken over behind its back
    deadline = time.time() + 5
    while not lease.lost and time.time() < deadline:
        time.sleep(0.02)
    assert lease.lost
    with pytest.raises(LockedError, match="lost the writer lease"):
        lease.check()
    lease.release()
    assert loc.read_json(".writer.lock")["owner"] == "someone else"      # not deleted: it is not ours


def _claim_path(fp):
    return f".claims/{fp[:16]}.json"


@pytest.mark.parametrize("bad", ["../../outside", "../x--{id}", "/tmp/x--{id}", "a/x--{id}", "x--{id}\n",
                                 "x--0123456789abcdef", 42])
def test_a_claim_that_is_not_a_plain_name_for_this_fingerprint_is_ignored(root, bad):
    """A claim is data from the store, never a path: one naming anything else is replaced by a proper name."""
    fp, _ = cache_fingerprint({"teacher": "t", "data": "d7"}, Storage("arrow", 8))
    store = Location(root)
    store.write_json(_claim_path(fp), {"name": bad.format(id=fp[:16]) if isinstance(bad, str) else bad,
                                       "fingerprint": fp})
    where, found = resolve(root, fp, "job")
    assert where == store.path("job--" + fp[:16]) and not found
    assert store.read_json(_claim_path(fp))["name"] == "job--" + fp[:16]
    assert resolve(root, fp, "other job") == (where, True)


@pytest.mark.parametrize("damage", [b"", b'{"name": "half-writ', b"[1, 2]", b"\xff\xfe"])
def test_an_empty_or_torn_claim_is_replaced(root, damage):
    """A crash between creating a claim and writing it left it empty or partial: resolve still finds a home."""
    fp, _ = cache_fingerprint({"teacher": "t", "data": "d8"}, Storage("arrow", 8))
    Location(root).write_bytes(_claim_path(fp), damage)
    where, found = resolve(root, fp, "job")
    assert where == Location(root).path("job--" + fp[:16]) and not found
    assert resolve(root, fp, "other job") == (where, True)
    done, _ = add_cache(root, "job", "d8")               # and the cache made there is the one found again
    assert done == where and names(root) == ["job--" + fp[:16]]


def test_resolvers_racing_over_a_damaged_claim_agree(root):
    import threading
    fp, _ = cache_fingerprint({"teacher": "t", "data": "d6"}, Storage("arrow", 8))
    Location(root).write_bytes(_claim_path(fp), b"")
    start, out = threading.Barrier(6), []

    def job(i):
        start.wait()
        out.append(resolve(root, fp, f"job {i}")[0])

    threads = [threading.Thread(target=job, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(out) == 6 and len(set(out)) == 1


def _tree(d):
    out = {}
    for base, _, files in os.walk(d):
        for f in files:
            with open(os.path.join(base, f), "rb") as fh:
                out[os.path.relpath(os.path.join(base, f), d)] = fh.read()
    return out


def test_gc_never_follows_a_store_entry_that_is_a_link(tmp_path, capsys):
    root = str(tmp_path / "store")
    add_cache(root, "done", "d1")
    outside = tmp_path / "outside"                     # an old incomplete cache, elsewhere
    kw = writer_kwargs("arrow", fingerprint_parts={"teacher": "t", "data": "d5"})
    with CacheWriter(outside, num_shards_planned=3, **kw) as w:
        w.write_shard(0, make_records(4), sample_start=0, sample_end=4)
    (outside / "notes.txt").write_text("mine")
    before = _tree(outside)
    old = time.time() - 30 * DAY
    for d, _, files in os.walk(outside):
        for f in files:
            os.utime(os.path.join(d, f), (old, old))
    link = os.path.join(root, "x--0123456789abcdef")
    os.symlink(outside, link)
    plan = gc(root, incomplete_older_than=0)
    assert [(e.name, e.state, a) for e, a, _ in plan] == [("x--0123456789abcdef", "link", "kept")]
    assert "symbolic link" in plan[0][2] and "not followed" in plan[0][2]
    assert os.path.islink(link) and _tree(outside) == before          # neither the link nor its target touched
    assert [n.split("--")[0] for n in names(root)] == ["done", "x"]   # the real cache is untouched too
    assert remove_cache(Location(link)) == "it is a symbolic link (not followed, nothing removed)"
    assert _tree(outside) == before
    assert gc_main([root, "--incomplete-older-than", "0s"]) == 0
    assert "symbolic link" in capsys.readouterr().out and _tree(outside) == before


def test_a_writer_refuses_a_store_entry_that_is_a_link(tmp_path):
    root = tmp_path / "store"
    fp, _ = cache_fingerprint({"teacher": "t", "data": "d4"}, Storage("arrow", 8))
    (tmp_path / "outside").mkdir()
    resolve(str(root), fp, "job")                       # claims job--<fp16>; then someone links it elsewhere
    os.symlink(tmp_path / "outside", root / ("job--" + fp[:16]))
    with pytest.raises(CacheError, match="is a symbolic link"):
        resolve(str(root), fp, "job")
    assert os.listdir(tmp_path / "outside") == []
