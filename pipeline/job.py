"""The precompute driver: fingerprint, find or reuse the cache, scan the dataset, run the teacher, report.

Read top to bottom: settle the job (settle.py: teacher, tokenizer, storage, fingerprint; meanwhile Ray starts
in the background where the job will most likely need it) -> find the cache (reuse it if complete) -> count the
dataset's records (a cheap pass: the shard plan) -> open (or resume) the cache -> scan the dataset once into a
spool while the teacher workers start, handing them each shard as soon as its records are read (dispatch.py)
-> commit the rest as they return -> summary (summary.py).
The cache may be a local directory or an fsspec URL, or be placed in a store.
"""
import os
import shutil
import time
from collections import Counter
from dataclasses import replace

from kdcache.cache_format import CacheError, CacheWriter
from kdcache.cache_format.lease import stamp_use
from kdcache.cache_format.location import Location
from kdcache.cache_format.manifest import MANIFEST_NAME, SHARD_DIR, num_shards
from kdcache.cache_format.store import is_store
from kdcache.cache_format.store import resolve as resolve_in_store
from kdcache.cache_format.writer import cache_fingerprint, existing_manifest
from kdcache.common.atomic import atomic_write_bytes
from kdcache.common.errors import BadRow, DataError, Interrupted, SkipSample

from . import canary, source
from . import summary as report
from .data import cache_records, is_cache, iter_rows, jsonl_lines, open_source_cache, parse_row
from .dispatch import Dispatcher, RunStats, prestart_workers
from .ray_start import RayStarter
from .settle import Job, may_start_early, settle
from .spool import Spool
from .teacher_served import ServedTeacher


def run_precompute(cfg, pool=None):
    """pool: a pipeline.pool.WorkerPool whose Ray and teacher workers serve this job and outlive it (kdcache
    onpolicy's rounds), else None: the job starts (or joins) Ray and stops its workers at the end."""
    t_start = time.time()
    # Ray and the teacher actors start at once in the background where the job will most likely need them: the
    # driver settles the job and reads the dataset meanwhile. Otherwise they start once there is work for them.
    if pool is not None:
        starter = pool.start(cfg, early=True)
    else:
        starter = RayStarter(cfg.ray_address, prestart_workers(cfg)) if may_start_early(cfg) else None
    try:
        job = settle(cfg, t_start)
        cfg = job.cfg                      # with max_length resolved
        # Everything the cache depends on is known before reading the dataset: fingerprint first, so a
        # finished cache (here or in a store) is found and reused without a teacher or a tokenizer pass.
        fp, full_parts = cache_fingerprint(job.parts, job.storage)
        job.cfg = cfg = replace(cfg, out=cache_location(cfg, fp, job.server))
        if cfg.location_file:
            atomic_write_bytes(cfg.location_file, cfg.out.encode())
        done = existing_manifest(cfg.out, fp, full_parts)
        if done is not None and done.complete:
            if "canary" in done.meta:              # a served teacher: still the weights this cache holds
                served_canary(job, done.meta)
            print(f"{cfg.out}: a complete cache of these inputs exists (fingerprint {fp[:16]}); reusing it: "
                  "nothing to do, no teacher work.")
            stamp_use(Location(cfg.out))
            return report.reused_summary(cfg, done, job.t_start)

        created = not Location(cfg.out).remote and not os.path.exists(cfg.out)
        spool = Spool()
        try:
            return run_job(job, spool, starter, pool)
        finally:
            spool.delete()
            if created and os.path.isdir(cfg.out) and not os.path.exists(os.path.join(cfg.out, MANIFEST_NAME)):
                shutil.rmtree(cfg.out, ignore_errors=True)   # a job stopped before committing anything leaves nothing
    finally:
        if starter is not None and pool is None:
            starter.close()


def teacher_name(cfg, server=None):
    """A short name of the teacher: its directory's, or the served model's."""
    if server:
        return os.path.basename(server["model"].rstrip("/")) or server["model"]
    return os.path.basename(os.path.abspath(cfg.teacher))


def default_alias(cfg, server=None):
    data = os.path.basename(cfg.data.rstrip("/")).split(".")[0]
    teacher = teacher_name(cfg, server)
    return f"{teacher}-{data}-k{cfg.top_k}" + ("-gen" if cfg.mode == "generate" else "")


def cache_location(cfg, fp, server=None):
    """The cache directory: --out itself, or, when --out is a store root, the store's cache for fingerprint fp."""
    if not (cfg.store or is_store(cfg.out)):
        return cfg.out
    if Location(cfg.out).exists("manifest.json"):
        raise CacheError(f"{cfg.out} is a cache, not a store root: drop --store to resume it, or name another "
                         "directory as the store")
    where, found = resolve_in_store(cfg.out, fp, cfg.alias or default_alias(cfg, server))
    print(f"store {cfg.out}: " + (f"found the cache of these inputs: {where}" if found
                                  else f"no cache of these inputs yet; writing {where}"))
    return where


