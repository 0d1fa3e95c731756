"""Records that carry their own token ids ({"input_ids", "labels"}, the Hugging Face convention): scored as given,
never templated or tokenized (rule 2 at the input); bad ones named by file and line (issue 25, item 1)."""
import json

import numpy as np
import pytest

from kdcache.cache_format import open_cache, verify_cache
from kdcache.common.errors import BadRow
from kdcache.pipeline.data import parse_row
from kdcache.pipeline.encode import Encoder
from tests.helpers.cli import precompute, write_jsonl

IGN = -100


def chat_as_ids(tok, rec):
    """The ids and labels a user's own pipeline (ms-swift, axolotl) would make of a chat: the template's ids, the
    assistant's tokens and its end-of-turn labelled."""
    enc = Encoder(tok).encode(parse_row(rec))
    labels = [IGN] * len(enc.input_ids)
    for p in enc.positions:
        labels[p + 1] = int(enc.input_ids[p + 1])
    return {"input_ids": enc.input_ids.tolist(), "labels": labels}, enc


def test_ids_and_labels_give_the_positions_the_labels_name(tiny):
    tok = tiny["tok"]
    rec, enc = chat_as_ids(tok, tiny["train"][0])
    got = Encoder(tok, vocab_size=len(tok)).encode(parse_row(rec), 7)
    assert got.sample_id == 7 and got.input_ids.tolist() == rec["input_ids"]
    np.testing.assert_array_equal(got.positions, enc.positions)          # position t-1 where labels[t] != -100
    assert not got.truncated                                              # its last target ends the turn
    # Ids no tokenizer would make from text are kept as they are: nothing is decoded and re-encoded.
    odd = {"input_ids": [5, 5, 5, 9, 3, tok.eos_token_id], "labels": [IGN, IGN, IGN, 9, 3, tok.eos_token_id]}
    got = Encoder(tok, vocab_size=len(tok)).encode(parse_row(odd))
    assert got.input_ids.tolist() == odd["input_ids"] and got.positions.tolist() == [2, 3, 4]


def test_without_labels_every_token_after_the_first_is_trained_and_a_record_that_never_stops_is_truncated(tiny):
    tok = tiny["tok"]
    got = Encoder(tok, vocab_size=len(tok)).encode(parse_row({"input_ids": [4, 8, 15, 16]}))
    assert got.positions.tolist() == [0, 1, 2] and got.truncated              # no end-of-turn target: never stops
    ended = Encoder(tok, vocab_size=len(tok)).encode(parse_row({"input_ids": [4, 8, tok.eos_token_id]}))
    assert not ended.truncated
    # labels[0] is never a target (no position predicts the first token): as in a Hugging Face loss
    got = Encoder(tok, vocab_size=len(tok)).encode(parse_row({"input_ids": [4, 8, 9], "labels": [4, IGN, 9]}))
    assert got.positions.tolist() == [1]


@pytest.mark.parametrize("rec,why", [
    ({"input_ids": []}, "'input_ids' must be a non-empty list of integers"),
    ({"input_ids": "1 2 3"}, "'input_ids' must be a non-empty list of integers"),
    ({"input_ids": [1, 2.0, 3]}, r"input_ids\[1\] must be an integer, got float"),
    ({"input_ids": [1, True, 3]}, r"input_ids\[1\] must be an integer, got bool"),
    ({"input_ids": [1, 2, 3], "labels": [IGN, 2]}, "'labels' has 2 entries and 'input_ids' 3"),
    ({"input_ids": [1, 2, 3], "labels": [IGN, 2, 4]}, r"labels\[2\] = 4 but input_ids\[2\] = 3"),
    ({"input_ids": [1, 2, 3], "labels": [1, IGN, IGN]}, "every label after the first is -100"),
])
def test_malformed_id_records_name_what_is_wrong(rec, why):
    with pytest.raises(BadRow, match=why):
        parse_row(rec)


