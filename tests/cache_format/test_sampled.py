"""Sampled caches (format 3, SPEC.md 4.4): written and read back by both storage formats with every log-prob
coding, checked by verify, refused where damaged, and readable by kdcache.collate / kdcache.kd_loss."""
import json

import numpy as np
import pytest
import torch

from kdcache.cache_format import Record, RecordError, Storage, open_cache, verify_cache, write_cache
from kdcache.cache_format.compact import sampled_rows
from kdcache.cache_format.errors import CacheError, ManifestError
from kdcache.cache_format.manifest import load_manifest
from kdcache.cache_format.record import check_record

V, EOS = 300, 2


def sampled_records(n, m, draws, seed=0):
    """Records as a sampled precompute writes them: for each position, the exact top-m of a random teacher
    distribution and `draws` draws from the rest. Returns (records, {sample_id: full log-probs [P, V]})."""
    rng = np.random.default_rng(seed)
    recs, full = [], {}
    for i in range(n):
        T = int(rng.integers(6, 40))
        ids = rng.integers(3, V, size=T).astype(np.int32)
        ids[-1] = EOS
        pos = np.arange(int(rng.integers(1, T - 1)), T - 1, dtype=np.int32)
        logits = rng.normal(size=(len(pos), V)) * 3
        lp = logits - np.logaddexp.reduce(logits, axis=1, keepdims=True)
        top = np.argsort(-lp, axis=1)[:, :m]
        rest = np.exp(lp)
        np.put_along_axis(rest, top, 0.0, axis=1)
        drawn = np.stack([rng.choice(V, draws, p=r / r.sum()) for r in rest])
        tid, tlp, counts = sampled_rows(top, np.take_along_axis(lp, top, 1), drawn, np.take_along_axis(lp, drawn, 1))
        target = lp[np.arange(len(pos)), ids[pos + 1]].astype(np.float32)
        recs.append(Record(i, ids, pos, tid, tlp, None, False, target, None, counts))
        full[i] = lp
    return recs, full


def entries(rec, r):
    return sorted((int(i), int(c)) for i, c in zip(rec.topk_ids[r], rec.sample_counts[r]) if i >= 0)


@pytest.mark.parametrize("backend", ["arrow", "zarr"])
@pytest.mark.parametrize("dtype", ["float16", "float32", "sqrt8"])
def test_a_sampled_cache_reads_back_its_ids_counts_and_log_probs(tmp_path, backend, dtype):
    recs, full = sampled_records(7, 3, 12)
    write_cache(tmp_path, recs, shard_size=3, storage=Storage(backend, 3, dtype, sample=12), vocab_size=V,
                eos_token_ids=[EOS], fingerprint_parts={"t": 1})
    m = json.loads((tmp_path / "manifest.json").read_text())
    assert m["format_version"] == 3 and m["sample"] == 12 and m["top_k"] == 3
    assert verify_cache(tmp_path).ok
    cache = open_cache(tmp_path)
    assert cache.sample == 12
    tol = {"float16": 2e-3, "float32": 1e-6, "sqrt8": None}[dtype]
    for a, b in zip(recs, cache):
        assert b.topk_ids.shape[1] == 15 and np.array_equal(b.input_ids, a.input_ids)
        for r in range(len(a.positions)):
            assert entries(a, r) == entries(b, r)                 # every distinct id with its count, exactly
            assert b.sample_counts[r].sum() == 12 and (b.sample_counts[r][b.topk_ids[r] >= 0] == 0).sum() == 3
            used = b.topk_ids[r] >= 0
            want = full[a.sample_id][r, b.topk_ids[r][used]]
            if tol is not None:                                   # each entry's own exact log-prob, any rank
                assert np.allclose(b.topk_logprobs[r][used], want, atol=tol * np.abs(want).max())
            else:                                                 # sqrt8: sqrt(p) within 1/510
                assert np.all(np.abs(np.exp(b.topk_logprobs[r][used] / 2) - np.exp(want / 2)) <= 1 / 510 + 1e-6)
        exact = np.exp(full[a.sample_id][np.arange(len(a.positions))[:, None], a.topk_ids[:, :3]]).sum(1)
        assert np.allclose(b.tail_mass, 1 - exact, atol=1e-5)   # the mass the draws came from


def test_a_top_k_cache_is_still_format_2_with_its_old_fingerprint_part():
    st = Storage("arrow", 8)
    assert "sample" not in st.fingerprint_part() and st.fingerprint_part()["version"] == 2
    assert Storage("arrow", 8, sample=4).fingerprint_part()["version"] == 3


def test_check_record_refuses_draws_that_do_not_add_up():
    recs, _ = sampled_records(1, 2, 8)
    rec = recs[0]
    check_record(rec, 10, V, sample=8)
    bad = rec.sample_counts.copy()
    bad[0, 2] += 1                                                # nine draws at the first position
    with pytest.raises(RecordError, match="sum to the 8 draws"):
        check_record(Record(**{**rec.__dict__, "sample_counts": bad}), 10, V, sample=8)
    fewer = rec.sample_counts.copy()
    fewer[0, int(np.flatnonzero(fewer[0] > 0)[0])] -= 1            # seven draws at the first position
    with pytest.raises(RecordError, match="sum to the 8 draws"):
        check_record(Record(**{**rec.__dict__, "sample_counts": fewer}), 10, V, sample=8)
    with pytest.raises(RecordError, match="sample_counts"):
        check_record(Record(**{**rec.__dict__, "sample_counts": None}), 10, V, sample=8)
    exact = rec.sample_counts.copy()
    exact[0, 0] = 1                                               # an exact entry counted as a draw
    exact[0, 2] -= 1 if exact[0, 2] > 1 else 0
    with pytest.raises(RecordError):
        check_record(Record(**{**rec.__dict__, "sample_counts": exact}), 10, V, sample=8)


