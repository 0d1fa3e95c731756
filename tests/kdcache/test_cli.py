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


def test_train_settings_and_the_rank_launcher_do_not_import_torch(tmp_path):
    """What only parses settings (`kdcache train --help`, a TrainConfig and its loss settings, the launcher that
    starts --nproc-per-node ranks) leaves torch to the ranks: about 2 s per command here."""
    import subprocess
    import sys
    code = ("import contextlib, io, sys\n"
            "from kdcache.train.cli import main\n"
            "from kdcache.train import launch\n"
            "from kdcache.train.config import TrainConfig\n"
            "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
            "    try:\n        main(['--help'])\n    except SystemExit:\n        pass\n"
            "cfg = TrainConfig(cache='c', student='s', out='o', beta=0.5)\n"
            "assert cfg.loss_config(151936).chunk_size == 512 and '--nproc-per-node' in out.getvalue()\n"
            "print('torch' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "False"
