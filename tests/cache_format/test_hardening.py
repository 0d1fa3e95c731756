"""Fixes from an outside review: links in shards, manifest temp files, job-tagged local shard names,
stores that ignore conditional puts, and tokenizer identities that miss merges and normalizers."""
import json
import os
import re
import shutil

import numpy as np
import pytest

from kdcache.cache_format import (
    CacheError,
    CacheWriter,
    ShardError,
    hash_json,
    hash_tree,
    open_cache,
    verify_cache,
    write_cache,
    write_shard_file,
)
from kdcache.cache_format.location import Location
from tests.helpers.records import make_records, shard_kwargs, writer_kwargs


def _manifest(d):
    return json.loads((d / "manifest.json").read_text())


# -- 1. symbolic links inside Zarr shard directories ------------------------------------------------

def _link_inside_zarr_shard(tmp_path, what):
    """A sound Zarr cache, then one entry of shard 0 replaced by a link to an identical copy outside it
    (so a reader that follows the link even gets the right bytes). Returns (cache, shard path, entry)."""
    d = tmp_path / "c"
    write_cache(d, make_records(20, seed=7), shard_size=10, **writer_kwargs("zarr"))
    rel = _manifest(d)["shards"][0]["path"]
    shard = d / rel
    entry = "input_ids/c/0" if what == "chunk file" else "input_ids"
    outside = tmp_path / "outside" / entry.replace("/", "_")
    outside.parent.mkdir()
    (shutil.copytree if what == "array directory" else shutil.copy2)(shard / entry, outside)
    (shutil.rmtree if what == "array directory" else os.remove)(shard / entry)
    os.symlink(outside, shard / entry)
    return d, rel, entry


@pytest.mark.parametrize("what", ["chunk file", "array directory"])
def test_a_link_inside_a_zarr_shard_is_refused_by_reader_checksum_and_verify(tmp_path, what):
    d, rel, entry = _link_inside_zarr_shard(tmp_path, what)
    cache = open_cache(d)
    with pytest.raises(ShardError, match=rf"{re.escape(rel)}: shard entry '{entry}' is a symbolic link"):
        cache[0]
    with pytest.raises(ShardError, match=rf"'{entry}' is a symbolic link"):
        cache.checked_path(0)
    assert cache[15].sample_id == 15                                   # the sound shard still reads
    rep = verify_cache(d)
    assert [w for w, _ in rep.problems] == [rel]
    assert f"'{entry}' is a symbolic link" in rep.problems[0][1]


def test_model_directories_may_still_hold_links(tmp_path):
    """hash_tree fingerprints model and dataset directories too, where links are normal (HF cache snapshots)."""
    (tmp_path / "blobs").mkdir()
    (tmp_path / "blobs" / "abc").write_bytes(b"weights")
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "model.safetensors").write_bytes(b"weights")
    (tmp_path / "snapshot").mkdir()
    os.symlink(tmp_path / "blobs" / "abc", tmp_path / "snapshot" / "model.safetensors")
    assert hash_tree(tmp_path / "snapshot") == hash_tree(tmp_path / "plain")
    with pytest.raises(ShardError, match="symbolic link"):
        hash_tree(tmp_path / "snapshot", shard=True)


# -- 2. the manifest's temp files ----------------------------------------------------------------------

def test_a_reopened_writer_sweeps_manifest_temp_files_of_killed_writers(tmp_path):
    d = tmp_path / "c"
    write_cache(d, make_records(8, seed=2), shard_size=4, **writer_kwargs("arrow"))
    stale = d / ".manifest.json.tmp-4242-deadbeef"          # atomic_write_bytes killed before its rename
    stale.write_bytes(b'{"half": ')
    keep = d / ".last_used.json"                            # other dot-files are not the writer's to remove
    keep.write_text('{"time": 1}')
    CacheWriter(d, num_shards_planned=2, **writer_kwargs("arrow")).open().close()
    assert not stale.exists() and keep.exists() and len(open_cache(d)) == 8


# -- 3. job-tagged local shard names -------------------------------------------------------------------

