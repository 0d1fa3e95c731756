"""Format 2's compact storage: adaptive k (top-p), sqrt8 log-probs, target log-probs, per-shard fidelity."""
import math
import shutil

import numpy as np
import pytest

from kdcache.cache_format import Record, compact, open_cache, write_cache
from kdcache.cache_format.manifest import cache_stats, load_manifest
from kdcache.cache_format.verify import verify_cache
from tests.helpers.cli import ROOT, kdcache
from tests.helpers.records import make_records, writer_kwargs

BACKENDS = ["arrow", "zarr"]
K, V = 16, 300


def records_with_targets(n=24, seed=3):
    recs = make_records(n, seed=seed, k=K, vocab=V)
    rng = np.random.default_rng(seed)
    for r in recs:      # a target log-prob below every top-k entry: the target is usually outside the top-k
        r.topk_logprobs = r.topk_logprobs.astype(np.float32)
        r.target_logprobs = (r.topk_logprobs[:, -1] - rng.uniform(0.1, 3.0, len(r.positions))).astype(np.float32)
    return recs


def as_dicts(ids, lps):
    """Per position: {id: log-prob} of the used entries (entries may come back in another order)."""
    return [{int(i): float(v) for i, v in zip(row_i, row_v) if i >= 0} for row_i, row_v in zip(ids, lps)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,top_p", [("float16", None), ("float32", 0.9), ("sqrt8", None), ("sqrt8", 0.95)])
def test_what_a_reader_gets_is_what_the_mode_promises(tmp_path, backend, dtype, top_p):
    recs = records_with_targets()
    m = write_cache(tmp_path, recs, shard_size=10,
                    **writer_kwargs(backend, k=K, vocab=V, logprob_dtype=dtype, top_p=top_p))
    assert m["top_p"] == top_p and m["format_version"] == 2 and verify_cache(tmp_path).ok
    kls = []
    for want, got in zip(recs, open_cache(tmp_path)):
        n = np.full(len(want.positions), K) if top_p is None else compact.top_p_counts(want.topk_logprobs, top_p)
        np.testing.assert_array_equal(got.topk_counts, n)
        if top_p is not None:        # the smallest prefix reaching top_p: one entry fewer would not
            mass = np.cumsum(np.exp(want.topk_logprobs.astype(np.float64)), 1)
            rows = np.arange(len(n))
            assert np.all((mass[rows, n - 1] >= top_p) | (n == K)) and np.all((n == 1) | (mass[rows, n - 2] < top_p))
        kept, kept_lp = compact.keep_prefix(want.topk_ids, want.topk_logprobs, n)
        expect = as_dicts(kept, compact.stored_logprobs(kept_lp, dtype))
        for e, g in zip(expect, as_dicts(got.topk_ids, got.topk_logprobs)):
            assert e.keys() == g.keys()
            np.testing.assert_allclose(list(g.values()), [e[i] for i in g], rtol=0, atol=1e-6)
        exact_tail = 1 - np.exp(np.where(kept >= 0, kept_lp, -np.inf).astype(np.float64)).sum(1)
        np.testing.assert_allclose(got.tail_mass, np.clip(exact_tail, 0, 1), atol=1e-6)   # exact, not rounded
        np.testing.assert_array_equal(got.target_logprobs, want.target_logprobs)
        kls.append(compact.kl_to_exact(want.topk_logprobs, compact.stored_logprobs(kept_lp, dtype), exact_tail, V))
    kl = np.concatenate(kls)
    st = cache_stats(m)
    assert st["kl_mean"] == pytest.approx(kl.mean(), rel=1e-4, abs=1e-9)
    assert st["kl_max"] == pytest.approx(kl.max(), rel=1e-4, abs=1e-9)
    nll = -np.concatenate([r.target_logprobs for r in recs]).astype(np.float64)
    assert st["teacher_ce"] == pytest.approx(nll.mean(), rel=1e-6)


def test_the_recorded_kl_of_a_top_p_row_is_the_spec_definition_worked_by_hand(tmp_path):
    """SPEC.md "Stored fidelity" on one float32 row: exact top-4 probabilities (.5, .3, .1, .05), top_p 0.75 keeps
    .5 and .3 (.5 < .75 <= .8), the stored tail is 1 - .8 = .2, and each of the 2 dropped ids gets the share
    .2 / (vocab_size - 2) of it. The writer's kl_max is KL(p || q) with p, q renormalised over the 4 ids."""
    vocab = 12                                     # small, so the share .2 / 10 = .02 weighs in the KL
    probs = (0.5, 0.3, 0.1, 0.05)
    rec = Record(0, np.array([3, 4, 2], np.int32), np.array([1], np.int32), np.array([[4, 7, 1, 9]], np.int32),
                 np.log(np.array([probs], np.float64)).astype(np.float32))
    kw = writer_kwargs("arrow", k=4, vocab=vocab, logprob_dtype="float32", top_p=0.75)   # float32: kept .5, .3 exact
    m = write_cache(tmp_path, [rec], shard_size=1, **kw)
    got = next(iter(open_cache(tmp_path)))
    assert got.topk_counts.tolist() == [2] and got.tail_mass[0] == pytest.approx(0.2, abs=1e-6)
    share = 0.2 / (vocab - 2)
    p = [x / 0.95 for x in probs]                                  # .95 = .5 + .3 + .1 + .05
    q = [x / (0.8 + 2 * share) for x in (0.5, 0.3, share, share)]
    want = sum(a * math.log(a / b) for a, b in zip(p, q))
    st = cache_stats(m)
    assert st["kl_max"] == pytest.approx(want, rel=1e-5) and st["kl_mean"] == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_dense_float32_cache_stores_the_exact_top_k(tmp_path, backend):
    """No top-p, float32: a reader gets the teacher's numbers, so the recorded KL is exactly 0, not merely small."""
    m = write_cache(tmp_path, records_with_targets(), shard_size=10,
                    **writer_kwargs(backend, k=K, vocab=V, logprob_dtype="float32"))
    st = cache_stats(m)
    assert st["kl_max"] == 0 and st["kl_mean"] == 0


def test_sqrt8_meets_its_stated_error_bound():
    """SPEC.md 4.3: |sqrt(p) read back - sqrt(p)| <= 1/510 for every p >= 0 (level 0 reads back 0.25/255)."""
    lp = np.log(np.concatenate([np.geomspace(1e-12, 1, 20000), np.linspace(0, 1, 20001)[1:]]))
    back = np.exp(compact.dequantize(compact.quantize(lp)).astype(np.float64) / 2)
    assert np.abs(back - np.exp(lp / 2)).max() <= 1 / 510 + 1e-7


def test_sqrt8_orders_ids_and_a_dense_cache_reads_by_reshape():
    ids = np.array([[5, 2, 9, 1], [7, 3, -1, -1]], dtype=np.int32)
    lps = np.log(np.array([[0.5, 0.3, 0.1, 0.05], [0.9, 0.05, 0, 0]]))
    counts = np.array([4, 2])
    steps, levels, _ = compact.pack_entries(ids, lps, counts, "sqrt8", np.uint16)
    assert steps.tolist() == [1, 1, 3, 4, 3, 4] and steps.dtype == np.uint16    # ids ascending, stored as steps
    back_ids, back_lp, _ = compact.unpack_entries(counts, steps, levels, "sqrt8", 4)
    assert back_ids.tolist() == [[1, 2, 5, 9], [3, 7, -1, -1]] and np.isneginf(back_lp[1, 2:]).all()
    np.testing.assert_allclose(np.exp(back_lp[0] / 2), np.sqrt([0.05, 0.3, 0.5, 0.1]), atol=1 / 510)


def test_large_vocabularies_keep_int32_ids(tmp_path):
    recs = make_records(4, seed=1, k=8, vocab=70000)
    write_cache(tmp_path, recs, shard_size=4, **writer_kwargs("arrow", k=8, vocab=70000, logprob_dtype="sqrt8"))
    got = list(open_cache(tmp_path))
    for r, g in zip(recs, got):
        assert [set(row) for row in r.topk_ids.tolist()] == [set(row) for row in g.topk_ids.tolist()]


@pytest.mark.parametrize("backend", BACKENDS)
def test_format_1_fixture_reads_verifies_and_inspects(backend, tmp_path):
    """A cache written by the last version-1 writer (tests/fixtures/v1) stays readable by every command."""
    src = f"{ROOT}/tests/fixtures/v1/{backend}"
    cache = open_cache(src)
    m = cache.manifest
    assert m["format_version"] == 1 and len(cache) == 6
    recs = list(cache)
    assert all(r.target_logprobs is None and r.topk_ids.shape[1] == 8 and (r.topk_ids >= 0).all() for r in recs)
    assert all(np.all(np.diff(r.topk_logprobs, axis=1) <= 1e-6) for r in recs)
    assert verify_cache(src).ok
    res = kdcache("inspect", src)
    assert res.returncode == 0 and "format 1" in res.stdout, res.stdout + res.stderr
    res = kdcache("verify", src)
    assert res.returncode == 0, res.stdout + res.stderr
    shutil.copytree(src, tmp_path / "c")
    res = kdcache("inspect", tmp_path / "c", "--card")
    assert res.returncode == 0 and "not recorded (format 1)" in (tmp_path / "c" / "README.md").read_text()
    other = open_cache(f"{ROOT}/tests/fixtures/v1/{'zarr' if backend == 'arrow' else 'arrow'}")
    for a, b in zip(recs, other):                 # both backends of version 1 read the same records
        np.testing.assert_array_equal(a.topk_ids, b.topk_ids)
        np.testing.assert_array_equal(a.topk_logprobs, b.topk_logprobs)


def test_inspect_shows_bytes_per_field_and_the_fidelity(tmp_path):
    write_cache(tmp_path, records_with_targets(), shard_size=12,
                **writer_kwargs("arrow", k=K, vocab=V, logprob_dtype="sqrt8", top_p=0.95))
    res = kdcache("inspect", tmp_path)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    for text in ("sqrt8", "top-p 0.95", "topk_ids", "topk_values", "tail_mass", "target_logprobs", "KL",
                 "perplexity"):
        assert text in out, (text, out)
    assert f"{cache_stats(load_manifest(tmp_path))['kl_mean']:.2e}" in out


def test_the_float16_bound_stated_in_spec_holds_in_p():
    """SPEC.md 4.3: p within a factor e^(+-2^-11 ln(1/p)), or e^(+-2^-25) where ln p is subnormal (p > 0.99994).
    The old statement, 2^-11 relative in ln p, is false below 6e-5 in magnitude (issue 23, item 14)."""
    p = np.concatenate([np.geomspace(1e-12, 0.5, 4000), 1 - np.geomspace(1e-9, 0.5, 4000)])
    lp = np.log(p)
    back = np.exp(lp.astype(np.float16).astype(np.float64))
    factor = np.abs(np.log(back / p))
    normal = np.abs(lp) >= 2.0 ** -14
    assert np.all(factor[normal] <= 2.0 ** -11 * np.abs(lp[normal]) * (1 + 1e-9))
    assert np.all(factor[~normal] <= 2.0 ** -25 * (1 + 1e-9)) and (~normal).sum() > 100
    assert np.any(np.abs(lp.astype(np.float16) - lp)[~normal] > 2.0 ** -11 * np.abs(lp[~normal]))  # the old claim fails
