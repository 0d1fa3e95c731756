"""The GPU path end to end on one GPU in at most 10 minutes (issue 24): one table, one row per check.

    .venv/bin/python bench/gpu_check.py [--out runs/gpu-check] [--cpu] [--keep]     (or: make gpu-check ARGS=...)

Models with a real architecture and vocabulary: Qwen2, 151,936 rows (a small trained byte-level BPE tokenizer,
its vocabulary padded as Qwen pads its own), random weights. Every command runs as a user runs it
(`python -m kdcache ...` in a subprocess, from a project directory of their own; tests/helpers/cli.py).
Checks: the hf float32 reference; vLLM bfloat16 and float32 against it sample by sample; vLLM generate mode;
a served teacher (`vllm serve` on 127.0.0.1) against the in-process vLLM cache; training under ZeRO-2 and
ZeRO-3 (bf16 on a GPU by itself); SIGTERM mid-run then resume, per-step losses against the uninterrupted run;
two ranks where two GPUs are visible.

--cpu (and by itself without a CUDA GPU): smaller sizes, vLLM in float32 only; rows that need a GPU say
"skipped: no GPU" and never count as passed. Writes OUT/gpu_check.md and OUT/gpu_check.json; exit 1 if any
row that ran failed. Installs nothing.
"""
import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from kdcache.cache_format import open_cache, verify_cache  # noqa: E402
from kdcache.demo import models  # noqa: E402
from kdcache.demo.task import corpus, make_splits, write_jsonl  # noqa: E402
from kdcache.demo.tokenizer import train_tokenizer  # noqa: E402
from tests.helpers.cli import precompute, user_env, user_project  # noqa: E402
from tests.helpers.vllm_server import VLLMServer  # noqa: E402
from tests.pipeline.test_vllm import assert_topk_parity  # noqa: E402
from tests.train.common import losses, run, train_cmd  # noqa: E402

VOCAB = 151936            # Qwen2's
K = 64
MAX_LENGTH = 256          # every cache alike (a served teacher's default would be its max_model_len - 1)
FP32_TOL = 2e-4           # nats: vLLM and transformers in float32 (tests/pipeline/test_vllm.py)
BF16_TOL = 1.0            # nats: bf16 logits of a random model against the float32 reference
GPU_LOSS_RTOL = 1e-2      # resumed against uninterrupted losses under bf16 on a GPU; exact on CPU
SIZES = {"gpu": dict(records=64, steps=20, batch=4), "cpu": dict(records=16, steps=8, batch=2)}
# hidden 256, head_dim 64 (vLLM's CPU attention needs >= 32); make_model ties the embeddings.
models.SIZES.update(
    check_teacher=dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2),
    check_student=dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2))


@dataclass
class Row:
    check: str
    ran: str = ""
    figures: str = ""
    result: str = "fail"      # pass, fail, or "skipped: why"
    seconds: float = 0.0


class Skip(Exception):
    pass


def need(res, what):
    """A finished subprocess that must have exited 0."""
    if res.returncode != 0:
        tail = (res.stderr or res.stdout or "").strip().splitlines()[-5:]
        raise RuntimeError(f"{what} exited {res.returncode}: " + " | ".join(tail))
    return res


def cache_run(ctx, name, *args, teacher=None):
    """`kdcache precompute` of the check's data into WORK/name, top-k float32 log-probs."""
    out = ctx.work / name
    res = precompute("--teacher", teacher or ctx.teacher, "--data", ctx.data, "--out", out, "--top-k", K,
                     "--logprob-dtype", "float32", "--max-length", MAX_LENGTH, "--shard-size", ctx.records // 4,
                     *args, timeout=600)
    need(res, f"precompute {name}")
    ctx.caches[name] = out
    return out


