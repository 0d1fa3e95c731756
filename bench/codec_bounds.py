"""How few bytes can a top-k position take? Empirical entropies of the sqrt8 streams under simple models.

    .venv/bin/python bench/codec_bounds.py [--chats 300] [--ks 64,128]

bench/fidelity.py measures what kdcache's shards take. This bench asks what an ideal entropy coder would
take under a given model of the data, so a codec is judged against a floor rather than against zstd. Every
figure is bytes per trained position: the empirical entropy (sum of -log2 of the observed frequencies) of one
stream, on the realistic teacher's exact top-k (bench/realistic.py). Models:

  ids, sorted steps        what kdcache stores: each row's ids ascending, as steps; per-slot order-0
  ids, frequency-remapped  the same after renumbering ids by how often they appear in a top-k (one table
                           per shard): small steps where the common ids are
  ids, membership bound    each vocabulary id in or out of the top-k independently, at its own frequency
  ids, same-token ref      the row of the last earlier position with the same input token as a reference:
                           one in/out flag per reference id, then the new ids as remapped steps
  levels, id order         what kdcache stores: one sqrt8 level per entry, in id order; order-0
  levels | ref level       the same, given the level the reference row gave that id (or "not there")
  levels, multiset only    the levels without which id has which (rank-order steps per slot): what the
                           ranking itself costs is the difference to "id order"
  zstd-N                   the stored streams through zstd at level N, as bytes (the real coder)
  zstd-N, rows by token    the same with a shard's rows sorted by input token (stable): a reader could undo
                           the order from the input ids at no cost in bytes; it brings similar rows together
                           for zstd to match
  --temperature T          the teacher's logits divided by T: T < 1 emulates a more confident teacher

The goal in issue 13 is 80 B/pos at k=64 for the whole shard, of which tail mass, target log-probs, input
ids and offsets take about 9 B.
"""
import argparse
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from kdcache.cache_format.compact import quantize  # noqa: E402


def bits(x):
    """Empirical entropy, in bits, of the values in x (order-0, summed over the values)."""
    _, c = np.unique(np.asarray(x).ravel(), return_counts=True)
    return float(-(c * np.log2(c / c.sum())).sum())


def cond_bits(ctx, x):
    """Empirical conditional entropy H(x | ctx), in bits, summed over the values."""
    key = np.asarray(ctx, np.int64) * (int(x.max()) + 1) + x
    return bits(key) - bits(ctx)


def per_slot(a):
    return sum(bits(a[:, j]) for j in range(a.shape[1]))


def steps(sorted_ids):
    return np.diff(sorted_ids, axis=1, prepend=0)


def reference_rows(tokens):
    """int64 [P]: the last earlier row with the same input token, -1 where there is none."""
    ref = np.full(len(tokens), -1, np.int64)
    order = np.lexsort((np.arange(len(tokens)), tokens))       # by token, then by position
    same = tokens[order][1:] == tokens[order][:-1]
    ref[order[1:][same]] = order[:-1][same]
    return ref


