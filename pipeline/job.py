"""The precompute driver: plan shards, fingerprint, run teacher workers on Ray, commit, report.

Read top to bottom: fingerprint -> find the cache (reuse it if complete) -> scan
the dataset -> open (or resume) the cache -> start Ray workers -> stream shards
through them with bounded in-flight work -> commit each finished shard -> summary.
The cache may be a local directory or an fsspec URL, or be placed in a store.
"""
import json
import os
import signal
import sys
import time
from collections import Counter
from dataclasses import replace

from cache_format import CacheError, CacheWriter, hash_json, hash_tree
from cache_format.lease import stamp_use
from cache_format.location import Location
from cache_format.store import is_store
from cache_format.store import resolve as resolve_in_store
from cache_format.tokenizer_id import tokenizer_identity
from cache_format.writer import cache_fingerprint, existing_manifest

from .data import BadRecord, DataError, iter_records, parse_record
from .encode import Encoder, Skip, end_of_turn_ids
from .spool import Spool

REPORT_DIR = "report"


class WorkerDied(CacheError):
    """A Ray teacher worker was killed or crashed mid-job."""


def resolve_backend(cfg):
    if cfg.backend != "auto":
        return cfg.backend
    try:
        import vllm  # noqa: F401
        return "vllm"
    except ImportError:
        return "hf"


def encode_all(cfg, encoder):
    """Yield (raw record, Encoded or None, (reason, message) or None) for every record, in order."""
    for raw in iter_records(cfg.data):
        if raw.error:
            yield raw, None, ("bad_record", raw.error)
            continue
        try:
            yield raw, encoder.encode(parse_record(raw.data)), None
        except BadRecord as e:
            yield raw, None, ("bad_record", str(e))
        except Skip as e:
            yield raw, None, (e.reason, str(e))


def scan(cfg, encoder, spool):
    """The one pass over the dataset: count records, list every skip, spool the encoded samples.

    Runs before any teacher work, so a malformed record under on_bad_record=fail costs nothing.
    """
    n, skipped = 0, []
    for raw, enc, skip in encode_all(cfg, encoder):
        n += 1
        if skip:
            skipped.append({"sample_id": raw.index, "where": raw.where, "reason": skip[0], "message": skip[1]})
        else:
            spool.add(raw.index, enc.input_ids, enc.positions, enc.truncated)
    spool.close_writing()
    return n, skipped


def fingerprint_parts(cfg, tok_identity, eos_ids, backend, dtype):
    capture = {"mode": cfg.mode, "max_length": cfg.max_length, "overlong": cfg.overlong,
               "template": cfg.template, "eos_token_ids": eos_ids, "backend": backend, "dtype": dtype,
               "on_bad_record": cfg.on_bad_record}
    if cfg.drop_end_of_turn:
        capture["drop_end_of_turn"] = True
    if cfg.mode == "generate":
        capture.update(max_new_tokens=cfg.gen_max_new_tokens, temperature=cfg.gen_temperature,
                       top_p=cfg.gen_top_p, seed=cfg.seed)
    return {
        "teacher": hash_tree(cfg.teacher),                 # weights + config, by content
        "tokenizer": hash_json(tok_identity),
        "data": hash_tree(cfg.data),
        "capture": capture,
    }


def iter_units(cfg, spool, todo):
    """Yield (shard index, items) for the shards in `todo`, from the spooled samples (empty shards too)."""
    pending = sorted(todo)
    current, items = None, []
    for sid, ids, pos, trunc in spool:
        j = sid // cfg.shard_size
        if j != current:
            while pending and pending[0] < j:          # shards before j, including ones whose records were all skipped
                k = pending.pop(0)
                yield k, (items if k == current else [])
            current, items = j, []
        if pending and pending[0] == j:
            items.append((sid, ids, pos, trunc))
    while pending:
        k = pending.pop(0)
        yield k, (items if k == current else [])


class StopFlag:
    """SIGTERM/SIGHUP/SIGINT: finish in-flight shards, commit them, exit 0. A second signal exits at once."""

    def __init__(self):
        self.stop = False
        self._old = {}

    def install(self):
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.stop:
            print(f"\n{signal.Signals(signum).name} again: exiting now; committed shards are safe.", file=sys.stderr)
            os._exit(130)
        self.stop = True
        print(f"\n{signal.Signals(signum).name}: finishing the shards in flight, then stopping "
              "(rerun the same command to resume).", file=sys.stderr)

    def restore(self):
        for sig, h in self._old.items():
            signal.signal(sig, h)


def worker_gpus(cfg):
    """GPUs per worker: as configured, else 1 where GPUs exist (asks the cluster only if one is named)."""
    if cfg.worker_gpus >= 0:
        return cfg.worker_gpus
    if cfg.ray_address:
        import ray
        start_ray(cfg)
        return 1.0 if ray.cluster_resources().get("GPU", 0) else 0.0
    import torch
    return 1.0 if torch.cuda.is_available() else 0.0


