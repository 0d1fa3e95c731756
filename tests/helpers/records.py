"""Builders of synthetic cache records with teacher-like distributions."""
import numpy as np

from kdcache.cache_format import Record, Storage, tail_mass_from_logprobs

EOS = 2


def teacher_like_topk(rng, n_pos, vocab, k, temperature=1.0):
    """Top-k of a peaked, Zipf-like softmax over the full vocabulary: ids [P,k], logprobs [P,k]."""
    ranks = np.arange(1, vocab + 1)
    logits = -1.1 * np.log(ranks)[None, :] * 3 / temperature + rng.normal(scale=1.0, size=(n_pos, vocab))
    perm = np.argsort(rng.random((n_pos, vocab)), axis=1)   # random id for each rank
    logits = np.take_along_axis(logits, np.argsort(perm, axis=1), axis=1)
    lp = logits - np.logaddexp.reduce(logits, axis=1, keepdims=True)
    ids = np.argsort(-lp, axis=1, kind="stable")[:, :k]
    return ids.astype(np.int32), np.take_along_axis(lp, ids, axis=1)


def make_record(rng, sample_id, *, vocab=300, k=8, min_len=6, max_len=60, eos=EOS, truncated=False):
    T = int(rng.integers(min_len, max_len))
    ids = rng.integers(3, vocab, size=T).astype(np.int32)
    start = int(rng.integers(1, T - 1))
    if not truncated:
        ids[-1] = eos                          # the last target is the end-of-turn token
    pos = np.arange(start, T - 1, dtype=np.int32)
    tid, tlp = teacher_like_topk(rng, len(pos), vocab, k)
    return Record(sample_id, ids, pos, tid, tlp, tail_mass_from_logprobs(tlp), truncated)


def make_records(n, seed=0, **kw):
    rng = np.random.default_rng(seed)
    return [make_record(rng, i, **kw) for i in range(n)]


STORAGE_KEYS = ("logprob_dtype", "codec", "top_p")


def writer_kwargs(backend, k=8, vocab=300, **extra):
    """CacheWriter / write_cache keywords: storage format `backend` (arrow, zarr), top-k k; extra storage settings
    (logprob_dtype, codec, top_p) go into its Storage, the rest to the writer."""
    storage = Storage(backend, k, **{key: extra.pop(key) for key in STORAGE_KEYS if key in extra})
    kw = dict(storage=storage, vocab_size=vocab, eos_token_ids=[EOS], fingerprint_parts={"teacher": "t", "data": "d"})
    kw.update(extra)
    return kw


def shard_kwargs(backend, k=8, vocab=300, **storage):
    """write_shard_file keywords matching writer_kwargs(backend, k, vocab, **storage)."""
    return dict(storage=Storage(backend, k, **storage), vocab_size=vocab)
