"""`kdcache verify CACHE --rescore FRACTION --teacher DIR [--backend hf]`: the engine gap of a cache, measured.

A fraction of each shard's samples (drawn by --seed, at least one a shard) is scored again by another backend
(transformers, what a trainer computes), at the cache's own token ids: the teacher's view where a record has one.
At each position both distributions are put on the same buckets, the position's stored ids and the rest of the
vocabulary, and KL(stored || rescored) over them is taken: a lower bound on the full-vocabulary KL (merging ids
never raises a KL), 0 when the two engines agree. The target token's log-prob difference comes beside it. Reported
per shard and over the sample; the cache is only read.
"""
from dataclasses import dataclass, field

import numpy as np

from kdcache.cache_format import open_cache
from kdcache.cache_format.cli import verify_parser, verify_report
from kdcache.common.errors import ConfigError
from kdcache.common.progress import bar

BACKENDS = ("hf",)    # the backends that score given ids (score_at): a top-k alone cannot place the cache's ids


@dataclass
class ShardGap:
    index: int
    samples: int = 0             # rescored, of `of`
    of: int = 0
    positions: int = 0
    kl: list = field(default_factory=list)          # per position (empty for a cache without top-k entries)
    target: list = field(default_factory=list)      # |difference| of the target's log-prob, where the cache has it

    def row(self):
        kl, tg = np.asarray(self.kl), np.asarray(self.target)
        return {"shard": self.index, "samples": self.samples, "of": self.of, "positions": self.positions,
                "kl_mean": float(kl.mean()) if kl.size else None, "kl_max": float(kl.max()) if kl.size else None,
                "target_diff_mean": float(tg.mean()) if tg.size else None}