def bounds(ids, lp, tokens, vocab):
    P, k = ids.shape
    out = {}
    order = np.argsort(ids, axis=1)
    sid = np.take_along_axis(ids, order, 1)
    levels = quantize(np.take_along_axis(lp, order, 1)).astype(np.int64)
    out["ids, sorted steps"] = per_slot(steps(sid))
    freq = np.bincount(ids.ravel(), minlength=vocab)
    remap = np.empty(vocab, np.int64)
    remap[np.argsort(-freq, kind="stable")] = np.arange(vocab)
    out["ids, frequency-remapped"] = per_slot(steps(np.sort(remap[ids], axis=1)))
    f = np.clip(freq[freq > 0] / P, 1e-12, 1 - 1e-12)
    out["ids, membership bound"] = float(-(f * np.log2(f) + (1 - f) * np.log2(1 - f)).sum() * P)

    ref = reference_rows(tokens)
    has = ref >= 0
    # in/out flags of the reference's ids, and each entry's reference level (0: not in the reference)
    rid, rlev = sid[ref[has]], levels[ref[has]]
    cur = sid[has]
    row = np.arange(len(cur))[:, None] * (vocab + 1)            # one searchsorted over all rows at once
    pos = np.searchsorted((rid + row).ravel(), (cur + row).ravel()).reshape(cur.shape) - row // (vocab + 1) * k
    pos = np.clip(pos, 0, k - 1)
    found = np.take_along_axis(rid, pos, 1) == cur
    kept = np.zeros_like(rid, bool)
    np.put_along_axis(kept, pos, found, 1)                       # which reference ids come back
    new = np.where(found, np.iinfo(np.int64).max, remap[cur])
    new = np.sort(new, axis=1)
    valid = new != np.iinfo(np.int64).max
    new_steps = np.diff(np.where(valid, new, 0), axis=1, prepend=0)[valid]
    n_new = valid.sum(1)
    first = per_slot(steps(np.sort(remap[ids[~has]], axis=1))) if (~has).any() else 0.0
    out["ids, same-token ref"] = (bits(kept.ravel()) + bits(n_new) + bits(new_steps) + first)
    ctx = np.where(found, np.take_along_axis(rlev, pos, 1) + 1, 0)
    out["levels, id order"] = bits(levels)
    out["levels | ref level"] = cond_bits(ctx, levels[has]) + bits(levels[~has])
    rank_levels = quantize(lp).astype(np.int64)
    out["levels, multiset only"] = per_slot(np.diff(rank_levels, axis=1, prepend=255))
    return {name: b / 8 / P for name, b in out.items()}, sid, levels


def zstd_sizes(sid, levels, id_dtype, level, order=None):
    from numcodecs import Zstd
    z = Zstd(level=level)
    P = len(sid)
    if order is not None:
        sid, levels = sid[order], levels[order]
    return (len(z.encode(steps(sid).astype(id_dtype).tobytes())) / P,
            len(z.encode(levels.astype(np.uint8).tobytes())) / P)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default=os.path.join(ROOT, "bench", "work", "realistic"))
    ap.add_argument("--chats", type=int, default=300)
    ap.add_argument("--ks", default="64,128")
    ap.add_argument("--temperature", type=float, default=1.0)
    args = ap.parse_args()
    import realistic
    from fidelity import teacher_scores
    built = realistic.build(args.workdir)
    scored, vocab = teacher_scores(built["teacher"], built["chats"], args.chats, args.temperature)
    tokens = np.concatenate([ids[pos] for ids, pos, _ in scored])
    lp_all = [lp for _, _, lp in scored]
    entropy = np.mean(np.concatenate([-(np.exp(lp) * lp).sum(1) for lp in lp_all]))
    print(f"{len(scored)} chats, {len(tokens):,} trained positions, vocab {vocab}, temperature "
          f"{args.temperature}: mean entropy {entropy:.2f} nats")
    by_token = np.argsort(tokens, kind="stable")
    for k in map(int, args.ks.split(",")):
        top = [np.argsort(-lp, axis=1, kind="stable")[:, :k] for lp in lp_all]
        ids = np.concatenate(top).astype(np.int64)
        lp = np.concatenate([np.take_along_axis(a, t, 1) for a, t in zip(lp_all, top)])
        b, sid, levels = bounds(ids, lp, tokens, vocab)
        print(f"\nk={k}: entropy floors, B/pos (one stream each)")
        for name, v in b.items():
            print(f"  {name:<26}{v:>7.1f}")
        for level in (3, 9, 19):
            i, lv = zstd_sizes(sid, levels, np.uint16, level)
            print(f"  zstd-{level:<21}{i:>7.1f} ids {lv:>6.1f} levels")
            i, lv = zstd_sizes(sid, levels, np.uint16, level, by_token)
            print(f"  {f'zstd-{level}, rows by token':<26}{i:>7.1f} ids {lv:>6.1f} levels")
        best = min(b["ids, sorted steps"], b["ids, frequency-remapped"], b["ids, same-token ref"])
        print(f"  best ids + best levels    {best + min(b['levels, id order'], b['levels | ref level']):>7.1f}")


if __name__ == "__main__":
    main()
