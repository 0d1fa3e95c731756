"""Cross-tokenizer distillation from a cache (issue 46): a ChatML teacher's cache trained into a Llama 3-template
student whose tokenizer has other merges, other ids and another vocabulary size.

    .venv/bin/python bench/cross_tokenizer.py [--seeds 3] [--steps 800] [--out bench/work/cross] [--arms A,B]
        [--noise 0.4]      # that share of the cache's chats with a wrong answer

Task: the demo's (a job posting -> its required skills, then the end of turn). The teacher (the demo's tokenizer:
byte-level BPE, 512 ids, ChatML, <|im_end|>; hidden 96) is trained on 2,000 chats. One cache of 800 other chats
(top-k 32, hf), with its source (SPEC.md 4.6). For each seed fresh students of the same size (hidden 64),
the same steps, batch and learning rate (four arms):
  cross KD    the Llama 3-family tokenizer (tests/helpers/families.py: 384 ids trained on the corpus reversed,
              <|begin_of_text|>, header markup, <|eot_id|>), `kdcache train --cross-tokenizer`, forward KL, no SFT term
  cross SFT   the same student and derived records, `--objective sft` (the cross-entropy on its own rendering)
  same KD     the teacher's tokenizer, token-exact KD from the same cache
  same SFT    the teacher's tokenizer, `--objective sft` (what the student's tokenizer alone changes)
Held-out (150 chats, none in the teacher's or the cache's data), each model in its own template, greedy, 32 tokens:
  stop        answers that end with the model's own end-of-turn token
  f1          label F1 of the answers (the demo's metric)
and from each run's train_summary.json / metrics.jsonl: coverage (positions by kind, teacher mass mapped) and
the mean step time. Prints a table (means and sample standard deviations over seeds), writes OUT/cross.json.
"""
import argparse
import json
import os
import random
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from runs import kdcache, write_jsonl  # noqa: E402

from kdcache.demo.task import SKILLS, f1, labels, make_example  # noqa: E402

NEW_TOKENS = 32


def make_data(n_teacher, n_distil, n_held, seed=0, noise=0.0):
    """(teacher's chats, the cache's chats, held-out chats), disjoint. noise: the share of the cache's chats whose
    answer is replaced by as many other skills (references with errors, as real data has; the teacher, trained
    on clean chats, scores them all)."""
    rng, seen, out = random.Random(seed), set(), []
    for n in (n_teacher, n_distil, n_held):
        part = []
        while len(part) < n:
            r = make_example(rng)
            if r["messages"][0]["content"] not in seen:
                seen.add(r["messages"][0]["content"])
                part.append(r)
        out.append(part)
    wrong = random.Random(seed + 1)
    for r in out[1]:
        if wrong.random() < noise:
            k = len(labels(r["messages"][-1]["content"]))
            r["messages"][-1]["content"] = ", ".join(wrong.sample(sorted(SKILLS), k))
    return out


def setup(out, args):
    from transformers import AutoTokenizer

    from kdcache.demo.models import make_model
    from kdcache.demo.task import corpus
    from kdcache.demo.teacher import train_teacher
    from kdcache.demo.tokenizer import train_tokenizer
    from tests.helpers.families import family_tokenizer
    d = os.path.join(out, "setup")
    done = os.path.join(d, "done.json")
    if os.path.isfile(done):
        return json.load(open(done))
    os.makedirs(d, exist_ok=True)
    teach, distil, held = make_data(args.teacher_chats, args.distil_chats, args.heldout, noise=args.noise)
    texts = list(corpus(teach + distil))
    t_tok = train_tokenizer(texts, os.path.join(d, "t-tok"), vocab_size=512)
    t0 = time.time()
    train_teacher(t_tok, teach, os.path.join(d, "teacher"), size=args.teacher_size, steps=args.teacher_steps,
                  log=lambda m: print(m, flush=True))
    teacher_s = time.time() - t0
    t_tok = AutoTokenizer.from_pretrained(os.path.join(d, "teacher"))
    s_tok = family_tokenizer("llama3", os.path.join(d, "s-tok"), texts[::-1], vocab_size=384)
    info = {"teacher": os.path.join(d, "teacher"), "teacher_training_s": round(teacher_s, 1),
            "distil": write_jsonl(distil, os.path.join(d, "distil.jsonl")),
            "heldout": write_jsonl(held, os.path.join(d, "heldout.jsonl")),
            "vocab": {"teacher": len(t_tok), "student": len(s_tok)}}
    for name, tok in (("student_cross", s_tok), ("student_same", t_tok)):
        model = make_model(tok, args.student_size, seed=1)
        model.generation_config.eos_token_id = tok.eos_token_id
        model.save_pretrained(os.path.join(d, name))
        tok.save_pretrained(os.path.join(d, name))
        info[name] = os.path.join(d, name)
    json.dump(info, open(done, "w"))
    return info


def train(cache, student, out, seed, args, *extra):
    t = None
    if not os.path.isfile(os.path.join(out, "final", "config.json")):
        t = kdcache("train", "--cache", cache, "--student", student, "--out", out, "--max-steps", args.steps,
                    "--batch-size", 16, "--lr", 3e-3, "--warmup-steps", 20, "--sft-alpha", 0, "--beta", 0,
                    "--seed", seed, "--save-every", 0, "--no-progress", "--log-every", 10, *extra,
                    log=out + ".log")
    summary = json.load(open(os.path.join(out, "train_summary.json")))
    rows = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    tok_s = statistics.mean(r["tokens_per_s"] for r in rows[1:] or rows)
    return os.path.join(out, "final"), summary, tok_s, t


