import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from kdcache.cache_format import (
    CacheWriter,
    FingerprintError,
    LockedError,
    ManifestError,
    RecordError,
    ShardError,
    open_cache,
    verify_cache,
    write_cache,
)
from tests.helpers.cli import ROOT
from tests.helpers.records import make_records, shard_kwargs, writer_kwargs

BACKENDS = ["arrow", "zarr"]


def _shard_rel(cache_dir, j):
    """Shard j's path as the manifest lists it (local names carry the writing job's tag)."""
    with open(os.path.join(cache_dir, "manifest.json")) as f:
        return json.load(f)["shards"][j]["path"]


def _shard_file(cache_dir, j, backend):
    path = os.path.join(cache_dir, _shard_rel(cache_dir, j))
    if backend == "zarr":   # the biggest payload file inside the group
        files = [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
        return max(files, key=os.path.getsize)
    return path


@pytest.mark.parametrize("backend", BACKENDS)
def test_verify_passes_on_sound_cache(tmp_path, backend):
    write_cache(tmp_path, make_records(80), shard_size=30, **writer_kwargs(backend))
    rep = verify_cache(tmp_path)
    assert rep.ok, rep.problems
    assert rep.samples_checked == 80 and rep.shards_checked == 3


@pytest.mark.parametrize("backend", BACKENDS)
def test_verify_reports_truncated_shard_by_name(tmp_path, backend):
    write_cache(tmp_path, make_records(80), shard_size=30, **writer_kwargs(backend))
    victim = _shard_file(tmp_path, 1, backend)
    with open(victim, "r+b") as f:
        f.truncate(os.path.getsize(victim) // 2)
    rep = verify_cache(tmp_path)
    assert not rep.ok
    assert [w for w, _ in rep.problems] == [_shard_rel(tmp_path, 1)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_verify_reports_bit_flip_by_name(tmp_path, backend):
    write_cache(tmp_path, make_records(80), shard_size=30, **writer_kwargs(backend))
    victim = _shard_file(tmp_path, 2, backend)
    with open(victim, "r+b") as f:
        f.seek(os.path.getsize(victim) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x10]))
    rep = verify_cache(tmp_path)
    assert len(rep.problems) == 1
    where, why = rep.problems[0]
    assert where == _shard_rel(tmp_path, 2) and "checksum" in why


@pytest.mark.parametrize("backend", BACKENDS)
def test_reader_never_sees_unlisted_shard(tmp_path, backend):
    recs = make_records(40)
    with CacheWriter(tmp_path, num_shards_planned=2, **writer_kwargs(backend)) as w:
        w.write_shard(0, recs[:20], sample_start=0, sample_end=20)
        # A crash after the shard file is published but before the manifest commit:
        from kdcache.cache_format import write_shard_file
        write_shard_file(tmp_path, 1, recs[20:], **shard_kwargs(backend),
                         sample_start=20, sample_end=40)
    cache = open_cache(tmp_path)
    assert len(cache) == 20 and cache.num_shards == 1 and not cache.complete
    assert {r.sample_id for r in cache} == set(range(20))
    with pytest.raises(IndexError):
        cache[20]
    rep = verify_cache(tmp_path)
    assert rep.ok and any("not listed" in why for _, why in rep.warnings)


def test_listed_but_missing_shard_is_an_error(tmp_path):
    write_cache(tmp_path, make_records(20), shard_size=10, **writer_kwargs("arrow"))
    rel = _shard_rel(tmp_path, 1)
    os.remove(tmp_path / rel)
    cache = open_cache(tmp_path)
    with pytest.raises(ShardError, match=rel):
        cache[15]
    assert [w for w, _ in verify_cache(tmp_path).problems] == [rel]


def test_concurrent_writer_refused(tmp_path):
    holder = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {ROOT!r})
        from kdcache.cache_format.lock import DirLock
        DirLock({str(tmp_path)!r}).acquire()
        print("locked", flush=True)
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", holder], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
        w = CacheWriter(tmp_path, num_shards_planned=1, **writer_kwargs("arrow"))
        with pytest.raises(LockedError, match=f"pid {proc.pid}"):
            w.open()
    finally:
        proc.kill()
        proc.wait()
    # The kernel drops the lock of a killed holder: no stale lock.
    with CacheWriter(tmp_path, num_shards_planned=1, **writer_kwargs("arrow")):
        pass


