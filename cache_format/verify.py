"""`verify`: every checksum and structural invariant of a cache.

Returns a report instead of raising, so one damaged shard does not hide
another; each problem names the shard file and the reason.
"""
import os
import shutil
import tempfile
from dataclasses import dataclass, field

import numpy as np

from kdcache.common.atomic import disk_bytes, remove

from .errors import CacheError, ShardError
from .fingerprint import check_shard_tree, hash_tree
from .location import as_location
from .manifest import SHARD_DIR, check_shard_path, load_manifest, safe_shard_path
from .record import lacks_end_of_turn
from .storage import get_format
from .values import MASS_TOL, Rules, sqrt8_mass_error  # noqa: F401  (MASS_TOL, sqrt8_mass_error: moved there)


@dataclass
class Report:
    directory: str
    problems: list = field(default_factory=list)   # (where, reason)
    warnings: list = field(default_factory=list)
    samples_checked: int = 0
    shards_checked: int = 0

    @property
    def ok(self):
        return not self.problems


def verify_cache(directory, *, structure=True) -> Report:
    """Check checksums, sizes and counts; with structure=True also decode every record."""
    loc = as_location(directory)
    rep = Report(loc.url)
    try:
        m = load_manifest(loc)
    except CacheError as e:
        rep.problems.append(("manifest.json", str(e)))
        return rep
    for key in ("samples", "tokens", "positions", "bytes"):
        total = sum(getattr(s, key if key == "bytes" else "num_" + key) for s in m.shards)
        if total != m.counts[key]:
            rep.problems.append(("manifest.json", f"counts.{key} is {m.counts[key]}, shards add up to {total}"))
    _coverage(m, rep)
    listed = set()
    seen_ids = set()
    scratch = tempfile.mkdtemp(prefix="kdcache-verify-") if loc.remote else None
    try:
        for n, info in enumerate(m.shards):
            listed.add(info.path)
            # A remote shard is checked on a local copy whose name is ours, never built from the manifest.
            local = os.path.join(scratch, f"shard-{n:06d}") if scratch else None
            _verify_shard(loc, m, info, rep, seen_ids, structure, local)
    finally:
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)
    _orphans(loc, listed, rep)
    if m.source is not None:
        _verify_source(loc, m, rep)
    if not m.complete:
        rep.warnings.append(("manifest.json", f"incomplete: {len(m.shards)} of "
                             f"{m.num_shards_planned} planned shards committed"))
    return rep


def _verify_shard(loc, m, info, rep, seen_ids, structure, local):
    name = info.path
    try:
        check_shard_path(loc, name)
        path = local if loc.remote else safe_shard_path(loc.url, name)
        if loc.remote:
            loc.download(name, path)
    except CacheError as e:
        rep.problems.append((name, str(e)))
        return
    except FileNotFoundError:
        pass
    if not os.path.exists(path):
        rep.problems.append((name, "listed in the manifest but missing"))
        return
    try:
        check_shard_tree(path)     # before any size or checksum: both would follow a link out of the cache
    except ShardError as e:
        rep.problems.append((name, str(e)))
        return
    size = disk_bytes(path)
    if size != info.bytes:
        rep.problems.append((name, f"size is {size} bytes, the manifest says {info.bytes} (truncated or replaced)"))
        return
    if hash_tree(path, shard=True) != info.sha256:
        rep.problems.append((name, "sha256 checksum mismatch (the shard's bytes changed after it was committed)"))
        return
    rep.shards_checked += 1
    if structure:
        try:
            _verify_records(path, m, info, rep, seen_ids)
        except CacheError as e:
            rep.problems.append((name, str(e)))
        except Exception as e:     # a damage no check foresaw: still this shard's problem, and the others go on
            rep.problems.append((name, f"cannot be decoded ({type(e).__name__}: {e})"))
    if loc.remote:
        remove(path)


