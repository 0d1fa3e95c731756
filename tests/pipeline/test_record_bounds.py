"""Issue 42, items 10 and 11: records whose integers cannot be token ids, lines too long to read whole, and a spool
on a full disk each get a message naming the line or the path, never a traceback, and under --on-bad-record skip
the job goes on, counting them."""
import json
import subprocess
import sys

import pytest

from kdcache.common.errors import BadRow
from kdcache.pipeline.data import iter_rows, parse_row
from tests.helpers.cli import precompute, write_jsonl


@pytest.mark.parametrize("rec,why", [
    ({"input_ids": [1, 2 ** 63]}, r"input_ids\[1\] = 9223372036854775808 is outside int32"),
    ({"input_ids": [1, 2, 3], "labels": [-100, 2, -2 ** 64]}, r"labels\[2\] = -18446744073709551616 is outside"),
    ({"input_ids": [1, 2 ** 31]}, r"input_ids\[1\] = 2147483648 is outside int32"),
])
def test_integers_past_int32_are_a_bad_record_not_an_overflow(rec, why):
    with pytest.raises(BadRow, match=why):
        parse_row(rec)


def test_a_line_of_more_integers_than_the_cap_stops_mid_parse(tmp_path, monkeypatch):
    monkeypatch.setenv("KDCACHE_MAX_RECORD_INTS", "1000")
    lines = [json.dumps({"input_ids": list(range(1, 901))}),             # 900 ints in 3.5 KB: read
             json.dumps({"input_ids": list(range(1, 5001))}),            # 5000: stopped
             json.dumps({"messages": [{"role": "user", "content": "x" * 50_000}]})]   # long, but no integers
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(lines) + "\n")
    rows = list(iter_rows(str(path)))
    assert rows[0].error is None and len(rows[0].data["input_ids"]) == 900
    assert rows[1].data is None and "more than 1,000 integers (KDCACHE_MAX_RECORD_INTS)" in rows[1].error
    assert rows[2].error is None and [r.where for r in rows] == [f"{path}:{i}" for i in (1, 2, 3)]


def test_the_cap_bounds_the_memory_of_a_huge_line(tmp_path):
    """A 60 MB line of 12M ids: read whole, the read grew the process by 539 MB here; stopped at the default cap
    (4M ints), by 240 MB (the line, its decoded text and the cap's ints). Measured in a child process, by its peak
    RSS against its RSS before the read; the bound sits between the two."""
    path = tmp_path / "huge.jsonl"
    with open(path, "w") as f:
        f.write('{"input_ids": [')
        f.write("1234," * 12_000_000)
        f.write("1]}\n")
    code = f"""
import json, resource
from kdcache.pipeline.data import iter_rows
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
rows = list(iter_rows({str(path)!r}))
grew = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
print(json.dumps({{"error": rows[0].error, "grew_mb": grew}}))
"""
    out = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
                     .stdout.strip().splitlines()[-1])
    assert "more than 4,194,304 integers" in out["error"]
    assert out["grew_mb"] < 390, out


@pytest.mark.ray
@pytest.mark.slow
def test_bad_integers_deep_json_and_huge_lines_are_skipped_and_counted_by_line(tiny, tmp_path):
    good = tiny["train"][:2]
    lines = [json.dumps(good[0]), json.dumps({"input_ids": [1, 2 ** 63, 3]}), "[" * 100_000 + "]" * 100_000,
             json.dumps({"input_ids": list(range(1, 3000))}), json.dumps(good[1])]
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(lines) + "\n")
    out = tmp_path / "c"
    res = precompute("--teacher", tiny["teacher"], "--data", data, "--out", out, "--backend", "hf", "--top-k", 4,
                     "--on-bad-record", "skip", extra_env={"KDCACHE_MAX_RECORD_INTS": "1000"}, shared_ray=True)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr[-3000:]
    skipped = {x["where"]: x["message"] for x in map(json.loads, open(out / "report" / "skipped.jsonl"))}
    assert sorted(skipped) == [f"{data}:{i}" for i in (2, 3, 4)], skipped
    assert "outside int32" in skipped[f"{data}:2"] and "nested too deeply" in skipped[f"{data}:3"]
    assert "KDCACHE_MAX_RECORD_INTS" in skipped[f"{data}:4"]
    from kdcache.cache_format import open_cache
    assert [r.sample_id for r in open_cache(out)] == [0, 4]


@pytest.mark.ray
@pytest.mark.slow
def test_a_full_spool_disk_names_the_spool_and_what_to_do(tiny, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", tiny["train"][:4])
    res = precompute("--teacher", tiny["teacher"], "--data", data, "--out", tmp_path / "c", "--backend", "hf",
                     "--top-k", 4, extra_env={"KDCACHE_ENOSPC_AT": "spool-write@1"}, shared_ray=True)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert "encoded.arrow: writing the tokenized samples failed: disk full" in res.stderr
    assert "KDCACHE_SPOOL_DIR" in res.stderr and "[Errno 28]" not in res.stderr