def test_second_writer_in_same_process_refused(tmp_path):
    with CacheWriter(tmp_path, num_shards_planned=1, **writer_kwargs("arrow")):
        with pytest.raises(LockedError):
            CacheWriter(tmp_path, num_shards_planned=1, **writer_kwargs("arrow")).open()


def test_unknown_format_version_refused(tmp_path):
    write_cache(tmp_path, make_records(5), shard_size=5, **writer_kwargs("arrow"))
    m = json.loads((tmp_path / "manifest.json").read_text())
    m["format_version"] = 99
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ManifestError, match=r"format_version 99 is not supported.*versions 1/2/3"):
        open_cache(tmp_path)


def test_truncated_manifest_is_a_clear_error(tmp_path):
    write_cache(tmp_path, make_records(5), shard_size=5, **writer_kwargs("arrow"))
    data = (tmp_path / "manifest.json").read_bytes()
    (tmp_path / "manifest.json").write_bytes(data[: len(data) // 2])
    with pytest.raises(ManifestError, match="manifest.json: not valid JSON"):
        open_cache(tmp_path)


@pytest.mark.parametrize("bad", ["../outside.arrow", "/etc/passwd", "shards/../../x.arrow", "shards/link.arrow"])
def test_manifest_paths_outside_cache_refused(tmp_path, bad):
    write_cache(tmp_path, make_records(5), shard_size=5, **writer_kwargs("arrow"))
    os.symlink(tmp_path / _shard_rel(tmp_path, 0), tmp_path / "shards" / "link.arrow")
    m = json.loads((tmp_path / "manifest.json").read_text())
    m["shards"][0]["path"] = bad
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ManifestError, match="refused|absolute"):
        open_cache(tmp_path)


def test_resume_with_different_inputs_names_the_difference(tmp_path):
    write_cache(tmp_path, make_records(5), shard_size=5, **writer_kwargs("arrow"))
    kw = writer_kwargs("arrow", fingerprint_parts={"teacher": "OTHER", "data": "d"})
    with pytest.raises(FingerprintError, match="differs in: teacher: content differs"):
        CacheWriter(tmp_path, num_shards_planned=1, **kw).open()
    kw = writer_kwargs("arrow", k=4)
    with pytest.raises(FingerprintError, match=r"differs in: format.top_k: 8 -> 4"):
        CacheWriter(tmp_path, num_shards_planned=1, **kw).open()


def test_resume_skips_committed_shards(tmp_path):
    recs = make_records(30)
    with CacheWriter(tmp_path, num_shards_planned=3, **writer_kwargs("arrow")) as w:
        w.write_shard(0, recs[:10], sample_start=0, sample_end=10)
    m = write_cache(tmp_path, recs, shard_size=10, **writer_kwargs("arrow"))
    assert m["complete"] and [s["index"] for s in m["shards"]] == [0, 1, 2]
    assert [r.sample_id for r in open_cache(tmp_path)] == list(range(30))


def test_verify_flags_sample_without_eos(tmp_path):
    recs = make_records(10)
    recs[4].input_ids[-1] = 7                       # end-of-turn target dropped: the bug kdcache exists for
    write_cache(tmp_path, recs, shard_size=10, **writer_kwargs("arrow"))
    rep = verify_cache(tmp_path)
    assert len(rep.problems) == 1 and "sample 4" in rep.problems[0][1] and "end-of-turn" in rep.problems[0][1]


def test_truncated_sample_may_lack_eos(tmp_path):
    recs = make_records(10, truncated=True)
    for r in recs:
        r.input_ids[-1] = 7
    write_cache(tmp_path, recs, shard_size=10, **writer_kwargs("zarr"))
    assert verify_cache(tmp_path).ok


def _rec(**over):
    base = make_records(1, seed=5)[0]
    for k, v in over.items():
        setattr(base, k, v)
    return base


@pytest.mark.parametrize("field,value,msg", [
    ("topk_logprobs", lambda r: r.topk_logprobs[:, ::-1].copy(), "sorted descending"),
    ("positions", lambda r: r.positions[::-1].copy(), "strictly increasing"),
    ("topk_ids", lambda r: r.topk_ids + 1000, r"\[0, 300\)"),
    ("topk_logprobs", lambda r: np.abs(r.topk_logprobs), "<= 0"),
    ("tail_mass", lambda r: r.tail_mass[:-1], "tail_mass must be"),
])
def test_writer_rejects_broken_records(tmp_path, field, value, msg):
    rec = _rec()
    setattr(rec, field, value(rec))
    with pytest.raises(RecordError, match=msg):
        write_cache(tmp_path, [rec], shard_size=1, **writer_kwargs("arrow"))
    assert not list(tmp_path.glob("shards/shard-00000*"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_failed_shard_write_leaves_no_partial_file(tmp_path, monkeypatch, backend):
    """An error half-way through a shard write (e.g. disk full) leaves nothing under any name."""
    from kdcache.cache_format import arrow_format, zarr_format
    calls = {"n": 0}
    target = (zarr_format, "_put") if backend == "zarr" else (arrow_format, "_batch")
    real = getattr(*target)

    def flaky(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(28, "No space left on device")
        return real(*a, **kw)

    monkeypatch.setattr(*target, flaky)
    with pytest.raises(OSError, match="No space"):
        write_cache(tmp_path, make_records(300), shard_size=300, **writer_kwargs(backend))
    assert calls["n"] == 2
    assert os.listdir(tmp_path / "shards") == []
    assert open_cache(tmp_path).num_shards == 0


def test_writer_sweeps_temp_files_of_killed_writers(tmp_path):
    d = tmp_path / "c"
    write_cache(d, make_records(8, seed=2), shard_size=4, **writer_kwargs("arrow"))
    stale = d / "shards" / ".shard-00001.arrow.tmp-4242-deadbeef"
    stale.write_bytes(b"half a shard")
    CacheWriter(d, num_shards_planned=2, **writer_kwargs("arrow")).open().close()
    assert not stale.exists() and len(open_cache(d)) == 8


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_shard_of_another_format_version_is_refused_by_name(tmp_path, backend, monkeypatch):
    """The manifest says version 2, but one shard was written by a version-4 writer: readers refuse it."""
    from kdcache.cache_format.storage import get_format
    write_cache(tmp_path / "new", make_records(20), shard_size=10, **writer_kwargs(backend))
    with monkeypatch.context() as m:
        m.setattr(get_format(backend), "FORMAT_VERSION", 4)
        write_cache(tmp_path / "v2", make_records(20), shard_size=10, **writer_kwargs(backend))
    assert open_cache(tmp_path / "new")[15].sample_id == 15              # the same data at version 2 reads
    name = _shard_rel(tmp_path / "v2", 0)
    with pytest.raises(ShardError, match=rf"{name}: shard format version '?4'?, this reader reads 1/2/3"):
        open_cache(tmp_path / "v2")[0]
    rep = verify_cache(tmp_path / "v2")
    assert [w for w, _ in rep.problems] == [name, _shard_rel(tmp_path / "v2", 1)]
    assert all("format version" in why for _, why in rep.problems)


def test_a_zarr_shard_of_a_later_version_with_other_arrays_is_refused_by_version(tmp_path, monkeypatch):
    """A later format may rename arrays: the reader names the version, not a missing array."""
    import shutil

    from kdcache.cache_format import zarr_format
    with monkeypatch.context() as m:
        m.setattr(zarr_format, "FORMAT_VERSION", 4)
        write_cache(tmp_path, make_records(10), shard_size=10, **writer_kwargs("zarr"))
    name = _shard_rel(tmp_path, 0)
    shutil.rmtree(tmp_path / name / "topk_values")
    with pytest.raises(ShardError, match=rf"{name}: shard format version 4, this reader reads 1/2/3"):
        open_cache(tmp_path)[0]


def _tamper(loc, change):
    """Rewrite a cache's manifest.json with change(manifest) applied (a hostile or damaged manifest)."""
    from kdcache.cache_format.location import Location
    loc = Location(str(loc))
    m = json.loads(loc.read_bytes("manifest.json"))
    change(m)
    loc.write_bytes("manifest.json", json.dumps(m).encode())


@pytest.mark.parametrize("field,value,says", [
    ("index", "../../../../victim", "index must be an integer"),
    ("index", 7, r"index must be an integer in \[0, 2\)"),
    ("index", True, "index must be an integer"),
    ("sample_start", -5, "sample_start must be a non-negative integer"),
    ("num_samples", 10 ** 6, "samples do not fit its range"),
    ("bytes", "12", "bytes must be a non-negative integer"),
    ("sha256", "../x", "sha256 must be 64 lowercase hex digits"),
])
def test_manifest_fields_are_type_and_range_checked(tmp_path, field, value, says):
    write_cache(tmp_path, make_records(20), shard_size=10, **writer_kwargs("arrow"))
    _tamper(tmp_path, lambda m: m["shards"][0].update({field: value}))
    with pytest.raises(ManifestError, match=says):
        open_cache(tmp_path)
    rep = verify_cache(tmp_path)
    assert not rep.ok and rep.problems[0][0] == "manifest.json" and "damaged" in rep.problems[0][1]


@pytest.mark.parametrize("key,value", [("top_k", "8"), ("eos_token_ids", [-1]), ("counts", {"samples": -1}),
                                       ("complete", "yes"), ("shards", {"0": {}})])
def test_manifest_top_level_fields_are_checked(tmp_path, key, value):
    write_cache(tmp_path, make_records(20), shard_size=10, **writer_kwargs("arrow"))
    _tamper(tmp_path, lambda m: m.update({key: value}))
    with pytest.raises(ManifestError, match=rf"{key} must be"):
        open_cache(tmp_path)


def test_remote_verify_never_writes_where_a_hostile_manifest_says(tmp_path):
    """The reported attack: `index` joined into verify's scratch path made download() replace any file."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    url = "memory://kd/hostile"
    write_cache(url, make_records(20), shard_size=10, **writer_kwargs("arrow"))
    rel = os.path.relpath(victim, "/")                                     # from / after climbing out
    _tamper(url, lambda m: m["shards"][0].update({"index": "../" * 8 + rel}))
    rep = verify_cache(url)
    assert victim.read_text() == "precious"
    assert not rep.ok and "index must be an integer" in rep.problems[0][1]
    _tamper(url, lambda m: m["shards"][0].update({"index": 0}))               # sound again: verify passes
    assert verify_cache(url).ok and victim.read_text() == "precious"


def test_a_resume_with_another_shard_plan_is_refused(tmp_path):
    recs = make_records(100)
    with CacheWriter(tmp_path, shard_size=50, num_records=100, **writer_kwargs("arrow")) as w:
        w.write_shard(0, recs[:50], sample_start=0, sample_end=50)
    with pytest.raises(ManifestError, match=r"shards of 50 records.*plans 99.*Resume with --shard-size 50"):
        CacheWriter(tmp_path, shard_size=99, num_records=100, **writer_kwargs("arrow")).open()
    assert len(open_cache(tmp_path)) == 50 and not open_cache(tmp_path).complete


def test_a_resume_of_an_old_cache_without_a_recorded_plan_checks_the_ranges(tmp_path):
    recs = make_records(100)
    with CacheWriter(tmp_path, num_shards_planned=2, **writer_kwargs("arrow")) as w:     # no plan recorded
        w.write_shard(0, recs[:50], sample_start=0, sample_end=50)
    with pytest.raises(ManifestError, match=r"shard 0 was committed for records \[0, 50\).*gives it \[0, 99\)"):
        CacheWriter(tmp_path, shard_size=99, num_records=100, **writer_kwargs("arrow")).open()
    w = CacheWriter(tmp_path, shard_size=50, num_records=100, **writer_kwargs("arrow")).open()   # the same plan
    with pytest.raises(ManifestError, match=r"shard 1 was written for records \[60, 100\)"):
        w.write_shard(1, recs[60:], sample_start=60, sample_end=100)                # a gap is never committed
    w.close()


def test_verify_finds_records_in_no_shard(tmp_path):
    """A complete manifest whose shards leave a gap (as the old resume could write) fails verify, naming it."""
    recs = make_records(100)
    with CacheWriter(tmp_path, num_shards_planned=2, **writer_kwargs("arrow")) as w:
        w.write_shard(0, recs[:50], sample_start=0, sample_end=50)
        w.write_shard(1, recs[99:], sample_start=99, sample_end=100)
    rep = verify_cache(tmp_path)
    assert ("manifest.json", "records [50, 99) are in no shard (before shard 1)") in rep.problems
