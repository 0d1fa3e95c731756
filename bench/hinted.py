"""A hinted teacher's cache against an unhinted one (issue 45): privileged context distilled into a student.

    .venv/bin/python bench/hinted.py [--seeds 3] [--steps 300] [--out bench/work/hinted] [--blind]

Task: the demo's (a job posting -> its required skills, then the end of turn). The hint carries the answer: the
teacher's system prompt "The required skills: docker, sql." (teacher_messages); the student sees only the posting.
The twelve skills are split in two halves. The teacher (the demo's student size, hidden 96) is trained on chats that are
either hinted (any skills: it learns to read the hint) or unhinted with skills of the first half only, so alone it
maps the second half's paraphrases poorly, and with the hint it answers every posting. This is the case privileged
context is for: a teacher that solves with the reference what it cannot solve alone. It learns the second half's
paraphrases from the hinted chats all the same; --blind gives each hinted chat another draw's posting, so that it
cannot (BENCHMARKS.md has both).

From one set of distillation chats (all skills, none in the teacher's training or the held-out set), two caches:
`kdcache precompute` over "messages" (the unhinted teacher) and over the same records with "teacher_messages" (the
hinted teacher scores the student's tokens in its own context). For each seed a fresh student (the test size,
hidden 64) trains the same steps from each cache alone (forward KL, sft_alpha 0), and one from the reference answers
(--objective sft) for scale. Held-out, for every model:
  stop     greedy answers that end with the end-of-turn token within 32 tokens
  f1       label F1 of the answers (the demo's metric); f1 B: over the postings that ask for a second-half skill
  kl H/U   teacher-forced KL(teacher || student) per answer token, full vocabulary, the hinted (H: in its own
           context) and the unhinted (U) teacher on the reference answers
Prints a table (means and sample standard deviations over seeds) and writes it to OUT/hinted.json.
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

FIRST = sorted(SKILLS)[::2]            # the half the teacher also learns without a hint
SECOND = sorted(SKILLS)[1::2]          # the half it learns only with one
NEW_TOKENS = 32


def hinted(rec):
    answer = rec["messages"][-1]["content"]
    return dict(rec, teacher_messages=[{"role": "system", "content": f"The required skills: {answer}."}]
                + rec["messages"])


def skills_of(rec):
    return labels(rec["messages"][-1]["content"])


def make_data(n_teacher, n_distil, n_held, seed=0, blind=False):
    """(teacher training chats, distillation chats, held-out chats), no posting in two of them. The teacher's are
    hinted (as {"messages": teacher view}) half the time; the unhinted half asks only for first-half skills.
    blind: each hinted chat's posting is another draw's, so the hint alone names the answer and no second-half
    paraphrase ever appears beside its skill: the teacher learns to copy the hint, and cannot map that half
    alone."""
    rng, seen = random.Random(seed), set()

    def draw(ok=lambda r: True):
        while True:
            r = make_example(rng)
            key = r["messages"][0]["content"]
            if key not in seen and ok(r):
                seen.add(key)
                return r
    teacher = []
    for i in range(n_teacher):
        if i % 2:
            view = hinted(draw())["teacher_messages"]
            if blind:
                view[1] = draw()["messages"][0]
            teacher.append({"messages": view})
        else:
            teacher.append(draw(lambda r: skills_of(r) <= set(FIRST)))
    distil = [draw() for _ in range(n_distil)]
    held = [draw() for _ in range(n_held)]
    return teacher, distil, held






def setup(out, args):
    from transformers import AutoTokenizer

    from kdcache.demo.models import make_model
    from kdcache.demo.task import corpus
    from kdcache.demo.teacher import train_teacher
    from kdcache.demo.tokenizer import train_tokenizer
    d = os.path.join(out, "setup")
    done = os.path.join(d, "done.json")
    if os.path.isfile(done):
        return json.load(open(done))
    os.makedirs(d, exist_ok=True)
    teach, distil, held = make_data(args.teacher_chats, args.distil_chats, args.heldout, blind=args.blind)
    tok = train_tokenizer(list(corpus(teach + distil)), os.path.join(d, "tok"), vocab_size=512)
    t0 = time.time()
    train_teacher(tok, teach, os.path.join(d, "teacher"), size=args.teacher_size, steps=args.teacher_steps,
                  log=lambda m: print(m, flush=True))
    student = os.path.join(d, "student_init")
    tok = AutoTokenizer.from_pretrained(os.path.join(d, "teacher"))
    model = make_model(tok, args.student_size, seed=1)
    model.save_pretrained(student)
    tok.save_pretrained(student)
    info = {"teacher": os.path.join(d, "teacher"), "student": student,
            "distil": write_jsonl(distil, os.path.join(d, "distil.jsonl")),
            "distil_hinted": write_jsonl([hinted(r) for r in distil], os.path.join(d, "distil_hinted.jsonl")),
            "heldout": write_jsonl(held, os.path.join(d, "heldout.jsonl")),
            "teacher_training_s": round(time.time() - t0, 1),
            "parameters": {"teacher": sum(p.numel() for p in make_model(tok, args.teacher_size).parameters()),
                           "student": sum(p.numel() for p in model.parameters())}}
    json.dump(info, open(done, "w"))
    return info


def caches(info, out):
    """{"unhinted": dir, "hinted": dir}: one precompute each, reused across seeds."""
    got = {}
    for name, data in (("unhinted", info["distil"]), ("hinted", info["distil_hinted"])):
        c = os.path.join(out, f"cache-{name}")
        if not os.path.isfile(os.path.join(c, "manifest.json")):
            kdcache("precompute", "--teacher", info["teacher"], "--data", data, "--out", c, "--backend", "hf",
                    "--top-k", 32, "--no-progress", log=os.path.join(out, "log.txt"))
        got[name] = c
    return got


def train(info, cache, out, seed, args, *extra):
    if not os.path.isfile(os.path.join(out, "final", "config.json")):
        kdcache("train", "--cache", cache, "--student", info["student"], "--out", out, "--max-steps", args.steps,
                "--batch-size", 16, "--lr", 3e-3, "--warmup-steps", 20, "--sft-alpha", 0, "--beta", 0, "--seed", seed,
                "--save-every", 0, "--no-progress", *extra, log=os.path.join(out + ".log"))
    return os.path.join(out, "final")


def views(enc, rec, hint):
    """(ids, answer positions) of a held-out chat's reference answer: the student's view, or the hinted
    teacher's."""
    from kdcache.pipeline.data import parse_row
    return enc.encode(parse_row(hinted(rec) if hint else rec)).scored


