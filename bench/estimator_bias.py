"""How far two cache-based estimates sit from the exact full-vocabulary loss (README: `--sample`, `--beta`).

1. A sampled cache (--sample N, optionally --top-k M) at temperature tau: the self-normalised estimate of the
   tempered forward KL, its value and its gradient's error against the exact one, averaged over cache draws.
2. GKD beta = 1 (reverse KL) over a top-k cache's buckets against the full reverse KL: the tail is one bucket, so
   most of reverse KL's penalty on tail tokens is lost (data processing: the bucket KL is a lower bound).

Teachers: rows of logits at a realistic spread (softmax entropy a few nats over V = 4,096); students: the same
logits perturbed. The project's own functions compute every figure (pipeline/draws.py, cache_format/compact.py,
train/batch.py sampled_weights, train/losses.py). Prints a table; `--rows`, `--trials` set the sizes.

    python bench/estimator_bias.py
"""
import argparse

import numpy as np
import torch
import torch.nn.functional as F

from kdcache.cache_format.compact import sampled_rows
from kdcache.pipeline.draws import generator_for, top_and_draws
from kdcache.train.batch import sampled_weights
from kdcache.train.losses import LossConfig, gkd_per_position, sampled_kl_per_position


def rows(n, v, seed, scale=2.5, noise=1.0):
    """(teacher log-probs [n, V], student logits [n, V]): Gaussian logits at `scale`, the student's perturbed."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(n, v, generator=g) * scale
    s = t + torch.randn(n, v, generator=g) * noise
    return F.log_softmax(t, -1), s


def exact_forward_kl(t_lp, s_logits, tau):
    """tau^2 KL(T_tau || S_tau) summed over rows, the full vocabulary, with its gradient in the student logits."""
    s = s_logits.clone().requires_grad_(True)
    t = F.log_softmax(t_lp / tau, -1)
    loss = (t.exp() * (t - F.log_softmax(s / tau, -1))).sum() * tau**2
    (grad,) = torch.autograd.grad(loss, s)
    return float(loss.detach()), grad


def sampled_estimate(t_lp, s_logits, tau, m, n, seed):
    """The trainer's estimate from one cache draw (top-M exact + N draws from the rest), value and gradient."""
    top_ids, top_lp, d_ids, d_lp = top_and_draws(t_lp, m, n, generator_for(seed, "cpu"))
    ids, lps, counts = sampled_rows(top_ids, top_lp, d_ids, d_lp)
    tail = 1.0 - np.exp(top_lp.astype(np.float64)).sum(-1) if m else np.ones(len(ids))
    w = sampled_weights(ids, lps, tail.astype(np.float32), counts)
    s = s_logits.clone().requires_grad_(True)
    cfg = LossConfig(temperature=tau)
    loss = sampled_kl_per_position(F.log_softmax(s, -1), torch.from_numpy(ids.astype(np.int64)),
                                   torch.from_numpy(lps), torch.from_numpy(w), cfg).sum()
    (grad,) = torch.autograd.grad(loss, s)
    return float(loss.detach()), grad


def sampled_table(args):
    print("## 1. Sampled cache: tempered forward KL, estimate vs exact (mean over cache draws)\n")
    print("| teacher scale | top-8 mass | tau | --top-k M | --sample N | exact | estimate | value bias "
          "| gradient error |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for scale, tau, m, n in [(2.5, 1.0, 0, 12), (2.5, 2.0, 0, 12), (2.5, 2.0, 8, 16), (2.5, 2.0, 0, 64),
                             (2.5, 0.5, 0, 12), (6.0, 1.0, 0, 12), (6.0, 2.0, 0, 12), (6.0, 2.0, 8, 16)]:
        t_lp, s = rows(args.rows, args.vocab, 0, scale)
        top8 = float(t_lp.topk(8, -1).values.exp().sum(-1).mean())
        exact, g_exact = exact_forward_kl(t_lp, s, tau)
        vals, grads = zip(*(sampled_estimate(t_lp, s, tau, m, n, seed) for seed in range(args.trials)))
        est, g_est = float(np.mean(vals)), torch.stack(grads).mean(0)
        err = float((g_est - g_exact).norm() / g_exact.norm())
        print(f"| {scale:g} | {top8:.2f} | {tau:g} | {m} | {n} | {exact / args.rows:.4f} | {est / args.rows:.4f} | "
              f"{(est - exact) / exact:+.1%} | {err:.1%} |")
    print(f"\n(per position; {args.rows} rows, V = {args.vocab:,}, {args.trials} cache draws; the gradient error is "
          "|E[grad est] - grad exact| / |grad exact|, where tau = 1 should show only Monte Carlo noise)\n")


def reverse_kl_table(args):
    print("## 2. GKD beta = 1 over a top-k cache's buckets vs the full reverse KL(S || T)\n")
    print("| teacher scale | student noise | k | full reverse KL | bucket reverse KL | share kept |")
    print("|---:|---:|---:|---:|---:|---:|")
    for scale, noise in [(2.5, 1.0), (4.0, 1.0), (2.5, 2.0)]:
        t_lp, s = rows(args.rows, args.vocab, 1, scale, noise)
        s_lp = F.log_softmax(s, -1)
        full = float((s_lp.exp() * (s_lp - t_lp)).sum(-1).mean())
        for k in (8, 64):
            top_lp, top_ids = t_lp.topk(k, -1)
            tail = (1.0 - top_lp.exp().sum(-1)).clamp_min(0)
            bucket = float(gkd_per_position(s, top_ids, top_lp, tail, LossConfig(beta=1.0)).mean())
            print(f"| {scale:g} | {noise:g} | {k} | {full:.4f} | {bucket:.4f} | {bucket / full:.1%} |")
    print()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--trials", type=int, default=1000)
    args = p.parse_args()
    torch.set_num_threads(2)
    sampled_table(args)
    reverse_kl_table(args)


if __name__ == "__main__":
    main()
