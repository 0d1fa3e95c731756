"""`kdcache train` end to end under DeepSpeed (CPU, gloo): learning, normalisation, settings, ranks, outputs.
(Signals, kill -9 and resume: test_trainer_resume.py.)"""
import json
import os
import sys

import numpy as np
import pytest
import torch

from tests.helpers.cli import ROOT, precompute, user_env, write_jsonl
from tests.train.common import (
    first_shards,
    losses,
    make_setup,
    run,
    train_cmd,
    two_process_run,
)

pytestmark = [pytest.mark.deepspeed, pytest.mark.slow]


@pytest.fixture(scope="module")
def setup(tiny, tmp_path_factory):
    return make_setup(tiny, tmp_path_factory)


def test_training_lowers_the_distillation_loss_and_saves_a_loadable_student(setup, tmp_path):
    ext = tmp_path / "torch_extensions"                   # DeepSpeed's JIT builds land here: none on CPU
    res = run(train_cmd(setup, tmp_path / "o", "--max-steps", 30, "--batch-size", 4, "--save-every", 10),
              env=user_env(TORCH_EXTENSIONS_DIR=ext))
    assert res.returncode == 0, res.stderr[-3000:]
    assert not [d for d in os.listdir(ext) if not d.startswith(".")], os.listdir(ext)   # the comm op skipped
    rows = losses(tmp_path / "o")
    assert [r["step"] for r in rows] == list(range(1, 31))
    # the outputs the README names: each metrics field filled in, tensorboard events, the run's settings
    warm = [r["lr"] for r in rows[:3]]
    assert warm[0] < warm[1] <= 3e-3 and rows[-1]["lr"] < max(r["lr"] for r in rows)     # warm-up, then decay
    assert all(r["grad_norm"] > 0 and r["tokens_per_s"] > 0 and r["epoch"] >= 0 for r in rows)
    assert rows[-1]["epoch"] > rows[0]["epoch"]                  # 30 steps of 4 over 48 samples: epochs 0-2
    events = [f for f in os.listdir(tmp_path / "o" / "tensorboard") if f.startswith("events.out.tfevents")]
    assert events and os.path.getsize(tmp_path / "o" / "tensorboard" / events[0]) > 100
    import yaml
    saved = yaml.safe_load(open(tmp_path / "o" / "train_config.yaml"))
    assert saved["batch_size"] == 4 and saved["max_steps"] == 30 and saved["lr"] == 3e-3
    first, last = sum(r["kd"] for r in rows[:3]) / 3, sum(r["kd"] for r in rows[-3:]) / 3
    assert last < 0.7 * first, (first, last)
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "o" / "final")
    vocab = json.load(open(tmp_path / "o" / "final" / "tokenizer.json"))["model"]["vocab"]
    assert model.config.vocab_size == len(vocab)
    assert (tmp_path / "o" / "loss_curve.png").stat().st_size > 1000
    ckpts = sorted(os.listdir(tmp_path / "o" / "checkpoints"))
    assert ckpts == ["step-00000020", "step-00000030"]          # keep_checkpoints=2


BASE = ("--max-steps", 3, "--batch-size", 4, "--no-shuffle", "--save-every", 0)


