"""Caches judged by the students they make (issue 26): one teacher, one student recipe, every storage mode.

    .venv/bin/python bench/students.py [--workdir bench/work/students] [--seeds 3] [--steps 150] [--modes a,b]

The teacher is bench/realistic.py's (a 1.36 M-parameter Qwen2 trained on the standard library's source,
V = 6,000, ~4 nats of next-token entropy), built or reused. Its 300 held-out chats are split: the first 240 are
the distillation data, the last 60 the students' held-out set. For each storage mode, `kdcache precompute` (hf
backend) writes a cache of the 240 chats; then for each seed, `kdcache train` trains a fresh small student (a
Qwen2 of hidden 64, 2 layers: 0.46 M parameters, most of them its tied embeddings) from that cache alone: the
same data, steps, batch, learning rate and seed under every mode, sft_alpha 0. Each student's final/ is then
scored, teacher-forced, on the held-out chats' assistant tokens (the positions kdcache trains):
  kl      KL(teacher || student) over the full vocabulary, nats per token
  ppl     the student's perplexity on the held-out tokens themselves
  ece     expected calibration error of the student's top-1 next-token probability (15 equal-width bins)
  agree   how often the student's top-1 token is the teacher's
(The demo task's stop rate does not apply: this teacher ends only 38% of its own sampled answers.) Also per
mode: bytes per position of the cache, precompute throughput after start-up (tokens/s), and the positions per
second one process reads. Prints one table (means and sample standard deviations over seeds) and writes it with
every run's figures to WORKDIR/students.json.
"""
import argparse
import json
import math
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

V = 6000
# mode -> precompute flags. full: every id of the vocabulary (the reference a student can learn from at most).
MODES = {
    "full": ["--top-k", V],
    "top64-float16": ["--top-k", 64],
    "top64-sqrt8": ["--top-k", 64, "--logprob-dtype", "sqrt8"],
    "top-p0.95": ["--top-k", 64, "--top-p", 0.95, "--logprob-dtype", "sqrt8"],
    "sample12": ["--sample", 12, "--logprob-dtype", "sqrt8"],
    "sample24": ["--sample", 24, "--logprob-dtype", "sqrt8"],
    "sample50": ["--sample", 50, "--logprob-dtype", "sqrt8"],
    "top8+sample16": ["--top-k", 8, "--sample", 16, "--logprob-dtype", "sqrt8"],
}
STUDENT = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
               intermediate_size=192)
N_TRAIN, ECE_BINS = 240, 15


def run(cmd, log):
    with open(log, "w") as f:
        res = subprocess.run([sys.executable, "-m", "kdcache", *map(str, cmd)], stdout=f, stderr=subprocess.STDOUT)
    if res.returncode != 0:
        raise SystemExit(f"failed ({res.returncode}): kdcache {' '.join(map(str, cmd))}; see {log}")


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def student_init(teacher, out):
    """A fresh student's config and tokenizer (kdcache train initialises it from --seed)."""
    from realistic import make_model
    from transformers import AutoTokenizer
    if not os.path.isfile(os.path.join(out, "config.json")):
        tok = AutoTokenizer.from_pretrained(teacher)
        model = make_model(tok, 0, **STUDENT)
        model.config.save_pretrained(out)
        model.generation_config.save_pretrained(out)
        tok.save_pretrained(out)
    return out


def held_out_positions(tok, chats):
    """[(token ids, [assistant span positions])]: what kdcache trains, on the held-out chats."""
    from kdcache.common.chat import chat_spans
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    out = []
    for c in chats:
        ids, spans = chat_spans(tok, c["messages"], {eos})
        out.append((ids, np.concatenate([np.arange(a - 1, b - 1) for a, b in spans])))
    return out


def teacher_logprobs(teacher, data):
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32).eval()
    with torch.no_grad():
        return [torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, pos].float(), -1)
                for ids, pos in data]


