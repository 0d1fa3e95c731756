"""`kdcache inspect --card` writes a dataset card whose loading snippets run as written; `kdcache ls` links it."""
import json
import re

from kdcache.cache_format import write_cache
from tests.helpers.cli import kdcache
from tests.helpers.records import make_records, writer_kwargs


def test_the_card_says_what_the_cache_holds_and_its_snippets_load_it(tmp_path, monkeypatch, capsys):
    recs = make_records(30, seed=11)
    meta = {"teacher": "qwen-tiny", "dataset": "chats.jsonl", "records": 30, "skipped": {},
            "tokenizer": {"vocab_size": 300, "vocab_sha256": "ab" * 32}}
    cache = tmp_path / "cache"
    m = write_cache(cache, recs, shard_size=12, **writer_kwargs("arrow", meta=meta))
    res = kdcache("inspect", cache, "--card")
    assert res.returncode == 0, res.stderr
    card = (cache / "README.md").read_text()
    for text in ("qwen-tiny", "chats.jsonl", "| top-k | 8 |", f"| samples | {len(recs)} |", m["fingerprint"],
                 "float16", "arrow shards, codec zstd", "kdcache.open_cache"):
        assert text in card, text
    assert card.startswith("---\ntags:") and all(f"  - {s['path']}" in card for s in m["shards"])
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf"))
    env = {}
    for code in re.findall(r"```python\n(.*?)```", card, flags=re.S):
        exec(compile(code, "README.md", "exec"), env)
    assert len(env["cache"]) == len(env["ds"]) == 30 and env["record"].sample_id == 0
    assert "(30," in capsys.readouterr().out                                  # the DuckDB count


def test_ls_links_the_card(tmp_path):
    from kdcache.cache_format.store import cache_name, init_store
    init_store(str(tmp_path))
    name = cache_name("tiny", "0123456789abcdef" * 4)
    write_cache(tmp_path / name, make_records(5), shard_size=5, **writer_kwargs("arrow"))
    before = json.loads(kdcache("ls", tmp_path, "--json").stdout)
    assert before["card"] is None
    kdcache("inspect", tmp_path / name, "--card")
    after = json.loads(kdcache("ls", tmp_path, "--json").stdout)
    assert after["card"].endswith(f"{name}/README.md")
    assert f"{name}/README.md" in kdcache("ls", tmp_path).stdout
