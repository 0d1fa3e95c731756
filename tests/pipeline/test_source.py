"""A cache's source (SPEC.md 4.6, issue 46): precompute writes each sample's conversation and the teacher's
tokenizer files into a complete cache, checksummed in the manifest and checked by verify; `kdcache source` adds
them to a cache made before, refusing a dataset or tokenizer that is not the cache's own; a cache of id records
gets none, and asking it for one names the command."""
import json
import os
import shutil

import pytest
from transformers import AutoTokenizer

from kdcache.cache_format import open_cache, verify_cache
from kdcache.cache_format.errors import ShardError
from kdcache.cache_format.manifest import MANIFEST_NAME, load_manifest
from kdcache.cache_format.source import SOURCE_DIR, CacheSource, SourceMissing
from kdcache.cache_format.tokenizer_id import tokenizer_identity
from kdcache.pipeline.data import parse_row
from tests.helpers.cli import kdcache, precompute, write_jsonl


@pytest.fixture(scope="module")
def made(tiny, tmp_path_factory):
    """A chat cache of 3 shards, one record of it malformed (skipped), one pair record and a hinted one."""
    d = tmp_path_factory.mktemp("source")
    rows = [dict(r) for r in tiny["train"][:14]]
    rows[3] = {"messages": "not a list"}
    rows[5] = {"prompt": " one", "completion": "x"}
    rows[8] = dict(rows[8], teacher_messages=[{"role": "system", "content": "Hint: sql."}] + rows[8]["messages"])
    data = write_jsonl(d / "data.jsonl", rows)
    out = d / "cache"
    res = precompute("--teacher", tiny["teacher"], "--data", data, "--out", out, "--backend", "hf", "--top-k", 8,
                     "--shard-size", 5, "--on-bad-record", "skip", shared_ray=True)
    assert res.returncode == 0, res.stderr[-3000:]
    return {"data": data, "rows": rows, "cache": str(out), "log": res.stdout}


def test_precompute_writes_every_samples_conversation_and_the_tokenizer(made, tiny, tmp_path):
    m = load_manifest(made["cache"])
    assert m.source is not None and "source:" in made["log"] and "per position" in made["log"]
    src = CacheSource(made["cache"], m)
    with open_cache(made["cache"]) as cache:
        seen = []
        for j, info in enumerate(cache.shards):
            ids, chats = src.chats(info.index)
            assert ids.tolist() == cache.shard(j).sample_ids().tolist()
            for sid, chat in zip(ids, chats):
                ex = parse_row(made["rows"][sid])
                assert chat["kind"] == ex.kind
                if ex.kind == "chat":
                    assert chat["messages"] == ex.messages
                    assert chat.get("teacher_messages") == ex.teacher_messages
                else:
                    assert (chat["prompt"], chat["completion"]) == (ex.prompt, ex.completion)
            seen += ids.tolist()
    assert 3 not in seen and len(seen) == 13                     # the malformed record has no sample and no chat
    tok = AutoTokenizer.from_pretrained(src.save_tokenizer(str(tmp_path / "tok")))
    assert tokenizer_identity(tok) == m.meta["tokenizer"]
    assert tok.chat_template == tiny["tok"].chat_template
    assert verify_cache(made["cache"]).ok


def test_verify_and_readers_refuse_a_changed_source(made, tmp_path):
    cache = str(tmp_path / "cache")
    shutil.copytree(made["cache"], cache)
    chats = os.path.join(cache, SOURCE_DIR, "chats-00001.arrow")
    with open(chats, "r+b") as f:
        f.seek(os.path.getsize(chats) // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    rep = verify_cache(cache)
    assert any(where == "source/chats-00001.arrow" and "sha256" in why for where, why in rep.problems), rep.problems
    with pytest.raises(ShardError, match="chats-00001.arrow: sha256"):
        CacheSource(cache, load_manifest(cache)).chats(1)
    tok_file = os.path.join(cache, SOURCE_DIR, "tokenizer", "tokenizer.json")
    os.remove(tok_file)
    assert any("tokenizer.json" in where for where, _ in verify_cache(cache).problems)


def strip_source(cache):
    """The cache as an older kdcache wrote it: no source key, no source files."""
    path = os.path.join(cache, MANIFEST_NAME)
    doc = json.load(open(path))
    doc.pop("source")
    json.dump(doc, open(path, "w"))
    shutil.rmtree(os.path.join(cache, SOURCE_DIR))


def test_source_command_adds_what_precompute_writes_and_refuses_other_inputs(made, tiny, tmp_path):
    cache = str(tmp_path / "cache")
    shutil.copytree(made["cache"], cache)
    strip_source(cache)
    with pytest.raises(SourceMissing, match="kdcache source CACHE --data DATASET --tokenizer TEACHER"):
        CacheSource(cache, load_manifest(cache))
    other = write_jsonl(tmp_path / "other.jsonl", made["rows"][:-1])
    res = kdcache("source", cache, "--data", other, "--tokenizer", tiny["teacher"])
    assert res.returncode == 2 and "not the dataset" in res.stderr and "other.jsonl" in res.stderr, res.stderr
    tok_dir = str(tmp_path / "othertok")
    from kdcache.demo.tokenizer import train_tokenizer
    train_tokenizer(["some other text entirely", "with other merges"] * 20, tok_dir, vocab_size=300)
    res = kdcache("source", cache, "--data", made["data"], "--tokenizer", tok_dir)
    assert res.returncode == 2 and "not the one" in res.stderr, res.stderr
    assert load_manifest(cache).source is None
    res = kdcache("source", cache, "--data", made["data"], "--tokenizer", tiny["teacher"])
    assert res.returncode == 0, res.stderr
    got, want = load_manifest(cache).source, load_manifest(made["cache"]).source
    assert got == want                                      # the same files, byte for byte (their checksums)
    assert verify_cache(cache).ok


def test_a_cache_of_id_records_gets_no_source_and_says_what_adds_one(made, tiny, tmp_path):
    out = tmp_path / "rescored"
    res = precompute("--teacher", tiny["teacher"], "--data", made["cache"], "--out", out, "--backend", "hf",
                     "--top-k", 4, shared_ray=True)
    assert res.returncode == 0, res.stderr[-3000:]
    m = load_manifest(str(out))
    assert m.source is None
    with pytest.raises(SourceMissing, match="holds no source"):
        CacheSource(str(out), m)
