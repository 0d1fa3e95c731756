"""What a step trained from each cache and under each objective, summed over every rank (metrics.jsonl's
by_cache, mixed_batches, positions_by_objective and kd_by_objective; train_summary.json's caches)."""
from .distributed import all_reduce
from .loss_config import OBJECTIVES


def by_cache(cfg, per_cache):
    """With several caches: {"by_cache": {cache: {"batches", "positions", "kd"}}} over every rank (kd: the mean
    over that cache's positions of the step, None when it had none); with --mix-cache also "mixed_batches", the
    micro-batches from it."""
    caches = cfg.caches
    if len(caches) < 2:
        return {}
    flat = all_reduce([float(v) for c in per_cache for v in c])
    rows = {c: {"batches": int(flat[3 * i]), "positions": int(flat[3 * i + 1]),
                "kd": flat[3 * i + 2] / flat[3 * i + 1] if flat[3 * i + 1] else None} for i, c in enumerate(caches)}
    return {"by_cache": rows, **({"mixed_batches": rows[cfg.mix_cache]["batches"]} if cfg.mix_cache else {})}


def by_objective(objectives, per_objective):
    """{"positions_by_objective": {objective: N}, "kd_by_objective": {objective: mean KD}} over every rank, for a
    run whose caches train different objectives (a token-rkl run's off-policy --mix-cache); {} otherwise."""
    if len(set(objectives)) < 2:
        return {}
    flat = all_reduce([v for o in OBJECTIVES for v in per_objective[o]])
    n = {o: int(flat[2 * i]) for i, o in enumerate(OBJECTIVES)}
    return {"positions_by_objective": n,
            "kd_by_objective": {o: (flat[2 * i + 1] / n[o] if n[o] else None) for i, o in enumerate(OBJECTIVES)}}


def cache_totals(cfg, rows):
    """With several caches: {cache: {"batches", "positions", "kd"}} over the logged steps (every step at
    --log-every 1), kd the mean over that cache's positions; None with one cache."""
    if len(cfg.caches) < 2:
        return None
    out = {}
    for c in cfg.caches:
        got = [r["by_cache"][c] for r in rows if c in r.get("by_cache", {})]
        n = sum(g["positions"] for g in got)
        kd = sum(g["kd"] * g["positions"] for g in got if g["kd"] is not None)
        out[c] = {"batches": sum(g["batches"] for g in got), "positions": n, "kd": kd / n if n else None}
    return out
