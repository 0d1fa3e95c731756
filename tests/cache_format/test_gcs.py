"""gs:// caches through gcsfs, against a GCS-compatible server on 127.0.0.1 (gcp-storage-emulator, mended where it
corrupts uploads: tests/helpers/gcsserver.py). The object-store behaviour is what test_remote.py asks of S3:
round trips of both shard formats, one writer at a time, kill -9 mid-write then resume, a damaged shard named."""
import pytest

from kdcache.cache_format import open_cache, verify_cache
from kdcache.cache_format.location import Location
from tests.cache_format import test_remote as on_s3
from tests.helpers.cli import precompute, write_jsonl


@pytest.mark.parametrize("backend", ["arrow", "zarr"])
def test_round_trip_on_gcs(gs_bucket, backend):
    on_s3.test_round_trip_on_s3(gs_bucket, backend)


def test_second_writer_on_gcs_is_refused_and_named(gs_bucket):
    on_s3.test_second_writer_on_s3_is_refused_and_named(gs_bucket)


@pytest.mark.parametrize("point", ["before-replace-manifest.json@3", "before-upload@4"])
def test_kill_9_mid_gcs_write_then_resume(gs_bucket, point):
    on_s3.test_kill_9_mid_remote_write_then_resume(gs_bucket, point)


def test_damaged_gcs_shard_is_refused_by_name(gs_bucket):
    on_s3.test_damaged_remote_shard_is_refused_by_name(gs_bucket)


@pytest.mark.ray
@pytest.mark.slow
def test_precompute_into_gcs(tiny, gs_bucket, tmp_path):
    """The Ray workers upload their shards to gs:// themselves (they inherit the emulator's address)."""
    url = f"{gs_bucket}/caches/c"
    data = write_jsonl(tmp_path / "d.jsonl", tiny["train"][:6])
    args = ["--teacher", tiny["teacher"], "--data", data, "--out", url, "--backend", "hf", "--top-k", 8,
            "--shard-size", 3]
    res = precompute(*args)
    assert res.returncode == 0, res.stderr[-3000:]
    rep = verify_cache(url)
    assert rep.ok and rep.shards_checked == 2 and rep.samples_checked == 6, rep.problems
    assert [r.sample_id for r in open_cache(url)] == list(range(6))
    assert Location(url).read_json("report/summary.json")["complete"]
