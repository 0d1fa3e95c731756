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

import numpy as np
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
    skip: tuple = None       # (reason, message): no record to use here (a sample the source cache skipped)


@dataclass
class Example:
    """A parsed row. kind: 'chat' (messages), 'pair' (prompt/completion), 'text', or 'ids' (token ids the record
    carries: input_ids, and labels with -100 where a token is not trained; None: every token after the first)."""
    kind: str
    messages: list = None
    prompt: str = None
    completion: str = None
    text: str = None
    input_ids: list = None
    labels: list = None
    truncated: bool = False  # flagged cut short by the record itself (a cache's samples carry theirs; a chat's or
    #                          pair's last answer was cut by its writer's budget: its end of turn is not trained)
    # Privileged context (SPEC.md 4.5): the conversation, or the ids and labels, as the teacher sees them
    teacher_messages: list = None
    teacher_input_ids: list = None
    teacher_labels: list = None


IGNORE = -100     # labels[t] == IGNORE: token t is not trained (the Hugging Face convention)


def _int_list(data, key):
    """A non-empty list of int32 values (token ids, or a label's -100), else BadRow naming the first bad entry."""
    v = data.get(key)
    if not isinstance(v, list) or not v:
        raise BadRow(f"field {key!r} must be a non-empty list of integers")
    for t, x in enumerate(v):
        if not isinstance(x, int) or isinstance(x, bool):
            raise BadRow(f"{key}[{t}] must be an integer, got {type(x).__name__} {x!r}"[:200])
        if not -2**31 <= x < 2**31:
            raise BadRow(f"{key}[{t}] = {str(x)[:40]} is outside int32: no vocabulary holds such an id")
    return v


def parse_ids(data) -> Example:
    """{"input_ids": [...], "labels": [...]}: labels[t] is IGNORE or input_ids[t]; position t-1 is trained where it
    is not IGNORE (labels[0] is never a target: no position predicts it). Without labels, every token is.
    With "teacher_input_ids" and "teacher_labels" (both needed): the ids the teacher scores, under the same rule."""
    ids, labels = _ids_and_labels(data, "input_ids", "labels")
    ex = Example("ids", input_ids=ids, labels=labels, truncated=_truncated(data))
    if data.get("teacher_input_ids") is not None or data.get("teacher_labels") is not None:
        ex.teacher_input_ids, ex.teacher_labels = _ids_and_labels(data, "teacher_input_ids", "teacher_labels")
        if ex.teacher_labels is None:
            raise BadRow("field 'teacher_input_ids' needs 'teacher_labels' (-100 where the teacher's token is not a "
                         "trained one): they say which of its tokens are the student's trained tokens")
    return ex


def _truncated(data) -> bool:
    truncated = data.get("truncated", False)
    if not isinstance(truncated, bool):
        raise BadRow(f"field 'truncated' must be true or false, got {type(truncated).__name__}")
    return truncated


def _ids_and_labels(data, ids_key, labels_key):
    """(ids, labels or None) of a record's id fields, checked (see parse_ids)."""
    ids = _int_list(data, ids_key)
    if labels_key not in data or data[labels_key] is None:
        return ids, None
    labels = _int_list(data, labels_key)
    if len(labels) != len(ids):
        raise BadRow(f"{labels_key!r} has {len(labels)} entries and {ids_key!r} {len(ids)}: they must be as long")
    x, y = np.asarray(ids, dtype=np.int64), np.asarray(labels, dtype=np.int64)
    wrong = np.nonzero((y != IGNORE) & (y != x))[0]
    if len(wrong):
        t = int(wrong[0])
        raise BadRow(f"{labels_key}[{t}] = {labels[t]} but {ids_key}[{t}] = {ids[t]}: a label is the input id it "
                     f"trains, or {IGNORE} (kdcache trains the ids it is given, never others)")
    if (y[1:] == IGNORE).all():
        raise BadRow(f"every {'label' if labels_key == 'labels' else labels_key + ' entry'} after the first is "
                     "-100: nothing to distill")
    return ids, labels


def is_cache(path) -> bool:
    """A kdcache cache (a directory or URL with a manifest) given as a dataset: its ids, rescored."""
    if "://" in str(path):
        return True
    return os.path.isfile(os.path.join(path, "manifest.json"))


def iter_rows(path):
    """Yield Row for every record of the dataset at path, in a fixed order."""
    if is_cache(path):
        yield from iter_cache_rows(path)
        return
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


MAX_RECORD_INTS = 2**22   # KDCACHE_MAX_RECORD_INTS: integers a long line may hold (ids and labels of 2M tokens)


class TooManyInts(ValueError):
    """A record line holds more integers than KDCACHE_MAX_RECORD_INTS: stopped mid-parse, before its lists grow."""


def _loads(raw):
    """json.loads of one line. A long line's integers are counted as they are parsed, and the parse stops past
    KDCACHE_MAX_RECORD_INTS: a Python int costs 36 bytes where its JSON costs 5, so a 250 MB line of ids would
    take 3.6 GB to read whole, to keep the first --max-length of them. A line of B bytes holds at most B / 2
    integers ("1,"), so only lines longer than twice the cap are counted (counting costs 2.6x the parse)."""
    cap, n = int(env_size("KDCACHE_MAX_RECORD_INTS", MAX_RECORD_INTS)), [0]
    if len(raw) <= 2 * cap:
        return json.loads(raw.decode("utf-8"))

    def parse_int(text):
        n[0] += 1
        if n[0] > cap:
            raise TooManyInts(f"a record of more than {cap:,} integers (KDCACHE_MAX_RECORD_INTS): too long to read; "
                              "cut it to the tokens you train on (--max-length keeps only those)")
        return int(text)
    return json.loads(raw.decode("utf-8"), parse_int=parse_int)


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
                data = _loads(raw)
                error = None
            except TooManyInts as e:
                data, error = None, str(e)
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


