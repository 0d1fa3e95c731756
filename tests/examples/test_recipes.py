"""The recipes under examples/ run, and the Hugging Face Trainer's first loss is `kdcache train`'s."""
import json
import os
import subprocess
import sys

import pytest

from tests.helpers.cli import ROOT, kdcache, precompute, user_env, user_project, write_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.deepspeed]


@pytest.fixture(scope="module")
def setup(tiny, tmp_path_factory):
    import torch

    from kdcache.demo.models import make_model, save
    d = tmp_path_factory.mktemp("recipes")
    teacher = make_model(tiny["tok"], "test", seed=11)
    with torch.no_grad():
        teacher.model.norm.weight.mul_(6.0)        # a peaked teacher: a distillation loss worth lowering
    save(teacher, tiny["tok"], str(d / "teacher"))
    data = write_jsonl(d / "d.jsonl", tiny["train"][:24])
    res = precompute("--teacher", d / "teacher", "--data", data, "--out", d / "cache", "--backend", "hf",
                     "--top-k", 16, "--shard-size", 8)
    assert res.returncode == 0, res.stderr[-3000:]
    student = make_model(tiny["tok"], "test", seed=5)
    student.config.save_pretrained(str(d / "student"))
    tiny["tok"].save_pretrained(str(d / "student"))
    return {"cache": str(d / "cache"), "student": str(d / "student"), "dir": d}


def recipe(name, setup, out, *extra):
    cmd = [sys.executable, os.path.join(ROOT, "examples", name), "--cache", setup["cache"], "--student",
           setup["student"], "--out", str(out), "--steps", 3, "--batch-size", 2, *extra]
    res = subprocess.run(list(map(str, cmd)), cwd=user_project(), capture_output=True, text=True, timeout=600,
                         env=user_env())
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    return res


def kdcache_train_first_loss(setup, out):
    """`kdcache train`'s step-1 loss on the first batch (no shuffle), computed once per module."""
    if "first_loss" in setup:
        return setup["first_loss"]
    res = kdcache("train", "--cache", setup["cache"], "--student", setup["student"], "--out", out, "--max-steps", 1,
                  "--batch-size", 2, "--no-shuffle", "--no-progress", "--save-every", 0, timeout=600,
                  env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")})
    assert res.returncode == 0, res.stderr[-3000:]
    setup["first_loss"] = json.loads(open(os.path.join(out, "metrics.jsonl")).readline())["loss"]
    return setup["first_loss"]


def test_hf_trainer_recipe_first_loss_equals_kdcache_train(setup, tmp_path):
    want = kdcache_train_first_loss(setup, tmp_path / "kd")
    recipe("hf_trainer.py", setup, tmp_path / "hf", "--no-shuffle")
    losses = json.load(open(tmp_path / "hf" / "kd_losses.json"))
    assert len(losses) == 3
    assert abs(losses[0] - want) < 1e-5 * max(1.0, abs(want)), (losses[0], want)
    assert (tmp_path / "hf" / "config.json").exists()


def test_trl_recipe_runs(setup, tmp_path):
    want = kdcache_train_first_loss(setup, tmp_path / "kd")
    recipe("trl_sft.py", setup, tmp_path / "trl", "--no-shuffle")
    losses = json.load(open(tmp_path / "trl" / "kd_losses.json"))
    assert len(losses) == 3 and abs(losses[0] - want) < 1e-3 * max(1.0, abs(want)), (losses[0], want)


def test_plain_loop_recipe_runs_and_learns(setup, tmp_path):
    res = recipe("plain_loop.py", setup, tmp_path / "plain", "--steps", 12)
    losses = [float(line.split()[-1]) for line in res.stdout.splitlines() if line.startswith("step ")]
    assert len(losses) == 12 and sum(losses[-3:]) < sum(losses[:3])
    assert (tmp_path / "plain" / "config.json").exists()