def compare(ref_dir, got_dir, tol, ids=True):
    """Sample by sample: same sample ids, input ids and positions; returns (max |d| of the top-k log-probs rank by
    rank, share of top-k ids in common, whether assert_topk_parity holds: ids equal except for ties within tol)."""
    ref = {r.sample_id: r for r in open_cache(ref_dir)}
    got = {r.sample_id: r for r in open_cache(got_dir)}
    if sorted(ref) != sorted(got):
        raise AssertionError(f"sample ids differ: {len(ref)} against {len(got)} samples")
    worst, shared, parity = 0.0, 0, True
    for sid, a in ref.items():
        b = got[sid]
        if not (np.array_equal(a.input_ids, b.input_ids) and np.array_equal(a.positions, b.positions)):
            raise AssertionError(f"sample {sid}: input ids or positions differ")
        worst = max(worst, float(np.abs(a.topk_logprobs - b.topk_logprobs).max()))
        shared += sum(len(set(x) & set(y)) for x, y in zip(a.topk_ids.tolist(), b.topk_ids.tolist()))
        if ids:
            try:
                assert_topk_parity(a, b, tol)
            except AssertionError:
                parity = False
    entries = sum(r.topk_ids.size for r in ref.values())
    return worst, shared / entries, parity


# ---------------------------------------------------------------- the checks: each fills its row, returns pass


def check_build(ctx, row):
    train, _ = make_splits(ctx.records, 0, seed=0)
    write_jsonl(train, ctx.data)
    tok = train_tokenizer(list(corpus(train)), str(ctx.work / "tok"), vocab_size=512)
    teacher = models.make_model(tok, "check_teacher", seed=0)
    n = teacher.get_input_embeddings().weight.shape[0]
    teacher.resize_token_embeddings(VOCAB, mean_resizing=False)
    with torch.no_grad():                 # padded rows as likely as the real ones, distributions made sharper
        emb = teacher.get_input_embeddings().weight
        emb[n:] = torch.randn(VOCAB - n, emb.shape[1], generator=torch.Generator().manual_seed(0)) * emb[:n].std()
        teacher.model.norm.weight.mul_(4.0)
    models.save(teacher, tok, ctx.teacher)
    student = models.make_model(tok, "check_student", seed=1)
    student.resize_token_embeddings(VOCAB, mean_resizing=False)
    student.config.save_pretrained(ctx.student)          # a fresh student from its config, as users start one
    tok.save_pretrained(ctx.student)
    cfgs = [teacher.config, student.config]
    head_dim = min(getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads for c in cfgs)
    row.ran = (f"Qwen2 teacher {cfgs[0].num_hidden_layers} layers, student {cfgs[1].num_hidden_layers}; "
               f"{ctx.records} records")
    row.figures = (f"tokenizer {len(tok)} trained entries, model vocab {VOCAB}; hidden 256, head_dim "
                   f"{head_dim}; {teacher.num_parameters() / 1e6:.1f}M / {student.num_parameters() / 1e6:.1f}M "
                   "params, tied embeddings")
    return all(c.vocab_size == VOCAB and c.tie_word_embeddings for c in cfgs) and head_dim >= 32


def check_hf(ctx, row):
    out = cache_run(ctx, "hf-fp32", "--backend", "hf", "--dtype", "float32")
    cache, rep = open_cache(out), verify_cache(out)
    row.ran = "precompute --backend hf --dtype float32 (the reference)"
    row.figures = f"{len(cache)} samples, {cache.manifest['counts']['positions']} positions, k={K}; verify ok={rep.ok}"
    return rep.ok and len(cache) == ctx.records


def check_vllm(dtype, tol):
    def check(ctx, row):
        row.ran = f"precompute --backend vllm --dtype {dtype} against hf float32"
        if dtype == "bfloat16" and not ctx.gpu:
            raise Skip("no GPU")
        out = cache_run(ctx, f"vllm-{dtype}", "--backend", "vllm", "--dtype", dtype)
        worst, shared, parity = compare(ctx.caches["hf-fp32"], out, tol, ids=dtype == "float32")
        row.figures = f"max abs d top-k log-prob {worst:.2e} nats (tol {tol:g}); top-k ids in common {shared:.1%}"
        if dtype == "float32":
            row.figures += f"; ids equal except ties: {parity}"
        return worst <= tol and parity
    return check


