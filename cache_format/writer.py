"""Writing a cache: shard files (one writer each) and the manifest (one owner).

Shard files can be written by any process that knows the directory, e.g. Ray
workers; only the CacheWriter, which holds the directory lock, commits them to
the manifest. Until committed, a shard file does not exist for readers.
"""
import os
import shutil
import tempfile
import uuid
from dataclasses import dataclass

import numpy as np

from .compact import to_store
from .errors import ConflictError, FingerprintError, LockedError, ManifestError
from .fingerprint import describe_diff, fingerprint
from .lease import Lease
from .location import as_location
from .lock import LOCK_NAME, DirLock
from .manifest import (
    MANIFEST_NAME,
    SHARD_DIR,
    Manifest,
    ShardEntry,
    load_manifest,
    new_manifest,
    num_shards,
    save_manifest,
    shard_name,
    shard_range,
)
from .record import check_record
from .storage import Storage


def write_shard_file(directory, index, records, *, storage: Storage, vocab_size, sample_start, sample_end,
                     tag=None) -> ShardEntry:
    """Check and write one shard atomically. Returns its manifest entry (not yet committed).

    sample_start/sample_end: the half-open range of dataset record indices this
    shard covers (records skipped as bad leave gaps; they are counted elsewhere).
    tag: the writing job's id, part of the name (CacheWriter.shard_tag), so that no write or upload of
    another job (a stale worker of a killed or displaced job) can ever replace a committed shard.
    """
    checked, kls = [], []
    for r in records:
        rec, kl = to_store(check_record(r, storage.width, vocab_size, ragged=storage.top_p is not None,
                                        sample=storage.sample),
                           top_p=storage.top_p,
                           logprob_dtype=storage.logprob_dtype, vocab_size=vocab_size)
        checked.append(rec)
        kls.append(kl)
    mod = storage.module
    rel = shard_name(index, mod.EXT, tag)
    loc = as_location(directory)
    kw = dict(top_k=storage.top_k, logprob_dtype=storage.logprob_dtype, codec=storage.codec, sample=storage.sample)
    if not loc.remote:
        os.makedirs(os.path.join(loc.url, SHARD_DIR), exist_ok=True)
        size, digest = mod.write_shard(loc.path(rel), checked, **kw)
    else:      # write and checksum locally, then upload under the final name (visible once committed)
        tmp = tempfile.mkdtemp(prefix="kdcache-shard-")
        try:
            local = os.path.join(tmp, rel.rsplit("/", 1)[-1])
            size, digest = mod.write_shard(local, checked, **kw)
            loc.upload(local, rel)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    entry = ShardEntry(
        index=int(index), path=rel, sample_start=int(sample_start), sample_end=int(sample_end),
        num_samples=len(checked), num_tokens=int(sum(len(r.input_ids) for r in checked)),
        num_positions=int(sum(len(r.positions) for r in checked)), bytes=int(size), sha256=digest,
        num_truncated=int(sum(r.truncated for r in checked)), stats=shard_stats(checked, kls))
    return WrittenShard(entry, storage)


@dataclass(frozen=True)
class WrittenShard:
    """A shard file written but not committed: its manifest entry and the storage it was written with."""
    entry: ShardEntry
    storage: Storage


def shard_stats(records, kls):
    """The shard entry's `stats`: stored fidelity (KL against the exact top-k) and the teacher's NLL of the
    data's own tokens, summed over the positions where it is known."""
    kl = np.concatenate(kls) if kls else np.zeros(0)
    nll = np.concatenate([-r.target_logprobs for r in records if r.target_logprobs is not None] or [np.zeros(0)])
    nll = nll[np.isfinite(nll)].astype(np.float64)
    return {"kl_sum": float(kl.sum()), "kl_max": float(kl.max(initial=0.0)),
            "target_nll_sum": float(nll.sum()), "target_positions": int(len(nll))}


def cache_fingerprint(fingerprint_parts, storage: Storage):
    """(fingerprint, parts): the job's parts plus the storage's `format` part, as recorded in the manifest."""
    parts = dict(fingerprint_parts)
    parts["format"] = storage.fingerprint_part()
    return fingerprint(parts), parts


def _refuse_other_inputs(where, old, fp, parts):
    if old.fingerprint != fp:
        differ = describe_diff(old.fingerprint_parts, parts)
        raise FingerprintError(
            f"{where} already holds a cache made from different inputs "
            f"(differs in: {'; '.join(differ) or 'unknown parts'}). "
            "Use a new --out directory, or delete this one to start over.")


def existing_manifest(where, fp, parts):
    """The manifest at `where` if a cache of these inputs is there, None if nothing was committed;
    FingerprintError naming the differing parts if it holds a cache of other inputs."""
    loc = as_location(where)
    if not loc.exists(MANIFEST_NAME):
        return None
    m = load_manifest(loc)
    _refuse_other_inputs(loc.url, m, fp, parts)
    return m