def bucket_kl(stored_ids, stored_lp, new_lp):
    """float64 [P]: KL(p || q) over each row's entries (ids >= 0) and one bucket for the rest of the vocabulary,
    p from the stored log-probs, q from the rescored ones at the same ids."""
    valid = stored_ids >= 0
    p = np.where(valid, np.exp(stored_lp.astype(np.float64)), 0.0)
    q = np.where(valid, np.exp(new_lp.astype(np.float64)), 0.0)
    p_rest, q_rest = np.clip(1.0 - p.sum(1), 0.0, 1.0), np.clip(1.0 - q.sum(1), 1e-12, 1.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(p > 0, p * (np.log(p) - np.log(np.maximum(q, 1e-30))), 0.0).sum(1)
        rest = np.where(p_rest > 0, p_rest * (np.log(np.maximum(p_rest, 1e-30)) - np.log(q_rest)), 0.0)
    return np.maximum(terms + rest, 0.0)


def rescore(cache_path, teacher, fraction, seed=0, progress=True):
    """[ShardGap] of each listed shard: fraction of its samples rescored by teacher (a backend with score_at)."""
    cache = open_cache(cache_path)
    picks = []
    for info in cache.shards:
        n = info.num_samples
        rows = sorted(np.random.default_rng([seed, info.index]).choice(n, size=min(n, max(1, round(fraction * n))),
                                                                       replace=False).tolist()) if n else []
        picks.append(rows)
    gaps = []
    with bar(total=sum(map(len, picks)), unit="sample", desc="rescore", disable=not progress) as b:
        for j, rows in enumerate(picks):
            info = cache.shards[j]
            gap = ShardGap(info.index, len(rows), info.num_samples)
            recs = [cache.shard(j)[r] for r in rows]
            seqs = [r.input_ids if r.teacher_input_ids is None else r.teacher_input_ids for r in recs]
            pos = [r.positions if r.teacher_input_ids is None else r.teacher_positions for r in recs]
            for r, sc in zip(recs, teacher.score_at(seqs, pos, [r.topk_ids for r in recs]) if recs else []):
                gap.positions += len(r.positions)
                if r.topk_ids.shape[1]:
                    gap.kl += bucket_kl(r.topk_ids, r.topk_logprobs, sc.logprobs).tolist()
                if r.target_logprobs is not None:
                    known = np.isfinite(r.target_logprobs)
                    gap.target += np.abs(sc.target_logprobs[known] - r.target_logprobs[known]).tolist()
            gaps.append(gap)
            b.update(len(rows))
    return gaps


def verify_main(argv=None):
    """`kdcache verify`: cache_format's checks, and with --rescore the engine gap."""
    p = verify_parser()
    g = p.add_argument_group("rescore (the engine gap: needs the teacher's weights here)")
    g.add_argument("--rescore", type=float, metavar="FRACTION",
                   help="also rescore this fraction of each shard's samples (at least one a shard) with --backend "
                        "and report KL(stored || rescored) per shard")
    g.add_argument("--teacher", help="the teacher's model directory (for a served teacher: the weights it serves)")
    g.add_argument("--backend", default="hf", choices=BACKENDS,
                   help="the backend that rescores: hf (transformers, what a trainer computes)")
    g.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    g.add_argument("--seed", type=int, default=0, help="which samples are rescored")
    g.add_argument("--trust-remote-code", action="store_true")
    g.add_argument("--no-progress", dest="progress", action="store_false")
    args = p.parse_args(argv)
    if args.rescore is None:
        return verify_report(args)
    if not 0 < args.rescore <= 1:
        raise ConfigError(f"--rescore: {args.rescore} is not a fraction in (0, 1]")
    if not args.teacher:
        raise ConfigError("--rescore needs --teacher DIR: the weights to rescore with")
    if not args.json:
        code = verify_report(args)
        if code:
            return code
    from .teacher import make_teacher
    teacher = make_teacher(args.backend, args.teacher, dtype=args.dtype, trust_remote_code=args.trust_remote_code)
    m = open_cache(args.cache).manifest
    vocab = teacher.model.get_output_embeddings().weight.shape[0]
    if vocab < m["vocab_size"]:
        raise ConfigError(f"--teacher {args.teacher}: its output layer has {vocab:,} rows, the cache {args.cache} "
                          f"holds ids below {m['vocab_size']:,}: not this cache's teacher (another tokenizer family)")
    gaps = rescore(args.cache, teacher, args.rescore, args.seed, args.progress and not args.json)
    overall = _overall(gaps)
    gaps = [g.row() for g in gaps]
    if args.json:
        return verify_report(args, extra={"rescore": {"backend": args.backend, "teacher": args.teacher,
                                                      "fraction": args.rescore, "shards": gaps, **overall}})
    teacher_name = (m.get("meta") or {}).get("teacher", "?")
    print(f"rescored by {args.backend} ({args.teacher}, {args.dtype}) against the cache's teacher {teacher_name} "
          f"({(m.get('meta') or {}).get('teacher_backend', '?')}): KL(stored || rescored) over each position's "
          "stored ids and the rest of the vocabulary, nats")
    print(f"{'shard':>6} {'samples':>9} {'positions':>9} {'KL mean':>10} {'KL max':>10} {'|d target lp|':>14}")
    for r in gaps:
        print(f"{r['shard']:>6} {r['samples']:>4}/{r['of']:<4} {r['positions']:>9} {_f(r['kl_mean']):>10} "
              f"{_f(r['kl_max']):>10} {_f(r['target_diff_mean']):>14}")
    print(f"{'all':>6} {overall['samples']:>9} {overall['positions']:>9} {_f(overall['kl_mean']):>10} "
          f"{_f(overall['kl_max']):>10} {_f(overall['target_diff_mean']):>14}")
    return 0


def _overall(gaps):
    """Over every rescored position: the means and the max."""
    kl = np.concatenate([np.asarray(g.kl, dtype=np.float64) for g in gaps] + [np.zeros(0)])
    tg = np.concatenate([np.asarray(g.target, dtype=np.float64) for g in gaps] + [np.zeros(0)])
    return {"samples": sum(g.samples for g in gaps), "positions": sum(g.positions for g in gaps),
            "kl_mean": float(kl.mean()) if kl.size else None, "kl_max": float(kl.max()) if kl.size else None,
            "target_diff_mean": float(tg.mean()) if tg.size else None}


def _f(x):
    return "-" if x is None else f"{x:.3g}"
