"""Several caches in one stream: each micro-batch comes from one cache, drawn for each micro-batch.

Weights None (the default of `--cache A --cache B`): a cache is drawn with probability proportional to the
positions it has left in the current pass, so the caches run out together. A pass is one epoch of every cache:
in epoch mode each stream ends after `epochs` epochs, so every position of every cache trains exactly once
per epoch; under --max-steps the streams cycle and a cache that finished the pass waits for the others.
Fixed weights (`--cache-weights`, or `--mix-cache` with GKD's lambda: [lambda, 1 - lambda]) draw each cache with
its weight, and every stream cycles (--max-steps).

Draw i (the i-th micro-batch of the run) is seeded by (seed, i) and the positions used so far, all saved in a
checkpoint with every stream's position, so a resumed run draws what an uninterrupted one would.
"""
from dataclasses import dataclass

import numpy as np

from .data import CacheStream, StreamPosition


@dataclass(frozen=True)
class MultiPosition:
    streams: tuple            # StreamPosition of each cache
    used: tuple               # positions (trained tokens) read from each cache so far
    draws: int = 0
    source: int = 0           # the cache the batch just before this position came from

    @property
    def epoch(self):
        """Epochs every cache has finished."""
        return min(p.epoch for p in self.streams)

    @classmethod
    def at_epoch(cls, n: int, epoch: int = 0, draws: int = 0) -> "MultiPosition":
        """n caches, each at the start of `epoch`."""
        return cls((StreamPosition(epoch, 0, 0),) * n, (0,) * n, draws)

    def to_dict(self) -> dict:
        return {"streams": [dict(p.to_dict(), used=u) for p, u in zip(self.streams, self.used)], "draws": self.draws}

    @classmethod
    def from_dict(cls, d: dict) -> "MultiPosition":
        saved = _saved(d)
        return cls(tuple(StreamPosition.from_dict(x) for x in saved), tuple(int(x.get("used", 0)) for x in saved),
                   int(d["draws"]))