def test_objective_sft_trains_the_cross_entropy_alone_on_the_fused_head(setup, tmp_path):
    # --objective sft: the loss is the cached completion tokens' cross-entropy, at weight 1, on the same fused,
    # chunked head as KD. Its first step's loss is the CE a KD run logs for the same first batch (the same
    # student, order and positions), and it falls; the summary names the chunk the run chose.
    res = run(train_cmd(setup, tmp_path / "sft", "--objective", "sft", *BASE[:1], 12, *BASE[2:]))
    assert res.returncode == 0, res.stderr[-3000:]
    kd = run(train_cmd(setup, tmp_path / "kd", "--max-steps", 1, *BASE[2:]))
    assert kd.returncode == 0, kd.stderr[-3000:]
    rows, kd_rows = losses(tmp_path / "sft"), losses(tmp_path / "kd")
    assert all(r["loss"] == pytest.approx(r["sft"], rel=1e-6) and r["kd"] == 0.0 for r in rows)
    assert rows[0]["sft"] == pytest.approx(kd_rows[0]["sft"], rel=1e-5)
    assert kd_rows[0]["loss"] != pytest.approx(kd_rows[0]["sft"], rel=1e-3)      # a KD run's loss is not its CE
    assert sum(r["sft"] for r in rows[-3:]) < 0.9 * sum(r["sft"] for r in rows[:3])
    summary = json.load(open(tmp_path / "sft" / "train_summary.json"))
    assert summary["loss_path"].startswith("fused head") and summary["loss_chunk"] == 512
    assert summary["loss_chunk_from"] == "the default for the student's vocabulary"
    assert "the default chunk for this vocabulary" in res.stdout


@pytest.fixture(scope="module")
def base_run(setup):
    """Three steps of batch 4 in cache order: the reference other runs must reproduce."""
    out = setup["dir"] / "base"
    res = run(train_cmd(setup, out, *BASE))
    assert res.returncode == 0, res.stderr[-3000:]
    return out


def test_loss_is_normalised_over_all_positions_of_the_accumulation_window(setup, base_run, tmp_path):
    """batch 4 x accum 1 and batch 1 x accum 4 see the same samples: same losses, same updates."""
    b = run(train_cmd(setup, tmp_path / "b", "--max-steps", 3, "--batch-size", 1, "--grad-accum", 4, "--no-shuffle",
                      "--save-every", 0))
    # ... and packing the same 4 samples into rows of up to 256 tokens changes nothing either.
    c = run(train_cmd(setup, tmp_path / "c", "--max-steps", 3, "--batch-size", 4, "--no-shuffle", "--save-every", 0,
                      "--pack", "--max-tokens", 256))
    assert b.returncode == 0 and c.returncode == 0, (b.stderr[-2000:], c.stderr[-2000:])
    la, lb, lc = losses(base_run), losses(tmp_path / "b"), losses(tmp_path / "c")
    assert len(la) == len(lb) == len(lc) == 3
    for x, y, z in zip(la, lb, lc):
        assert x["positions"] == y["positions"] == z["positions"]
        assert abs(x["loss"] - y["loss"]) < 1e-5 * max(1.0, abs(x["loss"])), (x, y)
        assert abs(x["loss"] - z["loss"]) < 1e-5 * max(1.0, abs(x["loss"])), (x, z)
        # ... while --pack really packed: fewer rows in its forward passes, none longer than --max-tokens
        assert x["rows"] == 4 and z["rows"] < x["rows"] and z["batch_tokens"] <= 256 * z["rows"], (x, z)


def test_training_from_s3_equals_training_from_local_disk(setup, base_run, tmp_path, bucket):
    """The same cache on an S3-compatible server: streamed through the local shard directory, the same losses."""
    from kdcache.cache_format.lease import live_readers
    from kdcache.cache_format.location import Location
    from tests.helpers.s3server import upload_dir
    url = upload_dir(setup["cache"], f"{bucket}/cache")
    remote = run(train_cmd(dict(setup, cache=url), tmp_path / "remote", *BASE))
    assert remote.returncode == 0, remote.stderr[-3000:]
    assert [r["loss"] for r in losses(base_run)] == [r["loss"] for r in losses(tmp_path / "remote")]
    assert live_readers(Location(url)) == [] and Location(url).exists(".last_used.json")