def score(model_dir, held):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    stops = model.generation_config.eos_token_id
    stops = set(stops if isinstance(stops, list) else [stops])
    ended, f1s = 0, []
    with torch.no_grad():
        for rec in held:
            prompt = tok(tok.apply_chat_template(rec["messages"][:-1], tokenize=False, add_generation_prompt=True),
                         add_special_tokens=False, return_tensors="pt")
            new = model.generate(**prompt, max_new_tokens=NEW_TOKENS, do_sample=False,
                                 pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else min(stops)
                                 )[0, prompt["input_ids"].shape[1]:].tolist()
            end = next((j for j, t in enumerate(new) if t in stops), None)
            ended += end is not None
            got = labels(tok.decode(new[:end] if end is not None else new, skip_special_tokens=True))
            f1s.append(f1(got, labels(rec["messages"][-1]["content"])))
    return {"stop": ended / len(held), "f1": statistics.mean(f1s)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "work", "cross"))
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--teacher-chats", type=int, default=2000)
    ap.add_argument("--teacher-steps", type=int, default=600)
    ap.add_argument("--teacher-size", default="student", help="kdcache.demo.models.SIZES")
    ap.add_argument("--student-size", default="test")
    ap.add_argument("--distil-chats", type=int, default=800)
    ap.add_argument("--heldout", type=int, default=150)
    ap.add_argument("--noise", type=float, default=0.0, help="share of the cache's chats with a wrong answer "
                    "(the teacher's chats and the held-out ones stay clean)")
    ap.add_argument("--arms", default="all", help="comma-separated arm names (e.g. 'cross-tokenizer KD,"
                    "cross-tokenizer SFT'), or all")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    info = setup(args.out, args)
    print(f"setup: vocabularies {info['vocab']}, teacher trained in {info['teacher_training_s']} s", flush=True)
    cache = os.path.join(args.out, "cache")
    if not os.path.isfile(os.path.join(cache, "manifest.json")):
        kdcache("precompute", "--teacher", info["teacher"], "--data", info["distil"], "--out", cache, "--backend",
                "hf", "--top-k", 32, "--no-progress", log=os.path.join(args.out, "log.txt"))
    held = [json.loads(x) for x in open(info["heldout"])]
    rows = {"teacher": [score(info["teacher"], held)]}
    arms = {"cross-tokenizer KD": (info["student_cross"], ("--cross-tokenizer",)),
            "cross-tokenizer SFT": (info["student_cross"], ("--cross-tokenizer", "--objective", "sft")),
            "same-tokenizer KD": (info["student_same"], ()),
            "same-tokenizer SFT": (info["student_same"], ("--objective", "sft"))}
    if args.arms != "all":
        arms = {name: arms[name] for name in args.arms.split(",")}
    coverage, speed = {}, {}
    for seed in range(args.seeds):
        for name, (student, extra) in arms.items():
            tag = name.replace(" ", "-").lower()
            final, summary, tok_s, _ = train(cache, student, os.path.join(args.out, f"{tag}-s{seed}"), seed, args,
                                             *extra)
            rows.setdefault(name, []).append(score(final, held))
            speed.setdefault(name, []).append(tok_s)
            if "cross_tokenizer" in summary:
                coverage[name] = next(iter(summary["cross_tokenizer"].values()))
            print(f"seed {seed} {name}: {rows[name][-1]}, {tok_s:,.0f} tokens/s", flush=True)
    table = {name: {k: (statistics.mean(r[k] for r in runs),
                        statistics.stdev(r[k] for r in runs) if len(runs) > 1 else 0.0) for k in ("stop", "f1")}
             for name, runs in rows.items()}
    print(f"\n{len(held)} held-out chats, {args.seeds} seeds, {args.steps} steps of 16 ({time.time() - t0:.0f} s)")
    print("| model | stop | F1 | tokens/s |")
    print("|---|---:|---:|---:|")
    for name, figs in table.items():
        tps = f"{statistics.mean(speed[name]):,.0f}" if name in speed else "-"
        print(f"| {name} | {figs['stop'][0]:.3f} ± {figs['stop'][1]:.3f} | {figs['f1'][0]:.3f} ± {figs['f1'][1]:.3f} "
              f"| {tps} |")
    kd, sft = rows.get("cross-tokenizer KD"), rows.get("cross-tokenizer SFT")
    if kd and sft:                         # the same seed's two students: data order and initial weights shared
        diff = [a["f1"] - b["f1"] for a, b in zip(kd, sft)]
        print(f"cross KD - cross SFT, F1 paired by seed: {statistics.mean(diff):+.3f} ± "
              f"{statistics.stdev(diff) if len(diff) > 1 else 0.0:.3f}; KD ahead in {sum(d > 0 for d in diff)} "
              f"of {len(diff)} seeds")
    for name, cov in coverage.items():
        print(f"{name}: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                     for k, v in cov.items() if k != "first_skipped"))
    json.dump({"args": vars(args), "info": info, "runs": rows, "table": table, "coverage": coverage,
               "tokens_per_s": speed}, open(os.path.join(args.out, "cross.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
