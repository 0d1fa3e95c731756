"""`kdcache demo`: the whole product on real models, on a CPU, in minutes.

1. a built-in tagging task (job posting -> required skills, then end of turn), train and held-out splits;
2. a tokenizer trained here, ChatML template, `<|im_end|>` = EOS = stop token (Qwen style);
3. a teacher trained on the task (cached under runs/demo/teacher and reused);
4. `kdcache precompute` (vLLM backend where it runs) over the train split, in this process (the control's cache
   reuses the first job's Ray and teacher);
5. `kdcache train` of a smaller fresh base-style student (EOS <|endoftext|>, no chat template) from the cache
   alone (sft_alpha = 0); its final/ stops at <|im_end|> with stock generate(), like the teacher;
6. the control: the same with --drop-end-of-turn (the bug other tools shipped);
7. `kdcache eval`: teacher, student and control side by side -> report.md + PNGs.
Exits non-zero when the bars are missed. Reruns reuse what is built and say so.
"""
import argparse
import json
import os
import subprocess
import sys
import time

STAGES = ("data", "teacher", "precompute", "train", "eval")
FULL = dict(n_train=3000, n_heldout=200, vocab=1024, teacher_size="teacher", teacher_steps=800, top_k=32,
            shard_size=500, student_steps=1200, student_batch=32, student_lr=3e-3, max_new_tokens=48)
# QUICK: the test suite's size, still a real result: the student stops on every held-out prompt, the control on
# none (200 teacher steps memorise the 48 chats; 40 student steps learn the stop).
QUICK = dict(n_train=48, n_heldout=12, vocab=400, teacher_size="test", teacher_steps=200, top_k=16,
             shard_size=16, student_steps=40, student_batch=8, student_lr=3e-3, max_new_tokens=16)
BARS = {"stop_rate": 0.95, "f1_gap": 0.10}
NOTE = ("Task: read a job posting, list the required skills, end the turn with `<|im_end|>`. "
        "**teacher**: trained on the task. **student**: a smaller fresh model trained only from the teacher's "
        "cached top-k (`kdcache precompute` then `kdcache train`, sft_alpha = 0). **student_no_eos**: the same, "
        "from a cache made with `--drop-end-of-turn`, i.e. without the positions that predict `<|im_end|>` "
        "(the bug other distillation tools shipped).")


def say(msg):
    print(f"[demo] {msg}", flush=True)


def kdcache(*args):
    """Run a kdcache subcommand as its own process (Ray, DeepSpeed and vLLM stay isolated)."""
    cmd = [sys.executable, "-m", "kdcache", *map(str, args)]
    say("$ kdcache " + " ".join(map(str, args)))
    res = subprocess.run(cmd)
    if res.returncode != 0:
        raise SystemExit(f"[demo] step failed ({res.returncode}): kdcache {args[0]}")


def build_data(root, p):
    from .task import make_splits, write_jsonl
    d = os.path.join(root, "data")
    if os.path.isfile(os.path.join(d, "heldout.jsonl")):
        say(f"reusing task data in {d}")
        return d
    os.makedirs(d, exist_ok=True)
    train, held = make_splits(p["n_train"], p["n_heldout"], seed=0)
    write_jsonl(train, os.path.join(d, "train.jsonl"))
    write_jsonl(held, os.path.join(d, "heldout.jsonl"))
    say(f"task data: {len(train)} train, {len(held)} held-out chats in {d}")
    return d


def build_teacher(root, data_dir, p):
    from .teacher import train_teacher
    out = os.path.join(root, "teacher")
    if os.path.isfile(os.path.join(out, "teacher_training.json")):
        say(f"reusing the trained teacher in {out}")
        return out
    from .task import corpus
    from .tokenizer import train_tokenizer
    records = [json.loads(x) for x in open(os.path.join(data_dir, "train.jsonl"))]
    tok = train_tokenizer(list(corpus(records)), os.path.join(root, "tokenizer"), vocab_size=p["vocab"])
    say(f"tokenizer: {len(tok)} tokens, eos {tok.eos_token!r}; training the teacher ({p['teacher_steps']} steps)")
    t0 = time.time()
    train_teacher(tok, records, out, size=p["teacher_size"], steps=p["teacher_steps"], log=say)
    say(f"teacher trained in {time.time() - t0:.0f} s -> {out}")
    return out