def test_verify_finds_draws_that_do_not_add_up_in_a_re_signed_shard(tmp_path):
    """A shard changed after commit fails its checksum; one changed and re-signed (checksum and size put back
    into the manifest, as a buggy writer would) fails the record checks, naming the draws."""
    import zarr

    from kdcache.cache_format import hash_tree
    from kdcache.cache_format.verify import disk_bytes
    recs, _ = sampled_records(4, 0, 8)
    write_cache(tmp_path, recs, shard_size=4, storage=Storage("zarr", 0, sample=8), vocab_size=V,
                eos_token_ids=[EOS], fingerprint_parts={"t": 1})
    assert verify_cache(tmp_path).ok
    shard = next(p for p in (tmp_path / "shards").iterdir() if not p.name.startswith("."))
    arr = zarr.open_array(str(shard / "sample_counts"), mode="r+")
    data = arr[:]
    data[0] += 1
    arr[:] = data
    rep = verify_cache(tmp_path)
    assert not rep.ok and any("sha256" in why for _, why in rep.problems)
    path = tmp_path / "manifest.json"
    m = json.loads(path.read_text())
    m["shards"][0].update(sha256=hash_tree(str(shard), shard=True), bytes=disk_bytes(str(shard)))
    m["counts"]["bytes"] = m["shards"][0]["bytes"]
    path.write_text(json.dumps(m))
    rep = verify_cache(tmp_path)
    assert not rep.ok and any("sum to the 8 draws" in why for _, why in rep.problems), rep.problems


def test_manifest_versions_and_sample_go_together(tmp_path):
    recs, _ = sampled_records(2, 0, 4)
    write_cache(tmp_path, recs, shard_size=2, storage=Storage("arrow", 0, sample=4), vocab_size=V,
                eos_token_ids=[EOS], fingerprint_parts={"t": 1})
    path = tmp_path / "manifest.json"
    m = json.loads(path.read_text())
    for change, why in [({"sample": None}, "sample"), ({"sample": 0}, "sample"), ({"sample": 256}, "sample"),
                        ({"format_version": 2}, "format_version is 2"), ({"top_p": 0.9}, "top_p")]:
        path.write_text(json.dumps({k: v for k, v in {**m, **change}.items() if v is not None}))
        with pytest.raises(ManifestError, match=why):
            load_manifest(tmp_path)
    with pytest.raises(CacheError, match="top_p"):
        Storage("arrow", 4, sample=8, top_p=0.9)
    with pytest.raises(CacheError, match="255"):
        Storage("arrow", 4, sample=300)


def test_collate_and_kd_loss_train_on_a_sampled_cache(tmp_path):
    import kdcache
    recs, full = sampled_records(3, 2, 10, seed=4)
    write_cache(tmp_path, recs, shard_size=3, storage=Storage("arrow", 2, "float32", sample=10), vocab_size=V,
                eos_token_ids=[EOS], fingerprint_parts={"t": 1})
    records = list(open_cache(tmp_path))
    batch = kdcache.collate(records, pad_id=0, student_vocab=V)
    assert batch.topk_weights is not None and batch.topk_ids.shape[1] == 12          # no target column added
    assert torch.allclose(batch.topk_weights.double().sum(1), torch.ones(batch.n_positions, dtype=torch.float64),
                          atol=1e-5)
    # the teacher's own logits give a loss of 0; others give the estimator by hand
    teacher = torch.zeros(len(records), batch.input_ids.shape[1], V)
    for b, r in enumerate(records):
        teacher[b, r.positions] = torch.tensor(full[r.sample_id], dtype=torch.float32)
    assert abs(float(kdcache.kd_loss(teacher, batch))) < 1e-5
    other = torch.randn_like(teacher)
    s = torch.log_softmax(other[batch.batch_index, batch.positions], -1)
    ids = batch.topk_ids.clamp_min(0)
    by_hand = (batch.topk_weights * (batch.topk_logprobs.nan_to_num(neginf=0.0) - s.gather(1, ids))).sum(1).mean()
    assert torch.allclose(kdcache.kd_loss(other, batch), by_hand, atol=1e-5)
    with pytest.raises(Exception, match="beta"):
        kdcache.kd_loss(other, batch, beta=0.5)


def test_inspect_and_the_dataset_card_say_what_a_sampled_cache_holds(tmp_path, capsys):
    from kdcache.cache_format.card import write_card
    from kdcache.cache_format.cli import inspect_main
    recs, _ = sampled_records(3, 2, 6)
    write_cache(tmp_path, recs, shard_size=3, storage=Storage("arrow", 2, "sqrt8", sample=6), vocab_size=V,
                eos_token_ids=[EOS], fingerprint_parts={"t": 1})
    assert inspect_main([str(tmp_path)]) in (0, None)
    out = capsys.readouterr().out
    assert "format 3" in out and "6 draws per position" in out and "sample_counts" in out
    card = open(write_card(str(tmp_path))).read()
    assert "top-2 + 6-draw sampled" in card and "6 draws from the rest of its next-token distribution" in card
