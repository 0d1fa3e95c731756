"""The precompute driver: fingerprint, find or reuse the cache, scan the dataset, run the teacher, report.

Read top to bottom: settle the job (teacher, tokenizer, fingerprint; meanwhile Ray starts in the background
where the job will most likely need it) -> find the cache (reuse it if complete) -> count the dataset's records
(a cheap pass: the shard plan) -> open (or resume) the cache -> scan the dataset once into a spool while the
teacher workers start, handing them each shard as soon as its records are read (dispatch.py) -> commit the
rest as they return -> summary (summary.py).
The cache may be a local directory or an fsspec URL, or be placed in a store.
"""
import json
import os
import shutil
import sys
import time
from collections import Counter
from dataclasses import dataclass, replace

from kdcache.cache_format import CacheError, CacheWriter, hash_json, hash_tree
from kdcache.cache_format.lease import stamp_use
from kdcache.cache_format.location import Location
from kdcache.cache_format.manifest import MANIFEST_NAME, SHARD_DIR
from kdcache.cache_format.store import is_store
from kdcache.cache_format.store import resolve as resolve_in_store
from kdcache.cache_format.tokenizer_id import tokenizer_identity
from kdcache.cache_format.writer import cache_fingerprint, existing_manifest, num_shards
from kdcache.common.errors import BadRecord, ConfigError, DataError, SkipSample

from . import summary as report
from .data import iter_records, parse_record
from .dispatch import Dispatcher, RayStarter, RunStats, own_ray, prestart_workers, worker_gpus
from .encode import Encoder, document_end_id, end_of_turn_ids
from .spool import Spool
from .teacher import choose_backend, is_url
from .worker import WorkerSpec


@dataclass
class Job:
    """Everything settled before the dataset is read."""
    cfg: object              # PrecomputeConfig, with out resolved (a store's cache directory)
    encoder: Encoder
    tokenizer_id: dict       # cache_format.tokenizer_id.tokenizer_identity of the teacher's tokenizer
    eos_ids: list            # end-of-turn token ids
    teacher_backend: str     # a key of pipeline.teacher.TEACHERS (`auto` resolved)
    backend_reason: str      # why that backend (printed, and recorded in the manifest's meta)
    server: dict | None      # a served teacher: what its server reports (pipeline.teacher_served.server_info)
    gpus: float              # per worker
    dtype: str               # teacher compute dtype (`auto` resolved)
    vocab_size: int
    parts: dict              # fingerprint parts (without the storage format, which the writer adds)
    t_start: float

    def worker_spec(self, codec):
        cfg = self.cfg
        threads = cfg.threads or max(1, (os.cpu_count() or 1) // cfg.workers)
        gen = None if cfg.mode != "generate" else dict(
            max_new_tokens=cfg.gen_max_new_tokens, temperature=cfg.gen_temperature, top_p=cfg.gen_top_p,
            seed=cfg.seed, eos_ids=self.eos_ids, max_length=cfg.max_length)
        return WorkerSpec(
            self.teacher_backend, cfg.teacher,
            teacher_kwargs=dict(dtype=self.dtype, max_length=cfg.max_length, max_top_k=cfg.top_k, seed=cfg.seed,
                                trust_remote_code=cfg.trust_remote_code, batch_tokens=cfg.batch_tokens,
                                threads=threads,
                                **({} if self.server is None else
                                   dict(requests_in_flight=cfg.requests_in_flight, expect=self.server))),
            shard_kwargs=dict(backend=cfg.format, top_k=cfg.top_k, vocab_size=self.vocab_size,
                              logprob_dtype=cfg.logprob_dtype, codec=codec, top_p=cfg.top_p),
            generate=gen)


def check_paths(cfg):
    """The teacher, tokenizer and dataset exist, before anything is loaded or started."""
    local = ("kdcache reads models from local directories: download a hub model first "
             "(huggingface-cli download NAME --local-dir DIR) and pass DIR")
    if is_url(cfg.teacher):
        if cfg.backend not in ("auto", "served"):
            raise ConfigError(f"backend: {cfg.backend!r} runs a local model directory, but the teacher is the URL "
                              f"{cfg.teacher}; use --backend served (or auto)")
        if not cfg.tokenizer:
            raise ConfigError(f"tokenizer: required with a served teacher ({cfg.teacher}): pass --tokenizer DIR, a "
                              "local copy of the served model's tokenizer files (and its config.json and "
                              "generation_config.json where you have them); kdcache tokenizes here and sends ids")
    elif cfg.backend == "served":
        raise ConfigError(f"backend: served needs the teacher as the URL of a vLLM server (http://HOST:PORT/v1), "
                          f"not {cfg.teacher!r}")
    elif not os.path.isfile(os.path.join(cfg.teacher, "config.json")):
        raise ConfigError(f"teacher: {cfg.teacher} is not a model directory (no config.json there); {local}")
    if cfg.tokenizer and not os.path.isdir(cfg.tokenizer):
        raise ConfigError(f"tokenizer: {cfg.tokenizer} is not a directory; {local}")
    if not os.path.exists(cfg.data):
        raise DataError(f"dataset {cfg.data} does not exist (hub dataset names need network access: save the "
                        "dataset to disk with datasets' save_to_disk and pass the directory)")


MAX_LENGTH_CAP = 2048    # the default max_length where the teacher's context is longer


def context_length(model_config):
    """The teacher's context (max_position_embeddings, of the text model where it is nested), or None."""
    text = getattr(model_config, "text_config", None) or model_config
    return getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None)