def start_ray(cfg):
    """Connect to cfg.ray_address (or $RAY_ADDRESS), else start a Ray for this job on 127.0.0.1, even if
    another one runs on this machine."""
    import ray
    if not ray.is_initialized():
        address = cfg.ray_address or os.environ.get("RAY_ADDRESS")
        if address:
            ray.init(address=address, log_to_driver=False)
        else:
            ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,
                     _node_ip_address="127.0.0.1", configure_logging=False)
    return ray


def run_precompute(cfg):
    t_start = time.time()
    from transformers import AutoConfig, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(cfg.tokenizer or cfg.teacher, trust_remote_code=cfg.trust_remote_code)
    extra = [tok.convert_tokens_to_ids(t) for t in cfg.eos_tokens]
    eos_ids = end_of_turn_ids(tok, extra)
    encoder = Encoder(tok, template=cfg.template, max_length=cfg.max_length, overlong=cfg.overlong,
                      eos_ids=eos_ids, mode=cfg.mode, drop_end_of_turn=cfg.drop_end_of_turn)
    if cfg.drop_end_of_turn:
        print("WARNING: --drop-end-of-turn leaves out every end-of-turn position (the bug kdcache exists to "
              "prevent); a student trained on this cache will not learn to stop.", file=sys.stderr)

    # Everything the cache depends on is known before reading the dataset: fingerprint first, so a
    # finished cache (here or in a store) is found and reused without a teacher or even a tokenizer pass.
    backend = resolve_backend(cfg)
    gpus = worker_gpus(cfg)
    dtype = cfg.dtype if cfg.dtype != "auto" else ("bfloat16" if gpus > 0 else "float32")
    vocab_size = AutoConfig.from_pretrained(cfg.teacher, trust_remote_code=cfg.trust_remote_code).vocab_size
    tok_id = tokenizer_identity(tok)
    parts = fingerprint_parts(cfg, tok_id, eos_ids, backend, dtype)
    fp, full_parts = cache_fingerprint(parts, backend=cfg.format, top_k=cfg.top_k, logprob_dtype=cfg.logprob_dtype,
                                       codec=cfg.codec)
    cfg = replace(cfg, out=cache_location(cfg, fp))
    done = existing_manifest(cfg.out, fp, full_parts)
    if done is not None and done["complete"]:
        print(f"{cfg.out}: a complete cache of these inputs exists (fingerprint {fp[:16]}); reusing it: "
              "nothing to do, no teacher work.")
        stamp_use(Location(cfg.out))
        return _reused_summary(cfg, done, t_start)

    out = Location(cfg.out)
    created = not out.remote and not os.path.exists(cfg.out)
    spool = Spool()
    try:
        return _job(cfg, t_start, tok_id, eos_ids, encoder, spool, backend, gpus, dtype, vocab_size, parts)
    finally:
        spool.delete()
        if created and os.path.isdir(cfg.out) and not os.listdir(cfg.out):
            os.rmdir(cfg.out)              # a job refused before writing anything leaves nothing behind


def default_alias(cfg):
    data = os.path.basename(cfg.data.rstrip("/")).split(".")[0]
    teacher = os.path.basename(os.path.abspath(cfg.teacher))
    return f"{teacher}-{data}-k{cfg.top_k}" + ("-gen" if cfg.mode == "generate" else "")


def cache_location(cfg, fp):
    """The cache directory: --out itself, or, when --out is a store root, the store's cache for fingerprint fp."""
    if not (cfg.store or is_store(cfg.out)):
        return cfg.out
    if Location(cfg.out).exists("manifest.json"):
        raise CacheError(f"{cfg.out} is a cache, not a store root: drop --store to resume it, or name another "
                         "directory as the store")
    where, found = resolve_in_store(cfg.out, fp, cfg.alias or default_alias(cfg))
    print(f"store {cfg.out}: " + (f"found the cache of these inputs: {where}" if found
                                  else f"no cache of these inputs yet; writing {where}"))
    return where


