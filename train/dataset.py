"""kdcache.CacheDataset: a cache as a torch IterableDataset, for Hugging Face Trainer, TRL or any loop."""
import torch

from .data import CacheStream, StreamPosition


class CacheDataset(torch.utils.data.IterableDataset):
    """Yields the cache's Records (see kdcache.open_cache) in `kdcache train`'s order.

    Each epoch is the cache's global order (shards and rows shuffled by (seed, epoch) when shuffle), split into
    contiguous spans for ranks (rank, world_size); within a rank, DataLoader workers read disjoint sets of
    shards. epochs=None streams forever. state_dict()/load_state_dict() resume exactly where the last record
    handed out left off (the position of the main-process iteration: use num_workers=0 when you checkpoint
    the dataset's state). Batch the records with kdcache.collate.
    """

    def __init__(self, cache, *, shuffle=True, seed=0, rank=0, world_size=1, epochs=1, prefetch=2):
        super().__init__()
        self.path = getattr(cache, "directory", None) or str(cache)      # a Cache, a path or a URL
        self.shuffle, self.seed, self.rank, self.world_size = shuffle, seed, rank, world_size
        self.epochs, self.prefetch = epochs, prefetch
        self._position = StreamPosition()

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        part = (0, 1) if info is None else (info.id, info.num_workers)
        stream = CacheStream(self.path, rank=self.rank, world=self.world_size, seed=self.seed, shuffle=self.shuffle,
                             epochs=self.epochs, prefetch=self.prefetch, part=part)
        if info is None:
            stream.position = self._position
        try:
            for record, position in stream.samples():
                if info is None:
                    self._position = position
                yield record
        finally:
            stream.close()

    def state_dict(self) -> dict:
        return self._position.to_dict()

    def load_state_dict(self, state: dict):
        self._position = StreamPosition.from_dict(state)