def _verify_records(path, m, info, rep, seen_ids):
    """The shard's records: the value rules of every decoded block (values.py, as every reader checks them; the
    first broken one is the shard's problem), then per sample its range, order, uniqueness and end of turn, and
    the shard's counts against the manifest."""
    name = info.path
    eos = np.array(m.eos_token_ids, dtype=np.int64)
    reader = get_format(m.backend).Shard(path, m.top_k, rules=Rules.of(m))
    sample = m.sample or 0
    if getattr(reader, "sample", 0) != sample:
        rep.problems.append((name, f"{reader.sample} draws per position in the shard, {sample} in the manifest"))
        return
    n = tokens = positions = 0
    prev = None
    for rec in reader:
        n += 1
        sid = rec.sample_id
        tokens += len(rec.input_ids)
        positions += len(rec.positions)
        if not info.sample_start <= sid < info.sample_end:
            rep.problems.append((name, f"sample {sid} outside the shard's range "
                                 f"[{info.sample_start}, {info.sample_end})"))
        if prev is not None and sid <= prev:
            rep.problems.append((name, f"sample ids not increasing ({prev} then {sid})"))
        if sid in seen_ids:
            rep.problems.append((name, f"sample {sid} appears twice in the cache"))
        seen_ids.add(sid)
        prev = sid
        if lacks_end_of_turn(rec.targets, rec.truncated, eos):
            rep.problems.append((name, f"sample {sid}: no trained position predicts an end-of-turn token "
                                 f"{eos.tolist()} and the sample is not flagged truncated"))
    rep.samples_checked += n
    for what, got in (("samples", n), ("tokens", tokens), ("positions", positions)):
        if got != getattr(info, "num_" + what):
            rep.problems.append((name, f"holds {got} {what}, the manifest says {getattr(info, 'num_' + what)}"))


def _coverage(m, rep):
    """Shard ranges tile the records with no gap or overlap (and match the recorded plan): a complete cache
    never lacks a record. Records skipped as bad lie inside ranges; they are counted in meta.skipped."""
    plan = m.plan
    end = 0
    for s in m.shards:                          # sorted by index
        j, lo, hi = s.index, s.sample_start, s.sample_end
        if plan:
            want = m.shard_range(j)
            if (lo, hi) != want:
                rep.problems.append(("manifest.json", f"shard {j} covers records [{lo}, {hi}), the plan "
                                     f"({plan['shard_size']} per shard) gives it [{want[0]}, {want[1]})"))
        elif m.complete and lo != end:
            rep.problems.append(("manifest.json", f"records [{min(end, lo)}, {max(end, lo)}) are "
                                 f"{'in no shard' if lo > end else 'in two shards'} (before shard {j})"))
        end = hi
    if plan and m.complete and m.shards and m.shards[-1].sample_end != plan["records"]:
        rep.problems.append(("manifest.json", f"complete, but the shards end at record "
                             f"{m.shards[-1].sample_end} of {plan['records']}"))


def _verify_source(loc, m, rep):
    """The source (SPEC.md 4.6): every tokenizer file and conversation file by checksum, one per committed shard
    holding that shard's sample ids in its order, each chat well-formed."""
    from .reader import open_cache
    from .source import TOKENIZER_DIR, CacheSource
    try:
        src = CacheSource(loc, m)
    except CacheError as e:
        rep.problems.append(("manifest.json", str(e)))
        return
    for name in src.files:
        try:
            src._read(f"{TOKENIZER_DIR}/{name}", src.files[name], "a tokenizer file")
        except CacheError as e:
            rep.problems.append((f"{TOKENIZER_DIR}/{name}", str(e)))
    cache = open_cache(loc.url, check_values=False) if not loc.remote else None
    try:
        for j, info in enumerate(m.shards):
            rel = src.entries[info.index]["path"]
            try:
                ids, _ = src.chats(info.index)
                want = cache.shard(j).sample_ids() if cache is not None else None
            except CacheError as e:
                rep.problems.append((rel, str(e)))
                continue
            if len(ids) != info.num_samples or (want is not None and not np.array_equal(ids, want)):
                rep.problems.append((rel, f"its sample ids are not those of shard {info.index} ({info.path}), in "
                                     "its order"))
    finally:
        if cache is not None:
            cache.close()


def _orphans(loc, listed, rep):
    for entry in loc.list(SHARD_DIR):
        rel = f"{SHARD_DIR}/{entry}"
        if rel not in listed:
            rep.warnings.append((rel, "not listed in the manifest: ignored by readers "
                                 "(left by an interrupted job; a resumed job rewrites it)"))
