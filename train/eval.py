"""`kdcache eval`: teacher and students side by side on held-out chats, with a report a person can read.

For each model: greedy generation on every held-out prompt -> how often it ends
with the end-of-turn token before the length limit, exact match against the
reference answer, mean/max generated length; teacher-forced per-token
KL(reference || model) on the reference completions, end-of-turn included; and the
on-policy figure, per-token KL(model || reference) on the model's own greedy
completions. Task-independent: a task's own metric reads the answers from eval.json
(the demo's label F1: kdcache.demo.task). Writes OUT/report.md, OUT/eval.json and PNGs
(generated lengths, loss curves).
"""
import argparse
import json
import os

import torch

from kdcache.cache_format.record import span_positions
from kdcache.common.errors import ConfigError, DataError

from .metrics import read_metrics


def load_heldout(path):
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{n}: invalid JSON ({e.msg} at column {e.colno})") from None
            msgs = rec.get("messages") if isinstance(rec, dict) else None
            if not msgs or not isinstance(msgs[-1], dict) or msgs[-1].get("role") != "assistant":
                raise DataError(f"{path}:{n}: eval needs chat records whose last message is the assistant's answer")
            rows.append(msgs)
    return rows


@torch.no_grad()
def stop_ids(model):
    """The ids stock generate() stops on: the model's generation config's EOS (an int or a list)."""
    eos = model.generation_config.eos_token_id
    return set(eos if isinstance(eos, list) else [] if eos is None else [eos])


def generate(model, tok, chats, max_new_tokens, batch_size):
    """Greedy completions as stock generate() makes them (no eos argument): [(token ids, ended_with_eos)]."""
    tok.padding_side = "left"
    stops, out = stop_ids(model), []
    pad = tok.pad_token_id if tok.pad_token_id is not None else min(stops)
    for i in range(0, len(chats), batch_size):
        prompts = [tok.apply_chat_template(m[:-1], tokenize=False, add_generation_prompt=True)
                   for m in chats[i:i + batch_size]]
        enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
        for row in gen[:, enc["input_ids"].shape[1]:].tolist():
            end = next((j for j, t in enumerate(row) if t in stops), None)
            out.append((row[:end + 1], True) if end is not None else ([t for t in row if t != pad], False))
    return out


def completion_batch(tok, msgs, stops):
    """(ids, positions) of a chat, positions predicting the answer through its end-of-turn token."""
    head = tok(tok.apply_chat_template(msgs[:-1], tokenize=False, add_generation_prompt=True),
               add_special_tokens=False)["input_ids"]
    full = tok(tok.apply_chat_template(msgs, tokenize=False), add_special_tokens=False)["input_ids"]
    end = next(j for j in range(len(head), len(full)) if full[j] in stops)
    return full, span_positions([(len(head), end + 1)]).tolist()


@torch.no_grad()
def mean_kl(ref_model, model, tok, chats):
    """Mean per-token KL(reference || model) over every answer position (full vocabulary)."""
    total, n = 0.0, 0
    for msgs in chats:
        ids, pos = completion_batch(tok, msgs, stop_ids(ref_model) | stop_ids(model))
        x = torch.tensor([ids])
        lp_r = torch.log_softmax(ref_model(x).logits[0, pos].float(), -1)
        lp_m = torch.log_softmax(model(x).logits[0, pos].float(), -1)
        total += float((lp_r.exp() * (lp_r - lp_m)).sum())
        n += len(pos)
    return total / max(n, 1)


@torch.no_grad()
def onpolicy_kl(ref_model, model, tok, chats, gens):
    """Mean per-token KL(model || reference) on the model's own greedy completions (full vocabulary): the on-policy
    figure, where a student's own mistakes are the positions it is measured on. Positions: those that predict
    each generated token, its end-of-turn included."""
    total, n = 0.0, 0
    for msgs, (new, _) in zip(chats, gens):
        if not new:
            continue
        head = tok(tok.apply_chat_template(msgs[:-1], tokenize=False, add_generation_prompt=True),
                   add_special_tokens=False)["input_ids"]
        x = torch.tensor([head + list(new)])
        pos = list(range(len(head) - 1, len(head) - 1 + len(new)))
        lp_m = torch.log_softmax(model(x).logits[0, pos].float(), -1)
        lp_r = torch.log_softmax(ref_model(x).logits[0, pos].float(), -1)
        total += float((lp_m.exp() * (lp_m - lp_r)).sum())
        n += len(pos)
    return total / max(n, 1)


def evaluate(models, data, reference=None, max_new_tokens=48, batch_size=64):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    chats = load_heldout(data)
    loaded = {name: (AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(),
                     AutoTokenizer.from_pretrained(path)) for name, path in models.items()}
    results = {}
    for name, (model, tok) in loaded.items():
        gens = generate(model, tok, chats, max_new_tokens, batch_size)
        answers = [tok.decode(ids, skip_special_tokens=True).strip() for ids, _ in gens]
        stops = sum(ended for _, ended in gens)
        refs = [msgs[-1]["content"].strip() for msgs in chats]
        exact = sum(ended and text == ref for (_, ended), text, ref in zip(gens, answers, refs))
        lengths = [len(ids) for ids, _ in gens]
        res = {"prompts": len(chats), "stop_rate": stops / len(chats), "exact_match": exact / len(chats),
               "mean_length": sum(lengths) / len(lengths), "max_length": max(lengths),
               "length_limit": max_new_tokens, "lengths": lengths, "answers": answers,
               "examples": [tok.decode(g[0]) for g in gens[:3]]}
        if reference and name != reference:
            res["kl_from_reference"] = mean_kl(loaded[reference][0], model, tok, chats)
            res["onpolicy_kl"] = onpolicy_kl(loaded[reference][0], model, tok, chats, gens)
        results[name] = res
    return results


