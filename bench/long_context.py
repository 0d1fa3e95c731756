"""Peak memory on long samples at a real vocabulary: the teacher scoring one sample (a precompute worker's work:
the hf backend, and vLLM's engine at a bounded and an unbounded step), one training step on it (a rank's work, the
fused chunked loss), and `kdcache train --pack --max-tokens T` end to end on a cache of such samples; each in a
fresh process.

    .venv/bin/python bench/long_context.py [--lengths 8192,32768] [--vocab 151936] [--k 64] [--engine-tokens 2048]
                                           [--only score,vllm,train,trainer]

The model is tiny (hidden 64, 2 layers, max_position_embeddings 32768), so what grows with T and V is the
pipeline's own memory: the hf backend takes its log_softmax over `rows` positions at a time (~96 MiB of float32
[rows, V]); vLLM's prompt_logprobs over the tokens of one engine step (--batch-tokens: a longer sample is split
over steps); the trainer's loss over --loss-chunk positions at a time (its default by vocabulary). Prints peak RSS
(ru_maxrss; vLLM's engine runs in the measured process) and the part above the process's RSS before the work.
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


def model_dir(vocab, max_len, out):
    """The tiny model saved with a tokenizer trained here (vLLM loads one; its 400 entries are padded to V)."""
    from kdcache.demo.task import corpus, make_splits
    from kdcache.demo.tokenizer import train_tokenizer
    if not os.path.isfile(os.path.join(out, "config.json")):
        tok = train_tokenizer(list(corpus(make_splits(60, 0, seed=0)[0])), os.path.join(out, "tok"), vocab_size=400)
        m = model(vocab, max_len)
        m.generation_config.eos_token_id = m.config.eos_token_id = tok.convert_tokens_to_ids("<|im_end|>")
        m.save_pretrained(out)
        tok.save_pretrained(out)
    return out


def child(what, T, vocab, k, engine_tokens, work):
    import numpy as np
    import torch
    sys.path.insert(0, ROOT)
    torch.set_num_threads(2)
    if what == "trainer":
        return trainer_run(T, vocab, k, work)
    m = None if what == "vllm" else model(vocab, max(T, 4096))
    ids = np.random.default_rng(0).integers(0, vocab, T)
    pos = np.arange(T - 1)
    before = rss_mb()
    t0 = time.perf_counter()
    if what == "vllm":
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"       # the engine in this process: its memory counted
        from kdcache.pipeline.teacher_vllm import VLLMTeacher
        d = model_dir(vocab, 32768, os.path.join(work, f"teacher-{vocab}"))
        before = rss_mb()
        t0 = time.perf_counter()
        v = VLLMTeacher(d, dtype="float32", max_length=T, max_top_k=k, batch_tokens=engine_tokens,
                        enforce_eager=True)
        loaded = round(time.perf_counter() - t0, 1)
        v.score([ids[:T - 1]], [pos[:-1]], k)        # a prompt leaves the engine room for its one new token
        extra = {"engine": v.engine_info(), "startup_s": loaded}
    elif what == "score":
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


def trainer_run(T, vocab, k, work):
    """`kdcache train --pack --max-tokens T` (2 steps, one T-token sample per micro-batch) on a cache of three
    T-token samples (token-id records scored by the hf backend). Peak RSS: the trainer's, a child of this process."""
    import numpy as np
    teacher = model_dir(vocab, 32768, os.path.join(work, f"teacher-{vocab}"))
    data = os.path.join(work, f"ids-{T}.jsonl")
    rng = np.random.default_rng(T)
    with open(data, "w") as f:
        for _ in range(3):
            ids = rng.integers(0, vocab, T).tolist()
            f.write(json.dumps({"input_ids": ids, "labels": [-100] * (T // 2) + ids[T // 2:]}) + "\n")
    cache = os.path.join(work, f"cache-{vocab}-{T}")
    kd = [sys.executable, "-m", "kdcache"]
    from kdcache.cache_format.manifest import load_manifest
    if not (os.path.isfile(os.path.join(cache, "manifest.json")) and load_manifest(cache).complete):
        subprocess.run([*kd, "precompute", "--teacher", teacher, "--data", data, "--out", cache, "--backend", "hf",
                        "--top-k", str(k), "--max-length", str(T), "--no-progress"], check=True, capture_output=True)
    out = os.path.join(work, f"train-{vocab}-{T}")
    t0 = time.perf_counter()
    res = subprocess.run([*kd, "train", "--cache", cache, "--student", teacher, "--out", out, "--max-steps", "2",
                          "--pack", "--max-tokens", str(T), "--batch-size", "4", "--save-every", "0",
                          "--no-require-eos", "--no-progress", "--resume", "never"], capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(res.stderr[-2000:])
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    print(json.dumps({"what": "trainer", "T": T, "peak_mb": round(peak), "above_start_mb": None,
                      "s": round(time.perf_counter() - t0, 1)}))


WORK = (("score", "teacher scoring (hf backend)"), ("vllm", "teacher scoring (vLLM, step E)"),
        ("vllm-whole", "teacher scoring (vLLM, step T)"), ("train", "train step (fused chunked loss)"),
        ("trainer", "kdcache train --pack --max-tokens T"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="8192,32768")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--k", type=int, default=64)
    ap.add_argument("--engine-tokens", type=int, default=2048, help="vLLM rows: --batch-tokens (tokens per step)")
    ap.add_argument("--only", default="score,vllm,vllm-whole,train,trainer")
    ap.add_argument("--work", default=os.path.join(ROOT, "bench", "work", "long_context"))
    ap.add_argument("--_child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._child:
        what, T = args._child[0], int(args._child[1])
        tokens = T if what == "vllm-whole" else args.engine_tokens
        return child(what.removesuffix("-whole"), T, args.vocab, args.k, tokens, args.work)
    os.makedirs(args.work, exist_ok=True)
    dense = 4 * args.vocab / 2**20
    print(f"vocabulary {args.vocab:,}, k {args.k}: one position's float32 logits are {dense:.2f} MiB "
          f"(a [T, V] block at T = 32,768: {dense * 32768 / 1024:.1f} GiB); vLLM step E = {args.engine_tokens}")
    print(f"{'work':<38}{'T':>7}{'peak RSS MB':>13}{'above start':>13}{'s':>7}  notes")
    only = args.only.split(",")
    for T in map(int, args.lengths.split(",")):
        for what, label in WORK:
            if what not in only:
                continue
            res = subprocess.run([sys.executable, __file__, "--vocab", str(args.vocab), "--k", str(args.k),
                                  "--engine-tokens", str(args.engine_tokens), "--work", args.work,
                                  "--_child", what, str(T)], capture_output=True, text=True)
            lines = [ln for ln in res.stdout.strip().splitlines() if ln.startswith("{")]
            if res.returncode or not lines:
                why = (res.stderr.strip().splitlines() or [f"exit {res.returncode}"])[-1][:90]
                print(f"{label:<38}{T:>7}  failed (exit {res.returncode}): {why}")
                continue
            r = json.loads(lines[-1])
            notes = {key: r[key] for key in ("rows", "chunk", "engine", "startup_s") if key in r}
            above = "-" if r["above_start_mb"] is None else f"{r['above_start_mb']:,}"
            print(f"{label:<38}{T:>7}{r['peak_mb']:>13,}{above:>13}{r['s']:>7}  {notes or ''}", flush=True)


if __name__ == "__main__":
    main()
