"""Draws from a teacher's distribution for a sampled cache (--sample N): the exact top-k, then N draws with
replacement from the rest, renormalised (stratified sampling: unbiased, and no draw is spent on what is stored
exactly). Vectorised over a block of positions; one torch.Generator per sample, seeded with its seed, so that a
resumed shard draws what the first attempt drew."""
import torch


def top_and_draws(lp: torch.Tensor, k: int, n: int, gen: torch.Generator):
    """lp: float32 [c, V] log-softmax rows at temperature 1. Returns numpy (top_ids int32 [c, k], top_lp float32
    [c, k] descending, draw_ids int32 [c, n], draw_lp float32 [c, n]: each draw's teacher log-prob).

    Probabilities in float32 (what the row holds; ids below 1e-38 are never drawn, a mass nothing can see). A
    row whose rest has no mass left draws uniformly from the rest's ids: the draws then carry weight
    tail_mass = 0 and change no loss."""
    c, V = lp.shape
    top_lp, top_ids = lp.topk(k, dim=-1) if k else (lp.new_zeros((c, 0)), lp.new_zeros((c, 0), dtype=torch.long))
    p = lp.float().exp()
    p.scatter_(1, top_ids, 0.0)
    rest = p.sum(-1, keepdim=True)
    if bool((rest <= 0).any()):
        uniform = torch.ones_like(p).scatter_(1, top_ids, 0.0)
        p = torch.where(rest > 0, p, uniform)
    draws = torch.multinomial(p, n, replacement=True, generator=gen)              # [c, n]; rows need not sum to 1
    return (top_ids.int().cpu().numpy(), top_lp.float().cpu().numpy(), draws.int().cpu().numpy(),
            lp.gather(1, draws).float().cpu().numpy())


def generator_for(seed: int, device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(int(seed) % (2**63))
    return g