def settle_max_length(cfg, model_config):
    """cfg with max_length resolved: the teacher's context capped at MAX_LENGTH_CAP by default; an explicit
    value above the context is refused here, before any Ray or teacher start-up."""
    ctx = context_length(model_config)
    if cfg.max_length is None:
        return replace(cfg, max_length=min(ctx or MAX_LENGTH_CAP, MAX_LENGTH_CAP))
    if ctx and cfg.max_length > ctx:
        raise ConfigError(f"max_length: {cfg.max_length} is above the teacher's context of {ctx} tokens "
                          f"(max_position_embeddings in {cfg.teacher}/config.json); use --max-length {ctx} or less")
    return cfg


def settle_served_max_length(cfg, server):
    """settle_max_length for a served teacher: the server's max_model_len, less the one token of room a scoring
    request needs (vLLM refuses a prompt that fills its context), capped at MAX_LENGTH_CAP by default."""
    room = server["max_model_len"] - 1
    if cfg.max_length is None:
        return replace(cfg, max_length=min(room, MAX_LENGTH_CAP))
    if cfg.max_length > room:
        raise ConfigError(f"max_length: {cfg.max_length} is more than the teacher server takes: its max_model_len is "
                          f"{server['max_model_len']} and a scoring request needs one token of room for the one it "
                          f"generates; use --max-length {room} or less, or restart the server with a larger "
                          "--max-model-len")
    return cfg


def served_model_config(cfg):
    """The served model's config.json where the tokenizer directory has one (its vocabulary size), else None."""
    if not os.path.isfile(os.path.join(cfg.tokenizer, "config.json")):
        return None
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(cfg.tokenizer, trust_remote_code=cfg.trust_remote_code)


def generation_eos_ids(model_dir):
    """The EOS ids of the teacher's generation_config.json (vLLM and transformers stop on them too: Qwen2.5
    stops on <|endoftext|> as well as <|im_end|>), so both backends stop on one recorded set."""
    import json
    try:
        with open(os.path.join(model_dir, "generation_config.json")) as f:
            eos = json.load(f).get("eos_token_id")
    except (OSError, ValueError):
        return []
    return [int(t) for t in (eos if isinstance(eos, list) else [eos]) if isinstance(t, int)]


