"""Bad input found as a new user would: refused up front, before any Ray, vLLM or DeepSpeed start-up."""
from tests.helpers.cli import kdcache, precompute, write_jsonl


def refused(res, *says):
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    assert "Traceback" not in res.stderr and all(s in res.stderr for s in says), res.stderr[-2000:]


def test_a_teacher_directory_that_does_not_exist(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": "docker"}])
    res = precompute("--teacher", tmp_path / "nope", "--data", data, "--out", tmp_path / "c")
    refused(res, f"teacher: {tmp_path / 'nope'} is not a model directory", "--local-dir")
    assert not (tmp_path / "c").exists()


def test_a_dataset_that_does_not_exist(tiny, tmp_path):
    res = precompute("--teacher", tiny["teacher"], "--data", tmp_path / "missing.jsonl", "--out", tmp_path / "c")
    refused(res, "missing.jsonl does not exist")


def test_an_empty_dataset(tiny, tmp_path):
    (tmp_path / "d.jsonl").write_text("\n")
    res = precompute("--teacher", tiny["teacher"], "--data", tmp_path / "d.jsonl", "--out", tmp_path / "c")
    refused(res, "no usable records (it is empty)")
    assert not (tmp_path / "c").exists()


def test_a_dataset_whose_records_are_all_skipped(tiny, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", ["{broken", {"messages": [{"role": "user", "content": "hi"}]}])
    res = precompute("--teacher", tiny["teacher"], "--data", data, "--out", tmp_path / "c",
                     "--on-bad-record", "skip", shared_ray=True)
    refused(res, "2 read, all skipped: bad_record: 2", "d.jsonl:1")


def test_top_k_above_the_vocabulary(tiny, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": "docker"}])
    res = precompute("--teacher", tiny["teacher"], "--data", data, "--out", tmp_path / "c", "--top-k", 4000)
    refused(res, "top_k: 4000 is more than the teacher's vocabulary of 400 tokens")


def test_train_with_a_missing_cache_says_so_before_deepspeed_starts(tiny, tmp_path):
    res = kdcache("train", "--cache", tmp_path / "nocache", "--student", tiny["teacher"], "--out", tmp_path / "o")
    assert res.returncode == 2 and f"{tmp_path / 'nocache'}/manifest.json: no manifest" in res.stderr
    assert "accelerator" not in (res.stdout + res.stderr).lower()       # DeepSpeed was never imported


def test_max_length_above_the_teachers_context(tiny, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": "docker"}])
    res = precompute("--teacher", tiny["teacher"], "--data", data, "--out", tmp_path / "c", "--max-length", 4096)
    refused(res, "max_length: 4096 is above the teacher's context of 512 tokens", "--max-length 512")