def count_rows(path):
    """The number of records iter_rows(path) yields, without parsing them: the shard plan (shard j = records
    [j*shard_size, (j+1)*shard_size)) needs it before the scan is over. JSONL: non-blank lines; Parquet: its
    metadata; anything else: a pass of the reader. The scan checks it read as many."""
    if is_cache(path):
        return cache_records(open_source_cache(path))
    if os.path.isfile(path) and path.endswith((".jsonl", ".json", ".ndjson")):
        with open(path, "rb") as f:
            return sum(1 for line in jsonl_lines(f) if line is None or line.strip())
    if os.path.isfile(path) and path.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq
        try:
            return pq.ParquetFile(path).metadata.num_rows
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"{path}: cannot be read as Parquet ({type(e).__name__}: {e})") from None
    return sum(1 for _ in iter_rows(path))


def scan(cfg, encoder, spool, n_records=None, pump=None):
    """The one pass over the dataset: count records, list every skip, spool the encoded samples. Returns (records
    read, skipped, samples by record kind).

    pump(records read, hold_back) is called after every record: the teacher workers get each shard as soon as its
    records are spooled (dispatch.Dispatcher.pump); hold_back once a malformed record will fail the job.
    A malformed record under on_bad_record=fail, a dataset with no usable record, or one whose record count differs
    from n_records stop the job here, after the whole pass, before anything is committed.
    """
    n, skipped, failing, kinds = 0, [], False, Counter()
    encode = encoder.encode_prompt if cfg.mode == "generate" else encoder.encode   # a prompt, or whole sequences
    for raw in iter_rows(cfg.data):
        n += 1
        try:
            if raw.error:
                raise BadRow(raw.error)
            if raw.skip:
                raise SkipSample(*raw.skip)
            ex = parse_row(raw.data)
            spool.add(encode(ex, raw.index))
            kinds[ex.kind] += 1
        except BadRow as e:
            skipped.append({"sample_id": raw.index, "where": raw.where, "reason": "bad_record", "message": str(e)})
            failing = cfg.on_bad_record == "fail"
        except SkipSample as e:
            skipped.append({"sample_id": raw.index, "where": raw.where, "reason": e.reason, "message": str(e)})
        if pump is not None:
            pump(n, failing or (n_records is not None and n > n_records))
    spool.close_writing()
    bad = [s for s in skipped if s["reason"] == "bad_record"]
    if bad and cfg.on_bad_record == "fail":
        raise DataError(f"{bad[0]['where']}: {bad[0]['message']} ({len(bad)} malformed record(s) in all; "
                        "fix them, or pass --on-bad-record skip to skip and list them)")
    if n == len(skipped):
        why = ", ".join(f"{k}: {v}" for k, v in sorted(Counter(s["reason"] for s in skipped).items()))
        raise DataError(f"dataset {cfg.data}: no usable records" + (f" ({n} read, all skipped: {why}; the first: "
                        f"{skipped[0]['where']}: {skipped[0]['message']})" if n else " (it is empty)")
                        + "; nothing to cache")
    if n_records is not None and n != n_records:
        raise DataError(f"dataset {cfg.data} changed while this job read it ({n_records} records counted first, "
                        f"{n} read); rerun once it no longer changes")
    return n, skipped, kinds


def discard_uncommitted(writer):
    """A job stopped before it committed anything, in a cache it created: take its manifest (and the shard files
    its workers wrote) back, so the directory holds no cache, as if the job had never started: a fixed dataset
    can then start afresh there. A cache with committed shards, or started by an earlier run, is left as it is."""
    if writer.manifest is None or writer.resumed or writer.manifest.shards:
        return
    loc = writer.location
    for name in loc.list(SHARD_DIR):
        loc.remove(f"{SHARD_DIR}/{name}")
    loc.remove(MANIFEST_NAME)


def served_canary(job: Job, meta: dict):
    """A served teacher's canary (canary.py), scored now and checked against meta's (a manifest's meta) where it has
    one: CanaryError if it differs. Returns (the workers' check: WorkerSpec.canary, the new meta.canary where meta has
    none); (None, None) for a local teacher (its fingerprint hashes its weights) or with --canary-positions 0."""
    cfg = job.cfg
    if job.server is None or not cfg.canary_positions:
        return None, None
    c = canary.pick(cfg, job.encoder, cfg.canary_positions)
    if c is None:
        return None, None
    teacher = ServedTeacher(cfg.teacher, requests_in_flight=cfg.requests_in_flight, expect=job.server)
    try:
        logprobs = canary.score(teacher, c)
    finally:
        teacher.close()
    reference, new = meta.get("canary"), None
    if reference is not None:
        mean = canary.check(reference, c, logprobs, cfg.canary_tolerance, cfg.teacher, "this job as it started")
        print(f"canary: the teacher server scores the cache's {len(logprobs)} canary positions as before (mean "
              f"difference {mean:.2g} nats, tolerance {cfg.canary_tolerance:g})")
    else:
        reference = new = canary.entry(c, logprobs, cfg.canary_tolerance)
    return {"canary": c, "reference": reference, "tolerance": cfg.canary_tolerance}, new