def test_local_shards_carry_their_writers_tag(tmp_path):
    a = CacheWriter(tmp_path / "a", num_shards_planned=1, **writer_kwargs("arrow"))
    b = CacheWriter(tmp_path / "b", num_shards_planned=1, **writer_kwargs("arrow"))
    assert re.fullmatch(r"[0-9a-f]{8}", a.shard_tag) and a.shard_tag != b.shard_tag
    with a:
        info = a.write_shard(0, make_records(4), sample_start=0, sample_end=4)
    assert info.path == f"shards/shard-00000-{a.shard_tag}.arrow"
    assert os.path.isfile(tmp_path / "a" / info.path)


@pytest.mark.parametrize("backend", ["arrow", "zarr"])
def test_a_stale_worker_of_an_old_job_cannot_replace_a_committed_shard(tmp_path, backend):
    """Job 1 hands shard 1 to a worker and dies; job 2 writes and commits shard 1; then job 1's worker,
    which never learnt its job was gone (flock is advisory, and per client on NFS), finishes shard 1."""
    d, recs, other = tmp_path / "c", make_records(8, seed=3), make_records(8, seed=4)
    kw = shard_kwargs(backend)
    with CacheWriter(d, shard_size=4, num_records=8, **writer_kwargs(backend)) as job1:
        job1.write_shard(0, recs[:4], sample_start=0, sample_end=4)
    with CacheWriter(d, shard_size=4, num_records=8, **writer_kwargs(backend)) as job2:
        job2.write_shard(1, recs[4:], sample_start=4, sample_end=8)
    late = write_shard_file(d, 1, other[4:], sample_start=4, sample_end=8, tag=job1.shard_tag, **kw)
    rep = verify_cache(d)
    assert rep.ok, rep.problems                                    # the committed shard is untouched
    assert np.array_equal(open_cache(d)[5].input_ids, recs[5].input_ids)
    assert late.entry.path != _manifest(d)["shards"][1]["path"]


def test_a_reopened_writer_sweeps_uncommitted_local_shards(tmp_path):
    d, recs = tmp_path / "c", make_records(8, seed=5)
    kw = dict(**shard_kwargs("arrow"), sample_start=4, sample_end=8)
    with CacheWriter(d, shard_size=4, num_records=8, **writer_kwargs("arrow")) as w:
        w.write_shard(0, recs[:4], sample_start=0, sample_end=4)
    orphans = [write_shard_file(d, 1, recs[4:], tag="0badc0de", **kw).entry.path,   # a killed job's shard
               write_shard_file(d, 1, recs[4:], **kw).entry.path]                  # an old, untagged one
    committed = _manifest(d)["shards"][0]["path"]
    CacheWriter(d, shard_size=4, num_records=8, **writer_kwargs("arrow")).open().close()
    assert os.listdir(d / "shards") == [committed.split("/")[1]]
    assert all(not (d / p).exists() for p in orphans) and verify_cache(d).ok


# -- 4. stores that drop the conditions of conditional puts ------------------------------------------

def _drop_conditions(monkeypatch):
    """What s3fs does with a botocore too old to know IfNoneMatch / IfMatch: drop them, silently."""
    import s3fs
    real = s3fs.S3FileSystem._get_s3_method_kwargs

    def without(self, method, *akw, **kw):
        out = real(self, method, *akw, **kw)
        for key in ("IfNoneMatch", "IfMatch"):
            out.pop(key, None)
        return out

    monkeypatch.setattr(s3fs.S3FileSystem, "_get_s3_method_kwargs", without)


def test_a_writer_refuses_a_store_that_ignores_conditional_writes(bucket, monkeypatch):
    url = f"{bucket}/caches/c"
    _drop_conditions(monkeypatch)
    w = CacheWriter(url, num_shards_planned=1, **writer_kwargs("arrow"))
    with pytest.raises(CacheError, match=rf"{re.escape(url)}: .*If-None-Match and If-Match.*upgrade s3fs and botocore"):
        w.open()
    assert Location(url).list() == []                         # no lock taken, no manifest, no probe left