def student_config(root, teacher, p):
    """A fresh base-style student, as people distil into: the teacher's vocabulary, but the base model's EOS
    (<|endoftext|>), a generation config that stops there, and no chat template. kdcache train still trains
    it from the cache alone, and its final/ stops at <|im_end|> like the teacher (the tokenizer check compares
    ids, not which token is called EOS; final/ gets the cache's end-of-turn ids and the teacher's template)."""
    from transformers import AutoTokenizer

    from .models import make_model
    out = os.path.join(root, "student_init")
    if not os.path.isfile(os.path.join(out, "config.json")):
        tok = AutoTokenizer.from_pretrained(teacher)
        tok.eos_token, tok.chat_template = "<|endoftext|>", None
        model = make_model(tok, "student" if p is FULL else "test", seed=1)
        model.config.save_pretrained(out)
        model.generation_config.save_pretrained(out)
        tok.save_pretrained(out)
    return out


def precompute_args(root, data_dir, teacher, p, control, teacher_backend):
    out = os.path.join(root, "cache_no_eos" if control else "cache")
    args = ["--teacher", teacher, "--data", os.path.join(data_dir, "train.jsonl"), "--out", out,
            "--top-k", p["top_k"], "--shard-size", p["shard_size"], "--backend", teacher_backend, "--max-length", 256,
            "--worker-cpus", 0.5]
    if control:
        args.append("--drop-end-of-turn")
    return out, [str(a) for a in args]


def run_precomputes(root, data_dir, teacher, p, variants, teacher_backend):
    """`kdcache precompute` for each cache, in this process on one Ray and one teacher (pipeline/pool.py, as
    `kdcache onpolicy` keeps them across rounds): the control's job takes the first job's teacher workers instead of
    starting Ray and loading the teacher again. Returns {control: cache directory}."""
    from kdcache.common.config import run_command
    from kdcache.pipeline.cli import DESCRIPTION
    from kdcache.pipeline.config import PrecomputeConfig
    from kdcache.pipeline.job import run_precompute
    from kdcache.pipeline.pool import WorkerPool
    pool, caches = WorkerPool(), {}

    def job(cfg):
        run_precompute(cfg, pool=pool)

    try:
        for control in variants:
            out, args = precompute_args(root, data_dir, teacher, p, control, teacher_backend)
            say("$ kdcache precompute " + " ".join(args))
            run_command("kdcache precompute", DESCRIPTION, PrecomputeConfig, job, args)
            caches[control] = out
    finally:
        pool.close()
    return caches


def run_train(root, cache, student_init, p, control):
    out = os.path.join(root, "student_no_eos" if control else "student")
    summary = os.path.join(out, "train_summary.json")
    if os.path.isfile(summary) and json.load(open(summary)).get("reason") == "finished":
        say(f"reusing the trained student in {out}")
        return out
    args = ["train", "--cache", cache, "--student", student_init, "--out", out, "--max-steps", p["student_steps"],
            "--batch-size", p["student_batch"], "--lr", p["student_lr"], "--warmup-steps", 20,
            "--sft-alpha", 0, "--beta", 0, "--save-every", 200]
    if control:
        args.append("--no-require-eos")       # this cache lacks the end-of-turn positions on purpose
    kdcache(*args)
    return out


def add_label_f1(report, heldout):
    """The task's own metric beside `kdcache eval`'s: label F1 of each model's answers, into eval.json and
    report.md. Returns eval.json's results with it."""
    from .task import label_f1
    path = os.path.join(report, "eval.json")
    results = json.load(open(path))
    for r in results.values():
        r["label_f1"] = label_f1(r["answers"], heldout)
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    rows = "\n".join(f"| {name} | {r['label_f1']:.3f} |" for name, r in results.items())
    with open(os.path.join(report, "report.md"), "a") as f:
        f.write(f"\n## The task: label F1\n\nAnswers read as comma-separated skill sets, against the reference.\n\n"
                f"| model | label F1 |\n|---|---|\n{rows}\n")
    return results


