"""`kdcache verify --rescore FRACTION --teacher DIR` (issue 45, part 3; pipeline/rescore.py): a sample of each
shard's samples scored again by transformers at the cache's own ids, KL(stored || rescored) per shard."""
import json

import numpy as np
import pytest

from kdcache.cache_format import open_cache
from kdcache.pipeline.rescore import bucket_kl
from tests.helpers.cli import kdcache, precompute, write_jsonl
from tests.pipeline.test_teacher_view import hinted


def test_the_bucket_kl_is_the_kl_over_the_stored_ids_and_the_rest_and_bounds_the_full_one():
    rng = np.random.default_rng(0)
    V, k, P = 40, 6, 50
    p = rng.dirichlet(np.full(V, 0.3), size=P)
    q = 0.7 * p + 0.3 * rng.dirichlet(np.full(V, 0.3), size=P)
    ids = np.argsort(-p, axis=1)[:, :k].astype(np.int32)
    ids[0, 4:] = -1                                           # a ragged row (--top-p): unused slots
    lp_p, lp_q = (np.log(np.take_along_axis(x, np.maximum(ids, 0), 1)) for x in (p, q))
    got = bucket_kl(ids, np.where(ids >= 0, lp_p, -np.inf), np.where(ids >= 0, lp_q, -np.inf))
    for r in range(P):
        sel = ids[r][ids[r] >= 0]
        pb, qb = np.append(p[r, sel], 1 - p[r, sel].sum()), np.append(q[r, sel], 1 - q[r, sel].sum())
        assert got[r] == pytest.approx(float((pb * np.log(pb / qb)).sum()), rel=1e-9, abs=1e-12)
        assert got[r] <= float((p[r] * np.log(p[r] / q[r])).sum()) + 1e-12       # merging ids never raises a KL
    assert np.all(bucket_kl(ids, lp_p, lp_p) < 1e-12) and got.mean() > 1e-3


@pytest.fixture(scope="module")
def hinted_cache(tiny, tmp_path_factory):
    """The tiny teacher's cache (hf, float32 log-probs, 3 shards) of hinted chats: the teacher scored its own view."""
    d = tmp_path_factory.mktemp("rescore")
    data = write_jsonl(d / "d.jsonl", [hinted(r) for r in tiny["train"][:12]])
    out = d / "cache"
    res = precompute("--teacher", tiny["teacher"], "--data", data, "--out", out, "--backend", "hf", "--top-k", 8,
                     "--logprob-dtype", "float32", "--shard-size", 4, shared_ray=True)
    assert res.returncode == 0, res.stderr[-3000:]
    assert open_cache(out)[0].teacher_input_ids is not None
    return out


@pytest.mark.ray
def test_rescoring_with_the_caches_teacher_finds_no_gap_and_other_weights_a_large_one(tiny, stopping, hinted_cache):
    res = kdcache("verify", hinted_cache, "--rescore", 0.5, "--teacher", tiny["teacher"], "--json", timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    same = json.loads(res.stdout)
    assert same["ok"] and same["rescore"]["fraction"] == 0.5
    rows = same["rescore"]["shards"]
    assert [r["shard"] for r in rows] == [0, 1, 2] and all(r["samples"] == 2 and r["of"] == 4 for r in rows)
    # the teacher's own view is rescored: float32 storage, the same weights, the same engine -> no gap
    assert same["rescore"]["kl_max"] < 1e-5 and same["rescore"]["target_diff_mean"] < 1e-5
    assert same["rescore"]["positions"] == sum(r["positions"] for r in rows) > 0
    res = kdcache("verify", hinted_cache, "--rescore", 0.5, "--teacher", stopping["greedy"], "--json", timeout=300)
    other = json.loads(res.stdout)["rescore"]
    # (the untrained teacher's top-8 holds little of its mass: the bucket KL, a lower bound, is small but clear)
    assert other["kl_mean"] > max(0.01, 1e3 * same["rescore"]["kl_max"]) and other["target_diff_mean"] > 0.1, other
    res = kdcache("verify", hinted_cache, "--rescore", 1, "--teacher", tiny["teacher"], "--no-progress", timeout=300)
    assert res.returncode == 0 and "KL(stored || rescored)" in res.stdout, res.stderr[-3000:]
    lines = res.stdout.splitlines()
    assert lines[0].startswith("OK:") and any(line.split()[:2] == ["all", "12"] for line in lines), res.stdout


@pytest.mark.ray
def test_rescore_needs_a_teacher_and_a_fraction(hinted_cache):
    res = kdcache("verify", hinted_cache, "--rescore", 0.5)
    assert res.returncode == 2 and "--rescore needs --teacher DIR" in res.stderr
    res = kdcache("verify", hinted_cache, "--rescore", 1.5, "--teacher", "x")
    assert res.returncode == 2 and "--rescore: 1.5 is not a fraction in (0, 1]" in res.stderr
    res = kdcache("verify", hinted_cache)                                    # plain verify as before
    assert res.returncode == 0 and res.stdout.startswith("OK:")