class CacheWriter:
    """Owns a cache directory (or URL) for one job: holds the lock, creates or resumes the manifest.

    Resuming checks the fingerprint: a directory made from a different teacher,
    tokenizer, dataset or setting is refused with the differing parts named.
    Locally the lock is a flock; on an object store it is a lease object created with a
    conditional put, and every manifest write is conditional on the version this writer
    wrote last, so a second writer can never silently replace it; the lease's generation, recorded
    in the manifest as writer_generation, fences off a writer whose lease lapsed and was taken over.
    """

    def __init__(self, directory, *, storage: Storage, vocab_size, eos_token_ids, fingerprint_parts,
                 num_shards_planned=None, shard_size=None, num_records=None, meta=None):
        """The plan: shard_size and num_records (shard j covers records shard_range(j, ...)), recorded in
        the manifest and checked on resume and on every commit; or num_shards_planned alone (ranges unchecked)."""
        self.location = as_location(directory)
        self.directory = self.location.url
        self.storage, self.vocab_size = storage, int(vocab_size)
        fp, parts = cache_fingerprint(fingerprint_parts, storage)
        self.plan = None if shard_size is None else {"shard_size": int(shard_size), "records": int(num_records)}
        if self.plan:
            num_shards_planned = num_shards(num_records, shard_size)
        self._init = dict(backend=storage.format, top_k=storage.top_k, vocab_size=vocab_size,
                          eos_token_ids=eos_token_ids, fingerprint=fp, fingerprint_parts=parts,
                          num_shards_planned=num_shards_planned, logprob_dtype=storage.logprob_dtype,
                          top_p=storage.top_p, meta=meta, plan=self.plan, sample=storage.sample)
        self._lock = (Lease(self.location, LOCK_NAME, exclusive=True) if self.location.remote
                      else DirLock(self.directory))
        # This job's shards carry its id in their names (see write_shard_file): its lease id on object
        # stores, a fresh random one locally, where flock is advisory (and per client on NFS).
        self.shard_tag = self._lock.owner[:8] if self.location.remote else uuid.uuid4().hex[:8]
        self._etag = None
        self.manifest: Manifest | None = None
        self.resumed = False

    def open(self):
        if not self.location.remote:
            os.makedirs(self.directory, exist_ok=True)
            self._lock.acquire()
        else:   # the new generation must exceed the manifest's too: a released lease object is gone
            self.location.check_conditional()     # the lease and every commit rely on conditional puts
            self._lock.acquire(after=self._generation_on_store())
        try:
            if self.location.exists(MANIFEST_NAME):
                self._resume()
            else:
                self.manifest = new_manifest(**self._init)
                self._save(exclusive=self.location.remote)
            self._sweep_leftovers()
        except BaseException:
            self._lock.release()
            raise
        return self

    def _resume(self):
        """Load the committed manifest. On object stores, rewrite it at once with this writer's generation,
        before sweeping anything: a displaced writer's If-Match tag is then stale and its late commit fails."""
        for tries_left in (2, 1, 0):
            self._etag = self.location.etag(MANIFEST_NAME)   # the tag first: a write in between fails our put
            self.manifest = load_manifest(self.location)
            self._check_same(self.manifest)
            self.resumed = True
            if not isinstance(self._lock, Lease):
                return
            try:
                self._save()
                return
            except LockedError as e:      # a displaced writer committed after we read: read again
                if not tries_left or not isinstance(e.__cause__, ConflictError):
                    raise

    def _sweep_leftovers(self):
        """Remove what killed writers left (we hold the lock: none is running): temp files of shards
        written half-way and of the manifest, and shards that were never committed (written or uploaded
        by killed or displaced jobs; each job writes under its own tag, so none of ours is among them)."""
        listed = {s.path for s in self.manifest.shards}
        for name in self.location.list(SHARD_DIR):
            rel = f"{SHARD_DIR}/{name}"
            if rel not in listed:
                self.location.remove(rel)
        if not self.location.remote:       # atomic_write_bytes's temp name; object stores have no temp files
            for name in self.location.list():
                if name.startswith(f".{MANIFEST_NAME}.tmp-"):
                    self.location.remove(name)

    def _check_same(self, old):
        new = self._init
        _refuse_other_inputs(self.directory, old, new["fingerprint"], new["fingerprint_parts"])
        if self.plan and old.plan not in (None, self.plan):
            raise ManifestError(
                f"{self.directory}: this cache was started with shards of {old.plan['shard_size']} records "
                f"({old.plan['records']} records in all); this run plans {self.plan['shard_size']} "
                f"({self.plan['records']}). Resume with --shard-size {old.plan['shard_size']}, or use a new "
                "output directory.")
        if old.num_shards_planned != new["num_shards_planned"]:
            raise ManifestError(f"{self.directory}: planned {old.num_shards_planned} shards before, "
                                f"{new['num_shards_planned']} now, with the same fingerprint")
        for s in old.shards:              # caches written before the plan was recorded
            self._check_range(s, "was committed")

    def _check_range(self, entry: ShardEntry, what):
        """A shard must cover exactly the records the plan gives its index, or samples could be lost."""
        if not self.plan:
            return
        j, size = entry.index, self.plan["shard_size"]
        want = shard_range(j, size, self.plan["records"])
        if (entry.sample_start, entry.sample_end) != want:
            raise ManifestError(
                f"{self.directory}: shard {j} {what} for records [{entry.sample_start}, {entry.sample_end}) "
                f"but this run's plan ({size} records per shard) gives it [{want[0]}, {want[1]}). Resume with the "
                "--shard-size the cache was started with, or use a new output directory.")

    def done_indices(self):
        return self.manifest.done_indices()

    def write_shard(self, index, records, *, sample_start, sample_end) -> ShardEntry:
        """Write one shard in this process and commit it (convenience for single-process jobs)."""
        written = write_shard_file(self.directory, index, records, storage=self.storage, vocab_size=self.vocab_size,
                                   sample_start=sample_start, sample_end=sample_end, tag=self.shard_tag)
        self.commit(written)
        return written.entry

    def commit(self, written: WrittenShard):
        """Add a finished shard to the manifest and rewrite it atomically. Refused if it was written with other
        storage settings than this cache's, or covers other records than the plan gives its index."""
        if written.storage != self.storage:
            raise ManifestError(f"{self.directory}: shard {written.entry.index} was written as "
                                f"{written.storage.describe()}, but this cache stores {self.storage.describe()}")
        self._check_range(written.entry, "was written")
        self.manifest.commit(written.entry, self.directory)
        self._save()

    def set_meta(self, key, value):
        """Record `key` in the manifest's meta; written with the next commit."""
        self.manifest.set_meta(key, value)

    def set_source(self, entry: dict):
        """Record the cache's source (SPEC.md 4.6; its files written already) and rewrite the manifest."""
        from .manifest import validate_manifest
        self.manifest.source = entry
        validate_manifest(self.manifest.to_json(), self.location)
        self._save()

    def _save(self, exclusive=False):
        if isinstance(self._lock, Lease):
            self._fence()
            self.manifest.writer_generation = self._lock.generation
        try:
            self._etag = save_manifest(self.location, self.manifest, exclusive=exclusive,
                                       if_match=None if exclusive else self._etag)
        except ConflictError as e:
            raise LockedError(f"{self.location.path(MANIFEST_NAME)} was written by another process while this "
                              f"job held the cache ({e}); stopping without committing anything more") from e

    def _fence(self):
        """Object stores: write the manifest only while the lease object still names this writer and its
        generation, and no later owner's manifest (a higher writer_generation) is on the store."""
        self._lock.confirm()
        on_store = self._generation_on_store()
        if on_store > self._lock.generation:
            raise LockedError(
                f"{self.location.path(MANIFEST_NAME)} was written by a later owner of the cache (writer generation "
                f"{on_store}, this job's is {self._lock.generation}): this job's lease lapsed and was taken over; "
                "stopping without committing anything more")

    def _generation_on_store(self):
        """writer_generation of the manifest on the store now; 0 if none (older writers) or unreadable."""
        try:
            g = self.location.read_json(MANIFEST_NAME).get("writer_generation", 0)
        except (FileNotFoundError, ValueError, AttributeError):
            return 0
        return g if isinstance(g, int) and not isinstance(g, bool) and g > 0 else 0

    def close(self):
        self._lock.release()

    def __enter__(self):
        return self.open()

    def __exit__(self, *exc):
        self.close()


