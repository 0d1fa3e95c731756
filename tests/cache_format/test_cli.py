import json

from kdcache.cache_format import write_cache
from tests.helpers.cli import kdcache
from tests.helpers.records import make_records, writer_kwargs


def test_inspect_human_and_json(tmp_path):
    write_cache(tmp_path, make_records(40), shard_size=15, **writer_kwargs("zarr"))
    out = kdcache("inspect", tmp_path)
    assert out.returncode == 0, out.stderr
    js = json.loads(kdcache("inspect", tmp_path, "--json").stdout)
    assert "complete (3/3 shards)" in out.stdout and js["manifest"]["shards"][2]["path"] in out.stdout
    assert js["manifest"]["counts"]["samples"] == 40
    assert js["derived"]["bytes_per_position"] > 0


def test_verify_exit_codes(tmp_path):
    write_cache(tmp_path, make_records(20), shard_size=10, **writer_kwargs("arrow"))
    ok = kdcache("verify", tmp_path)
    assert ok.returncode == 0 and "OK" in ok.stdout
    rel = json.loads((tmp_path / "manifest.json").read_text())["shards"][0]["path"]
    with open(tmp_path / rel, "ab") as f:
        f.write(b"junk")
    bad = kdcache("verify", tmp_path)
    assert bad.returncode == 1 and rel in bad.stdout


def test_not_a_cache_is_a_clear_error(tmp_path):
    out = kdcache("inspect", tmp_path)
    assert out.returncode == 2 and "no manifest" in out.stderr


def test_dispatcher_help_and_unknown_command():
    assert "inspect" in kdcache("--help").stdout
    assert kdcache("frobnicate").returncode == 2