def test_non_default_loss_settings_and_a_deepspeed_file_reach_the_step(setup, tmp_path):
    """--beta, --temperature, --tail renorm, --sft-alpha, --loss-chunk and --deepspeed FILE.json, end to end: the
    first step's logged loss is the loss of those settings on the first batch at the initial weights, worked out
    here in-process (far from the default settings' loss), and the JSON's ZeRO stage is the one that ran."""
    from kdcache.cache_format import open_cache
    from kdcache.train.batch import collate
    from kdcache.train.losses import LossConfig
    from kdcache.train.model import DistillModule, load_student
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 1}}))
    out = tmp_path / "o"
    res = run(train_cmd(setup, out, "--max-steps", 1, "--batch-size", 2, "--no-shuffle", "--save-every", 1,
                        "--beta", 0.5, "--temperature", 2.0, "--tail", "renorm", "--sft-alpha", 0.3,
                        "--loss-chunk", 16, "--deepspeed", ds))
    assert res.returncode == 0, res.stderr[-3000:]
    got, = losses(out)
    cache = open_cache(setup["cache"])
    model = load_student(str(setup["student"]), seed=0)
    batch = collate([cache[0], cache[1]], pad_id=0, student_vocab=model.get_input_embeddings().weight.shape[0])
    with torch.no_grad():
        def loss_of(**settings):
            total, parts = DistillModule(model, LossConfig(**settings))(batch)
            return float(total) / batch.n_positions, parts["kd"] / batch.n_positions, parts["sft"] / batch.n_positions
        loss, kd, sft = loss_of(beta=0.5, temperature=2.0, tail="renorm", sft_alpha=0.3, chunk_size=16)
        default, _, _ = loss_of()
    assert got["positions"] == batch.n_positions
    assert got["loss"] == pytest.approx(loss, rel=1e-5) and got["kd"] == pytest.approx(kd, rel=1e-5)
    assert got["sft"] == pytest.approx(sft, rel=1e-5) and sft > 0
    assert abs(default - loss) > 0.05 * abs(default)                    # the settings matter to this figure
    ck = out / "checkpoints" / "step-00000001"
    names = [f for _, _, files in os.walk(ck) for f in files]
    assert any("optim_states" in f for f in names), names               # ZeRO >= 1 writes partitioned optimizer state


