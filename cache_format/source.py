"""A cache's source (SPEC.md 4.6): the teacher's tokenizer files and each sample's conversation as text.

With them a cache is self-contained: a trainer whose tokenizer differs from the teacher's (cross-tokenizer
distillation) re-renders what the teacher scored from the cache alone, with no teacher model, dataset or network.
Files under `source/`, listed with their checksums in the manifest's `source` key:
  source/tokenizer/NAME        the teacher's tokenizer files (tokenizer.json, tokenizer_config.json, ...)
  source/chats-JJJJJ.arrow     per committed shard j: an Arrow IPC file of its samples' conversations, in the
                               shard's order (columns sample_id int64, chat utf8: a JSON object, SPEC.md 4.6)
"""
import hashlib
import json
import os

import numpy as np
import pyarrow as pa

from .errors import CacheError, ManifestError, ShardError
from .location import as_location

SOURCE_DIR = "source"
TOKENIZER_DIR = f"{SOURCE_DIR}/tokenizer"
VERSION = 1
KINDS = ("chat", "pair", "text")            # what a chat object's "kind" may be
ROLES = ("system", "user", "assistant", "tool")


class SourceMissing(CacheError):
    """The cache holds no source (or not for every shard): cross-tokenizer training cannot use it."""


def chats_name(index: int) -> str:
    return f"{SOURCE_DIR}/chats-{index:05d}.arrow"


def check_chat(chat, where) -> dict:
    """A chat object (SPEC.md 4.6), checked: kind "chat" with messages (and maybe teacher_messages) of
    {role, content}, "pair" with prompt and completion, or "text" with text. ShardError naming `where`."""
    def bad(what):
        raise ShardError(f"{where}: {what}")

    if not isinstance(chat, dict) or chat.get("kind") not in KINDS:
        bad(f"a chat must be an object whose kind is one of {list(KINDS)}, found {str(chat)[:80]!r}")
    need = {"chat": ("messages",), "pair": ("prompt", "completion"), "text": ("text",)}[chat["kind"]]
    for key in need:
        if key not in chat:
            bad(f"a {chat['kind']!r} chat needs {key!r}")
    for key in ("messages", "teacher_messages"):
        if key in chat and not (isinstance(chat[key], list) and chat[key] and all(
                isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)
                for m in chat[key])):
            bad(f"{key} must be a non-empty list of {{role, content}} with a role in {list(ROLES)}")
    if "truncated" in chat and (chat["kind"] == "text" or not isinstance(chat["truncated"], bool)):
        bad("truncated must be true or false, on a chat or pair only")
    for key in ("prompt", "completion", "text"):
        if key in chat and not isinstance(chat[key], str):
            bad(f"{key} must be a string")
    return chat


def chats_bytes(sample_ids, chats) -> bytes:
    """The Arrow IPC file of one shard's conversations (rows in the shard's sample order)."""
    table = pa.table({"sample_id": pa.array(np.asarray(sample_ids, np.int64), pa.int64()),
                      "chat": pa.array([json.dumps(c, ensure_ascii=False, sort_keys=True) for c in chats],
                                       pa.string())})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema, options=pa.ipc.IpcWriteOptions(compression="zstd")) as w:
        w.write_table(table)
    return sink.getvalue().to_pybytes()


def write_tokenizer(where, files: dict) -> dict:
    """Write the tokenizer files {name: bytes} under source/tokenizer/; returns {name: sha256}."""
    loc = as_location(where)
    out = {}
    for name, data in sorted(files.items()):
        _check_name(name, loc)
        loc.write_bytes(f"{TOKENIZER_DIR}/{name}", data)
        out[name] = hashlib.sha256(data).hexdigest()
    return out


