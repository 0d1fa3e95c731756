"""The vLLM backend and a served teacher at real vocabularies (151,936 as Qwen, 262,144 as Gemma 3), against the hf
backend, and what each costs.

    .venv/bin/python bench/large_vocab.py [--vocabs 151936,262144] [--ks 64,128] [--records 12]

A tiny Qwen2 teacher (the suite's tokenizer, its embedding padded to V with rows as likely as the real ones, so ids
past 2^17 are scored), float32 everywhere. For each V and k: `kdcache precompute` with --backend hf, vllm and
(at the largest k) served (`vllm serve` on 127.0.0.1); the largest |log-prob difference| against hf over entries of
the same id, the ranks that differ where no near-tie explains it, and the teacher's seconds (report/summary.json).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
TIE = 2e-4


def teacher(tok, vocab, out):
    import torch

    from kdcache.demo.models import make_model, save
    m = make_model(tok, "test", seed=3)
    n = m.get_input_embeddings().weight.shape[0]
    m.resize_token_embeddings(vocab)
    with torch.no_grad():
        emb = m.get_input_embeddings().weight
        emb[n:] = torch.randn(vocab - n, emb.shape[1], generator=torch.Generator().manual_seed(0)) * emb[:n].std()
    save(m, tok, out)
    return out


def precompute(*args):
    cmd = [sys.executable, "-m", "kdcache", "precompute", "--no-progress", *map(str, args)]
    t0 = time.time()
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if res.returncode:
        raise SystemExit(f"failed: {' '.join(map(str, args))}\n{res.stderr[-2000:]}")
    return time.time() - t0


def compare(ref_dir, got_dir):
    """(largest |d log-prob| over the same ids, ranks differing without a near-tie, positions)."""
    from kdcache.cache_format import open_cache
    worst, untied, n = 0.0, 0, 0
    for a, b in zip(open_cache(ref_dir), open_cache(got_dir)):
        assert np.array_equal(a.input_ids, b.input_ids) and np.array_equal(a.positions, b.positions)
        n += len(a.positions)
        for r in range(len(a.positions)):
            common = {int(i): lp for i, lp in zip(a.topk_ids[r], a.topk_logprobs[r])}
            for i, lp in zip(b.topk_ids[r], b.topk_logprobs[r]):
                if int(i) in common:
                    worst = max(worst, abs(float(lp) - float(common[int(i)])))
            for c in np.nonzero(a.topk_ids[r] != b.topk_ids[r])[0]:
                lp = a.topk_logprobs[r]
                if not any(abs(lp[c] - lp[j]) <= TIE for j in (c - 1, c + 1) if 0 <= j < len(lp)):
                    untied += 1
    return worst, untied, n


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocabs", default="151936,262144")
    ap.add_argument("--ks", default="64,128")
    ap.add_argument("--records", type=int, default=12)
    ap.add_argument("--no-served", action="store_true")
    args = ap.parse_args()
    from kdcache.demo.task import corpus, make_splits, write_jsonl
    from kdcache.demo.tokenizer import train_tokenizer
    from tests.helpers.vllm_server import VLLMServer
    work = tempfile.mkdtemp(prefix="kdvocab-")
    train, _ = make_splits(120, 0, seed=0)
    tok = train_tokenizer(list(corpus(train)), os.path.join(work, "tok"), vocab_size=400)
    data = os.path.join(work, "d.jsonl")
    write_jsonl(train[:args.records], data)
    ks = [int(k) for k in args.ks.split(",")]
    print(f"{args.records} chats, float32; teacher_s = the teacher's own seconds (summary.json), wall = the command")
    print(f"{'V':>8}{'k':>5}{'backend':>9}{'max |dlp| vs hf':>17}{'ranks off':>11}{'positions':>11}"
          f"{'teacher_s':>11}{'wall s':>8}")
    for vocab in map(int, args.vocabs.split(",")):
        t_dir = teacher(tok, vocab, os.path.join(work, f"t{vocab}"))
        server = None
        if not args.no_served:
            server = VLLMServer(t_dir, max_logprobs=max(ks), log_path=os.path.join(work, f"vllm{vocab}.log")).start()
        try:
            for k in ks:
                common = ["--data", data, "--top-k", k, "--logprob-dtype", "float32", "--max-length", 256]
                runs = [("hf", ["--teacher", t_dir, "--backend", "hf"]),
                        ("vllm", ["--teacher", t_dir, "--backend", "vllm"])]
                if server is not None and k == max(ks):
                    runs.append(("served", ["--teacher", server.url, "--tokenizer", t_dir]))
                for name, extra in runs:
                    out = os.path.join(work, f"c{vocab}-{k}-{name}")
                    wall = precompute(*extra, *common, "--out", out)
                    teacher_s = json.load(open(os.path.join(out, "report", "summary.json")))["teacher_s"]
                    if name == "hf":
                        ref, row = out, ("-", "-", "-")
                    else:
                        worst, untied, n = compare(ref, out)
                        row = (f"{worst:.2e}", untied, n)
                    print(f"{vocab:>8}{k:>5}{name:>9}{row[0]:>17}{row[1]:>11}{row[2]:>11}{teacher_s:>11}"
                          f"{wall:>8.1f}", flush=True)
        finally:
            if server is not None:
                server.stop()


if __name__ == "__main__":
    main()