def write_cache(directory, records, *, shard_size, **kwargs):
    """Write a whole cache in this process: records in order, shard_size per shard. Returns its Manifest."""
    records = list(records)
    with CacheWriter(directory, shard_size=shard_size, num_records=len(records), **kwargs) as w:
        for j in range(num_shards(len(records), shard_size)):
            if j in w.done_indices():
                continue
            lo, hi = shard_range(j, shard_size, len(records))
            w.write_shard(j, records[lo:hi], sample_start=lo, sample_end=hi)
        return w.manifest


def reopen(directory) -> CacheWriter:
    """A CacheWriter for the cache at `directory` with the settings its manifest records (not yet opened): for
    changes that score nothing, such as adding its source (SPEC.md 4.6)."""
    m = load_manifest(directory)
    parts = dict(m.fingerprint_parts)
    fmt = parts.pop("format", None)
    if not isinstance(fmt, dict):
        raise ManifestError(f"{as_location(directory).url}: the manifest records no storage settings "
                            "(fingerprint_parts.format); a cache this old cannot be changed in place")
    storage = Storage(format=fmt["backend"], top_k=fmt["top_k"], logprob_dtype=fmt["logprob_dtype"],
                      codec=fmt.get("codec"), top_p=fmt.get("top_p"), sample=fmt.get("sample", 0))
    plan = m.plan or {}
    return CacheWriter(directory, storage=storage, vocab_size=m.vocab_size, eos_token_ids=m.eos_token_ids,
                       fingerprint_parts=parts, num_shards_planned=None if plan else m.num_shards_planned,
                       shard_size=plan.get("shard_size"), num_records=plan.get("records"), meta=m.meta)
