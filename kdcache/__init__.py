"""kdcache: knowledge distillation where the teacher runs once.

The public API, for training with a cache in any loop (Hugging Face Trainer, TRL, your own):

    open_cache(path_or_url)        a cache: len(), cache[i] -> Record, iteration, .manifest       (no torch)
    CacheDataset(cache, *, shuffle, seed, rank, world_size, epochs)
                                   a torch IterableDataset of Records; ranks and DataLoader workers read
                                   disjoint shares; each iteration the next epoch(s) (set_epoch as HF calls it);
                                   mark_trained(batch) after each trained batch, then state_dict() /
                                   load_state_dict() resume exactly, under fetch-ahead loops and workers
    collate(records, *, pad_id, student_vocab, pack_len=0) -> Batch
                                   input_ids (R, T), attention_mask, position_ids, the trained positions
                                   (batch_index, positions, targets: N each), topk_ids / topk_logprobs (N, k)
                                   or (N, k + 1) with the target's own bucket (-1 = no entry), tail_mass (N,),
                                   stream_state (where a CacheDataset stands after the batch)
    kd_loss(logits, batch, **loss_settings) -> loss
                                   generalized JSD / forward / reverse KL with the tail bucket, temperature and
                                   SFT term, exactly as `kdcache train`; logits (R, T, V) or (N, V)
    kd_loss_chunked(hidden, lm_head, batch, **loss_settings) -> loss
                                   the same on hidden states (R, T, H) or (N, H) and the output head, fused and
                                   chunked so that at most one [chunk, V] block of logits exists at a time
    CrossTokenizer(cache, student_tokenizer).convert_all(records) -> records
                                   a student of another tokenizer family: each record re-derived in the
                                   student's ids by byte alignment (README, --cross-tokenizer); collate and
                                   the losses train its positions by kind
    Record, Batch, LossConfig      the types above

Stable across minor versions: these names, their arguments and the fields of Record and Batch (new optional
arguments and fields may be added). Everything else (cache_format, pipeline, train) is internal. Importing
kdcache does not import torch; the torch-based names import it when first used.
"""
import importlib

__version__ = "0.1.0"

_API = {
    "open_cache": "kdcache.cache_format.reader",
    "Record": "kdcache.cache_format.record",
    "CacheDataset": "kdcache.train.dataset",
    "collate": "kdcache.train.batch",
    "Batch": "kdcache.train.batch",
    "kd_loss": "kdcache.train.api",
    "kd_loss_chunked": "kdcache.train.api",
    "LossConfig": "kdcache.train.losses",
    "CrossTokenizer": "kdcache.train.cross",
}
__all__ = sorted(_API)


def __getattr__(name):
    if name not in _API:
        raise AttributeError(f"module 'kdcache' has no attribute {name!r}")
    value = getattr(importlib.import_module(_API[name]), name)
    globals()[name] = value          # imported once
    return value


def __dir__():
    return __all__
