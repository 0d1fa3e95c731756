"""What a precompute job leaves beside the cache and prints at the end: reports, the summary, the bar."""
import json
import os
import time
from collections import Counter

from kdcache.cache_format.location import Location
from kdcache.cache_format.manifest import fidelity_text, teacher_ce_text
from kdcache.common.config import dumps
from kdcache.common.progress import bar

REPORT_DIR = "report"


def progress(cfg, total, initial):
    return bar(total=total, initial=initial, unit="sample", desc="precompute", disable=not cfg.progress)


def save_reports(cfg, skipped):
    """report/skipped.jsonl (every skipped record, with where and why) and report/precompute.yaml."""
    out = Location(cfg.out)
    lines = "".join(json.dumps(s, ensure_ascii=False) + "\n" for s in skipped)
    out.write_bytes(f"{REPORT_DIR}/skipped.jsonl", lines.encode("utf-8"))
    out.write_bytes(f"{REPORT_DIR}/precompute.yaml", dumps(cfg).encode("utf-8"))


def summary(cfg, writer, skipped, t_start, stats, shards_at_start):
    """The job's figures: written to report/summary.json, printed, returned."""
    m = writer.manifest
    c = m.counts
    wall = time.time() - t_start
    s = {
        "cache": cfg.out, "complete": m.complete, "shards": f"{len(m.shards)}/{m.num_shards_planned}",
        "shards_this_run": len(m.shards) - shards_at_start,
        "records": m.meta["records"], "samples_written": c["samples"],
        "skipped": dict(Counter(x["reason"] for x in skipped)),
        "inputs": dict(m.meta.get("inputs", {})),    # samples by record kind: chat, pair, text, ids (token ids)
        "truncated": sum(x.num_truncated or 0 for x in m.shards),
        "tokens": c["tokens"], "positions": c["positions"], "bytes": c["bytes"],
        "bytes_per_position": round(c["bytes"] / c["positions"], 1) if c["positions"] else None,
        "wall_s": round(wall, 1), "tokens_this_run": stats.tokens,
        "throughput_tok_s": round(stats.tokens / wall, 1) if wall else None,
        "teacher_s": round(stats.teacher_s, 1), "resumed": shards_at_start > 0,
        "teacher_retries": stats.retried,       # served teacher: requests answered only after a retry
        "loop_s": round(stats.loop_s, 2),       # first shard submitted -> last shard committed (startup excluded)
        "loop_tok_s": round(stats.tokens / stats.loop_s, 1) if stats.loop_s else None,
        # seconds from the job's start: Ray up, the first teacher loaded, the first shard submitted, the dataset
        # read, the first shard committed (pipeline.dispatch.Dispatcher)
        "startup": dict(stats.startup),
        # where the teacher ran: {gcs_address, own (started by the job), workers_by_node (Ray node: workers)}
        "ray": dict(stats.ray),
        "shards_by_node": dict(stats.shards_by_node),    # shards committed this run per Ray node
        # vLLM: {max_num_batched_tokens (tokens per engine step), chunked_prefill, max_num_seqs}; {} for others
        "teacher_engine": dict(stats.engine),
        "fidelity": fidelity_text(m), "teacher_on_data": teacher_ce_text(m),
    }
    Location(cfg.out).write_bytes(f"{REPORT_DIR}/summary.json", json.dumps(s, indent=1).encode())
    _print(s, skipped)
    return s


def reused_summary(cfg, m, t_start):
    c = m.counts
    s = {"cache": cfg.out, "complete": True, "reused": True, "shards": f"{len(m.shards)}/{len(m.shards)}",
         "shards_this_run": 0, "records": m.meta.get("records"), "samples_written": c["samples"],
         "skipped": m.meta.get("skipped", {}), "tokens": c["tokens"], "positions": c["positions"],
         "bytes": c["bytes"], "wall_s": round(time.time() - t_start, 1), "tokens_this_run": 0,
         "teacher_s": 0.0, "resumed": False}
    print(f"\nprecompute summary\n  {'cache':<16} {cfg.out} (complete, reused)\n"
          f"  {'samples':<16} {c['samples']:,}\n  {'teacher work':<16} none")
    return s


def _startup_text(st):
    """' (first shard submitted at 31.2 s: Ray up at 5.1 s, the teacher loaded at 31.0 s, the dataset read at
    4.9 s)', or '' without teacher work."""
    if "first_submit_s" not in st:
        return ""
    parts = [f"{what} at {st[k]} s" for k, what in (("ray_s", "Ray up"), ("workers_ready_s", "the teacher loaded"),
                                                      ("scan_s", "the dataset read")) if k in st]
    if st.get("kept_workers"):
        parts.insert(0, f"Ray and {st['kept_workers']} teacher worker(s) kept from an earlier job")
    return f" (first shard submitted at {st['first_submit_s']} s" + (": " + ", ".join(parts) if parts else "") + ")"


def _print(s, skipped):
    print("\nprecompute summary")
    rows = [("cache", f"{s['cache']} ({'complete' if s['complete'] else 'INCOMPLETE'}, {s['shards']} shards)"),
            ("samples written", f"{s['samples_written']:,} of {s['records']:,} records"),
            ("skipped", ", ".join(f"{k}: {v}" for k, v in sorted(s["skipped"].items())) or "none"),
            ("inputs", ", ".join(f"{k}: {v:,}" for k, v in s["inputs"].items()) or "none"),
            ("truncated", s["truncated"]),
            ("tokens", f"{s['tokens']:,} ({s['positions']:,} scored positions)"),
            ("size", f"{s['bytes'] / 1e6:.2f} MB, {s['bytes_per_position']} B/position"),
            ("stored fidelity", s["fidelity"]),
            ("teacher on data", s["teacher_on_data"]),
            ("wall time", f"{s['wall_s']} s" + _startup_text(s["startup"])),
            ("throughput", f"{s['loop_tok_s']:,} tokens/s after startup, {s['throughput_tok_s']:,} over the wall time"
             if s["tokens_this_run"] else "no teacher work")]
    eng = s.get("teacher_engine") or {}
    if eng:
        chunked = "on" if eng["chunked_prefill"] else "off (this model: whole samples per step)"
        rows.append(("vLLM engine", f"{eng['max_num_batched_tokens']:,} tokens per step, chunked prefill {chunked}"))
    workers, shards = s["ray"].get("workers_by_node") or {}, s.get("shards_by_node") or {}
    if len(set(workers) | set(shards)) > 1:
        rows.append(("Ray nodes", ", ".join(f"{n}: {workers.get(n, 0)} worker(s), {shards.get(n, 0)} shard(s)"
                                            for n in sorted(set(workers) | set(shards)))))
    if s["teacher_retries"]:
        rows.append(("teacher retries", f"{s['teacher_retries']:,} request(s) answered after a retry (the teacher "
                                        "server was unreachable or failed for a while; nothing was lost)"))
    for k, v in rows:
        print(f"  {k:<16} {v}")
    if s["inputs"].get("ids"):
        print(f"  {s['inputs']['ids']:,} record(s) came as token ids: scored as given, never tokenized here, so the "
              "tokenizer check had nothing to compare for them; the manifest records them as made with the "
              "tokenizer it names (--tokenizer, default the teacher's)")
    if skipped:
        print(f"  skipped records are listed in {os.path.join(s['cache'], REPORT_DIR, 'skipped.jsonl')}")