def write_chats(where, index, sample_ids, chats) -> dict:
    """Write shard `index`'s conversations; returns its entry in the manifest's source.chats."""
    for sid, c in zip(sample_ids, chats):
        check_chat(c, f"sample {int(sid)}")
    data = chats_bytes(sample_ids, chats)
    rel = chats_name(index)
    as_location(where).write_bytes(rel, data)
    return {"index": int(index), "path": rel, "num_samples": len(chats), "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest()}


def source_entry(tokenizer: dict, chats: list) -> dict:
    return {"version": VERSION, "tokenizer": {"files": dict(sorted(tokenizer.items()))},
            "chats": sorted(chats, key=lambda c: c["index"])}


def _check_name(name, where):
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or name.startswith("."):
        raise ManifestError(f"{as_location(where).path('manifest.json')}: source tokenizer file name {name!r} must "
                            "be a plain file name (no '/', '\\', leading '.')")


def validate_source(src, planned, bad):
    """The manifest's `source` value, checked (validate_manifest calls this; `bad` raises)."""
    if not isinstance(src, dict) or src.get("version") != VERSION:
        bad(f"source must be an object of version {VERSION}, found {str(src)[:80]!r}")
    files = (src.get("tokenizer") or {}).get("files") if isinstance(src.get("tokenizer"), dict) else None
    if not isinstance(files, dict) or not files or not all(
            isinstance(n, str) and n and "/" not in n and "\\" not in n and not n.startswith(".")
            and isinstance(h, str) and len(h) == 64 and all(c in "0123456789abcdef" for c in h)
            for n, h in files.items()):
        bad("source.tokenizer.files must be a non-empty object of plain file names to sha256 hex digests")
    chats = src.get("chats")
    if not isinstance(chats, list):
        bad("source.chats must be a list")
    seen = set()
    for c in chats:
        ok = isinstance(c, dict) and all(isinstance(c.get(k), int) and not isinstance(c.get(k), bool)
                                         and c[k] >= 0 for k in ("index", "num_samples", "bytes"))
        if not ok or c["index"] >= planned or c["index"] in seen or c.get("path") != chats_name(c["index"]) \
                or not (isinstance(c.get("sha256"), str) and len(c["sha256"]) == 64):
            bad(f"source.chats entry {str(c)[:80]!r} must be {{index < {planned} (once), path "
                "source/chats-JJJJJ.arrow of that index, num_samples, bytes, sha256}}")
        seen.add(c["index"])


class CacheSource:
    """The source of a cache, checked against its manifest: tokenizer_files() and chats(index)."""

    def __init__(self, where, manifest):
        self.location, self.manifest = as_location(where), manifest
        src = manifest.source
        if src is None:
            raise SourceMissing(f"{self.location.url} holds no source (the conversations as text and the teacher's "
                                f"tokenizer, SPEC.md 4.6); add it with: {ADD_COMMAND}")
        self.files = src["tokenizer"]["files"]
        self.entries = {c["index"]: c for c in src["chats"]}
        lacking = [s.index for s in manifest.shards if s.index not in self.entries]
        if lacking:
            raise SourceMissing(f"{self.location.url}: shard(s) {lacking[:8]} have no conversations in the source "
                                f"(written before they were committed); add them with: {ADD_COMMAND}")

    def _read(self, rel, sha, what):
        try:
            data = self.location.read_bytes(rel)
        except FileNotFoundError:
            raise ShardError(f"{self.location.path(rel)}: {what} listed in the manifest is missing") from None
        if hashlib.sha256(data).hexdigest() != sha:
            raise ShardError(f"{self.location.path(rel)}: sha256 checksum mismatch ({what} changed after it was "
                             "written)")
        return data

    def tokenizer_files(self) -> dict:
        """{name: bytes}, each checked against its checksum."""
        return {n: self._read(f"{TOKENIZER_DIR}/{n}", h, "a tokenizer file") for n, h in self.files.items()}

    def save_tokenizer(self, directory) -> str:
        """Write the checked tokenizer files into `directory` (for AutoTokenizer.from_pretrained); returns it."""
        os.makedirs(directory, exist_ok=True)
        for name, data in self.tokenizer_files().items():
            with open(os.path.join(directory, name), "wb") as f:
                f.write(data)
        return directory

    def chats(self, index) -> tuple:
        """(sample_ids int64 [n], [chat dict]) of committed shard `index`, checked."""
        e = self.entries.get(index)
        if e is None:
            raise SourceMissing(f"{self.location.url}: shard {index} has no conversations in the source")
        rel = e["path"]
        data = self._read(rel, e["sha256"], f"shard {index}'s conversations")
        try:
            table = pa.ipc.open_file(pa.py_buffer(data)).read_all()
            ids = np.asarray(table.column("sample_id").to_pylist(), np.int64)
            texts = table.column("chat").to_pylist()
        except (pa.ArrowInvalid, KeyError) as e2:
            raise ShardError(f"{self.location.path(rel)}: not an Arrow file of sample_id and chat ({e2})") from None
        if len(ids) != e["num_samples"]:
            raise ShardError(f"{self.location.path(rel)}: {len(ids)} rows, the manifest lists {e['num_samples']}")
        out = []
        for sid, text in zip(ids, texts):
            where = f"{self.location.path(rel)} (sample {int(sid)})"
            try:
                out.append(check_chat(json.loads(text), where))
            except (TypeError, json.JSONDecodeError) as e2:
                raise ShardError(f"{where}: chat is not JSON ({e2})") from None
        return ids, out


ADD_COMMAND = ("kdcache source CACHE --data DATASET --tokenizer TEACHER (the dataset and the teacher's tokenizer "
               "the cache was made from; nothing is rescored), or rerun the cache's own kdcache precompute command")
