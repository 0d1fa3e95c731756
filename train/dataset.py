"""kdcache.CacheDataset: a cache as a torch IterableDataset, for Hugging Face Trainer, TRL or any loop."""
import torch

from kdcache.common.errors import ConfigError

from .data import CacheStream, StreamPosition
from .mix import MultiPosition, MultiStream


class CacheDataset(torch.utils.data.IterableDataset):
    """Yields the cache's Records (see kdcache.open_cache) in `kdcache train`'s order.

    Each epoch is the cache's global order (shards and rows shuffled by (seed, epoch) when shuffle), split into
    contiguous spans for ranks (rank, world_size); within a rank, DataLoader workers read disjoint sets of
    shards. An iteration yields `epochs` epochs (None: forever), and the next iteration goes on from there, so
    iterating again gives the next epoch(s); set_epoch(e) (the Hugging Face Trainer and Accelerate call it)
    makes the next iteration epoch e's. A resumed iteration ends where the interrupted one would have.

    Resuming exactly. Each Record carries `stream_state`, and kdcache.collate puts the last one on the Batch.
    A loop that fetches ahead (the Hugging Face Trainer, Accelerate) or uses DataLoader workers calls
    mark_trained(batch) once a batch is trained; state_dict() is then what was trained, not what was fetched,
    for every worker. Without mark_trained it is where the main process's iteration stands (exact for a plain
    loop with num_workers=0). load_state_dict() refuses a state of another number of workers.

    Several caches (a list, e.g. one per teacher): each sample comes from one, drawn as `kdcache train --cache A
    --cache B` draws its micro-batches (train/mix.py): in proportion to the positions each has left, so an epoch
    yields every sample of every cache once, or by `weights` (then epochs=None: the caches cycle). The state
    then holds every cache's position and the draws, and resumes as exactly.
    """

    def __init__(self, cache, *, shuffle=True, seed=0, rank=0, world_size=1, epochs=1, prefetch=2, weights=None):
        super().__init__()
        caches = list(cache) if isinstance(cache, (list, tuple)) else [cache]
        self.paths = [getattr(c, "directory", None) or str(c) for c in caches]      # Caches, paths or URLs
        self.path = self.paths[0]
        if len(set(self.paths)) < len(self.paths):
            raise ConfigError(f"CacheDataset: a cache given twice in {self.paths}")
        if weights is not None and (len(weights) != len(self.paths) or epochs is not None):
            raise ConfigError(f"CacheDataset: weights {list(weights)} need one weight per cache ({len(self.paths)}) "
                              "and epochs=None (weighted caches cycle)")
        self.weights = None if weights is None else [float(w) for w in weights]
        self.shuffle, self.seed, self.rank, self.world_size = shuffle, seed, rank, world_size
        self.epochs, self.prefetch = epochs, prefetch
        self._start = {1: {0: self._at_epoch(0)}}     # workers -> {worker: where its next iteration starts}
        self._trained = {}                           # (worker, workers) -> StreamPosition after its last trained batch
        self._from_epoch = 0                         # the epoch the current (or next) iteration began at

    # -- iteration -------------------------------------------------------------------
    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        part = (0, 1) if info is None else (info.id, info.num_workers)
        start = self._start_of(part)
        end = None if self.epochs is None else self._from_epoch + self.epochs
        streams = [CacheStream(p, rank=self.rank, world=self.world_size, seed=self.seed, shuffle=self.shuffle,
                               epochs=end, prefetch=self.prefetch, part=part, batch_size=1) for p in self.paths]
        if len(streams) == 1:
            stream, items = streams[0], None
        else:
            stream = MultiStream(streams, self.weights, self.seed)
            items = ((records[0], position) for records, position in stream.batches())
        stream.position = start
        try:
            for record, position in items or stream.samples():
                record.stream_state = {**position.to_dict(), "worker": part[0], "workers": part[1]}
                self._start[part[1]] = {**self._start.get(part[1], {}), part[0]: position}   # this process's copy
                yield record
            if end is not None:
                self._from_epoch = end              # the iteration ran to its end: the next one begins there
        finally:
            stream.close()

    def _start_of(self, part):
        i, n = part
        if n not in self._start:
            saved = sorted(self._start)
            if any(p != self._at_epoch(0) for w in saved for p in self._start[w].values()):
                raise ConfigError(f"CacheDataset: the state was saved with {saved[0]} DataLoader worker(s), and "
                                  f"this DataLoader has {n}: each worker reads its own shards, so the positions "
                                  f"do not carry over. Resume with num_workers={saved[0] if saved[0] > 1 else 0}.")
            return self._at_epoch(max([p.epoch for w in saved for p in self._start[w].values()] or [0]))
        return self._start[n].get(i, self._at_epoch(0))

    def _at_epoch(self, epoch):
        """The position at the start of `epoch` (of every cache)."""
        return StreamPosition(epoch, 0, 0) if len(self.paths) == 1 else MultiPosition.at_epoch(len(self.paths), epoch)

    def _position(self, d):
        return StreamPosition.from_dict(d) if len(self.paths) == 1 else MultiPosition.from_dict(d)

    def set_epoch(self, epoch):
        """Start the next iteration at epoch `epoch` (where it is not already past its start), every worker."""
        self._from_epoch = int(epoch)
        for n, parts in list(self._start.items()):
            self._start[n] = {i: p if p.epoch >= epoch else self._at_epoch(epoch)
                              for i, p in ({**{i: self._at_epoch(0) for i in range(n)}, **parts}).items()}

    # -- resumable position ----------------------------------------------------------
    def mark_trained(self, batch):
        """Record that `batch` (from kdcache.collate of this dataset's records) has been trained."""
        st = batch.stream_state
        if st is None:
            raise ConfigError("CacheDataset.mark_trained: the batch carries no stream_state (collate records of "
                              "this CacheDataset with kdcache.collate)")
        self._trained[(st["worker"], st["workers"])] = self._position(st)

    def state_dict(self) -> dict:
        """{"epoch", "shard_cursor", "row_cursor"} with one reader (several caches: {"streams": [...], "draws"});
        {"workers": n, "positions": {i: ...}} with DataLoader workers."""
        if self._trained:
            n = max(w for _, w in self._trained)
            where = {i: self._trained.get((i, n), self._start.get(n, {}).get(i, self._at_epoch(0))) for i in range(n)}
        else:
            n = max(self._start)
            where = {i: self._start[n].get(i, self._at_epoch(0)) for i in range(n)}
        if n == 1:
            return {**where[0].to_dict(), "from_epoch": self._from_epoch}
        return {"workers": n, "positions": {str(i): p.to_dict() for i, p in where.items()},
                "from_epoch": self._from_epoch}

    def load_state_dict(self, state: dict):
        if "workers" in state:
            n = int(state["workers"])
            self._start = {n: {int(i): self._position(p) for i, p in state["positions"].items()}}
        else:
            self._start = {1: {0: self._position(state)}}
        # States saved before from_epoch: the iteration began at the epoch the position is in.
        self._from_epoch = int(state.get("from_epoch", min(p.epoch for ps in self._start.values()
                                                               for p in ps.values())))
        self._trained = {}