def open_source_cache(path):
    """The cache at path, complete, or DataError."""
    from kdcache.cache_format import open_cache
    from kdcache.cache_format.errors import CacheError
    try:
        cache = open_cache(path)
    except (CacheError, OSError) as e:
        raise DataError(f"dataset {path}: a cache that cannot be read ({e}); a URL as --data must be a kdcache "
                        "cache") from None
    m = cache.manifest
    if not m["complete"]:
        raise DataError(f"dataset {path}: the cache is incomplete ({len(m['shards'])} of {m['num_shards_planned']} "
                        "shards); finish it (rerun its precompute) before rescoring it")
    return cache


def cache_records(cache) -> int:
    """The source's record count: its sample ids run below it (skipped records leave gaps)."""
    return max((int(s["sample_end"]) for s in cache.manifest["shards"]), default=0)


def iter_cache_rows(path):
    """A cache's samples as id records (their input ids, their trained positions as labels, their truncated flag,
    their teacher view where they have one),
    at their own sample ids; the records the source skipped come out as skips, so both caches line up id for id."""
    cache = open_source_cache(path)
    skip = ("source_skipped", "the source cache has no sample here (it skipped the record: see its "
                              "report/skipped.jsonl)")
    try:
        nxt = 0
        for rec in cache:
            sid = int(rec.sample_id)
            for i in range(nxt, sid):
                yield Row(i, f"{path} sample {i}", skip=skip)
            labels = np.full(len(rec.input_ids), IGNORE, dtype=np.int64)
            labels[rec.positions + 1] = rec.input_ids[rec.positions + 1]
            data = {"input_ids": rec.input_ids.tolist(), "labels": labels.tolist(), "truncated": bool(rec.truncated)}
            if rec.teacher_input_ids is not None:          # rescored under the teacher's view, as it was scored
                t_labels = np.full(len(rec.teacher_input_ids), IGNORE, dtype=np.int64)
                t_labels[rec.teacher_positions + 1] = rec.teacher_input_ids[rec.teacher_positions + 1]
                data.update(teacher_input_ids=rec.teacher_input_ids.tolist(), teacher_labels=t_labels.tolist())
            yield Row(sid, f"{path} sample {sid}", data)
            nxt = sid + 1
        for i in range(nxt, cache_records(cache)):
            yield Row(i, f"{path} sample {i}", skip=skip)
    finally:
        cache.close()              # a URL cache's local shard copies go with it


def _need_str(d, key, where_key=None, allow_empty=False):
    v = d.get(key)
    if not isinstance(v, str):
        raise BadRow(f"field {where_key or key!r} must be a string, got {type(v).__name__}")
    if not allow_empty and not v.strip():
        raise BadRow(f"field {where_key or key!r} is empty or whitespace only")
    return v


def _messages(data, key):
    """The chat under `key`, checked: a non-empty list of {role, content}, with at least one assistant turn."""
    msgs = data[key]
    if not isinstance(msgs, list) or not msgs:
        raise BadRow(f"field {key!r} must be a non-empty list")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise BadRow(f"{key}[{i}] must be an object, got {type(m).__name__}")
        role = m.get("role")
        if role not in ROLES:
            raise BadRow(f"{key}[{i}].role must be one of {list(ROLES)}, got {role!r}")
        content = _need_str(m, "content", f"{key}[{i}].content", allow_empty=role != "assistant")
        out.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in out):
        raise BadRow(f"{'chat' if key == 'messages' else key} has no assistant turn, so nothing to distill")
    return out


def parse_row(data) -> Example:
    """Check the record's shape and types; raise BadRow naming the field. Unknown fields are ignored.
    "truncated": true on a chat or pair: its last answer was cut short by its writer (a generation budget), so
    its end of turn, which the template writes, is not trained (kdcache onpolicy --cross-tokenizer writes these)."""
    if not isinstance(data, dict):
        raise BadRow(f"record must be a JSON object, got {type(data).__name__}")
    if "input_ids" in data:
        return parse_ids(data)
    if "messages" in data:
        ex = Example("chat", messages=_messages(data, "messages"), truncated=_truncated(data))
        if data.get("teacher_messages") is not None:
            ex.teacher_messages = _messages(data, "teacher_messages")
        return ex
    if data.get("teacher_messages") is not None:
        raise BadRow("field 'teacher_messages' needs 'messages' beside it (the conversation as the student sees it)")
    if "prompt" in data:
        key = "completion" if "completion" in data else "response" if "response" in data else None
        if key is None:
            raise BadRow("field 'prompt' needs a 'completion' (or 'response') field")
        return Example("pair", prompt=_need_str(data, "prompt", allow_empty=True), completion=_need_str(data, key),
                       truncated=_truncated(data))
    if "text" in data:
        return Example("text", text=_need_str(data, "text"))
    raise BadRow(f"record has none of the fields 'messages', 'prompt'+'completion', 'text', 'input_ids' "
                    f"(found: {sorted(data)[:8]})")
