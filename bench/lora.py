"""LoRA students against full fine-tuning, from one cache (issue 44).

    .venv/bin/python bench/lora.py [--workdir bench/work/lora] [--steps 150] [--ranks 8,64]

The teacher is bench/realistic.py's (a 1.36 M-parameter Qwen2 trained on the standard library's source, V = 6,000),
built or reused. LoRA adapts a trained model, so the student is one too: a Qwen2 of the teacher's shape (hidden
128, 3 layers) pretrained by realistic.py's own loop for --base-steps (600) steps (the teacher had 2,000), a
weaker model of the same family. The teacher's 300 held-out chats are split: 200 are distilled (`kdcache
precompute --top-k 64`), 40 tune each method's learning rate, 60 are the test set. Each method trains --steps
steps of batch 8 from the same cache, base and seed (forward KL, sft_alpha 0) at each of its learning rates; the
rate with the lowest KL on the tuning chats is kept, and its student is scored on the test chats:
  kl       KL(teacher || student) over the full vocabulary, nats per held-out assistant token
  agree    how often the student's top-1 token is the teacher's
  tok/s    training throughput, the median over steps of metrics.jsonl's tokens_per_s (same data for each method)
  ckpt     bytes of one checkpoint directory (module and optimizer state) at the last step
Prints one table and writes every run's figures to WORKDIR/lora.json.
"""
import argparse
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from students import held_out_positions, run, score, teacher_logprobs, write_jsonl  # noqa: E402

N_TRAIN, N_TUNE = 200, 40
LRS = {"full": (1e-3, 3e-3, 1e-2), "lora": (3e-3, 1e-2, 3e-2)}


def base_student(teacher, out, steps):
    """A pretrained student to adapt: the teacher's shape, realistic.py's data and loop, `steps` steps, seed 1."""
    import realistic
    from transformers import AutoTokenizer
    if os.path.isfile(os.path.join(out, "model.safetensors")):
        return out
    tok = AutoTokenizer.from_pretrained(teacher)
    train_texts, _ = realistic.split_files(realistic.stdlib_files(realistic.DEFAULTS["megabytes"]))
    text_ids = realistic.token_stream(tok, train_texts)
    chat_ids = realistic.chat_stream(tok, realistic.cut_chats(train_texts, realistic.DEFAULTS["seed"] + 1))
    model = realistic.make_model(tok, 1)
    print(f"base student: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters, pretraining "
          f"{steps} steps", flush=True)
    realistic.train(model, text_ids, chat_ids, steps=steps, seed=1)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def dir_bytes(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def last_checkpoint(out):
    ckpts = os.path.join(out, "checkpoints")
    steps = sorted(d for d in os.listdir(ckpts) if not d.startswith("."))
    return os.path.join(ckpts, steps[-1])


def train_one(args, cache, base, method, lr, work):
    """Figures of one run: its directory, trainable parameters, throughput, checkpoint bytes."""
    out = os.path.join(work, "runs", f"{method}-lr{lr:g}")
    flags = [] if method == "full" else ["--lora-r", int(method.split("r")[-1])]
    if not os.path.isfile(os.path.join(out, "train_summary.json")):
        t0 = time.time()
        run(["train", "--cache", cache, "--student", base, "--out", out, "--max-steps", args.steps, "--batch-size", 8,
             "--lr", lr, "--warmup-steps", 10, "--sft-alpha", 0, "--seed", 0, "--save-every", args.steps,
             "--no-progress", *flags], os.path.join(work, f"train-{method}-lr{lr:g}.log"))
        print(f"{method} lr {lr:g}: trained in {time.time() - t0:.0f} s", flush=True)
    summary = json.load(open(os.path.join(out, "train_summary.json")))
    rows = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    return dict(out=out, lr=lr, trainable=summary["parameters"]["trainable"], total=summary["parameters"]["total"],
                tok_s=float(np.median([r["tokens_per_s"] for r in rows[1:]])),
                ckpt_bytes=dir_bytes(last_checkpoint(out)), final_loss=rows[-1]["loss"])


def table(results, base_fig):
    lines = ["| student | trainable params | lr (tuned) | KL(T‖S) test | top-1 agree | tok/s (vs full) | "
             "checkpoint bytes (vs full) |", "|---|---:|---:|---:|---:|---:|---:|",
             f"| base, not distilled | - | - | {base_fig['kl']:.4f} | {base_fig['agree']:.3f} | - | - |"]
    full = results["full"]["best"]
    for method, r in results.items():
        b = r["best"]
        lines.append(f"| {method} | {b['trainable']:,} of {b['total']:,} | {b['lr']:g} | {b['test']['kl']:.4f} | "
                     f"{b['test']['agree']:.3f} | {b['tok_s']:,.0f} ({b['tok_s'] / full['tok_s']:.2f}x) | "
                     f"{b['ckpt_bytes']:,} ({b['ckpt_bytes'] / full['ckpt_bytes']:.3f}x) |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default="bench/work/lora")
    ap.add_argument("--teacher-workdir", default="bench/work/realistic")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--base-steps", type=int, default=600)
    ap.add_argument("--ranks", default="8,64")
    args = ap.parse_args()
    from realistic import build
    from transformers import AutoTokenizer
    work = os.path.abspath(args.workdir)
    os.makedirs(work, exist_ok=True)
    built = build(args.teacher_workdir)
    teacher = built["teacher"]
    chats = [json.loads(x) for x in open(built["chats"])]
    train, tune, test = chats[:N_TRAIN], chats[N_TRAIN:N_TRAIN + N_TUNE], chats[N_TRAIN + N_TUNE:]
    data_path = os.path.join(work, "train.jsonl")
    write_jsonl(data_path, train)
    base = base_student(teacher, os.path.join(work, "base"), args.base_steps)
    cache = os.path.join(work, "cache")
    if not os.path.isfile(os.path.join(cache, "report", "summary.json")):
        run(["precompute", "--teacher", teacher, "--data", data_path, "--out", cache, "--backend", "hf",
             "--top-k", 64, "--shard-size", 50, "--worker-cpus", 0.5, "--no-progress"],
            os.path.join(work, "precompute.log"))
    tok = AutoTokenizer.from_pretrained(teacher)
    sets = {name: held_out_positions(tok, c) for name, c in (("tune", tune), ("test", test))}
    t_lp = {name: teacher_logprobs(teacher, d) for name, d in sets.items()}
    base_fig = score(base, sets["test"], t_lp["test"])
    print(f"base student on the test chats: KL {base_fig['kl']:.4f}", flush=True)
    results = {}
    for method in ["full"] + [f"lora-r{r}" for r in args.ranks.split(",")]:
        runs = []
        for lr in LRS["full" if method == "full" else "lora"]:
            fig = train_one(args, cache, base, method, lr, work)
            fig["tune"] = score(os.path.join(fig["out"], "final"), sets["tune"], t_lp["tune"])
            print(f"  {method} lr {lr:g}: tuning KL {fig['tune']['kl']:.4f}", flush=True)
            runs.append(fig)
        best = min(runs, key=lambda f: f["tune"]["kl"])
        best["test"] = score(os.path.join(best["out"], "final"), sets["test"], t_lp["test"])
        results[method] = {"runs": runs, "best": best}
        with open(os.path.join(work, "lora.json"), "w") as f:
            json.dump({"base": base_fig, "results": results, "steps": args.steps}, f, indent=1)
    print()
    print(table(results, base_fig))


if __name__ == "__main__":
    main()