def test_two_ranks_zero0_from_disk_and_zero3_from_s3_agree(setup, tmp_path, bucket):
    """A cache whose second half repeats its first, read in order: rank 1 reads what rank 0 reads, so 2 ranks of
    batch 2 must give the per-step losses of 1 rank of batch 2 (a wrong world factor in the loss or the gradient
    would change them), with twice its positions."""
    data = write_jsonl(tmp_path / "d.jsonl", setup["records"][:8] * 2)
    res = precompute("--teacher", setup["dir"] / "teacher", "--data", data, "--out", tmp_path / "cache", "--backend",
                     "hf", "--top-k", 32, "--shard-size", 8, shared_ray=True)
    assert res.returncode == 0, res.stderr
    # An untied head (Llama 3 8B's, Qwen2.5-7B's): under ZeRO-3 its weight is a partition outside its own forward.
    import shutil
    shutil.copytree(setup["student"], tmp_path / "student")
    conf = json.loads((tmp_path / "student" / "config.json").read_text())
    (tmp_path / "student" / "config.json").write_text(json.dumps(dict(conf, tie_word_embeddings=False)))
    setup = dict(setup, cache=tmp_path / "cache", student=tmp_path / "student")
    one = run(train_cmd(setup, tmp_path / "one", "--max-steps", 4, "--batch-size", 2, "--save-every", 0,
                        "--threads", 1, "--no-shuffle"))
    assert one.returncode == 0, one.stderr[-3000:]
    rows = two_process_run(setup, tmp_path / "z0", 0)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for a, b in zip(losses(tmp_path / "one"), rows):
        assert b["positions"] == 2 * a["positions"], (a, b)
        assert abs(a["loss"] - b["loss"]) < 1e-5 * max(1.0, abs(a["loss"])), (a, b)
    # the gradient itself, before AdamW's normalisation hides a uniform factor: the same norm at step 1
    a, b = losses(tmp_path / "one")[0], rows[0]
    assert abs(a["grad_norm"] - b["grad_norm"]) < 1e-4 * a["grad_norm"], (a, b)
    ck = tmp_path / "z0" / "checkpoints" / "step-00000004"
    assert (ck / "rank-00000.json").exists() and (ck / "rank-00001.json").exists()
    assert json.load(open(ck / "complete.json"))["world_size"] == 2
    # ZeRO-3 partitions the weights over the two ranks: same losses, and the saved student is whole.
    # This run's two ranks read the same cache from S3, each on its own, with the same result.
    from tests.helpers.s3server import upload_dir
    remote = dict(setup, cache=upload_dir(setup["cache"], f"{bucket}/cache"))
    # Every parameter partitioned (ZeRO-3 keeps those under stage3_param_persistence_threshold whole, which is
    # all of this student's): lm_head's weight is then only a partition outside its own forward.
    ds3 = tmp_path / "ds3.json"
    ds3.write_text(json.dumps({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                                     "stage3_max_reuse_distance": 0, "stage3_max_live_parameters": 0,
                                                     "stage3_prefetch_bucket_size": 0}}))
    rows3 = two_process_run(remote, tmp_path / "z3", 3, deepspeed=ds3)
    for a, b in zip(rows, rows3):
        assert abs(a["loss"] - b["loss"]) < 1e-4 * max(1.0, abs(a["loss"])), (a, b)
    # ZeRO-3 keeps the fused, chunked head (the partitioned lm_head gathered for it), not [N, V] dense logits
    for z in ("z0", "z3"):
        assert json.load(open(tmp_path / z / "train_summary.json"))["loss_path"].startswith("fused head"), z
    from safetensors.torch import load_file
    w0 = load_file(tmp_path / "z0" / "final" / "model.safetensors")
    w3 = load_file(tmp_path / "z3" / "final" / "model.safetensors")
    assert w0.keys() == w3.keys()
    for k in w0:
        assert w0[k].shape == w3[k].shape and w0[k].numel() > 0, k
        torch.testing.assert_close(w0[k], w3[k], atol=1e-4, rtol=1e-3)


def test_tokenizer_mismatch_refused(setup, tmp_path):
    from kdcache.demo.tokenizer import train_tokenizer
    other = tmp_path / "other"
    train_tokenizer(["a completely different corpus of words"] * 20, str(other), vocab_size=300)
    res = run(train_cmd(setup, tmp_path / "o", "--tokenizer", other, "--max-steps", 1))
    assert res.returncode == 2
    assert "tokenizer differs" in res.stderr and "vocabulary" in res.stderr


def test_bad_config_values_are_refused_with_the_key(setup, tmp_path):
    res = run(train_cmd(setup, tmp_path / "o", "--beta", "1.5"))
    assert res.returncode == 2 and "beta" in res.stderr
    cfg = tmp_path / "c.yaml"
    cfg.write_text("temprature: 2.0\n")
    res = run(train_cmd(setup, tmp_path / "o", "--config", cfg))
    assert res.returncode == 2 and "unknown config key" in res.stderr and "temprature" in res.stderr


def test_an_epoch_under_a_token_budget_trains_every_position(setup, tmp_path):
    """--max-tokens without --pack: micro-batches hold fewer than --batch-size samples, so counting steps from
    --batch-size stopped the epoch early and said finished (63 of 160 positions, issue 23, item 5)."""
    from kdcache.cache_format import open_cache
    cache = first_shards(setup, tmp_path / "cache", 2)
    want = sum(len(r.positions) for r in open_cache(cache))
    out = tmp_path / "o"
    res = run(train_cmd(dict(setup, cache=cache), out, "--epochs", 1, "--batch-size", 8, "--max-tokens", 160,
                        "--save-every", 0, "--threads", 1))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    rows = losses(out)
    assert sum(r["positions"] for r in rows) == want and len(rows) > 16 // 8          # more steps than 16 / 8
    assert json.load(open(out / "train_summary.json"))["reason"] == "finished"