def test_ids_outside_the_teachers_vocabulary_and_single_ids_are_refused(tiny):
    tok = tiny["tok"]
    enc = Encoder(tok, vocab_size=400)
    with pytest.raises(BadRow, match=r"input_ids\[2\] = 400 is outside the teacher's vocabulary of 400 ids "
                                     r"\(2 such id\(s\)"):
        enc.encode(parse_row({"input_ids": [1, 2, 400, 3, -1]}))
    with pytest.raises(BadRow, match="input_ids holds one id"):
        enc.encode(parse_row({"input_ids": [5]}))


def test_generate_mode_prompts_are_the_ids_before_the_first_label(tiny):
    tok = tiny["tok"]
    rec, enc = chat_as_ids(tok, tiny["train"][1])
    got = Encoder(tok, vocab_size=len(tok)).encode_prompt(parse_row(rec), 3)
    assert got.input_ids.tolist() == rec["input_ids"][:enc.positions[0] + 1]      # through the generation prompt
    whole = Encoder(tok, vocab_size=len(tok)).encode_prompt(parse_row({"input_ids": [4, 8, 15]}))
    assert whole.input_ids.tolist() == [4, 8, 15]                                # no labels: all of it
    # labels[0] names an id (it predicts nothing: no position before it): the prompt still runs to the first
    # trained target at t >= 1, never empty (issue 42, section 4)
    first_set = Encoder(tok, vocab_size=len(tok)).encode_prompt(parse_row({"input_ids": [4, 8, 15, 16],
                                                                           "labels": [4, IGN, 15, 16]}))
    assert first_set.input_ids.tolist() == [4, 8]