def _job(cfg, t_start, tok_id, eos_ids, encoder, spool, backend, gpus, dtype, vocab_size, parts):
    n_records, skipped = scan(cfg, encoder, spool)
    bad = [s for s in skipped if s["reason"] == "bad_record"]
    if bad and cfg.on_bad_record == "fail":
        first = bad[0]
        raise DataError(f"{first['where']}: {first['message']} ({len(bad)} malformed record(s) in all; "
                        "fix them, or pass --on-bad-record skip to skip and list them)")
    n_units = max(1, -(-n_records // cfg.shard_size))
    meta = {"teacher": os.path.basename(os.path.abspath(cfg.teacher)), "dataset": os.path.basename(cfg.data),
            "mode": cfg.mode, "teacher_backend": backend, "dtype": dtype, "tokenizer": tok_id,
            "records": n_records, "skipped": dict(Counter(s["reason"] for s in skipped))}
    writer = CacheWriter(cfg.out, backend=cfg.format, top_k=cfg.top_k, vocab_size=vocab_size,
                         eos_token_ids=eos_ids, fingerprint_parts=parts, num_shards_planned=n_units,
                         logprob_dtype=cfg.logprob_dtype, codec=cfg.codec, meta=meta)
    with writer:
        _save_reports(cfg, skipped)
        todo = set(range(n_units)) - writer.done_indices()
        at_start = len(writer.manifest["shards"])
        if not todo:
            print(f"{cfg.out}: cache already complete ({n_units} shards); nothing to do.")
            return _summary(cfg, writer, skipped, t_start, 0, 0.0, at_start)
        if writer.resumed:
            print(f"{cfg.out}: resuming, {n_units - len(todo)} of {n_units} shards already committed.")
        expected = n_records - len(skipped)
        ray = start_ray(cfg)
        run_tokens, teacher_s, loop_s, stopped = _run_units(cfg, ray, gpus, writer, spool, todo, backend, dtype,
                                                            vocab_size, eos_ids, n_records, expected)
        summary = _summary(cfg, writer, skipped, t_start, run_tokens, teacher_s, at_start, loop_s)
        if stopped:
            print(f"stopped early with {len(todo) - summary['shards_this_run']} shard(s) left; "
                  "rerun the same command to resume.")
        return summary


def _run_units(cfg, ray, gpus, writer, spool, todo, backend, dtype, vocab_size, eos_ids, n_records, expected):
    from .worker import TeacherWorker
    threads = cfg.threads or max(1, (os.cpu_count() or 1) // cfg.workers)
    teacher_kwargs = dict(dtype=dtype, max_length=cfg.max_length, max_top_k=cfg.top_k, seed=cfg.seed,
                          trust_remote_code=cfg.trust_remote_code, batch_tokens=cfg.batch_tokens, threads=threads)
    cache_kwargs = dict(backend=cfg.format, top_k=cfg.top_k, vocab_size=vocab_size,
                        logprob_dtype=cfg.logprob_dtype, codec=writer.codec)
    gen_kwargs = dict(max_new_tokens=cfg.gen_max_new_tokens, temperature=cfg.gen_temperature, top_p=cfg.gen_top_p,
                      seed=cfg.seed, eos_ids=eos_ids, max_length=cfg.max_length)
    opts = dict(num_cpus=cfg.worker_cpus, num_gpus=gpus)
    creds = {k: v for k, v in os.environ.items() if k.startswith(("AWS_", "GOOGLE_", "FSSPEC_"))}
    if cfg.ray_address and writer.location.remote and creds:
        opts["runtime_env"] = {"env_vars": creds}     # workers on other machines write to the same store
    Actor = ray.remote(TeacherWorker).options(**opts)
    workers = [Actor.remote(backend, cfg.teacher, teacher_kwargs, cache_kwargs, gen_kwargs, cfg.mode)
               for _ in range(min(cfg.workers, len(todo)))]
    ray.get([w.ready.remote() for w in workers])

    flag = StopFlag().install()
    pending, free = {}, list(workers) * cfg.max_in_flight
    bar = _progress(cfg, expected, writer.manifest["counts"]["samples"])
    run_tokens, teacher_s, t0 = 0, 0.0, time.perf_counter()
    units = iter_units(cfg, spool, todo)
    try:
        while True:
            while free and not flag.stop:
                nxt = next(units, None)
                if nxt is None:
                    break
                j, items = nxt
                w = free.pop(0)
                unit = {"directory": writer.directory, "shard_tag": writer.shard_tag, "index": j, "items": items,
                        "sample_start": j * cfg.shard_size, "sample_end": min((j + 1) * cfg.shard_size, n_records)}
                pending[w.run.remote(unit)] = (w, j)
            if not pending:
                break
            done, _ = ray.wait(list(pending), num_returns=1)
            for ref in done:
                w, j = pending.pop(ref)
                free.append(w)
                try:
                    res = ray.get(ref)
                except ray.exceptions.RayActorError as e:
                    raise WorkerDied(f"a teacher worker died ({type(e).__name__}) while on shard {j}; the "
                                     f"{len(writer.done_indices())} shards committed so far are safe. Rerun the "
                                     "same command to resume.") from e
                except ray.exceptions.RayTaskError as e:   # e.g. the disk filled up while writing the shard
                    cause = e.cause if getattr(e, "cause", None) is not None else e
                    raise WorkerDied(f"shard {j} failed in its worker: {type(cause).__name__}: {cause}. The "
                                     f"{len(writer.done_indices())} shards committed so far are safe; fix the cause "
                                     "and rerun the same command to resume.") from e
                info = res["info"]
                writer.commit(info)
                run_tokens += res["tokens"]
                teacher_s += res["teacher_s"]
                bar.update(info["num_samples"])
                bar.set_postfix(tok_s=f"{run_tokens / (time.perf_counter() - t0):,.0f}",
                                shards=f"{len(writer.manifest['shards'])}/{writer.manifest['num_shards_planned']}")
    finally:
        bar.close()
        flag.restore()
        for w in workers:
            ray.kill(w)
    return run_tokens, teacher_s, time.perf_counter() - t0, flag.stop


def _progress(cfg, total, initial):
    from tqdm import tqdm
    return tqdm(total=total, initial=initial, unit="sample", desc="precompute", disable=not cfg.progress,
                dynamic_ncols=True)


def _save_reports(cfg, skipped):
    out = Location(cfg.out)
    lines = "".join(json.dumps(s, ensure_ascii=False) + "\n" for s in skipped)
    out.write_bytes(f"{REPORT_DIR}/skipped.jsonl", lines.encode("utf-8"))
    from kdcache.config import dumps
    out.write_bytes(f"{REPORT_DIR}/precompute.yaml", dumps(cfg).encode("utf-8"))


def _summary(cfg, writer, skipped, t_start, run_tokens, teacher_s, shards_at_start, loop_s=0.0):
    m = writer.manifest
    c = m["counts"]
    wall = time.time() - t_start
    summary = {
        "cache": cfg.out, "complete": m["complete"], "shards": f"{len(m['shards'])}/{m['num_shards_planned']}",
        "shards_this_run": len(m["shards"]) - shards_at_start,
        "records": m["meta"]["records"], "samples_written": c["samples"],
        "skipped": dict(Counter(s["reason"] for s in skipped)),
        "truncated": sum(s.get("num_truncated", 0) for s in m["shards"]),
        "tokens": c["tokens"], "positions": c["positions"], "bytes": c["bytes"],
        "bytes_per_position": round(c["bytes"] / c["positions"], 1) if c["positions"] else None,
        "wall_s": round(wall, 1), "tokens_this_run": run_tokens,
        "throughput_tok_s": round(run_tokens / wall, 1) if wall else None,
        "teacher_s": round(teacher_s, 1), "resumed": shards_at_start > 0,
        "loop_s": round(loop_s, 2),       # first shard submitted -> last shard committed (startup excluded)
        "loop_tok_s": round(run_tokens / loop_s, 1) if loop_s else None,
    }
    Location(cfg.out).write_bytes(f"{REPORT_DIR}/summary.json", json.dumps(summary, indent=1).encode())
    _print_summary(summary, skipped)
    return summary


def _reused_summary(cfg, m, t_start):
    c = m["counts"]
    summary = {"cache": cfg.out, "complete": True, "reused": True, "shards": f"{len(m['shards'])}/{len(m['shards'])}",
               "shards_this_run": 0, "records": m["meta"].get("records"), "samples_written": c["samples"],
               "skipped": m["meta"].get("skipped", {}), "tokens": c["tokens"], "positions": c["positions"],
               "bytes": c["bytes"], "wall_s": round(time.time() - t_start, 1), "tokens_this_run": 0,
               "teacher_s": 0.0, "resumed": False}
    print(f"\nprecompute summary\n  {'cache':<16} {cfg.out} (complete, reused)\n"
          f"  {'samples':<16} {c['samples']:,}\n  {'teacher work':<16} none")
    return summary


def _print_summary(s, skipped):
    print("\nprecompute summary")
    rows = [("cache", f"{s['cache']} ({'complete' if s['complete'] else 'INCOMPLETE'}, {s['shards']} shards)"),
            ("samples written", f"{s['samples_written']:,} of {s['records']:,} records"),
            ("skipped", ", ".join(f"{k}: {v}" for k, v in sorted(s["skipped"].items())) or "none"),
            ("truncated", s["truncated"]),
            ("tokens", f"{s['tokens']:,} ({s['positions']:,} scored positions)"),
            ("size", f"{s['bytes'] / 1e6:.2f} MB, {s['bytes_per_position']} B/position"),
            ("wall time", f"{s['wall_s']} s"),
            ("throughput", f"{s['loop_tok_s']:,} tokens/s after startup, {s['throughput_tok_s']:,} over the wall time"
             if s["tokens_this_run"] else "no teacher work")]
    for k, v in rows:
        print(f"  {k:<16} {v}")
    if skipped:
        print(f"  skipped records are listed in {os.path.join(s['cache'], REPORT_DIR, 'skipped.jsonl')}")
