"""Training-step cost of cache-based KD, in one run on the same student and batch.

    .venv/bin/python bench/train_step.py [--vocab 32000] [--batch 8] [--seq 256] [--k 64] [--steps 8]

Prints, for forward + backward + AdamW step (plain torch, CPU threads as set):
  * plain SFT (cross-entropy)                      -> the floor
  * KD from the cache (chunked GKD, tail bucket)   -> ratio to SFT (goal <= 1.10)
  * online KD: teacher 4x the student run every step, full-vocab KL -> what users do today
and the peak memory of tensors alive during the loss alone (forward + backward over N positions,
gradients of hidden states and head included) for the chunked loss against the same loss on dense
[N, V] logits, each measured in a fresh process.
"""
import argparse
import json
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kdcache.train.losses import LossConfig, chunked_kd_loss, default_chunk, kd_loss_from_logits  # noqa: E402


def model(vocab, hidden, layers, seed):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
                      num_attention_heads=hidden // 32, num_key_value_heads=max(1, hidden // 128),
                      max_position_embeddings=4096, tie_word_embeddings=True)
    return Qwen2ForCausalLM(cfg)


def batch(args, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    N = args.batch * (args.seq - 1)
    bidx = torch.arange(args.batch).repeat_interleave(args.seq - 1)
    pos = torch.arange(args.seq - 1).repeat(args.batch)
    lp = torch.log_softmax(torch.randn(N, args.vocab, generator=g) * 3, -1)
    top_lp, top_ids = lp.topk(args.k, -1)
    tail = (1 - top_lp.double().exp().sum(-1)).clamp(0, 1).float()
    return ids, bidx, pos, top_ids, top_lp, tail, ids[bidx, pos + 1]


def timed(fn, steps):
    fn()                                   # warm-up
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - t0) / steps


def step_times(args):
    student = model(args.vocab, args.hidden, args.layers, 0)
    teacher = model(args.vocab, args.hidden * 2, args.layers * 2, 1).eval()     # ~4x the parameters
    ns = sum(p.numel() for p in student.parameters())
    nt = sum(p.numel() for p in teacher.parameters())
    ids, bidx, pos, tid, tlp, tail, tgt = batch(args)
    opt = torch.optim.AdamW(student.parameters(), lr=1e-4)
    cfg = LossConfig(beta=0.5, tail="tail", chunk_size=args.chunk)
    head = student.get_output_embeddings()

    def sft():
        out = student(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad()

    def kd_cache():
        h = student.model(input_ids=ids).last_hidden_state[bidx, pos]
        loss, _ = chunked_kd_loss(h, head.weight, tid, tlp, tail, tgt, cfg)
        (loss / len(pos)).backward()
        opt.step()
        opt.zero_grad()

    def kd_online():
        with torch.no_grad():
            t_lp = torch.log_softmax(teacher(input_ids=ids).logits[bidx, pos].float(), -1)
        s_lp = torch.log_softmax(student(input_ids=ids).logits[bidx, pos].float(), -1)
        loss = (t_lp.exp() * (t_lp - s_lp)).sum() / len(pos)
        loss.backward()
        opt.step()
        opt.zero_grad()

    res = {name: timed(fn, args.steps) for name, fn in (("sft", sft), ("kd_cache", kd_cache),
                                                         ("kd_online", kd_online))}
    return res, ns, nt


class LiveBytes:
    """Peak bytes of tensor storages created while active (a dispatch mode; inputs made before do not count)."""

    def __enter__(self):
        import weakref

        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten
        outer = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_flatten(out)[0]:
                    if isinstance(t, torch.Tensor):
                        st = t.untyped_storage()
                        outer.live.setdefault(id(st), (weakref.ref(st), st.nbytes()))
                outer.live = {k: v for k, v in outer.live.items() if v[0]() is not None}
                outer.peak = max(outer.peak, sum(n for _, n in outer.live.values()))
                return out

        self.live, self.peak, self.mode = {}, 0, Mode()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)


def loss_memory(args, mode):
    """Peak MB of tensors alive during one loss forward + backward over N positions."""
    N, V, H = args.mem_positions, args.mem_vocab, 256
    g = torch.Generator().manual_seed(0)
    h = torch.randn(N, H, generator=g, requires_grad=True)
    w = (torch.randn(V, H, generator=g) * 0.02).requires_grad_()
    tid = torch.randint(0, V, (N, args.k), generator=g)
    tlp = torch.log_softmax(torch.randn(N, args.k, generator=g), -1) - 1.0
    tlp, _ = tlp.sort(-1, descending=True)
    tail = (1 - tlp.exp().sum(-1)).clamp(0, 1)
    tgt = torch.randint(0, V, (N,), generator=g)
    cfg = LossConfig(beta=0.5, chunk_size=args.chunk)
    with LiveBytes() as mem:
        if mode == "chunked":
            loss, _ = chunked_kd_loss(h, w, tid, tlp, tail, tgt, cfg)
        else:
            loss, _ = kd_loss_from_logits(h @ w.T, tid, tlp, tail, tgt, cfg)
        loss.backward()
    return mem.peak / 2 ** 20


