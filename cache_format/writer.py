"""Writing a cache: shard files (one writer each) and the manifest (one owner).

Shard files can be written by any process that knows the directory, e.g. Ray
workers; only the CacheWriter, which holds the directory lock, commits them to
the manifest. Until committed, a shard file does not exist for readers.
"""
import os

from .backends import DEFAULT_CODEC, get_backend
from .errors import FingerprintError, ManifestError
from .fingerprint import describe_diff, fingerprint
from .lock import DirLock
from .manifest import (
    MANIFEST_NAME,
    SHARD_DIR,
    load_manifest,
    new_manifest,
    recount,
    save_manifest,
    shard_name,
)
from .record import check_record


def write_shard_file(directory, index, records, *, backend, top_k, vocab_size,
                     sample_start, sample_end, logprob_dtype="float16", codec=None):
    """Check and write one shard atomically. Returns its manifest entry (not yet committed).

    sample_start/sample_end: the half-open range of dataset record indices this
    shard covers (records skipped as bad leave gaps; they are counted elsewhere).
    """
    mod = get_backend(backend)
    checked = [check_record(r, top_k, vocab_size) for r in records]
    rel = shard_name(index, mod.EXT)
    os.makedirs(os.path.join(directory, SHARD_DIR), exist_ok=True)
    size, digest = mod.write_shard(os.path.join(directory, rel), checked, top_k=top_k,
                                   logprob_dtype=logprob_dtype, codec=codec or DEFAULT_CODEC[backend])
    return {
        "index": int(index), "path": rel,
        "sample_start": int(sample_start), "sample_end": int(sample_end),
        "num_samples": len(checked),
        "num_tokens": int(sum(len(r.input_ids) for r in checked)),
        "num_positions": int(sum(len(r.positions) for r in checked)),
        "num_truncated": int(sum(r.truncated for r in checked)),
        "bytes": int(size), "sha256": digest,
    }


class CacheWriter:
    """Owns a cache directory for one job: holds the lock, creates or resumes the manifest.

    Resuming checks the fingerprint: a directory made from a different teacher,
    tokenizer, dataset or setting is refused with the differing parts named.
    """

    def __init__(self, directory, *, backend, top_k, vocab_size, eos_token_ids, fingerprint_parts,
                 num_shards_planned, logprob_dtype="float16", codec=None, meta=None):
        self.directory = str(directory)
        self.backend, self.top_k, self.vocab_size = backend, int(top_k), int(vocab_size)
        self.logprob_dtype, self.codec = logprob_dtype, codec or DEFAULT_CODEC[backend]
        get_backend(backend)
        parts = dict(fingerprint_parts)
        parts["format"] = {"backend": backend, "top_k": self.top_k, "logprob_dtype": logprob_dtype,
                           "codec": self.codec}
        self._init = dict(backend=backend, top_k=top_k, vocab_size=vocab_size, eos_token_ids=eos_token_ids,
                          fingerprint=fingerprint(parts), fingerprint_parts=parts,
                          num_shards_planned=num_shards_planned, logprob_dtype=logprob_dtype, meta=meta)
        self._lock = DirLock(self.directory)
        self.manifest = None
        self.resumed = False

    def open(self):
        os.makedirs(self.directory, exist_ok=True)
        self._lock.acquire()
        try:
            if os.path.exists(os.path.join(self.directory, MANIFEST_NAME)):
                self.manifest = load_manifest(self.directory)
                self._check_same(self.manifest)
                self.resumed = True
            else:
                self.manifest = new_manifest(**self._init)
                save_manifest(self.directory, self.manifest)
        except BaseException:
            self._lock.release()
            raise
        return self

    def _check_same(self, old):
        new = self._init
        if old["fingerprint"] == new["fingerprint"]:
            if old["num_shards_planned"] != new["num_shards_planned"]:
                raise ManifestError(f"{self.directory}: planned {old['num_shards_planned']} shards before, "
                                    f"{new['num_shards_planned']} now, with the same fingerprint")
            return
        differ = describe_diff(old.get("fingerprint_parts", {}), new["fingerprint_parts"])
        raise FingerprintError(
            f"{self.directory} already holds a cache made from different inputs "
            f"(differs in: {'; '.join(differ) or 'unknown parts'}). "
            "Use a new --out directory, or delete this one to start over.")

    def done_indices(self):
        return {s["index"] for s in self.manifest["shards"]}

    def write_shard(self, index, records, *, sample_start, sample_end):
        """Write one shard in this process and commit it (convenience for single-process jobs)."""
        info = write_shard_file(self.directory, index, records, backend=self.backend, top_k=self.top_k,
                                vocab_size=self.vocab_size, sample_start=sample_start,
                                sample_end=sample_end, logprob_dtype=self.logprob_dtype, codec=self.codec)
        self.commit(info)
        return info

    def commit(self, info):
        """Add a finished shard to the manifest and rewrite it atomically."""
        if info["index"] in self.done_indices():
            raise ManifestError(f"{self.directory}: shard {info['index']} is already committed")
        if not 0 <= info["index"] < self.manifest["num_shards_planned"]:
            raise ManifestError(f"{self.directory}: shard index {info['index']} outside the plan "
                                f"[0, {self.manifest['num_shards_planned']})")
        self.manifest["shards"].append(info)
        recount(self.manifest)
        save_manifest(self.directory, self.manifest)

    def close(self):
        self._lock.release()

    def __enter__(self):
        return self.open()

    def __exit__(self, *exc):
        self.close()


def write_cache(directory, records, *, shard_size, **kwargs):
    """Write a whole cache in this process: records in order, shard_size per shard."""
    records = list(records)
    n_shards = max(1, -(-len(records) // shard_size))
    with CacheWriter(directory, num_shards_planned=n_shards, **kwargs) as w:
        for j in range(n_shards):
            if j in w.done_indices():
                continue
            part = records[j * shard_size:(j + 1) * shard_size]
            w.write_shard(j, part, sample_start=j * shard_size, sample_end=j * shard_size + len(part))
        return w.manifest
