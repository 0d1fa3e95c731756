"""A cache's source (SPEC.md 4.6): the dataset's conversations and the teacher's tokenizer files, written into the
cache so that cross-tokenizer training needs nothing else. precompute attaches it once a cache is complete;
`kdcache source CACHE --data DATA --tokenizer TEACHER` attaches it to a cache made before, checking that the
dataset and the tokenizer are the ones its fingerprint records (nothing is rescored)."""
import argparse
import os
import tempfile

from kdcache.cache_format.errors import CacheError
from kdcache.cache_format.fingerprint import hash_json
from kdcache.cache_format.manifest import load_manifest
from kdcache.cache_format.reader import open_cache
from kdcache.cache_format.source import source_entry, write_chats, write_tokenizer
from kdcache.cache_format.tokenizer_id import tokenizer_identity
from kdcache.cache_format.writer import reopen
from kdcache.common.errors import BadRow, ConfigError, DataError

from .data import iter_rows, parse_row

# Besides what the tokenizer saves: config.json tells transformers which tokenizer class to build
# (transformers 5 picks it by the model type), so the stored files load as the teacher's did.
MODEL_FILES = ("config.json",)


def chat_of(ex) -> dict | None:
    """The chat object of a parsed record (SPEC.md 4.6); None for id records, which hold no text."""
    if ex.kind == "chat":
        out = {"kind": "chat", "messages": ex.messages}
        if ex.teacher_messages:
            out["teacher_messages"] = ex.teacher_messages
    elif ex.kind == "pair":
        out = {"kind": "pair", "prompt": ex.prompt, "completion": ex.completion}
    if ex.kind in ("chat", "pair"):
        if ex.truncated:
            out["truncated"] = True
        return out
    if ex.kind == "text":
        return {"kind": "text", "text": ex.text}
    return None


def tokenizer_files(tok, model_dir=None) -> dict:
    """{name: bytes}: what tok.save_pretrained writes, plus the model's config.json where there is one."""
    with tempfile.TemporaryDirectory(prefix="kdcache-tok-") as d:
        tok.save_pretrained(d)
        out = {n: open(os.path.join(d, n), "rb").read() for n in sorted(os.listdir(d))
               if os.path.isfile(os.path.join(d, n))}
    for name in MODEL_FILES:
        path = os.path.join(model_dir, name) if model_dir and os.path.isdir(model_dir) else None
        if path and os.path.isfile(path):
            out[name] = open(path, "rb").read()
    return out


def attach(writer, data, tok, model_dir=None) -> dict:
    """Write the source of the open writer's complete cache from its dataset `data` and teacher tokenizer `tok`
    (the caller has checked they are the cache's own). Returns figures: samples, bytes, bytes per position."""
    m = writer.manifest
    if not m.complete:
        raise CacheError(f"{writer.directory}: the cache is incomplete ({len(m.shards)} of {m.num_shards_planned} "
                         "shards); its source is written once every shard is committed")
    cache = open_cache(writer.directory, check_values=False)
    chats, no_text = [], 0
    try:
        rows = iter_rows(data)
        row = next(rows, None)
        for j, info in enumerate(cache.shards):
            ids = cache.shard(j).sample_ids()
            got = []
            for sid in ids:
                while row is not None and row.index < sid:
                    row = next(rows, None)
                if row is None or row.index != sid or row.data is None:
                    raise DataError(f"dataset {data}: record {int(sid)}, which the cache's shard {info.index} holds, "
                                    "is missing or unreadable: this is not the dataset the cache was made from")
                try:
                    chat = chat_of(parse_row(row.data))
                except BadRow as e:
                    raise DataError(f"{row.where}: {e}; the cache holds a sample of it, so this is not the dataset "
                                    "the cache was made from") from None
                if chat is None:
                    no_text += 1
                got.append(chat)
            if no_text:
                raise DataError(f"dataset {data}: record(s) of token ids (the first: shard {info.index}) hold no text, "
                                "so the cache can have no source: cross-tokenizer training needs text records "
                                "(messages, prompt/completion or text)")
            chats.append(write_chats(writer.directory, info.index, ids, got))
    finally:
        cache.close()
    files = write_tokenizer(writer.directory, tokenizer_files(tok, model_dir))
    writer.set_source(source_entry(files, chats))
    size = sum(c["bytes"] for c in chats)
    return {"samples": sum(c["num_samples"] for c in chats), "bytes": size, "tokenizer_files": len(files),
            "bytes_per_position": size / max(m.counts["positions"], 1),
            "share_of_shards": size / max(m.counts["bytes"], 1)}


def describe(figures) -> str:
    return (f"source: {figures['samples']} conversations, {figures['bytes']:,} bytes "
            f"({figures['bytes_per_position']:.1f} per position, {100 * figures['share_of_shards']:.1f}% of the "
            f"shards), {figures['tokenizer_files']} tokenizer files")


def check_inputs(cache_dir, data, tok):
    """ConfigError unless `data` and `tok` are the dataset and tokenizer the cache's fingerprint records."""
    from .settle import data_part
    parts = load_manifest(cache_dir).fingerprint_parts
    if "data" in parts and data_part(data) != parts["data"]:
        raise ConfigError(f"{data} is not the dataset {cache_dir} was made from: its content hash differs from the "
                          "one the cache's fingerprint records (fingerprint_parts.data)")
    if "tokenizer" in parts and hash_json(tokenizer_identity(tok)) != parts["tokenizer"]:
        raise ConfigError(f"this tokenizer is not the one {cache_dir} was made with: its identity (vocabulary, "
                          "merges, specials) differs from the one the cache's fingerprint records")


def main(argv=None):
    ap = argparse.ArgumentParser(prog="kdcache source", description="Attach a cache's source (its conversations "
                                 "and the teacher's tokenizer, SPEC.md 4.6) without rescoring anything.")
    ap.add_argument("cache", help="a complete cache directory")
    ap.add_argument("--data", required=True, help="the dataset the cache was made from")
    ap.add_argument("--tokenizer", required=True, help="the teacher (or its tokenizer) the cache was made with")
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    check_inputs(args.cache, args.data, tok)
    with reopen(args.cache) as writer:
        if writer.manifest.source is not None:
            print(f"{args.cache}: already holds its source; written again")
        figures = attach(writer, args.data, tok, args.tokenizer)
    print(f"{args.cache}: {describe(figures)}")
    return 0
