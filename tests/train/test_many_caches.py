"""`kdcache train --cache A --cache B`: two teachers' caches in one run. An epoch trains every position of each
once (counted per cache in metrics.jsonl, on one rank and on two), a run stopped mid-way resumes to the same
losses, and each cache passes rule 2 on its own or is refused by name."""
import json
import shutil

import pytest
import torch

from tests.helpers.cli import precompute, write_jsonl
from tests.train.common import losses, make_setup, run, train_cmd


@pytest.fixture(scope="module")
def setup(tiny, tmp_path_factory):
    """make_setup's cache (48 records, teacher seed 11) and a second teacher's (seed 13) over 24 other records."""
    from kdcache.demo.models import make_model, save
    s = make_setup(tiny, tmp_path_factory)
    d = s["dir"]
    second = make_model(tiny["tok"], "test", seed=13)
    with torch.no_grad():
        second.model.norm.weight.mul_(4.0)
    save(second, tiny["tok"], str(d / "teacher2"))
    data = write_jsonl(d / "d2.jsonl", tiny["train"][48:72])
    res = precompute("--teacher", d / "teacher2", "--data", data, "--out", d / "cache2", "--backend", "hf",
                     "--top-k", 16, "--shard-size", 5, shared_ray=True)
    assert res.returncode == 0, res.stderr
    s["cache2"] = d / "cache2"
    return s


def _positions(cache):
    return json.load(open(cache / "manifest.json"))["counts"]["positions"]


def _by_cache(rows, cache):
    return sum(r["by_cache"][str(cache)]["positions"] for r in rows)


def _two(setup, out, *extra):
    return train_cmd(setup, out, "--cache", setup["cache2"], "--batch-size", 4, "--save-every", 5, *extra)


@pytest.mark.parametrize("ranks", [1, 2])
def test_an_epoch_over_two_teachers_caches_trains_every_position_of_each_once(setup, tmp_path, ranks):
    out = tmp_path / "run"
    res = run(_two(setup, out, "--threads", 1, *(("--nproc-per-node", 2) if ranks == 2 else ())))
    assert res.returncode == 0, res.stderr[-3000:]
    rows = losses(out)
    assert _by_cache(rows, setup["cache"]) == _positions(setup["cache"])       # every position of each, once
    assert _by_cache(rows, setup["cache2"]) == _positions(setup["cache2"])
    assert sum(r["positions"] for r in rows) == _positions(setup["cache"]) + _positions(setup["cache2"])
    # both caches are drawn from start to end (in proportion to the positions left), not one after the other
    from_second = [n for n, r in enumerate(rows) if r["by_cache"][str(setup["cache2"])]["batches"]]
    assert from_second[0] < len(rows) // 3 and from_second[-1] > 2 * len(rows) // 3, from_second
    kd = [r["by_cache"][str(setup["cache2"])]["kd"] for r in rows if r["by_cache"][str(setup["cache2"])]["kd"]]
    assert kd and all(k > 0 for k in kd)
    summary = json.load(open(out / "train_summary.json"))
    assert summary["step"] == len(rows)
    assert summary["caches"][str(setup["cache2"])]["positions"] == _positions(setup["cache2"])


def test_a_run_over_two_caches_stopped_mid_way_resumes_to_the_same_losses(setup, tmp_path):
    straight = tmp_path / "straight"
    res = run(_two(setup, straight))
    assert res.returncode == 0, res.stderr[-3000:]
    out = tmp_path / "stopped"
    first = run(_two(setup, out, "--stop-after", 7))
    assert first.returncode == 0 and "stopped by stop_after" in first.stdout, first.stderr[-3000:]
    assert len(losses(out)) == 7
    again = run(_two(setup, out))
    assert again.returncode == 0 and "resumed from" in again.stdout, again.stderr[-3000:]
    keys = ("step", "loss", "kd", "positions", "by_cache")
    assert [{k: r[k] for k in keys} for r in losses(out)] == [{k: r[k] for k in keys} for r in losses(straight)]
    # the same --out with another set of caches: refused, naming what changed
    other = run(train_cmd(setup, out, "--batch-size", 4))
    assert other.returncode == 2 and "caches" in other.stderr and "cannot be resumed" in other.stderr, other.stderr


def test_each_cache_is_checked_on_its_own_and_bad_settings_are_named(setup, tmp_path):
    foreign = tmp_path / "foreign"
    shutil.copytree(setup["cache2"], foreign)
    m = json.load(open(foreign / "manifest.json"))
    m["meta"]["tokenizer"] = dict(m["meta"]["tokenizer"], vocab_size=m["meta"]["tokenizer"]["vocab_size"] + 1)
    (foreign / "manifest.json").write_text(json.dumps(m))
    res = run(train_cmd(setup, tmp_path / "a", "--cache", foreign))
    assert res.returncode == 2 and str(foreign) in res.stderr and "vocabulary size" in res.stderr, res.stderr
    res = run(train_cmd(setup, tmp_path / "b", "--cache", setup["cache2"], "--cache-weights", "0.7,0.3"))
    assert res.returncode == 2 and "cache_weights" in res.stderr and "--max-steps" in res.stderr, res.stderr
    res = run(train_cmd(setup, tmp_path / "c", "--cache", setup["cache2"], "--cache-weights", "1", "--max-steps", 3))
    assert res.returncode == 2 and "one per --cache" in res.stderr, res.stderr
    res = run(train_cmd(setup, tmp_path / "d", "--cache", setup["cache"]))
    assert res.returncode == 2 and "given twice" in res.stderr, res.stderr


def test_cache_weights_set_the_share_of_micro_batches(setup, tmp_path):
    out = tmp_path / "weighted"
    res = run(_two(setup, out, "--cache-weights", "1,3", "--max-steps", 24, "--save-every", 0))
    assert res.returncode == 0, res.stderr[-3000:]
    rows = losses(out)
    second = sum(r["by_cache"][str(setup["cache2"])]["batches"] for r in rows)
    assert 12 <= second <= 23, second            # 3/4 of 24 draws expected (18); by positions it would be ~1/3