def check_generate(ctx, row):
    new = 16
    row.ran = f"precompute --backend vllm --mode generate --gen-max-new-tokens {new}, verify_cache"
    out = cache_run(ctx, "vllm-generate", "--backend", "vllm", "--mode", "generate", "--gen-max-new-tokens", new)
    cache, rep = open_cache(out), verify_cache(out)
    recs, eos = list(cache), set(cache.eos_token_ids)
    steps = [len(r.positions) for r in recs]
    ended = sum(int(r.input_ids[r.positions[-1] + 1]) in eos for r in recs if len(r.positions))
    row.figures = (f"{len(recs)} samples, {sum(steps)} generated steps ({min(steps)}-{max(steps)} each), "
                   f"{ended} ended with end-of-turn; verify ok={rep.ok}")
    if rep.problems:
        row.figures += f" {rep.problems[0]}"
    return rep.ok and len(recs) == ctx.records and 1 <= min(steps) and max(steps) <= new


def check_served(ctx, row):
    row.ran = "vllm serve (float32) on 127.0.0.1, precompute --teacher URL --tokenizer DIR, against in-process vLLM"
    t0 = time.time()
    server = VLLMServer(ctx.teacher, max_model_len=512, max_logprobs=K, log_path=ctx.work / "vllm-serve.log").start()
    started = time.time() - t0
    try:
        t0 = time.time()
        out = cache_run(ctx, "served", "--tokenizer", ctx.teacher, "--teacher-revision", "gpu-check",
                        teacher=server.url)
        scored = time.time() - t0
    finally:
        server.stop()
    worst, shared, parity = compare(ctx.caches["vllm-float32"], out, FP32_TOL)
    ok = verify_cache(out).ok
    row.figures = (f"server up in {started:.0f} s, precompute {scored:.0f} s; max abs d {worst:.2e} "
                   f"(tol {FP32_TOL:g}); ids equal except ties: {parity}; verify ok={ok}")
    return worst <= FP32_TOL and parity and ok


def train_args(ctx, out, stage, *extra):
    setup = {"cache": ctx.caches["vllm-float32"], "student": ctx.student}
    return train_cmd(setup, out, "--max-steps", ctx.steps, "--batch-size", ctx.batch, "--save-every", 0,
                     "--deepspeed", stage, *extra)


def check_train(stage, *extra):
    def check(ctx, row):
        name = f"zero{stage}" + ("-2ranks" if extra else "")
        row.ran = " ".join(["train --deepspeed", str(stage), *map(str, extra), f"{ctx.steps} steps, batch {ctx.batch}"])
        if extra and ctx.gpus < 2:
            raise Skip("no GPU" if not ctx.gpu else f"{ctx.gpus} GPU")
        out = ctx.work / name
        need(run(train_args(ctx, out, stage, *extra), timeout=600), f"train {name}")
        got = [r["loss"] for r in losses(out)]
        row.figures = (f"{len(got)} steps, loss {got[0]:.3f} -> {got[-1]:.3f}, "
                       f"{'bf16' if ctx.gpu else 'fp32'}; final/ saved: {(out / 'final' / 'config.json').exists()}")
        return len(got) == ctx.steps and bool(np.isfinite(got).all()) and (out / "final" / "config.json").exists()
    return check


def check_resume(ctx, row):
    """SIGTERM after a few steps, rerun the same command: the losses of the uninterrupted ZeRO-2 run."""
    row.ran = f"train --deepspeed 2, SIGTERM mid-run, same command again; against the {ctx.steps}-step ZeRO-2 run"
    out, cmd = ctx.work / "resume", train_args(ctx, ctx.work / "resume", 2)
    env = {k: v for k, v in user_env().items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                          "MASTER_PORT")}
    proc = subprocess.Popen(cmd, cwd=user_project(), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    metrics, at = out / "metrics.jsonl", max(2, ctx.steps // 4)
    deadline = time.time() + 600
    while proc.poll() is None and time.time() < deadline:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= at:
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=600)
    stopped = len(losses(out)) if metrics.exists() else 0
    if proc.returncode != 0 or "stopped by SIGTERM" not in output or stopped >= ctx.steps:
        raise RuntimeError(f"the first run exited {proc.returncode} after {stopped} steps: "
                           + " | ".join(output.strip().splitlines()[-3:]))
    res = need(run(cmd, timeout=600), "the resumed run")
    got, want = [r["loss"] for r in losses(out)], [r["loss"] for r in losses(ctx.work / "zero2")]
    steps_ok = [r["step"] for r in losses(out)] == list(range(1, ctx.steps + 1)) and "resumed from" in res.stdout
    if len(got) != len(want):
        raise RuntimeError(f"{len(got)} steps against the reference's {len(want)}")
    rel = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got, want))
    tol = GPU_LOSS_RTOL if ctx.gpu else 0.0
    row.figures = (f"stopped at step {stopped}, resumed to {len(got)}; max relative loss difference {rel:.2e} "
                   f"(tol {'exact' if not tol else f'{tol:g}'})")
    return steps_ok and rel <= tol


