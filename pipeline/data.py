"""Dataset readers and the record parser.

Sources: JSONL, Parquet, or a Hugging Face `datasets` directory saved with
`save_to_disk`. Each yields Row(index, where, data, error): index counts
records in file order (the cache's sample_id), `where` is "file:line" or
"file:row N" for messages. Bad records are never dropped here: they come out
with `error` set and the job counts, reports, or fails on them.
"""
import glob
import json
import os
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from kdcache.common.env import env_size
from kdcache.common.errors import BadRow, DataError

ROLES = ("system", "user", "assistant", "tool")



@dataclass
class Row:
    """One row of the dataset (a JSONL line, a Parquet or `datasets` row), before parsing. Not a cache Record."""
    index: int               # its place in the dataset's fixed order: the sample id of what it becomes
    where: str               # "FILE:LINE" or "FILE row N", for messages
    data: object = None      # the decoded JSON object (or table row as a dict)
    error: str = None        # why it could not be decoded (a bad row, counted under --on-bad-record)


@dataclass
class Example:
    """A parsed row. kind: 'chat' (messages), 'pair' (prompt/completion) or 'text'."""
    kind: str
    messages: list = None
    prompt: str = None
    completion: str = None
    text: str = None


def iter_rows(path):
    """Yield Row for every record of the dataset at path, in a fixed order."""
    if not os.path.exists(path):
        raise DataError(f"dataset {path} does not exist (hub dataset names need network access, "
                        "which this machine has not: save the dataset to disk and pass the directory)")
    if os.path.isdir(path):
        yield from _iter_hf_dir(path)
    elif path.endswith(".parquet"):
        yield from _iter_table_rows(path, _parquet_batches(path))
    elif path.endswith((".jsonl", ".json", ".ndjson")):
        yield from _iter_jsonl(path)
    else:
        raise DataError(f"dataset {path}: unknown format; use .jsonl, .parquet or a `datasets` save_to_disk directory")


MAX_LINE_BYTES = 256 * 2**20     # KDCACHE_MAX_RECORD_BYTES: a longer JSONL line is a bad record, never read whole


def jsonl_lines(f):
    """Yield each line of a binary file, or None for one longer than KDCACHE_MAX_RECORD_BYTES (skipped in
    bounded chunks: a 2 GB line costs no more memory than the limit)."""
    limit = env_size("KDCACHE_MAX_RECORD_BYTES", MAX_LINE_BYTES)
    while True:
        line = f.readline(limit + 1)
        if not line:
            return
        if len(line) <= limit:
            yield line
            continue
        while not line.endswith(b"\n"):            # the rest of the over-long line
            line = f.readline(2**20)
            if not line:
                break
        yield None


def _iter_jsonl(path):
    index = 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(jsonl_lines(f), start=1):
            where = f"{path}:{lineno}"
            if raw is None:
                yield Row(index, where, None, "a line longer than KDCACHE_MAX_RECORD_BYTES "
                          f"({env_size('KDCACHE_MAX_RECORD_BYTES', MAX_LINE_BYTES):,} bytes)")
                index += 1
                continue
            if not raw.strip():
                continue                      # blank lines are not records
            try:
                data = json.loads(raw.decode("utf-8"))
                error = None
            except UnicodeDecodeError as e:
                data, error = None, f"invalid UTF-8 at byte {e.start}"
            except json.JSONDecodeError as e:
                data, error = None, f"invalid JSON ({e.msg} at column {e.colno})"
            except RecursionError:
                data, error = None, "JSON nested too deeply to read"
            yield Row(index, where, data, error)
            index += 1


def _parquet_batches(path):
    try:
        yield from pq.ParquetFile(path).iter_batches(batch_size=1024)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: cannot be read as Parquet ({type(e).__name__}: {e})") from None


def _iter_table_rows(name, batches, start=0):
    index = start
    for batch in batches:
        for row in batch.to_pylist():
            yield Row(index, f"{name}:row {index - start}", row, None)
            index += 1


def _iter_hf_dir(path):
    state = os.path.join(path, "state.json")
    if os.path.isfile(state):
        with open(state) as f:
            files = [os.path.join(path, d["filename"]) for d in json.load(f)["_data_files"]]
    else:
        files = sorted(glob.glob(os.path.join(path, "*.arrow")))
    if not files:
        raise DataError(f"dataset directory {path} holds no state.json or .arrow files "
                         "(expected the output of datasets' save_to_disk)")
    index = 0
    for fname in files:
        with pa.memory_map(fname) as src:
            try:
                reader = pa.ipc.open_stream(src)
            except pa.ArrowInvalid:
                reader = pa.ipc.open_file(src)
                reader = (reader.get_batch(i) for i in range(reader.num_record_batches))
            for rec in _iter_table_rows(fname, reader, start=index):
                yield rec
                index = rec.index + 1


def _need_str(d, key, where_key=None, allow_empty=False):
    v = d.get(key)
    if not isinstance(v, str):
        raise BadRow(f"field {where_key or key!r} must be a string, got {type(v).__name__}")
    if not allow_empty and not v.strip():
        raise BadRow(f"field {where_key or key!r} is empty or whitespace only")
    return v


def parse_row(data) -> Example:
    """Check the record's shape and types; raise BadRow naming the field. Unknown fields are ignored."""
    if not isinstance(data, dict):
        raise BadRow(f"record must be a JSON object, got {type(data).__name__}")
    if "messages" in data:
        msgs = data["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise BadRow("field 'messages' must be a non-empty list")
        out = []
        for i, m in enumerate(msgs):
            if not isinstance(m, dict):
                raise BadRow(f"messages[{i}] must be an object, got {type(m).__name__}")
            role = m.get("role")
            if role not in ROLES:
                raise BadRow(f"messages[{i}].role must be one of {list(ROLES)}, got {role!r}")
            content = _need_str(m, "content", f"messages[{i}].content", allow_empty=role != "assistant")
            out.append({"role": role, "content": content})
        if not any(m["role"] == "assistant" for m in out):
            raise BadRow("chat has no assistant turn, so nothing to distill")
        return Example("chat", messages=out)
    if "prompt" in data:
        key = "completion" if "completion" in data else "response" if "response" in data else None
        if key is None:
            raise BadRow("field 'prompt' needs a 'completion' (or 'response') field")
        return Example("pair", prompt=_need_str(data, "prompt", allow_empty=True), completion=_need_str(data, key))
    if "text" in data:
        return Example("text", text=_need_str(data, "text"))
    raise BadRow(f"record has none of the fields 'messages', 'prompt'+'completion', 'text' "
                    f"(found: {sorted(data)[:8]})")