def check_bars(results):
    t, s, c = results["teacher"], results["student"], results.get("student_no_eos")
    failures = []
    if s["stop_rate"] < BARS["stop_rate"]:
        failures.append(f"distilled student stops on {s['stop_rate']:.1%} < {BARS['stop_rate']:.0%}")
    if t["label_f1"] - s["label_f1"] > BARS["f1_gap"]:
        failures.append(f"student label F1 {s['label_f1']:.3f} is more than {BARS['f1_gap']} below the "
                        f"teacher's {t['label_f1']:.3f}")
    if c is not None and c["stop_rate"] > s["stop_rate"] - 0.5:
        failures.append(f"control student stops on {c['stop_rate']:.1%}: not clearly fewer than "
                        f"{s['stop_rate']:.1%}")
    return failures


def main(argv=None):
    ap = argparse.ArgumentParser(prog="kdcache demo", description=__doc__.splitlines()[0])
    ap.add_argument("--root", default="runs/demo", help="where everything is built and reused")
    ap.add_argument("--stage", choices=STAGES, default="eval", help="stop after this stage")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (the test suite's version); no quality bars")
    ap.add_argument("--no-control", action="store_true", help="skip the control experiment (EOS removed)")
    from kdcache.pipeline.teacher import TEACHERS, choose_backend
    ap.add_argument("--backend", choices=("auto", *(t for t in TEACHERS if t != "served")), default="auto",
                    help="teacher backend for precompute (auto: vLLM with a CUDA GPU, transformers on CPU)")
    args = ap.parse_args(argv)
    p = QUICK if args.quick else FULL
    t0 = time.time()
    os.makedirs(args.root, exist_ok=True)
    data_dir = build_data(args.root, p)
    if args.stage == "data":
        return 0
    teacher = build_teacher(args.root, data_dir, p)
    if args.stage == "teacher":
        return 0
    variants = [False] if args.no_control else [False, True]
    teacher_backend, why = choose_backend(args.backend)
    say(f"teacher backend: {teacher_backend} ({'auto: ' if args.backend == 'auto' else ''}{why})")
    caches = run_precomputes(args.root, data_dir, teacher, p, variants, teacher_backend)
    if args.stage == "precompute":
        return 0
    init = student_config(args.root, teacher, p)
    students = {c: run_train(args.root, caches[c], init, p, c) for c in variants}
    if args.stage == "train":
        return 0
    report = os.path.join(args.root, "report")
    eval_args = ["eval", "--data", os.path.join(data_dir, "heldout.jsonl"), "--out", report, "--reference",
                 "teacher", "--model", f"teacher={teacher}", "--max-new-tokens", p["max_new_tokens"],
                 "--title", "kdcache demo: does a student distilled from the cache learn to stop?",
                 "--note", NOTE]
    for c, d in students.items():
        name = "student_no_eos" if c else "student"
        eval_args += ["--model", f"{name}={os.path.join(d, 'final')}", "--run", f"{name}={d}"]
    kdcache(*eval_args)
    results = add_label_f1(report, os.path.join(data_dir, "heldout.jsonl"))
    say(f"done in {time.time() - t0:.0f} s; report: {os.path.join(report, 'report.md')}")
    if args.quick:
        return 0
    failures = check_bars(results)
    with open(os.path.join(report, "report.md"), "a") as f:
        f.write("\n## Bars\n\n" + ("\n".join(f"- MISSED: {x}" for x in failures) if failures else
                                    f"- all met: student stops on >= {BARS['stop_rate']:.0%}, label F1 within "
                                    f"{BARS['f1_gap']} of the teacher, control clearly fails to stop") + "\n")
    for x in failures:
        say(f"BAR MISSED: {x}")
    return 1 if failures else 0