CHECKS = [
    ("1 models", check_build),
    ("2 hf reference", check_hf),
    ("2 vLLM bf16", check_vllm("bfloat16", BF16_TOL)),
    ("2 vLLM fp32", check_vllm("float32", FP32_TOL)),
    ("3 generate", check_generate),
    ("4 served", check_served),
    ("5 ZeRO-2", check_train(2)),
    ("5 ZeRO-3", check_train(3)),
    ("5 SIGTERM + resume", check_resume),
    ("6 two ranks", check_train(2, "--nproc-per-node", 2)),
]


def run_check(ctx, name, fn):
    row, t0 = Row(name), time.time()
    try:
        row.result = "pass" if fn(ctx, row) else "fail"
    except Skip as e:
        row.result = f"skipped: {e}"
    except Exception as e:          # a failed check is a row: the next checks still run
        row.figures = (row.figures + "; " if row.figures else "") + f"{type(e).__name__}: {e}"[:400]
    row.seconds = round(time.time() - t0, 1)
    print(f"[{row.seconds:7.1f} s] {row.check}: {row.result}  {row.figures}", flush=True)
    return row


def table(rows):
    esc = lambda s: str(s).replace("|", "\\|")  # noqa: E731
    lines = ["| check | what ran | figures | result | s |", "|---|---|---|---|---|"]
    lines += [f"| {esc(r.check)} | {esc(r.ran)} | {esc(r.figures)} | {esc(r.result)} | {r.seconds:.1f} |" for r in rows]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "gpu-check"), help="where the table goes")
    ap.add_argument("--cpu", action="store_true", help="what a CPU can run (GPUs hidden), smaller sizes")
    ap.add_argument("--keep", action="store_true", help="keep OUT/work (models, caches, runs; a few GB)")
    args = ap.parse_args()
    if args.cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    gpu = torch.cuda.is_available()
    out = os.path.abspath(args.out)
    work = Path(out) / "work"
    shutil.rmtree(work, ignore_errors=True)          # fresh: a rerun into the same caches would be a no-op
    work.mkdir(parents=True)
    ctx = SimpleNamespace(gpu=gpu, gpus=torch.cuda.device_count() if gpu else 0, work=work, caches={},
                          data=work / "data.jsonl", teacher=work / "teacher", student=work / "student",
                          **SIZES["gpu" if gpu else "cpu"])
    device = torch.cuda.get_device_name(0) + f" x{ctx.gpus}" if gpu else f"CPU ({os.cpu_count()} cores)"
    print(f"gpu_check on {device}: {ctx.records} records, {ctx.steps} training steps", flush=True)
    t0 = time.time()
    rows = [run_check(ctx, name, fn) for name, fn in CHECKS]
    wall = time.time() - t0
    failed = [r.check for r in rows if r.result == "fail"]
    head = (f"# gpu_check ({time.strftime('%Y-%m-%d %H:%M')}, {device}, {platform.node()}, "
            f"{'GPU' if gpu else 'CPU'} sizes)\n\nWall {wall:.0f} s; {len(failed)} failed"
            f"{': ' + ', '.join(failed) if failed else ''}; skipped rows are not passes.\n\n")
    text = head + table(rows) + "\n"
    with open(os.path.join(out, "gpu_check.md"), "w") as f:
        f.write(text)
    with open(os.path.join(out, "gpu_check.json"), "w") as f:
        json.dump({"device": device, "gpu": gpu, "wall_s": round(wall, 1), "rows": [asdict(r) for r in rows]}, f,
                  indent=1)
    print("\n" + text + f"\nwritten to {out}/gpu_check.md and gpu_check.json")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