class MultiStream:
    def __init__(self, streams: list[CacheStream], weights: list[float] | None, seed: int):
        if weights is not None and (len(weights) != len(streams) or min(weights) < 0 or sum(weights) <= 0):
            raise ValueError(f"weights {weights} for {len(streams)} caches")
        self.streams, self.seed = list(streams), int(seed)
        self.weights = None if weights is None else [float(w) for w in weights]
        self.sizes = [_positions(s) for s in streams]      # positions of this rank's span, per epoch
        self.position = MultiPosition(tuple(s.position for s in streams), (0,) * len(streams))

    @property
    def cache(self):
        return self.streams[0].cache

    @property
    def damaged(self):
        return {k: v for s in self.streams for k, v in s.damaged.items()}

    def chances(self, used, ended=()):
        """Each cache's probability for the next draw, given the positions used and the streams that ended."""
        if self.weights is not None:
            w = [0.0 if k in ended else x for k, x in enumerate(self.weights)]
        else:
            live = [k for k in range(len(self.streams)) if k not in ended]
            if not live:
                return [0.0] * len(self.streams)
            passes = min(used[k] // self.sizes[k] for k in live)      # passes every live cache has finished
            w = [0.0 if k in ended else max(0, (passes + 1) * self.sizes[k] - used[k]) for k in range(len(used))]
        total = sum(w)
        return [x / total for x in w] if total else w

    def draw(self, i, used, ended=()):
        """The cache micro-batch i comes from (None: every stream ended)."""
        p = self.chances(used, ended)
        if not any(p):
            return None
        u = np.random.default_rng([self.seed, 7, i]).random()
        k = int(np.searchsorted(np.cumsum(p), u, side="right"))
        return min(k, max(j for j, x in enumerate(p) if x > 0))       # rounding at the top end

    def batches(self):
        """Yield (records, MultiPosition after them), from the saved position on."""
        for s, p in zip(self.streams, self.position.streams):
            s.position = p
        its = [s.batches() for s in self.streams]
        at, used, ended = list(self.position.streams), list(self.position.used), set()
        i = self.position.draws
        while True:
            k = self.draw(i, used, ended)
            if k is None:
                return
            nxt = next(its[k], None)
            if nxt is None:
                ended.add(k)          # this stream's epochs are done; the draw is made again without it
                continue
            records, at[k] = nxt
            used[k] += sum(len(r.positions) for r in records)
            i += 1
            yield records, MultiPosition(tuple(at), tuple(used), i, k)

    def count_batches(self, epochs):
        return sum(s.count_batches(epochs) for s in self.streams)

    def samples_per_epoch(self):
        return sum(s.samples_per_epoch() for s in self.streams)

    def order(self):
        rest = [s.order() for s in self.streams[1:]]
        if len(self.streams) == 2 and self.weights is not None:      # --mix-cache's names, as saved before
            return dict(self.streams[0].order(), mix=rest[0], mix_lambda=self.weights[0])
        return dict(self.streams[0].order(), caches=rest,
                    cache_weights=self.weights if self.weights is not None else "positions-left")

    def state_dict(self):
        d = self.position.to_dict()
        for entry, s in zip(d["streams"], self.streams):
            entry["cache"] = _identity(s)
        return d

    def load_state_dict(self, state):
        if len(_saved(state)) != len(self.streams):
            raise ValueError(f"a state of {len(_saved(state))} streams for {len(self.streams)} caches")
        self.position = MultiPosition.from_dict(state)

    def carry_over(self, state):
        """A checkpoint of other caches (the last round's, `kdcache onpolicy`): a cache that was in it reads on
        from where it stood, the others from their start; the draw count goes on."""
        if "streams" in state:
            saved = {d["cache"]: d for d in state["streams"]}
            keep = [saved.get(_identity(s)) for s in self.streams]
        elif "mix" in state:     # a two-cache state from before MultiStream: the mixed-in cache (the last) reads on
            keep = [None] * (len(self.streams) - 1) + [state["mix"]]
        else:                    # a one-cache state (a round that routed every prompt to one teacher)
            keep = [None] * len(self.streams)
        self.position = MultiPosition(tuple(StreamPosition.from_dict(d) if d else StreamPosition() for d in keep),
                                      tuple(int(d.get("used", 0)) if d else 0 for d in keep),
                                      int(state.get("draws", 0)))

    def close(self):
        for s in self.streams:
            s.close()


def _saved(state):
    """The per-stream entries of a saved state; a two-cache state from before MultiStream ({"main", "mix"})
    reads as its two streams."""
    return state["streams"] if "streams" in state else [state["main"], state["mix"]]


def _identity(stream: CacheStream) -> str:
    """What names a cache in a saved state: its fingerprint and its committed shards' hashes."""
    o = stream.order()
    return f"{o['cache_fingerprint']}:{o['shards_sha256']}"


def _positions(stream: CacheStream) -> int:
    """Trained positions in one epoch of the stream's span: shards' counts, pro rata where a span cuts a shard."""
    total = 0
    for j, rows in stream.segments(0):
        s = stream.cache.shards[j]
        total += s.num_positions * len(rows) // max(1, s.num_samples)
    return max(1, total)


def streams_of(stream) -> list:
    """The CacheStreams of a run's stream: itself, or a MultiStream's."""
    return stream.streams if isinstance(stream, MultiStream) else [stream]


def open_streams(cfg, rank, world):
    """One cache's stream, or a MultiStream over several: --cache repeated, or --mix-cache."""
    streams = [open_stream(cfg, c, rank, world) for c in cfg.caches]
    if len(streams) == 1:
        return streams[0]
    return MultiStream(streams, cfg.weights(), cfg.seed)


def open_stream(cfg, cache, rank, world):
    return CacheStream(cache, rank=rank, world=world, seed=cfg.seed, shuffle=cfg.shuffle, batch_size=cfg.batch_size,
                       max_tokens=0 if cfg.pack else cfg.max_tokens, prefetch=cfg.prefetch,
                       epochs=None if cfg.max_steps else cfg.epochs, skip_damaged=cfg.skip_damaged_shards,
                       track_use=True)   # a lease on the cache: `kdcache gc` keeps it while this run reads