def test_ids_records_read_alike_from_jsonl_parquet_and_a_save_to_disk_directory(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from kdcache.pipeline.data import iter_rows
    rows = [{"input_ids": [1, 2, 3, 4], "labels": [IGN, IGN, 3, 4]}, {"input_ids": [7, 8], "labels": [IGN, 8]}]
    table = pa.table({"input_ids": pa.array([r["input_ids"] for r in rows], pa.list_(pa.int64())),
                      "labels": pa.array([r["labels"] for r in rows], pa.list_(pa.int64()))})
    pq.write_table(table, tmp_path / "d.parquet")
    hf = tmp_path / "hf"
    hf.mkdir()
    with pa.OSFile(str(hf / "data-00000-of-00001.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    (hf / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    for path in (write_jsonl(tmp_path / "d.jsonl", rows), str(tmp_path / "d.parquet"), str(hf)):
        got = [parse_row(r.data) for r in iter_rows(str(path))]
        assert [(e.kind, e.input_ids, e.labels) for e in got] == [("ids", r["input_ids"], r["labels"]) for r in rows]


@pytest.mark.ray
@pytest.mark.slow
def test_ids_records_cache_as_their_chats_and_a_cache_as_data_is_rescored_id_for_id(tiny, stopping, tmp_path):
    """1. The chats' own ids as records give the chats' cache, id for id; a record with an id past the vocabulary
    is named by file and line and counted; the summary says the ids came untokenized.
    2. A cache given as --data: another teacher scores exactly its ids at exactly its positions, under its sample
    ids (the records it skipped stay skipped and counted), as that teacher does in process. Its recorded tokenizer
    must be the job's, else refused with the difference named."""
    from kdcache.demo.task import corpus, make_splits
    from kdcache.demo.tokenizer import train_tokenizer
    from kdcache.pipeline.teacher_hf import HFTeacher
    chats = tiny["train"][:5]
    data = write_jsonl(tmp_path / "chats.jsonl", chats[:2] + [{"messages": "bad"}] + chats[2:])
    common = ["--top-k", 8, "--backend", "hf", "--shard-size", 4, "--logprob-dtype", "float32"]
    res = precompute("--teacher", tiny["teacher"], "--data", data, "--out", tmp_path / "src", "--on-bad-record",
                     "skip", "--max-length", 100, *common, shared_ray=True)  # a chat cut (a truncated flag), one empty
    assert res.returncode == 0, res.stderr[-3000:]
    tok = tiny["tok"]
    rows = [chat_as_ids(tok, r)[0] for r in chats]
    rows.insert(2, {"input_ids": [1, 2, 4000], "labels": [IGN, 2, 4000]})
    res = precompute("--teacher", tiny["teacher"], "--data", write_jsonl(tmp_path / "ids.jsonl", rows), "--out",
                     tmp_path / "ids", "--on-bad-record", "skip", "--max-length", 100, *common, shared_ray=True)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "came as token ids" in res.stdout and "ids: 4" in res.stdout
    assert verify_cache(tmp_path / "ids").ok
    by_ids, src = list(open_cache(tmp_path / "ids")), list(open_cache(tmp_path / "src"))
    assert [r.sample_id for r in by_ids] == [r.sample_id for r in src]
    for a, b in zip(by_ids, src):
        for field in ("input_ids", "positions", "topk_ids", "topk_logprobs"):
            np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
        assert a.truncated == b.truncated
    skipped = [json.loads(x) for x in open(tmp_path / "ids" / "report" / "skipped.jsonl")]
    bad = [x for x in skipped if x["reason"] == "bad_record"]
    assert len(bad) == 1 and bad[0]["where"].endswith("ids.jsonl:3") and bad[0]["sample_id"] == 2
    assert "input_ids[2] = 4000 is outside the teacher's vocabulary" in bad[0]["message"]
    summary = json.load(open(tmp_path / "ids" / "report" / "summary.json"))
    assert summary["inputs"] == {"ids": 4} and summary["skipped"] == {"bad_record": 1, "no_targets": 1}
    # 2. the cache as data
    res = precompute("--teacher", stopping["greedy"], "--data", tmp_path / "src", "--out", tmp_path / "re", *common,
                     shared_ray=True)
    assert res.returncode == 0, res.stderr[-3000:]
    assert verify_cache(tmp_path / "re").ok
    src, re_ = list(open_cache(tmp_path / "src")), list(open_cache(tmp_path / "re"))
    assert [r.sample_id for r in re_] == [r.sample_id for r in src] == [1, 3, 4, 5]
    assert any(r.truncated for r in src) and any(not r.truncated for r in src)
    hf = HFTeacher(stopping["greedy"], dtype="float32")
    want = hf.score([r.input_ids for r in src], [r.positions for r in src], 8)
    for a, b, (ids, lp, _) in zip(src, re_, want):
        np.testing.assert_array_equal(a.input_ids, b.input_ids)
        np.testing.assert_array_equal(a.positions, b.positions)
        assert a.truncated == b.truncated
        np.testing.assert_array_equal(b.topk_ids, ids)
        np.testing.assert_allclose(b.topk_logprobs, lp, atol=1e-5)
        assert not np.array_equal(a.topk_logprobs, b.topk_logprobs)       # the other teacher's numbers
    summary = json.load(open(tmp_path / "re" / "report" / "summary.json"))
    assert summary["skipped"] == {"source_skipped": 2} and summary["inputs"] == {"ids": 4}
    assert summary["records"] == 6
    # Rescoring it again is the same job (reading a cache stamps it, which must not change the fingerprint).
    again = precompute("--teacher", stopping["greedy"], "--data", tmp_path / "src", "--out", tmp_path / "re", *common,
                       shared_ray=True)
    assert again.returncode == 0 and "nothing to do" in again.stdout, again.stdout[-2000:] + again.stderr[-2000:]
    # Ids made with another tokenizer (same size, other merges) are refused before any work, the difference named.
    other = train_tokenizer(list(corpus(make_splits(30, 0, seed=9)[0]))[::-1], str(tmp_path / "tok2"), vocab_size=400)
    assert other.get_vocab() != tiny["tok"].get_vocab()
    res = precompute("--teacher", stopping["greedy"], "--tokenizer", tmp_path / "tok2", "--data", tmp_path / "src",
                     "--out", tmp_path / "refused", *common, shared_ray=True)
    assert res.returncode == 2, res.stderr[-3000:]
    assert f"dataset {tmp_path / 'src'}: its token ids were made with another tokenizer" in res.stderr
    assert "vocabulary" in res.stderr and not (tmp_path / "refused").exists()