def attach_source(job: Job, writer, kinds):
    """A complete cache of text records gets its source (SPEC.md 4.6) once, so that it is self-contained: a
    student of another tokenizer can train from it alone (--cross-tokenizer). Caches of id records (a cache as
    --data among them) hold no text and get none."""
    if not writer.manifest.complete or writer.manifest.source is not None or "ids" in kinds or not kinds:
        return
    cfg = job.cfg
    model_dir = cfg.tokenizer if job.server else cfg.teacher
    print(f"{cfg.out}: {source.describe(source.attach(writer, cfg.data, job.encoder.tok, model_dir))}")


def run_job(job: Job, spool, starter=None, pool=None):
    """starter: Ray starting in the background (RayStarter), else started here once there is work for it. pool:
    as run_precompute's."""
    cfg = job.cfg
    n_records = count_rows(cfg.data)
    if n_records == 0:
        raise DataError(f"dataset {cfg.data}: no usable records (it is empty); nothing to cache")
    n_units = num_shards(n_records, cfg.shard_size)
    meta = {"teacher": teacher_name(cfg, job.server), "dataset": os.path.basename(cfg.data),
            "mode": cfg.mode, "teacher_backend": job.teacher_backend, "teacher_backend_reason": job.backend_reason,
            "dtype": job.dtype,
            "tokenizer": job.tokenizer_id, "records": n_records,
            "text_end": job.encoder.tok.convert_ids_to_tokens(job.encoder.text_end),
            "chat_template": job.encoder.tok.chat_template if isinstance(job.encoder.tok.chat_template, str) else None,
            "skipped": {}}        # filled in once the scan is over, before the first commit writes it
    if job.teacher_backend == "vllm":
        meta["vllm_engine"] = {"enforce_eager": cfg.enforce_eager,
                               "tensor_parallel_size": cfg.tensor_parallel_size,
                               "pipeline_parallel_size": cfg.pipeline_parallel_size}
    if cfg.generator:
        # stop_ids: where its generations stop on either backend, the teacher's turn ends (teacher_vllm.stop_only_at)
        meta["generator"] = {"model": os.path.basename(os.path.abspath(cfg.generator)),
                             "backend": job.generator_backend, "stop_ids": sorted(int(t) for t in job.turn_ends)}
    if job.server:
        meta["teacher_server"] = {"url": cfg.teacher, **job.server, "revision": cfg.teacher_revision}
    writer = CacheWriter(cfg.out, storage=job.storage, vocab_size=job.vocab_size, eos_token_ids=job.turn_ends,
                         fingerprint_parts=job.parts, shard_size=cfg.shard_size, num_records=n_records, meta=meta)
    with writer:
        try:
            held, new = served_canary(job, writer.manifest.meta)
        except BaseException:
            discard_uncommitted(writer)             # a job stopped here leaves no cache, as if never started
            raise
        if new is not None:
            writer.set_meta("canary", new)          # written with the first commit
        todo = set(range(n_units)) - writer.done_indices()
        at_start = len(writer.manifest.shards)
        if writer.resumed and todo:
            print(f"{cfg.out}: resuming, {n_units - len(todo)} of {n_units} shards already committed.")
        dispatch = None
        if todo:
            spec = replace(job.worker_spec(), canary=held)
            starter = starter or (pool.start(cfg) if pool is not None else RayStarter(cfg.ray_address))
            dispatch = Dispatcher(cfg, writer, starter, spec, job.gpus, todo, n_records, spool, job.t_start, pool)
        try:
            try:
                _, skipped, kinds = scan(cfg, job.encoder, spool, n_records, pump=dispatch and dispatch.pump)
            except BaseException:
                if dispatch:
                    dispatch.close()        # the workers stop before their shard files are taken back
                discard_uncommitted(writer)
                raise
            writer.set_meta("skipped", dict(Counter(s["reason"] for s in skipped)))
            writer.set_meta("inputs", dict(sorted(kinds.items())))    # samples by record kind: chat, pair, text, ids
            report.save_reports(cfg, skipped)
            if not todo:
                print(f"{cfg.out}: cache already complete ({n_units} shards); nothing to do.")
                attach_source(job, writer, kinds)
                return report.summary(cfg, writer, skipped, job.t_start, RunStats(), at_start)
            dispatch.scan_finished()
            bar = report.progress(cfg, n_records - len(skipped), writer.manifest.counts["samples"])
            try:
                stats = dispatch.run(bar)
            finally:
                bar.close()
        finally:
            if dispatch:
                dispatch.close()
        attach_source(job, writer, kinds)
        out = report.summary(cfg, writer, skipped, job.t_start, stats, at_start)
        if stats.abandoned:
            discard_uncommitted(writer)
            flag = dispatch.flag
            raise Interrupted(f"stopped by {flag.signal}: shard(s) {stats.abandoned} were still in flight when "
                              "KDCACHE_STOP_GRACE_S ran out and are not committed (their workers were stopped); "
                              f"the {len(writer.manifest.shards)} committed shard(s) are safe. Rerun the same command "
                              "to resume: it scores those shards again.", flag.signal, flag.signum)
        if stats.stopped:
            print(f"stopped early with {len(todo) - out['shards_this_run']} shard(s) left; "
                  "rerun the same command to resume.")
        return out