def chunk_parts(args, chunks):
    """Seconds per step of each piece of the fused loss (train/losses.py _FusedChunks) over N positions at each
    chunk size: the head's forward matmul, the loss's forward + backward on [c, V] logits, d(hidden) and the
    d(weight) accumulation into [V, H]. Where the chunk's cost comes from."""
    from kdcache.train.losses import _loss_sums
    N, V, H = args.batch * (args.seq - 1), args.vocab, args.hidden
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(N, H, generator=g), torch.randn(V, H, generator=g) * 0.02
    _, _, _, tid, tlp, tail, tgt = batch(args)
    rows = {}
    for c in chunks:
        cfg = LossConfig(beta=0.5, chunk_size=c)
        gw = torch.zeros_like(w)
        for _ in range(2):                                     # the first pass warms up; the second is kept
            t = dict.fromkeys(("head matmul", "loss fwd+bwd", "d(hidden)", "d(weight) +="), 0.0)
            for lo in range(0, N, c):
                sl = slice(lo, lo + c)
                t0 = time.perf_counter()
                z = (h[sl] @ w.T).requires_grad_(True)
                t1 = time.perf_counter()
                with torch.enable_grad():
                    loss, _, _ = _loss_sums(z, tid[sl], tlp[sl], tail[sl], tgt[sl], cfg)
                (d,) = torch.autograd.grad(loss, z)
                t2 = time.perf_counter()
                _ = d @ w
                t3 = time.perf_counter()
                gw.addmm_(d.T, h[sl])
                t4 = time.perf_counter()
                for k, dt in zip(t, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                    t[k] += dt
        rows[c] = t
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--k", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=0, help="loss chunk (default: kdcache train's, by vocabulary)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--mem-positions", type=int, default=4096)
    ap.add_argument("--mem-vocab", type=int, default=151936)
    ap.add_argument("--mem-chunk", type=int, default=1024, help="a chunk to compare the default with")
    ap.add_argument("--parts", default="", help="chunk sizes, e.g. 128,256,1024: time each piece of the fused "
                    "loss at each (and nothing else)")
    ap.add_argument("--_memory", choices=("chunked", "dense"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.parts:
        rows = chunk_parts(args, [int(c) for c in args.parts.split(",")])
        names = list(next(iter(rows.values())))
        print(f"fused loss pieces, s per {args.batch * (args.seq - 1)} positions, vocab {args.vocab}, hidden "
              f"{args.hidden}, {torch.get_num_threads()} threads")
        print(f"{'chunk':>6}" + "".join(f"{n:>15}" for n in names) + f"{'total':>10}")
        for c, t in rows.items():
            print(f"{c:>6}" + "".join(f"{t[n]:>15.3f}" for n in names) + f"{sum(t.values()):>10.3f}")
        return
    if args._memory:
        args.chunk = args.chunk or default_chunk(args.mem_vocab)
        print(json.dumps({"mb": loss_memory(args, args._memory)}))
        return
    args.chunk = args.chunk or default_chunk(args.vocab)
    t, ns, nt = step_times(args)
    N = args.batch * (args.seq - 1)
    print(f"student {ns / 1e6:.1f}M params, teacher {nt / 1e6:.1f}M ({nt / ns:.1f}x), vocab {args.vocab}, "
          f"batch {args.batch}x{args.seq} ({N} trained positions), k={args.k}, {torch.get_num_threads()} threads")
    print(f"loss chunk {args.chunk} positions")
    print(f"{'step':<34}{'s/step':>9}{'vs SFT':>9}")
    for name, label in (("sft", "plain SFT (cross-entropy)"), ("kd_cache", "KD from the cache (chunked GKD)"),
                        ("kd_online", "online KD, teacher run each step")):
        print(f"{label:<34}{t[name]:>9.3f}{t[name] / t['sft']:>9.2f}")
    print(f"online KD / cache KD: {t['kd_online'] / t['kd_cache']:.2f}x")
    full = args.mem_positions * args.mem_vocab * 4 / 2 ** 20
    print(f"\nloss peak memory (forward + backward), vocab {args.mem_vocab}; one fp32 [N, V] at "
          f"N={args.mem_positions} is {full:.0f} MB")
    dense = None
    default = default_chunk(args.mem_vocab)
    for mode, chunk in (("dense", 0), ("chunked", args.mem_chunk), ("chunked", default)):
        out = subprocess.run([sys.executable, __file__, "--_memory", mode, "--mem-positions", str(args.mem_positions),
                              "--mem-vocab", str(args.mem_vocab), "--k", str(args.k), "--chunk", str(chunk or 1)],
                             capture_output=True, text=True, check=True)
        mb = json.loads(out.stdout.strip().splitlines()[-1])["mb"]
        dense = dense or mb
        label = "dense [N, V] logits" if mode == "dense" else f"chunked, {chunk} positions per chunk" + \
            (" (the default)" if chunk == default else "")
        print(f"  {label:<46}{mb:>8.0f} MB  ({mb / dense:.3f}x dense)" if mode != "dense"
              else f"  {label:<46}{mb:>8.0f} MB")


if __name__ == "__main__":
    main()