def test_three_ranks_with_an_uneven_split_agree_on_one_step_count(setup, tmp_path):
    """Rank shares differ by a sample. 16 samples on 3 ranks (5, 5, 6), batch 2: the old count (a share over the
    batch, rounded down) gave 2, 2 and 3 steps, and the third rank called a collective the others never joined
    (issue 23, item 6: the run hung). Now the micro-batches are counted (the last one may be short: 3 each, every
    sample trained), and the ranks take the fewest: 8 samples (2, 3, 3) give 1, 2 and 2, so 1 step, and the
    summary says 2 samples were left."""
    for n_shards, steps, left in ((2, 3, 0), (1, 1, 2)):
        cache = first_shards(setup, tmp_path / f"cache{n_shards}", n_shards)
        out = tmp_path / f"o{n_shards}"
        res = run(train_cmd(dict(setup, cache=cache), out, "--epochs", 1, "--batch-size", 2, "--save-every", 0,
                            "--threads", 1, "--nproc-per-node", 3), timeout=600)
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
        assert [r["step"] for r in losses(out)] == list(range(1, steps + 1))
        summary = json.load(open(out / "train_summary.json"))
        assert summary["step"] == steps and summary["samples_untrained"] == left


def test_a_base_student_trains_without_flags_and_its_final_stops_like_the_teacher(setup, tmp_path):
    """The most common pairing: an instruct teacher's cache, a base student (same vocabulary, EOS <|endoftext|>,
    a generation config that stops there, no chat template). final/ must stop at <|im_end|> with stock generate()."""
    import shutil

    from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor
    base = tmp_path / "base"
    tok = AutoTokenizer.from_pretrained(setup["student"])
    tok.eos_token, tok.chat_template = "<|endoftext|>", None
    tok.save_pretrained(base)
    shutil.copy(setup["student"] / "config.json", base / "config.json")
    (base / "generation_config.json").write_text(json.dumps({"eos_token_id": tok.eos_token_id}))
    out = tmp_path / "o"
    res = run(train_cmd(dict(setup, student=base), out, "--max-steps", 3, "--batch-size", 2, "--save-every", 0))
    assert res.returncode == 0, res.stderr[-3000:]
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    final = out / "final"
    assert im_end in json.load(open(final / "generation_config.json"))["eos_token_id"]
    saved = AutoTokenizer.from_pretrained(final)
    assert saved.chat_template and "<|im_start|>" in saved.chat_template            # the teacher's template

    class EndAfterTwo(LogitsProcessor):                  # the student "emits" <|im_end|> as its third token
        def __call__(self, input_ids, scores):
            if input_ids.shape[1] == start + 2:
                scores[:] = float("-inf")
                scores[:, im_end] = 0.0
            return scores

    model = AutoModelForCausalLM.from_pretrained(final)
    prompt = saved.apply_chat_template([{"role": "user", "content": "docker?"}], add_generation_prompt=True,
                                       return_tensors="pt", return_dict=True)["input_ids"]
    start = prompt.shape[1]
    gen = model.generate(prompt, max_new_tokens=20, do_sample=False, logits_processor=[EndAfterTwo()])
    assert gen.shape[1] == start + 3 and int(gen[0, -1]) == im_end              # stock generate() stopped there


@pytest.mark.parametrize("backend", ["zarr"])
def test_a_format_1_cache_still_trains(backend, tmp_path):
    """tests/fixtures/v1: a cache written by the last version-1 writer; a student of its tokenizer trains on it."""
    import shutil
    student = tmp_path / "student"
    shutil.copytree(os.path.join(ROOT, "tests", "fixtures", "v1", "tokenizer"), student)
    cache = str(tmp_path / "cache")                     # a copy: a training run stamps the cache it reads
    shutil.copytree(os.path.join(ROOT, "tests", "fixtures", "v1", backend), cache)
    out = tmp_path / "o"
    res = run([sys.executable, "-m", "kdcache", "train", "--cache", cache, "--student", str(student), "--out",
               str(out), "--no-progress", "--max-steps", "3", "--batch-size", "2", "--save-every", "0"])
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    rows = losses(out)
    # The fixture's student is built from the teacher's own config and seed: it is the teacher, so its KD loss is
    # 0 up to float rounding (either sign); what is checked is that the old format feeds real positions.
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["positions"] > 0 and abs(r["kd"]) < 1e-4 for r in rows)


