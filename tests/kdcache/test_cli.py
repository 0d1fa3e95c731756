"""The dispatcher is the one place errors reach the user: a KdcacheError is a message and exit 2."""
import os

from tests.helpers.cli import kdcache


def test_an_error_is_one_line_naming_the_file_and_exit_2(tmp_path):
    res = kdcache("inspect", tmp_path)
    assert res.returncode == 2
    assert res.stderr.startswith(f"error: {tmp_path}/manifest.json: no manifest") and "Traceback" not in res.stderr


def test_kdcache_traceback_shows_the_exception(tmp_path):
    res = kdcache("inspect", tmp_path, env=dict(os.environ, KDCACHE_TRACEBACK="1"))
    assert res.returncode == 1 and "Traceback" in res.stderr and "ManifestMissing" in res.stderr


def test_unknown_command_and_help():
    assert kdcache("frobnicate").returncode == 2
    res = kdcache("--help")
    assert res.returncode == 0 and all(c in res.stdout for c in ("precompute", "train", "verify", "gc"))