def settle(cfg, t_start):
    """The Job: tokenizer, end-of-turn ids, teacher backend, dtype and fingerprint parts."""
    from transformers import AutoConfig, AutoTokenizer
    check_paths(cfg)
    backend, reason = choose_backend(cfg.backend, cfg.teacher)
    print(f"teacher backend: {backend} ({'auto: ' if cfg.backend == 'auto' else ''}{reason})")
    server = None
    if backend == "served":
        from .teacher_served import server_info
        if cfg.dtype != "auto":
            raise ConfigError(f"dtype: {cfg.dtype!r} cannot be set for a served teacher: it computes in the server's "
                              "dtype (vllm serve --dtype); drop --dtype")
        server = server_info(cfg.teacher)
        print(f"teacher server {cfg.teacher}: model {server['model']!r}, max_model_len {server['max_model_len']}, "
              f"vLLM {server['vllm_version']}" + (f", revision {cfg.teacher_revision!r}" if cfg.teacher_revision
                                                  else " (no --teacher-revision)"))
        model_config = served_model_config(cfg)
        cfg = settle_served_max_length(cfg, server)
    else:
        model_config = AutoConfig.from_pretrained(cfg.teacher, trust_remote_code=cfg.trust_remote_code)
        cfg = settle_max_length(cfg, model_config)
    if cfg.worker_cpus is None:       # a served teacher's workers only wait on HTTP
        cfg = replace(cfg, worker_cpus=0.25 if server else 1.0)
    tok = AutoTokenizer.from_pretrained(cfg.tokenizer or cfg.teacher, trust_remote_code=cfg.trust_remote_code)
    text_end = document_end_id(tok, cfg.text_end)
    extra = [tok.convert_tokens_to_ids(t) for t in cfg.eos_tokens] + \
        generation_eos_ids(cfg.tokenizer if server else cfg.teacher) + [text_end]
    eos_ids = end_of_turn_ids(tok, extra)
    encoder = Encoder(tok, template=cfg.template, max_length=cfg.max_length, overlong=cfg.overlong,
                      eos_ids=eos_ids, mode=cfg.mode, drop_end_of_turn=cfg.drop_end_of_turn, text_end=text_end)
    if cfg.drop_end_of_turn:
        print("WARNING: --drop-end-of-turn leaves out every end-of-turn position (the bug kdcache exists to "
              "prevent); a student trained on this cache will not learn to stop.", file=sys.stderr)
    if server:
        gpus = max(cfg.worker_gpus, 0.0)      # the GPUs are the server's
        dtype = "server"
    else:
        gpus = worker_gpus(cfg)
        dtype = cfg.dtype if cfg.dtype != "auto" else ("bfloat16" if gpus > 0 else "float32")
    if model_config is not None:
        vocab_size = (getattr(model_config, "text_config", None) or model_config).vocab_size
    else:
        vocab_size = len(tok)
        print(f"note: {cfg.tokenizer} has no config.json: the teacher's vocabulary size is taken from its tokenizer "
              f"({vocab_size}); copy the served model's config.json there if its embeddings are padded beyond it")
    if cfg.top_k > vocab_size:
        raise ConfigError(f"top_k: {cfg.top_k} is more than the teacher's vocabulary of {vocab_size} tokens; "
                          f"use --top-k {vocab_size} or less")
    if server:
        from .teacher_served import check_top_k
        check_top_k(cfg.teacher, server, cfg.top_k)
    tok_id = tokenizer_identity(tok)
    parts = fingerprint_parts(cfg, tok_id, eos_ids, backend, dtype, server)
    return Job(cfg, encoder, tok_id, eos_ids, backend, reason, server, gpus, dtype, vocab_size, parts, t_start)


def teacher_part(cfg, server):
    """The teacher's fingerprint part: its weights and config by content, or, for a served teacher, what its
    server reports plus --teacher-revision (remote weights cannot be hashed: see the README)."""
    if server is None:
        return hash_tree(cfg.teacher)
    return {"served_model": server["model"], "max_model_len": server["max_model_len"],
            "vllm_version": server["vllm_version"], "revision": cfg.teacher_revision}