def test_a_store_that_honours_conditional_writes_is_probed_and_used(bucket):
    url = f"{bucket}/caches/c"
    m = write_cache(url, make_records(8, seed=6), shard_size=4, **writer_kwargs("arrow"))
    assert m["complete"] and verify_cache(url).ok
    assert not [n for n in Location(url).list() if n.startswith(".kdcache-probe")]


def test_memory_urls_are_not_probed(monkeypatch):
    """memory:// has no conditional puts: it keeps its read-then-write checks, and nothing is probed."""
    calls = []
    monkeypatch.setattr(Location, "write_bytes", _counting(Location.write_bytes, calls))
    write_cache("memory://kd-hardening/c", make_records(4), shard_size=4, **writer_kwargs("arrow"))
    assert calls and not [rel for rel in calls if "probe" in rel]


def _counting(real, calls):
    def wrapped(self, rel, *a, **kw):
        calls.append(rel)
        return real(self, rel, *a, **kw)
    return wrapped


# -- 5. tokenizer identity covers merges and normalizer ----------------------------------------------

def _bpe(merges):
    """A fast tokenizer over the vocabulary {a, b, c, ab, bc} with these merges."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<unk>": 0, "a": 1, "b": 2, "c": 3, "ab": 4, "bc": 5}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def test_the_same_vocabulary_with_other_merges_is_another_tokenizer():
    from kdcache.cache_format.tokenizer_id import diff_identity, tokenizer_identity
    one, two = _bpe([("a", "b"), ("b", "c")]), _bpe([("b", "c"), ("a", "b")])
    assert one("abc")["input_ids"] != two("abc")["input_ids"]            # the same text, other ids
    a, b = tokenizer_identity(one), tokenizer_identity(two)
    assert a["vocab_sha256"] == b["vocab_sha256"]
    assert a["tokenizer_json_sha256"] != b["tokenizer_json_sha256"] and hash_json(a) != hash_json(b)
    assert any("other merges, normalizer" in d for d in diff_identity(a, b))


def test_the_same_vocabulary_with_another_normalizer_is_another_tokenizer(tmp_path):
    import copy

    from tokenizers import normalizers

    from kdcache.cache_format.tokenizer_id import diff_identity, tokenizer_identity
    from kdcache.demo.tokenizer import train_tokenizer
    tok = train_tokenizer(["Hello World, a Test of Tokens."] * 30, str(tmp_path / "t"), vocab_size=300)
    lower = copy.deepcopy(tok)
    lower.backend_tokenizer.normalizer = normalizers.Lowercase()
    a, b = tokenizer_identity(tok), tokenizer_identity(lower)
    assert a["vocab_sha256"] == b["vocab_sha256"] and hash_json(a) != hash_json(b)
    assert diff_identity(a, b) and not diff_identity(a, tokenizer_identity(copy.deepcopy(tok)))
    tok("Hello World", truncation=True, max_length=2)      # leaves truncation set on the backend tokenizer
    assert tokenizer_identity(tok) == a                    # call-time settings are not part of the identity
    old = {k: v for k, v in a.items() if k != "tokenizer_json_sha256"}      # a manifest from before the key
    assert diff_identity(old, b) == [] and diff_identity(b, old) == []


def test_an_arrow_batch_past_int32_offsets_is_refused_not_wrapped(monkeypatch, tmp_path):
    """Arrow list offsets are int32: past 2^31 values they would wrap silently (issue 23, item 14). The limit is
    lowered here so that a small shard reaches it."""
    from kdcache.cache_format import arrow_format
    monkeypatch.setattr(arrow_format, "INT32_MAX", 100)
    with pytest.raises(ShardError, match=r"more than an Arrow list column's int32 offsets.*--format zarr"):
        write_cache(tmp_path / "c", make_records(20, seed=1), shard_size=20, **writer_kwargs("arrow"))
    write_cache(tmp_path / "z", make_records(20, seed=1), shard_size=20, **writer_kwargs("zarr"))   # zarr: fine