def score(student_dir, data, teacher_lp):
    """The held-out figures of one student (see the module's docstring)."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(student_dir, dtype=torch.float32).eval()
    kl = nll = agree = n = 0.0
    conf, right = [], []
    with torch.no_grad():
        for (ids, pos), t in zip(data, teacher_lp):
            s = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, pos].float(), -1)
            tgt = torch.tensor(ids)[torch.as_tensor(pos) + 1]
            kl += float((t.exp() * (t - s)).sum())
            nll -= float(s.gather(1, tgt[:, None]).sum())
            agree += float((s.argmax(-1) == t.argmax(-1)).sum())
            p, top = s.exp().max(-1)
            conf.append(p.numpy())
            right.append((top == tgt).numpy())
            n += len(pos)
    conf, right = np.concatenate(conf), np.concatenate(right)
    bins = np.minimum((conf * ECE_BINS).astype(int), ECE_BINS - 1)
    ece = sum(abs(right[bins == b].mean() - conf[bins == b].mean()) * (bins == b).mean()
              for b in range(ECE_BINS) if (bins == b).any())
    return {"kl": kl / n, "ppl": math.exp(nll / n), "ece": float(ece), "agree": agree / n, "tokens": int(n)}


def read_speed(cache_dir, repeats=3):
    """Positions per second that one process decodes, iterating the whole cache (best of `repeats`)."""
    from kdcache.cache_format import open_cache
    best = 0.0
    for _ in range(repeats):
        t0, n = time.perf_counter(), 0
        for rec in open_cache(cache_dir):
            n += len(rec.positions)
        best = max(best, n / (time.perf_counter() - t0))
    return best


def mean_sd(xs):
    xs = np.asarray(xs, dtype=np.float64)
    return float(xs.mean()), float(xs.std(ddof=1)) if len(xs) > 1 else 0.0


def table(results):
    head = ("| mode | B/position | precompute tok/s | read positions/s | KL(T‖S) nats/token | student ppl | ECE | "
            "top-1 agree |\n|---|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    for mode, r in results.items():
        cells = [f"{r['bytes_per_position']:.1f}", f"{r['precompute_tokens_per_s']:,.0f}",
                 f"{r['read_positions_per_s'] / 1e6:.2f} M"]
        for key, fmt in (("kl", "{:.4f}"), ("ppl", "{:.2f}"), ("ece", "{:.4f}"), ("agree", "{:.3f}")):
            m, sd = mean_sd([s[key] for s in r["students"]])
            cells.append(f"{fmt.format(m)} ± {fmt.format(sd)}")
        rows.append(f"| {mode} | " + " | ".join(cells) + " |")
    return head + "\n" + "\n".join(rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default="bench/work/students")
    ap.add_argument("--teacher-workdir", default="bench/work/realistic")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated, of: " + ", ".join(MODES))
    args = ap.parse_args()
    from realistic import build
    from transformers import AutoTokenizer
    work = os.path.abspath(args.workdir)
    os.makedirs(work, exist_ok=True)
    built = build(args.teacher_workdir)
    teacher = built["teacher"]
    chats = [json.loads(x) for x in open(built["chats"])]
    train, held = chats[:N_TRAIN], chats[N_TRAIN:]
    data_path = os.path.join(work, "train.jsonl")
    write_jsonl(data_path, train)
    init = student_init(teacher, os.path.join(work, "student_init"))
    tok = AutoTokenizer.from_pretrained(teacher)
    data = held_out_positions(tok, held)
    t_lp = teacher_logprobs(teacher, data)
    print(f"teacher {teacher}: {len(train)} chats to distil, {len(held)} held out "
          f"({sum(len(p) for _, p in data):,} held-out positions)", flush=True)
    out_json = os.path.join(work, "students.json")
    results = json.load(open(out_json)) if os.path.exists(out_json) else {}
    for mode in args.modes.split(","):
        cache = os.path.join(work, "caches", mode)
        if not os.path.exists(os.path.join(cache, "report", "summary.json")):
            t0 = time.time()
            run(["precompute", "--teacher", teacher, "--data", data_path, "--out", cache, "--backend", "hf",
                 "--shard-size", 60, "--worker-cpus", 0.5, "--no-progress", *MODES[mode]],
                os.path.join(work, f"precompute-{mode}.log"))
            print(f"{mode}: cache in {time.time() - t0:.0f} s", flush=True)
        summary = json.load(open(os.path.join(cache, "report", "summary.json")))
        m = json.load(open(os.path.join(cache, "manifest.json")))
        entry = results.get(mode, {})
        entry.update(bytes_per_position=m["counts"]["bytes"] / m["counts"]["positions"],
                     precompute_tokens_per_s=summary["loop_tok_s"], flags=list(map(str, MODES[mode])),
                     read_positions_per_s=read_speed(cache))
        done = {s["seed"] for s in entry.get("students", [])}
        for seed in range(args.seeds):
            if seed in done:
                continue
            out = os.path.join(work, "runs", f"{mode}-seed{seed}")
            t0 = time.time()
            run(["train", "--cache", cache, "--student", init, "--out", out, "--max-steps", args.steps,
                 "--batch-size", args.batch_size, "--lr", args.lr, "--warmup-steps", 10, "--sft-alpha", 0,
                 "--seed", seed, "--save-every", 10**6, "--no-progress"],
                os.path.join(work, f"train-{mode}-{seed}.log"))
            fig = dict(seed=seed, train_s=round(time.time() - t0, 1), **score(os.path.join(out, "final"), data, t_lp))
            entry.setdefault("students", []).append(fig)
            print(f"{mode} seed {seed}: " + ", ".join(f"{k} {v:.4g}" for k, v in fig.items()), flush=True)
            results[mode] = entry
            with open(out_json, "w") as f:
                json.dump(results, f, indent=1)
        results[mode] = entry
    with open(out_json, "w") as f:
        json.dump(results, f, indent=1)
    print()
    print(table({m: results[m] for m in MODES if m in results and results[m].get("students")}))


if __name__ == "__main__":
    main()