def fingerprint_parts(cfg, tok_identity, eos_ids, backend, dtype, server=None):
    capture = {"mode": cfg.mode, "max_length": cfg.max_length, "overlong": cfg.overlong,
               "template": cfg.template, "eos_token_ids": eos_ids, "backend": backend, "dtype": dtype,
               "on_bad_record": cfg.on_bad_record, "text_end": cfg.text_end}
    if cfg.drop_end_of_turn:
        capture["drop_end_of_turn"] = True
    if cfg.mode == "generate":
        capture.update(max_new_tokens=cfg.gen_max_new_tokens, temperature=cfg.gen_temperature,
                       top_p=cfg.gen_top_p, seed=cfg.seed)
    return {
        "teacher": teacher_part(cfg, server),              # weights + config, by content (or the server's word)
        "tokenizer": hash_json(tok_identity),
        "data": hash_tree(cfg.data),
        "capture": capture,
    }


def run_precompute(cfg):
    t_start = time.time()
    # Ray and the teacher actors start at once in the background where the job will most likely need them: the
    # driver settles the job and reads the dataset meanwhile. Otherwise they start once there is work for them.
    starter = RayStarter(cfg.ray_address, prestart_workers(cfg)) if may_start_early(cfg) else None
    try:
        job = settle(cfg, t_start)
        cfg = job.cfg                      # with max_length resolved
        # Everything the cache depends on is known before reading the dataset: fingerprint first, so a
        # finished cache (here or in a store) is found and reused without a teacher or a tokenizer pass.
        fp, full_parts = cache_fingerprint(job.parts, backend=cfg.format, top_k=cfg.top_k,
                                           logprob_dtype=cfg.logprob_dtype, codec=cfg.codec, top_p=cfg.top_p)
        job.cfg = cfg = replace(cfg, out=cache_location(cfg, fp, job.server))
        done = existing_manifest(cfg.out, fp, full_parts)
        if done is not None and done["complete"]:
            print(f"{cfg.out}: a complete cache of these inputs exists (fingerprint {fp[:16]}); reusing it: "
                  "nothing to do, no teacher work.")
            stamp_use(Location(cfg.out))
            return report.reused_summary(cfg, done, job.t_start)

        created = not Location(cfg.out).remote and not os.path.exists(cfg.out)
        spool = Spool()
        try:
            return run_job(job, spool, starter)
        finally:
            spool.delete()
            if created and os.path.isdir(cfg.out) and not os.path.exists(os.path.join(cfg.out, MANIFEST_NAME)):
                shutil.rmtree(cfg.out, ignore_errors=True)   # a job stopped before committing anything leaves nothing
    finally:
        if starter is not None:
            starter.close()


def may_start_early(cfg):
    """Whether Ray may start before the job is settled: a local teacher, a Ray of the job's own, --out neither a
    store nor a complete cache (either may well be reused without any teacher work), and nothing a cheap look finds
    that settle would refuse (bad paths, max_length above the teacher's context, top_k above its vocabulary, an
    empty dataset), so refusals still come before any Ray start-up."""
    if is_url(cfg.teacher) or not own_ray(cfg.ray_address) or cfg.store:
        return False
    try:
        check_paths(cfg)
        out = Location(cfg.out)
        if is_store(cfg.out) or (out.exists(MANIFEST_NAME) and out.read_json(MANIFEST_NAME).get("complete")):
            return False
        with open(os.path.join(cfg.teacher, "config.json")) as f:
            conf = json.load(f)
        text = conf.get("text_config") or conf
        ctx = text.get("max_position_embeddings") or text.get("n_positions")
        if (cfg.max_length and ctx and cfg.max_length > ctx) or cfg.top_k > text.get("vocab_size", cfg.top_k):
            return False
        if os.path.isfile(cfg.data) and os.path.getsize(cfg.data) < 4096:
            with open(cfg.data, "rb") as f:
                return bool(f.read().strip())
        return True
    except Exception:        # anything odd: settle says what, before any Ray start-up
        return False


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


def count_records(path):
    """The number of records iter_records(path) yields, without parsing them: the shard plan (shard j = records
    [j*shard_size, (j+1)*shard_size)) needs it before the scan is over. JSONL: non-blank lines; Parquet: its
    metadata; anything else: a pass of the reader. The scan checks it read as many."""
    if os.path.isfile(path) and path.endswith((".jsonl", ".json", ".ndjson")):
        with open(path, "rb") as f:
            return sum(1 for line in f if line.strip())
    if os.path.isfile(path) and path.endswith(".parquet"):
        import pyarrow.parquet as pq
        return pq.ParquetFile(path).metadata.num_rows
    return sum(1 for _ in iter_records(path))


