"""Peak memory on long samples at a real vocabulary: the teacher scoring one sample (a precompute worker's work,
hf backend) and one training step on it (a rank's work, the fused chunked loss), each in a fresh process.

    .venv/bin/python bench/long_context.py [--lengths 8192,32768] [--vocab 151936] [--k 64]

The model is tiny (hidden 64, 2 layers, max_position_embeddings 32768), so what grows with T and V is the
pipeline's own memory: the hf backend takes its log_softmax over `rows` positions at a time (~96 MiB of float32
[rows, V]); the trainer's loss over --loss-chunk positions at a time (its default by vocabulary: 96 MiB). Prints
peak RSS (ru_maxrss) and the part above the process's RSS before the work.
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def model(vocab, max_len):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1,
                                        max_position_embeddings=max_len, tie_word_embeddings=True)).eval()


def rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child(what, T, vocab, k):
    import numpy as np
    import torch
    sys.path.insert(0, ROOT)
    torch.set_num_threads(2)
    m = model(vocab, max(T, 4096))
    ids = np.random.default_rng(0).integers(0, vocab, T)
    pos = np.arange(T - 1)
    before = rss_mb()
    t0 = time.perf_counter()
    if what == "score":
        from kdcache.pipeline.teacher_hf import HFTeacher
        hf = HFTeacher.__new__(HFTeacher)                  # the backend around this in-memory model
        hf.device, hf.model, hf.batch_tokens = "cpu", m, T
        hf.transform, hf.own_forward = None, None
        hf.rows = max(16, (96 << 20) // (4 * vocab))
        hf.score([ids], [pos], k)
        extra = {"rows": hf.rows}
    else:
        from kdcache.train.batch import Batch
        from kdcache.train.losses import LossConfig, default_chunk
        from kdcache.train.model import DistillModule
        m.train()
        cfg = LossConfig(chunk_size=default_chunk(vocab))
        mod = DistillModule(m, cfg)
        N = len(pos)
        tk = torch.from_numpy(np.random.default_rng(1).integers(0, vocab, (N, k)))
        lp = torch.log_softmax(torch.randn(N, k), -1) - 1.0
        b = Batch(input_ids=torch.from_numpy(ids)[None], attention_mask=torch.ones(1, T, dtype=torch.long),
                  position_ids=None, batch_index=torch.zeros(N, dtype=torch.long), positions=torch.from_numpy(pos),
                  sample_index=torch.zeros(N, dtype=torch.long), targets=torch.from_numpy(ids[1:]), topk_ids=tk,
                  topk_logprobs=lp, tail_mass=torch.full((N,), 0.1), n_tokens=T, n_outside_vocab=0, sample_ids=[0],
                  truncated=[False])
        loss, _ = mod(b)
        loss.backward()
        extra = {"chunk": cfg.chunk_size}
    print(json.dumps({"what": what, "T": T, "peak_mb": round(rss_mb()), "above_start_mb": round(rss_mb() - before),
                      "s": round(time.perf_counter() - t0, 1), **extra}))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="8192,32768")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--k", type=int, default=64)
    ap.add_argument("--_child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._child:
        return child(args._child[0], int(args._child[1]), args.vocab, args.k)
    dense = 4 * args.vocab / 2**20
    print(f"vocabulary {args.vocab:,}, k {args.k}: one position's float32 logits are {dense:.2f} MiB "
          f"(a [T, V] block at T = 32,768: {dense * 32768 / 1024:.1f} GiB)")
    print(f"{'work':<34}{'T':>7}{'peak RSS MB':>13}{'above start':>13}{'s':>7}")
    for T in map(int, args.lengths.split(",")):
        for what, label in (("score", "teacher scoring (hf backend)"), ("train", "train step (fused chunked loss)")):
            res = subprocess.run([sys.executable, __file__, "--vocab", str(args.vocab), "--k", str(args.k),
                                  "--_child", what, str(T)], capture_output=True, text=True)
            if res.returncode:
                print(f"{label:<34}{T:>7}  failed: {res.stderr.strip().splitlines()[-1][:80]}")
                continue
            r = json.loads(res.stdout.strip().splitlines()[-1])
            print(f"{label:<34}{T:>7}{r['peak_mb']:>13,}{r['above_start_mb']:>13,}{r['s']:>7}")


if __name__ == "__main__":
    main()