def write_report(results, out, runs=None, reference=None, title="kdcache eval", note=""):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(out, exist_ok=True)
    names = list(results)
    fig, ax = plt.subplots(figsize=(7, 4))
    limit = max(r["length_limit"] for r in results.values())
    bins = range(0, limit + 2)
    ax.hist([results[n]["lengths"] for n in names], bins=bins, label=names)   # side by side per bin
    ax.set_xlabel("generated tokens (greedy)")
    ax.set_ylabel("held-out prompts")
    ax.set_title("generated lengths: a model that never stops piles up at the limit")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "lengths.png"), dpi=110)
    plt.close(fig)
    pictures = ["lengths.png"]
    if runs:
        fig, ax = plt.subplots(figsize=(7, 4))
        for name, run_dir in runs.items():
            rows = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
            ax.plot([r["step"] for r in rows], [r["kd"] for r in rows], label=name)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("distillation loss per trained position")
        ax.set_title("student training loss (from each cache)")
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(os.path.join(out, "loss_curves.png"), dpi=110)
        plt.close(fig)
        pictures.append("loss_curves.png")

    header = ["model", "ends with end-of-turn", "exact match", "mean length", "max length",
              f"KL({reference} ‖ model) per token" if reference else "KL",
              f"KL(model ‖ {reference}) per token, own samples" if reference else "on-policy KL"]
    lines = [f"# {title}", "", *([note, ""] if note else []), "| " + " | ".join(header) + " |",
             "|" + "---|" * len(header)]
    for name in names:
        r = results[name]
        kl = f"{r['kl_from_reference']:.4f}" if "kl_from_reference" in r else "—"
        own = f"{r['onpolicy_kl']:.4f}" if "onpolicy_kl" in r else "—"
        lines.append(f"| {name} | {r['stop_rate']:.1%} | {r['exact_match']:.1%} | "
                     f"{r['mean_length']:.1f} | {r['max_length']} / {r['length_limit']} | {kl} | {own} |")
    lines += ["", f"{results[names[0]]['prompts']} held-out prompts, greedy decoding, "
              f"limit {limit} new tokens. The first KL is teacher-forced on the reference answers; the second is "
              "on each model's own greedy completions (where its own mistakes lead it).", ""]
    lines += [f"![{p}]({p})" for p in pictures]
    lines += ["", "## First generations", ""]
    for name in names:
        lines.append(f"- **{name}**: " + " · ".join(f"`{e!r}`" for e in results[name]["examples"]))
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(text)
    slim = {n: {k: v for k, v in r.items() if k != "lengths"} for n, r in results.items()}
    with open(os.path.join(out, "eval.json"), "w") as f:
        json.dump(slim, f, indent=1)
    return text


def print_table(results):
    print(f"\n{'model':<16}{'stops':>8}{'exact':>8}{'mean len':>10}{'max len':>9}{'KL/token':>10}{'own KL':>10}")
    for name, r in results.items():
        kl = f"{r['kl_from_reference']:.4f}" if "kl_from_reference" in r else "—"
        own = f"{r['onpolicy_kl']:.4f}" if "onpolicy_kl" in r else "—"
        print(f"{name:<16}{r['stop_rate']:>8.1%}{r['exact_match']:>8.1%}"
              f"{r['mean_length']:>10.1f}{r['max_length']:>9}{kl:>10}{own:>10}")


def _pairs(items, what):
    out = {}
    for item in items or []:
        if "=" not in item:
            raise ConfigError(f"--{what} expects NAME=PATH, got {item!r}")
        k, v = item.split("=", 1)
        out[k] = v
    return out


def main(argv=None):
    p = argparse.ArgumentParser(prog="kdcache eval", description=__doc__.splitlines()[0])
    p.add_argument("--model", action="append", required=True, help="NAME=DIR of a saved model (repeatable)")
    p.add_argument("--data", required=True, help="held-out chats (JSONL, last message = reference answer)")
    p.add_argument("--out", required=True, help="report directory")
    p.add_argument("--reference", help="NAME of the model the KL is measured from (usually the teacher)")
    p.add_argument("--run", action="append", help="NAME=TRAIN_OUT_DIR whose metrics.jsonl to plot (repeatable)")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--title", default="kdcache eval", help="report title")
    p.add_argument("--note", default="", help="a paragraph placed under the title")
    args = p.parse_args(argv)
    models = _pairs(args.model, "model")
    if args.reference and args.reference not in models:
        raise ConfigError(f"--reference {args.reference} is not one of the --model names {list(models)}")
    results = evaluate(models, args.data, args.reference, args.max_new_tokens, args.batch_size)
    write_report(results, args.out, _pairs(args.run, "run"), args.reference, args.title, args.note)
    print_table(results)
    print(f"\nreport: {os.path.join(args.out, 'report.md')}")
    return 0
