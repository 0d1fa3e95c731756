"""Two caches in one stream: each micro-batch comes from the first with probability `lam`, else from the second.

GKD's lambda (Agarwal et al. 2024): the fraction of on-policy data, here the round cache of `kdcache onpolicy`
against a fixed off-policy cache. Draw i (the i-th micro-batch of the run) is seeded by (seed, i), so a resumed
run draws what an uninterrupted one would; the position saved in a checkpoint is both streams' and the draw count.
"""
from dataclasses import dataclass

import numpy as np

from .data import CacheStream, StreamPosition


@dataclass(frozen=True)
class MixedPosition:
    main: StreamPosition
    mix: StreamPosition
    draws: int = 0
    from_main: bool = True     # where the batch just before this position came from

    @property
    def epoch(self):
        return self.main.epoch


class MixedStream:
    def __init__(self, main: CacheStream, mix: CacheStream, lam: float, seed: int):
        self.main, self.mix, self.lam, self.seed = main, mix, float(lam), int(seed)
        self.position = MixedPosition(main.position, mix.position, 0)

    @property
    def cache(self):
        return self.main.cache

    @property
    def damaged(self):
        return {**self.main.damaged, **self.mix.damaged}

    def from_main(self, i):
        """Whether micro-batch i comes from the main cache."""
        return bool(np.random.default_rng([self.seed, 7, i]).random() < self.lam)

    def batches(self):
        """Yield (records, MixedPosition after them), from the saved position on (both streams cycle: max_steps)."""
        self.main.position, self.mix.position = self.position.main, self.position.mix
        streams = {True: self.main.batches(), False: self.mix.batches()}
        at = {True: self.position.main, False: self.position.mix}
        i = self.position.draws
        while True:
            side = self.from_main(i)
            nxt = next(streams[side], None)
            if nxt is None:
                return
            records, at[side] = nxt
            i += 1
            yield records, MixedPosition(at[True], at[False], i, side)

    def order(self):
        return dict(self.main.order(), mix=self.mix.order(), mix_lambda=self.lam)

    def state_dict(self):
        return {"main": self.position.main.to_dict(), "mix": self.position.mix.to_dict(), "draws": self.position.draws}

    def load_state_dict(self, state):
        self.position = MixedPosition(StreamPosition.from_dict(state["main"]), StreamPosition.from_dict(state["mix"]),
                                      int(state["draws"]))

    def carry_over(self, state):
        """A checkpoint of another main cache (the last round's): the main cache from its start, the mixed-in one
        and the draws where they stood, so each round reads on into the off-policy cache."""
        self.position = MixedPosition(StreamPosition(), StreamPosition.from_dict(state["mix"]), int(state["draws"]))

    def close(self):
        self.main.close()
        self.mix.close()
