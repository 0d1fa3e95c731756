"""Generate mode on the hf backend: prompts decoded together against one at a time.

    .venv/bin/python bench/generate.py [--prompts 64] [--new-tokens 48] [--size student] [--threads 1]

A random-init model of the demo's sizes (`--size`: test, student, teacher) with the demo's tokenizer, the demo's
prompts, greedy decoding to a fixed budget (no end-of-turn: every row runs the whole budget, the worst case for
batching). "one at a time" is the same backend with a batch budget of one token (each prompt a batch of its own),
which is what generate mode did before batching. Prints tokens/s of each and the ratio, and checks that both wrote
the same tokens.
"""
import argparse
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--size", default="student", choices=("test", "student", "teacher"))
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    import torch

    from kdcache.common.chat import render
    from kdcache.demo.models import make_model, save
    from kdcache.demo.task import corpus, make_splits
    from kdcache.demo.tokenizer import train_tokenizer
    from kdcache.pipeline.teacher_hf import HFTeacher
    torch.set_num_threads(args.threads)
    d = tempfile.mkdtemp(prefix="kdcache-bench-generate-")
    train, _ = make_splits(max(args.prompts, 200), 0, seed=0)
    tok = train_tokenizer(list(corpus(train)), os.path.join(d, "tok"), vocab_size=400)
    save(make_model(tok, args.size, seed=0), tok, os.path.join(d, "model"))
    model = HFTeacher(os.path.join(d, "model"), dtype="float32")
    prompts = [tok(render(tok, r["messages"][:-1], gen_prompt=True), add_special_tokens=False)["input_ids"]
               for r in train[:args.prompts]]
    gen = dict(max_new_tokens=[args.new_tokens] * len(prompts), temperature=0.0, top_p=1.0,
               seeds=list(range(len(prompts))), turn_ends=set())
    results = {}
    for name, budget in (("one at a time", 1), ("batched", 8192)):
        model.batch_tokens = budget
        t0 = time.perf_counter()
        out = model.generate(prompts, **gen)
        results[name] = (time.perf_counter() - t0, out)
    tokens = args.prompts * args.new_tokens
    print(f"{args.prompts} prompts (mean {sum(map(len, prompts)) / len(prompts):.0f} tokens) x {args.new_tokens} "
          f"new tokens, size {args.size}, {args.threads} thread(s)")
    for name, (s, _) in results.items():
        print(f"  {name:<14} {s:7.2f} s  {tokens / s:8.0f} tokens/s")
    one, batched = results["one at a time"], results["batched"]
    same = sum(a[0] == b[0] for a, b in zip(one[1], batched[1]))
    print(f"  batched / one at a time: {one[0] / batched[0]:.1f}x faster; the same tokens for {same}/{len(prompts)}")


if __name__ == "__main__":
    main()
