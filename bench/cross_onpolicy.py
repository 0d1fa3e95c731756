"""On-policy rounds across tokenizer families (issue 46, item 3): `kdcache onpolicy --cross-tokenizer` after
off-policy cross-tokenizer KD, against as many more off-policy steps.

    .venv/bin/python bench/cross_onpolicy.py [--base bench/work/cross-300] [--seeds 2] [--rounds 2]

Starts from what `bench/cross_tokenizer.py --steps S --out BASE` left: its teacher (ChatML, 512 ids), its cache
and, per seed, its cross-tokenizer KD student (the Llama 3 family, 384 ids) after S steps. Two arms per seed, the
same optimizer steps (rounds x steps per round), batch 16, lr 3e-3, forward KL, no SFT term:
  off-policy  `kdcache train --cross-tokenizer` on the same cache, from the start student
  on-policy   `kdcache onpolicy --cross-tokenizer`: each round the student samples (temperature 1, 32 new tokens)
              completions for the next P prompts of the cache's data in its own tokens, the teacher scores their
              text, the student trains on that round's cache
Held out as in cross_tokenizer.py (stop, F1), plus per round the completions scored, cut and left out, and the
wall time of each arm. Prints a table; writes OUT/onpolicy.json.
"""
import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

from cross_tokenizer import score  # noqa: E402
from runs import kdcache  # noqa: E402

COMMON = ("--batch-size", 16, "--lr", 3e-3, "--warmup-steps", 20, "--sft-alpha", 0, "--beta", 0, "--save-every", 0,
          "--no-progress", "--log-every", 10, "--cross-tokenizer")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default=os.path.join(ROOT, "bench", "work", "cross-300"))
    ap.add_argument("--out", default=None, help="default: BASE/onpolicy")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompts-per-round", type=int, default=400)
    ap.add_argument("--steps-per-round", type=int, default=150)
    args = ap.parse_args()
    out = args.out or os.path.join(args.base, "onpolicy")
    os.makedirs(out, exist_ok=True)
    info = json.load(open(os.path.join(args.base, "setup", "done.json")))
    cache = os.path.join(args.base, "cache")
    held = [json.loads(x) for x in open(info["heldout"])]
    steps = args.rounds * args.steps_per_round
    rows, walls, rounds = {}, {}, {}
    for seed in range(args.seeds):
        start = os.path.join(args.base, f"cross-tokenizer-kd-s{seed}", "final")
        rows.setdefault("start", []).append(score(start, held))
        arm = os.path.join(out, f"offpolicy-s{seed}")
        if not os.path.isfile(os.path.join(arm, "final", "config.json")):
            walls.setdefault("off-policy", []).append(kdcache(
                "train", "--cache", cache, "--student", start, "--out", arm, "--max-steps", steps, "--seed", seed,
                *COMMON, log=arm + ".log"))
        rows.setdefault("off-policy", []).append(score(os.path.join(arm, "final"), held))
        arm = os.path.join(out, f"onpolicy-s{seed}")
        if not os.path.isfile(os.path.join(arm, "final", "config.json")):
            walls.setdefault("on-policy", []).append(kdcache(
                "onpolicy", "--teacher", info["teacher"], "--student", start, "--data", info["distil"], "--out", arm,
                "--rounds", args.rounds, "--prompts-per-round", args.prompts_per_round, "--steps-per-round",
                args.steps_per_round, "--gen-temperature", 1, "--gen-max-new-tokens", 32, "--top-k", 32,
                "--backend", "hf", "--seed", seed, *COMMON, log=arm + ".log"))
        rows.setdefault("on-policy", []).append(score(os.path.join(arm, "final"), held))
        rounds[seed] = [e.get("completions") for e in json.load(open(os.path.join(arm, "summary.json")))["rounds"]]
        print(f"seed {seed}: " + ", ".join(f"{k} {v[-1]}" for k, v in rows.items()), flush=True)
    table = {name: {k: (statistics.mean(r[k] for r in runs),
                        statistics.stdev(r[k] for r in runs) if len(runs) > 1 else 0.0) for k in ("stop", "f1")}
             for name, runs in rows.items()}
    print(f"\n{len(held)} held-out chats, {args.seeds} seeds, {steps} more steps of 16 "
          f"({args.rounds} rounds of {args.prompts_per_round} prompts on-policy)")
    print("| student | stop | F1 | wall s |")
    print("|---|---:|---:|---:|")
    for name, figs in table.items():
        wall = f"{statistics.mean(walls[name]):.0f}" if walls.get(name) else "-"
        print(f"| {name} | {figs['stop'][0]:.3f} ± {figs['stop'][1]:.3f} | {figs['f1'][0]:.3f} ± "
              f"{figs['f1'][1]:.3f} | {wall} |")
    for seed, per in rounds.items():
        for r, c in enumerate(per, start=1):
            if c:
                left = {k: c[k] for k in ("not_utf8", "special_token", "blank") if c[k]}
                print(f"seed {seed} round {r}: {c['completions']} completions, {c['truncated']} cut by the budget, "
                      f"left out {left or 'none'}")
    json.dump({"args": vars(args), "runs": rows, "table": table, "wall_s": walls, "rounds": rounds},
              open(os.path.join(out, "onpolicy.json"), "w"), indent=1)
    print(f"wrote {os.path.join(out, 'onpolicy.json')} ({time.strftime('%H:%M')})")


if __name__ == "__main__":
    main()