def scan(cfg, encoder, spool, n_records=None, pump=None):
    """The one pass over the dataset: count records, list every skip, spool the encoded samples.

    pump(records read, hold_back) is called after every record: the teacher workers get each shard as soon as its
    records are spooled (dispatch.Dispatcher.pump); hold_back once a malformed record will fail the job.
    A malformed record under on_bad_record=fail, a dataset with no usable record, or one whose record count differs
    from n_records stop the job here, after the whole pass, before anything is committed.
    """
    n, skipped, failing = 0, [], False
    for raw in iter_records(cfg.data):
        n += 1
        try:
            if raw.error:
                raise BadRecord(raw.error)
            spool.add(encoder.encode(parse_record(raw.data), raw.index))
        except BadRecord as e:
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
    return n, skipped


def discard_uncommitted(writer):
    """A job stopped before it committed anything, in a cache it created: take its manifest (and the shard files
    its workers wrote) back, so the directory holds no cache, as if the job had never started: a fixed dataset
    can then start afresh there. A cache with committed shards, or started by an earlier run, is left as it is."""
    if writer.manifest is None or writer.resumed or writer.manifest["shards"]:
        return
    loc = writer.location
    for name in loc.list(SHARD_DIR):
        loc.remove(f"{SHARD_DIR}/{name}")
    loc.remove(MANIFEST_NAME)


def run_job(job, spool, starter=None):
    """starter: Ray starting in the background (RayStarter), else started here once there is work for it."""
    cfg = job.cfg
    n_records = count_records(cfg.data)
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
    if job.server:
        meta["teacher_server"] = {"url": cfg.teacher, **job.server, "revision": cfg.teacher_revision}
    writer = CacheWriter(cfg.out, backend=cfg.format, top_k=cfg.top_k, vocab_size=job.vocab_size,
                         eos_token_ids=job.eos_ids, fingerprint_parts=job.parts, shard_size=cfg.shard_size,
                         num_records=n_records,
                         logprob_dtype=cfg.logprob_dtype, codec=cfg.codec, top_p=cfg.top_p,
                         meta=meta)
    with writer:
        todo = set(range(n_units)) - writer.done_indices()
        at_start = len(writer.manifest["shards"])
        if writer.resumed and todo:
            print(f"{cfg.out}: resuming, {n_units - len(todo)} of {n_units} shards already committed.")
        dispatch = None
        if todo:
            spec = job.worker_spec(writer.codec)
            starter = starter or RayStarter(cfg.ray_address)
            dispatch = Dispatcher(cfg, writer, starter, spec, job.gpus, todo, n_records, spool, job.t_start)
        try:
            try:
                _, skipped = scan(cfg, job.encoder, spool, n_records, pump=dispatch and dispatch.pump)
            except BaseException:
                if dispatch:
                    dispatch.close()        # the workers stop before their shard files are taken back
                discard_uncommitted(writer)
                raise
            writer.manifest["meta"]["skipped"] = dict(Counter(s["reason"] for s in skipped))
            report.save_reports(cfg, skipped)
            if not todo:
                print(f"{cfg.out}: cache already complete ({n_units} shards); nothing to do.")
                return report.summary(cfg, writer, skipped, job.t_start, RunStats(), at_start)
            dispatch.scan_finished()
            bar = report.progress(cfg, n_records - len(skipped), writer.manifest["counts"]["samples"])
            try:
                stats = dispatch.run(bar)
            finally:
                bar.close()
        finally:
            if dispatch:
                dispatch.close()
        out = report.summary(cfg, writer, skipped, job.t_start, stats, at_start)
        if stats.stopped:
            print(f"stopped early with {len(todo) - out['shards_this_run']} shard(s) left; "
                  "rerun the same command to resume.")
        return out