def score(model_dir, held, teachers, enc, hint=False):
    """Stop rate, F1 (all, B) and KL from each teacher of one model on the held-out chats. hint: the model answers
    in the hinted teacher's context (the teacher's own row)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    stops = set(enc.turn_ends)
    ended, f1s, f1b = 0, [], []
    with torch.no_grad():
        for rec in held:
            msgs = hinted(rec)["teacher_messages"] if hint else rec["messages"]
            prompt = tok(tok.apply_chat_template(msgs[:-1], tokenize=False, add_generation_prompt=True),
                         add_special_tokens=False, return_tensors="pt")
            new = model.generate(**prompt, max_new_tokens=NEW_TOKENS, do_sample=False,
                                 pad_token_id=tok.pad_token_id)[0, prompt["input_ids"].shape[1]:].tolist()
            end = next((j for j, t in enumerate(new) if t in stops), None)
            ended += end is not None
            got = labels(tok.decode(new[:end] if end is not None else new, skip_special_tokens=True))
            f1s.append(f1(got, skills_of(rec)))
            if skills_of(rec) & set(SECOND):
                f1b.append(f1s[-1])
        res = {"stop": ended / len(held), "f1": statistics.mean(f1s), "f1_b": statistics.mean(f1b)}
        if hint:
            return res
        for name, (teacher, t_hint) in teachers.items():
            total, n = 0.0, 0
            for rec in held:
                t_ids, t_pos = views(enc, rec, t_hint)
                s_ids, s_pos = views(enc, rec, False)
                lp_t = torch.log_softmax(teacher(torch.tensor([t_ids.tolist()])).logits[0, t_pos].float(), -1)
                lp_s = torch.log_softmax(model(torch.tensor([s_ids.tolist()])).logits[0, s_pos].float(), -1)
                total += float((lp_t.exp() * (lp_t - lp_s)).sum())
                n += len(s_pos)
            res[f"kl_{name}"] = total / n
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "work", "hinted"))
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--teacher-chats", type=int, default=2000)
    ap.add_argument("--teacher-steps", type=int, default=600)
    ap.add_argument("--teacher-size", default="student", help="kdcache.demo.models.SIZES")
    ap.add_argument("--student-size", default="test")
    ap.add_argument("--distil-chats", type=int, default=800)
    ap.add_argument("--heldout", type=int, default=150)
    ap.add_argument("--blind", action="store_true",
                    help="the teacher's hinted chats carry another draw's posting (make_data): it cannot solve "
                         "the second half alone")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kdcache.pipeline.encode import Encoder
    t0 = time.time()
    info = setup(args.out, args)
    print(f"setup: teacher {info['parameters']['teacher']:,} parameters, trained in {info['teacher_training_s']} s",
          flush=True)
    cache = caches(info, args.out)
    held = [json.loads(x) for x in open(info["heldout"])]
    enc = Encoder(AutoTokenizer.from_pretrained(info["teacher"]))
    teacher = AutoModelForCausalLM.from_pretrained(info["teacher"], dtype=torch.float32).eval()
    teachers = {"H": (teacher, True), "U": (teacher, False)}
    rows = {"teacher, hinted": [score(info["teacher"], held, teachers, enc, hint=True)],
            "teacher, unhinted": [score(info["teacher"], held, teachers, enc)]}
    arms = {"KD from the unhinted cache": (cache["unhinted"], ()), "KD from the hinted cache": (cache["hinted"], ()),
            "SFT on the references": (cache["unhinted"], ("--objective", "sft"))}
    for seed in range(args.seeds):
        for name, (c, extra) in arms.items():
            tag = name.split()[-2] if name.startswith("KD") else "sft"
            final = train(info, c, os.path.join(args.out, f"{tag}-s{seed}"), seed, args, *extra)
            rows.setdefault(name, []).append(score(final, held, teachers, enc))
            print(f"seed {seed} {name}: {rows[name][-1]}", flush=True)
    keys = ("stop", "f1", "f1_b", "kl_H", "kl_U")
    table = {name: {k: (statistics.mean(r[k] for r in runs),
                        statistics.stdev(r[k] for r in runs) if len(runs) > 1 else 0.0)
                    for k in keys if k in runs[0]} for name, runs in rows.items()}
    print(f"\n{len(held)} held-out chats, {args.seeds} seeds, {args.steps} steps of 16 ({time.time() - t0:.0f} s)")
    print("| model | stop | F1 | F1, second-half skills | KL from hinted teacher | KL from unhinted teacher |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, figs in table.items():
        cells = [f"{figs[k][0]:.3f} ± {figs[k][1]:.3f}" if k in figs else "-" for k in keys]
        print(f"| {name} | " + " | ".join(cells) + " |")
    json.dump({"args": vars(args), "info": info, "runs": rows, "table": table},
              open(os.path.join(args.out, "hinted.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