def test_multi_turn_and_truncated_samples_train_packed(setup, tmp_path):
    """Not only one-turn chats: multi-turn chats (every assistant turn trained) and samples cut at --max-length
    (flagged truncated, no end-of-turn at their end) train, packed, every cached position once in an epoch."""
    from kdcache.cache_format import open_cache
    from tests.helpers.chats import MULTI
    long = {"messages": [{"role": "user", "content": "list the skills"},
                         {"role": "assistant", "content": "docker, sql, python, linux " * 6}]}
    short = {"prompt": "hello there", "completion": "sql"}
    rows = [MULTI, long, short, MULTI, long, short]             # 78, 123 and 12 tokens
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    res = precompute("--teacher", setup["dir"] / "teacher", "--data", data, "--out", tmp_path / "cache",
                     "--backend", "hf", "--top-k", 8, "--max-length", 100, shared_ray=True)
    assert res.returncode == 0, res.stderr
    cache = open_cache(tmp_path / "cache")
    recs = list(cache)
    assert [r.truncated for r in recs] == [False, True, False, False, True, False]
    assert np.sum(np.isin(recs[0].targets, list(cache.eos_token_ids))) == 2          # two assistant turns
    out = tmp_path / "o"
    res = run(train_cmd(dict(setup, cache=tmp_path / "cache"), out, "--epochs", 1, "--batch-size", 3, "--pack",
                        "--max-tokens", 128, "--save-every", 0))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    rows_logged = losses(out)
    assert sum(r["positions"] for r in rows_logged) == sum(len(r.positions) for r in recs)
    assert all(np.isfinite(r["loss"]) for r in rows_logged)


def test_a_padded_teachers_ids_the_student_lacks_are_counted(setup, tiny, tmp_path):
    """A teacher whose vocabulary is padded past the student's (Qwen2.5-7B's 152,064 rows against a 151,936
    student): its top-k names ids the student has no row for. They train as the tail bucket and are counted, per
    step in metrics.jsonl and in total in train_summary.json, not moved silently."""
    from kdcache.cache_format import open_cache
    from kdcache.demo.models import make_model, save
    tok = tiny["tok"]
    teacher = make_model(tok, "test", seed=11)
    n = teacher.get_input_embeddings().weight.shape[0]
    teacher.resize_token_embeddings(n + 64)
    with torch.no_grad():                               # the padded rows copy the first 64: as likely as they are
        emb = teacher.get_input_embeddings().weight
        emb[n:] = emb[:64]
    save(teacher, tok, str(tmp_path / "teacher"))
    data = write_jsonl(tmp_path / "d.jsonl", setup["records"][:8])
    res = precompute("--teacher", tmp_path / "teacher", "--data", data, "--out", tmp_path / "cache", "--backend",
                     "hf", "--top-k", 32, shared_ray=True)
    assert res.returncode == 0, res.stderr
    outside = sum(int((r.topk_ids >= n).sum()) for r in open_cache(tmp_path / "cache"))
    assert outside > 0
    out = tmp_path / "o"
    res = run(train_cmd(dict(setup, cache=tmp_path / "cache"), out, "--epochs", 1, "--batch-size", 4,
                        "--save-every", 0))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    per_step = [r["outside_vocab"] for r in losses(out)]
    summary = json.load(open(out / "train_summary.json"))
    assert sum(per_step) == summary["outside_vocab"] == outside and "no embedding row" in res.stdout
