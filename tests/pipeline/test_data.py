import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kdcache.pipeline.data import BadRow, DataError, iter_rows, parse_row
from tests.helpers.cli import write_jsonl

CHAT = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}


@pytest.mark.parametrize("data,msg", [
    ([1, 2], "must be a JSON object"),
    ({"foo": 1}, "none of the fields"),
    ({"messages": []}, "non-empty list"),
    ({"messages": [{"role": "user", "content": "q"}]}, "no assistant turn"),
    ({"messages": [{"role": "wizard", "content": "q"}, {"role": "assistant", "content": "a"}]}, "role must be"),
    ({"messages": [{"content": "q"}, {"role": "assistant", "content": "a"}]}, "role must be"),
    ({"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "a"}]}, "must be a string"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "  \n"}]}, "whitespace"),
    ({"messages": ["hi"]}, r"messages\[0\] must be an object"),
    ({"prompt": "p"}, "needs a 'completion'"),
    ({"prompt": "p", "completion": ""}, "empty"),
    ({"prompt": 3, "completion": "c"}, "'prompt' must be a string"),
    ({"text": None}, "'text' must be a string"),
])
def test_bad_records_name_the_field(data, msg):
    with pytest.raises(BadRow, match=msg):
        parse_row(data)


def test_good_shapes_and_unknown_fields_ignored():
    assert parse_row({**CHAT, "id": 7}).kind == "chat"
    assert parse_row({"prompt": "", "response": "r"}).completion == "r"
    assert parse_row({"text": "t", "meta": {}}).kind == "text"


def test_jsonl_reports_file_and_line_and_keeps_indices(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [json.dumps(CHAT), "", "{not json", json.dumps(CHAT)])
    with open(path, "ab") as f:
        f.write(b'{"text": "caf\xe9"}\n')            # invalid UTF-8
    recs = list(iter_rows(path))
    assert [r.index for r in recs] == [0, 1, 2, 3]    # blank line is not a record
    assert recs[1].where.endswith("d.jsonl:3") and "invalid JSON" in recs[1].error
    assert recs[2].where.endswith("d.jsonl:4") and recs[2].error is None
    assert recs[3].where.endswith("d.jsonl:5") and "invalid UTF-8" in recs[3].error


def test_parquet_and_hf_directory(tmp_path):
    table = pa.table({"prompt": ["a", "b"], "completion": ["x", "y"]})
    pq.write_table(table, tmp_path / "d.parquet")
    recs = list(iter_rows(str(tmp_path / "d.parquet")))
    assert [r.data["completion"] for r in recs] == ["x", "y"] and recs[1].where.endswith("row 1")
    # The layout of datasets' save_to_disk: Arrow stream files listed in state.json.
    hf = tmp_path / "hf"
    hf.mkdir()
    for i, t in enumerate([table, pa.table({"prompt": ["c"], "completion": ["z"]})]):
        with pa.OSFile(str(hf / f"data-{i:05d}-of-00002.arrow"), "wb") as sink, pa.ipc.new_stream(sink, t.schema) as w:
            w.write_table(t)
    (hf / "state.json").write_text(json.dumps({"_data_files": [{"filename": f"data-{i:05d}-of-00002.arrow"}
                                                               for i in range(2)]}))
    recs = list(iter_rows(str(hf)))
    assert [(r.index, r.data["completion"]) for r in recs] == [(0, "x"), (1, "y"), (2, "z")]


def test_unknown_or_missing_dataset_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        list(iter_rows(str(tmp_path / "nope.jsonl")))
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unknown format"):
        list(iter_rows(str(tmp_path / "d.csv")))


def test_a_record_nested_too_deeply_is_a_counted_bad_row(tmp_path):
    """5,000 levels of nesting made json raise RecursionError through the reader (issue 23, item 13): the rest of
    the dataset went unread even with --on-bad-record skip."""
    deep = "[" * 5000 + "]" * 5000
    path = write_jsonl(tmp_path / "d.jsonl", [CHAT, deep, CHAT])
    rows = list(iter_rows(path))
    assert [r.error for r in rows] == [None, "JSON nested too deeply to read", None]
    assert rows[1].where == f"{path}:2" and rows[2].index == 2


def test_a_corrupt_parquet_file_is_named(tmp_path):
    from kdcache.pipeline.job import count_rows
    bad = tmp_path / "broken.parquet"
    bad.write_bytes(b"PAR1" + b"\x00" * 64 + b"PAR1")
    with pytest.raises(DataError, match=r"broken\.parquet: cannot be read as Parquet"):
        list(iter_rows(str(bad)))
    with pytest.raises(DataError, match=r"broken\.parquet: cannot be read as Parquet"):
        count_rows(str(bad))


def test_a_line_longer_than_the_limit_is_a_bad_row_never_read_whole(tmp_path, monkeypatch):
    """A 2 GB line would have been read whole and killed the process (issue 23, item 11); the limit is lowered
    here (KDCACHE_MAX_RECORD_BYTES) so that a 3 MB line is over it."""
    from kdcache.pipeline.job import count_rows
    monkeypatch.setenv("KDCACHE_MAX_RECORD_BYTES", "1M")
    huge = json.dumps({"text": "x" * 3_000_000})
    path = write_jsonl(tmp_path / "d.jsonl", [CHAT, huge, "", CHAT])
    rows = list(iter_rows(path))
    assert len(rows) == 3 == count_rows(path)
    assert rows[1].error.startswith("a line longer than KDCACHE_MAX_RECORD_BYTES") and rows[1].where == f"{path}:2"
    assert rows[2].data == CHAT and rows[2].where == f"{path}:4"
