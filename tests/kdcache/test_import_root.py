"""One import root: kdcache works from a user's project that has its own train.py, pipeline/ and cache_format/,
its import graph runs one way, a built wheel holds only `kdcache.*`, and a cache made before the move is reused."""
import ast
import json
import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

from tests.helpers.cli import ROOT, kdcache, precompute, user_env, user_project

# Floors, lowest first: a module may import its own floor and the ones below, never one above.
# pipeline and train stand side by side: neither imports the other.
FLOORS = {"common": 0, "cache_format": 1, "pipeline": 2, "train": 2, "top": 3}
FOLDERS = {"kdcache/common": "common", "cache_format": "cache_format", "pipeline": "pipeline", "train": "train"}


def floor_of_module(name):
    """kdcache.X.Y -> its floor name; None for a module outside kdcache."""
    parts = name.split(".")
    if parts[0] != "kdcache":
        return None
    return parts[1] if len(parts) > 1 and parts[1] in FLOORS and parts[1] != "top" else "top"


def kdcache_imports(path, package):
    """Absolute names of the kdcache modules a file imports (relative imports resolved against `package`)."""
    out = []
    for node in ast.walk(ast.parse(pathlib.Path(path).read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module
            out.append(mod)
    return [m for m in out if m and m.split(".")[0] == "kdcache"]


def test_the_import_graph_runs_one_way():
    upward = []
    for folder, floor in FOLDERS.items():
        package = "kdcache." + floor
        for path in sorted(pathlib.Path(ROOT, folder).rglob("*.py")):
            for mod in kdcache_imports(path, package):
                other = floor_of_module(mod)
                if other != floor and (FLOORS[other] >= FLOORS[floor]):
                    upward.append(f"{path.relative_to(ROOT)} imports {mod}")
    assert not upward, "imports that run up a floor or sideways:\n" + "\n".join(upward)


def test_the_graph_check_sees_an_upward_import(tmp_path):
    """The check above can fail: a format module that imported the trainer would be caught."""
    f = tmp_path / "m.py"
    f.write_text("from kdcache.train.losses import kd_loss_from_logits\nfrom ..common.errors import KdcacheError\n")
    mods = kdcache_imports(f, "kdcache.cache_format")
    assert mods == ["kdcache.train.losses", "kdcache.common.errors"]
    assert [FLOORS[floor_of_module(m)] >= FLOORS["cache_format"] for m in mods] == [True, False]


def test_no_module_imports_a_bare_top_level_name():
    bare = []
    for folder in [*FOLDERS, "kdcache", "examples", "bench"]:
        for path in sorted(pathlib.Path(ROOT, folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module] if isinstance(node, ast.ImportFrom) and not node.level else []
                bare += [f"{path.relative_to(ROOT)}: {n}" for n in names
                         if n and n.split(".")[0] in ("cache_format", "pipeline", "train")]
    assert not bare, bare


def test_the_api_and_the_commands_work_from_a_users_project():
    """The user's train.py, pipeline/ and cache_format/ each exit when imported: none of them may be."""
    res = subprocess.run([sys.executable, "-c", "import kdcache; kdcache.kd_loss; kdcache.open_cache; "
                          "kdcache.CacheDataset; import kdcache.pipeline.job, kdcache.train.trainer; print('ok')"],
                         cwd=user_project(), env=user_env(), capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]
    for command in ("train", "precompute", "eval", "inspect", "verify", "ls", "gc"):
        res = kdcache(command, "--help")
        assert res.returncode == 0 and "usage: kdcache " + command in res.stdout, (command, res.stderr[-2000:])


def test_the_user_project_would_be_caught():
    """The helper's project is hostile for real: importing its train.py from there exits with its message."""
    res = subprocess.run([sys.executable, "-c", "import train"], cwd=user_project(), env=user_env(),
                         capture_output=True, text=True, timeout=60)
    assert res.returncode != 0 and "the user's train.py was imported" in res.stderr


@pytest.mark.slow
def test_a_built_wheel_holds_only_the_kdcache_root(tmp_path):
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(tmp_path), ROOT], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    (wheel,) = tmp_path.glob("kdcache-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"kdcache"}, tops
    for want in ("kdcache/cache_format/SPEC.md", "kdcache/cache_format/writer.py", "kdcache/pipeline/job.py",
                 "kdcache/pipeline/configs/precompute.yaml", "kdcache/train/configs/train.yaml",
                 "kdcache/train/trainer.py", "kdcache/common/errors.py", "kdcache/demo/run.py"):
        assert want in names, want


@pytest.mark.slow
@pytest.mark.ray
def test_a_cache_made_before_the_move_is_reused_by_fingerprint(tmp_path):
    """tests/fixtures/v2: written by the last commit before the move. The same inputs find it complete."""
    src = pathlib.Path(ROOT, "tests", "fixtures", "v2")
    shutil.copytree(src, tmp_path / "v2")
    d = tmp_path / "v2"
    before = json.loads((d / "cache" / "manifest.json").read_text())
    res = precompute("--teacher", d / "teacher", "--data", d / "data.jsonl", "--out", d / "cache",
                     "--backend", "hf", "--top-k", 8, "--shard-size", 4)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "reusing it" in res.stdout and before["fingerprint"][:16] in res.stdout, res.stdout[-2000:]
    assert "teacher work     none" in res.stdout
    after = json.loads((d / "cache" / "manifest.json").read_text())
    assert after["fingerprint"] == before["fingerprint"] and after["shards"] == before["shards"]
    # and a changed setting is a different fingerprint (the reuse above is not a check that always passes)
    res = precompute("--teacher", d / "teacher", "--data", d / "data.jsonl", "--out", d / "cache",
                     "--backend", "hf", "--top-k", 4, "--shard-size", 4)
    assert res.returncode != 0 and "made from different inputs (differs in: format.top_k: 8 -> 4)" in res.stderr
    assert os.path.exists(d / "cache" / "manifest.json")
