"""`kdcache inspect`, `verify`, `ls` and `gc`: the commands that need only the format."""
import argparse
import calendar
import json
import time

import numpy as np

from .card import CARD
from .compact import BOUNDS
from .errors import CacheError, ManifestMissing
from .location import Location
from .manifest import fidelity_text, load_manifest, safe_shard_path, teacher_ce_text
from .storage import default_codec, get_format
from .store import gc, is_store, list_caches
from .verify import verify_cache

CACHE = ("cache", "cache directory or URL (holds manifest.json)")
STORE = ("store", "store root, e.g. runs/store or s3://bucket/kd")


def _parser(name, description, target):
    """The parser of `kdcache NAME TARGET ...`; target: CACHE or STORE."""
    p = argparse.ArgumentParser(prog=f"kdcache {name}", description=description)
    p.add_argument(target[0], help=target[1])
    return p


def inspect_main(argv=None):
    p = _parser("inspect", "Summarize a logit cache: counts, k, backend, fingerprint, bytes per position, and a "
                           "per-shard table.", CACHE)
    p.add_argument("--json", action="store_true", help="print the manifest plus derived figures as JSON")
    p.add_argument("--card", action="store_true", help="write a dataset card (README.md) into the cache: what it "
                                                      "holds, its figures, and how to load it")
    p.add_argument("--sample", type=int, default=None, metavar="I",
                   help="print the I-th stored sample instead: its token ids, and the teacher's own view where it "
                        "saw another context (privileged context), with each position's target and top entry")
    args = p.parse_args(argv)
    if args.sample is not None:
        return _print_sample(args.cache, args.sample)
    try:
        m = load_manifest(args.cache)
    except ManifestMissing as e:
        raise ManifestMissing(f"{e}{_store_hint(args.cache)}") from None
    c = m.counts
    derived = {
        "bytes_per_position": c["bytes"] / c["positions"] if c["positions"] else None,
        "bytes_per_token": c["bytes"] / c["tokens"] if c["tokens"] else None,
        "shards_committed": len(m.shards),
    }
    if args.json:
        print(json.dumps({"manifest": m.to_json(), "derived": derived}, indent=1, sort_keys=True))
        return 0
    if args.card:
        from .card import write_card
        print(f"wrote {write_card(args.cache)}")
    meta = m.meta
    codec = default_codec(m.backend, m.fingerprint_parts.get("format", {}).get("codec"))
    rows = [
        ("cache", args.cache),
        ("format", f"{m.format} format {m.format_version}, storage {m.backend} (codec {codec}), "
                   f"log-probs {m.logprob_dtype}" + (f", top-p {m.top_p}" if m.top_p else "")),
        ("status", ("complete" if m.complete else "INCOMPLETE") +
                   f" ({len(m.shards)}/{m.num_shards_planned} shards)"),
        ("samples", f"{c['samples']:,}"),
        ("tokens", f"{c['tokens']:,} (scored positions {c['positions']:,})"),
        ("top_k", m.top_k),
        *([("sample", f"{m.sample} draws per position from the rest of the distribution (stored once per distinct "
                      f"id, with its count; SPEC.md 4.4)")] if m.sample else []),
        ("vocab_size", m.vocab_size),
        ("eos_token_ids", m.eos_token_ids),
        ("size", f"{c['bytes'] / 1e6:.2f} MB, " + (f"{derived['bytes_per_position']:.1f} B/position"
                                                   if c["positions"] else "no positions")),
        ("log-probs", BOUNDS.get(m.logprob_dtype, m.logprob_dtype) + "; tail mass, target log-probs float32"),
        ("fidelity", fidelity_text(m)),
        ("teacher on data", teacher_ce_text(m)),
        ("source", _source_text(m)),
        ("fingerprint", m.fingerprint[:16]),
    ] + [(k, v) for k, v in sorted(meta.items()) if isinstance(v, (str, int, float))]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    _print_field_bytes(args.cache, m, codec)
    print()
    print(f"{'shard':<24} {'samples':>8} {'range':>15} {'tokens':>10} {'positions':>10} {'MB':>8}")
    for s in m.shards:
        rng = f"{s.sample_start}-{s.sample_end}"
        print(f"{s.path:<24} {s.num_samples:>8} {rng:>15} {s.num_tokens:>10} "
              f"{s.num_positions:>10} {s.bytes / 1e6:>8.2f}")
    return 0


def _source_text(m):
    """The inspect line of a cache's source (SPEC.md 4.6)."""
    if m.source is None:
        return "none (no conversations or teacher tokenizer, SPEC.md 4.6; `kdcache source` adds them)"
    chats = m.source["chats"]
    size = sum(c["bytes"] for c in chats)
    per = f", {size / m.counts['positions']:.1f} B/position" if m.counts["positions"] else ""
    return (f"{sum(c['num_samples'] for c in chats):,} conversations in {len(chats)} files, {size / 1e6:.2f} MB{per}; "
            f"teacher tokenizer: {', '.join(sorted(m.source['tokenizer']['files']))}")


def _print_sample(path, i):
    """`kdcache inspect CACHE --sample I`: both views of one sample, as ids (the format holds no tokenizer)."""
    from .reader import open_cache
    with open_cache(path) as cache:
        try:
            r = cache[i]
        except IndexError as e:
            raise SystemExit(f"error: {path}: {e}") from None
    print(f"sample_id {r.sample_id}: {len(r.input_ids)} tokens, {len(r.positions)} trained positions"
          + (", truncated" if r.truncated else ""))
    print(f"student view (input_ids): {r.input_ids.tolist()}")
    if r.teacher_input_ids is None:
        print("teacher view: the same ids (no privileged context)")
    else:
        print(f"teacher view (teacher_input_ids, {len(r.teacher_input_ids)} tokens): {r.teacher_input_ids.tolist()}")
    t_pos = r.positions if r.teacher_positions is None else r.teacher_positions
    print(f"{'position':>9} {'teacher':>8} {'target':>8} {'top id':>8} {'top logprob':>12}")
    best = r.topk_logprobs.argmax(axis=1)                      # a sqrt8 cache's rows come in id order
    rows = np.arange(len(best))
    for p, t, tgt, top, lp in zip(r.positions, t_pos, r.targets, r.topk_ids[rows, best], r.topk_logprobs[rows, best]):
        print(f"{int(p):>9} {int(t):>8} {int(tgt):>8} {int(top):>8} {float(lp):>12.4f}")
    return 0


def _print_field_bytes(where, m, codec):
    """Bytes per trained position of each field, measured on the first shard (local caches)."""
    loc = Location(where)
    if loc.remote or not m.shards or not m.shards[0].num_positions:
        return
    s = m.shards[0]
    sizes = get_format(m.backend).field_bytes(safe_shard_path(loc.url, s.path), codec)
    print(f"\nbytes per trained position by field ({s.path}, {s.num_positions:,} positions):")
    for name, b in sorted(sizes.items(), key=lambda x: -x[1]):
        print(f"  {name:<18}{b / s.num_positions:>8.2f}")


def _store_hint(path):
    try:
        return f"\n{path} is a store: `kdcache ls {path}` lists its caches" if is_store(path) else ""
    except (CacheError, OSError):
        return ""


def verify_parser():
    p = _parser("verify", "Check every checksum and structural invariant of a cache. Exit 0 when sound, 1 with "
                          "the shard and reason when not.", CACHE)
    p.add_argument("--quick", action="store_true", help="checksums and sizes only; skip decoding records")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    return p


def verify_main(argv=None):
    return verify_report(verify_parser().parse_args(argv))


def verify_report(args, extra=None):
    """Verify args.cache and print the report (as one JSON object with --json, extra's keys added). The exit code."""
    rep = verify_cache(args.cache, structure=not args.quick)
    if args.json:
        print(json.dumps({"ok": rep.ok, "problems": rep.problems, "warnings": rep.warnings,
                          "shards_checked": rep.shards_checked, "samples_checked": rep.samples_checked,
                          **(extra or {})}))
    else:
        for where, why in rep.warnings:
            print(f"warning  {where}: {why}")
        for where, why in rep.problems:
            print(f"FAIL     {where}: {why}")
        verdict = "OK" if rep.ok else f"{len(rep.problems)} problem(s)"
        print(f"{verdict}: {rep.shards_checked} shard(s) checksummed, {rep.samples_checked} sample(s) decoded")
    return 0 if rep.ok else 1


def _when(t):
    return time.strftime("%Y-%m-%d %H:%M", time.gmtime(t)) if t else "-"


def ls_main(argv=None):
    p = _parser("ls", "List the caches in a store (a directory or an fsspec URL): teacher, dataset, k, size, "
                      "completeness, dates, runs reading them.", STORE)
    p.add_argument("--json", action="store_true", help="one JSON object per cache")
    args = p.parse_args(argv)
    entries = list_caches(args.store)
    cards = {e.name: _card(e) for e in entries}
    if args.json:
        for e in entries:
            m = e.manifest.to_json() if e.manifest else {}
            print(json.dumps({"name": e.name, "url": e.url, "state": e.state, "complete": e.complete,
                              "fingerprint": m.get("fingerprint"), "meta": m.get("meta"), "top_k": m.get("top_k"),
                              "backend": m.get("backend"), "counts": m.get("counts"), "updated": e.updated,
                              "last_used": e.last_used, "readers": len(e.readers), "writing": e.writing,
                              "error": e.error, "card": cards[e.name]}, sort_keys=True))
        return 0
    if not entries:
        print(f"{args.store}: no caches")
        return 0
    rows = [("NAME", "STATE", "TEACHER", "DATASET", "K", "BACKEND", "SAMPLES", "SIZE", "UPDATED", "LAST USED", "RUNS",
             "CARD")]
    for e in entries:
        m = e.manifest.to_json() if e.manifest else {}
        meta = m.get("meta", {})
        c = m.get("counts", {})
        state = e.state + (" (writing)" if e.writing else "")
        rows.append((e.name, state, str(meta.get("teacher", "-")), str(meta.get("dataset", "-")),
                     str(m.get("top_k", "-")), m.get("backend", "-"), f"{c.get('samples', 0):,}",
                     f"{c.get('bytes', 0) / 1e6:.1f} MB", _when(e.updated), _when(e.last_used),
                     f"{len(e.readers)} reading" if e.readers else "-",
                     f"{e.name}/{CARD}" if cards[e.name] else "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())
    return 0


def _card(entry):
    """URL of the cache's dataset card (kdcache inspect --card), or None; never read through a link."""
    if entry.link is not None:
        return None
    loc = Location(entry.url)
    return loc.path(CARD) if loc.exists(CARD) else None


def parse_age(text):
    """'7d', '12h', '30m', '45s' -> seconds."""
    units = {"d": 86400, "h": 3600, "m": 60, "s": 1}
    try:
        return float(text[:-1]) * units[text[-1]]
    except (KeyError, ValueError, IndexError):
        raise argparse.ArgumentTypeError(f"{text!r} is not an age like 7d, 12h, 30m or 45s") from None


def parse_date(text):
    """'2026-11-01' or '2026-11-01T12:00' (UTC) -> unix seconds."""
    for fmt in ("%Y-%m-%d", "%Y-%m-%dT%H:%M", "%Y-%m-%dT%H:%M:%S"):
        try:
            return float(calendar.timegm(time.strptime(text, fmt)))
        except ValueError:
            continue
    raise argparse.ArgumentTypeError(f"{text!r} is not a date like 2026-11-01 or 2026-11-01T12:00 (UTC)")


def gc_main(argv=None):
    p = _parser("gc", "Remove incomplete caches idle for longer than an age, and caches not used since a date. A "
                      "cache that a run is writing or reading is never removed.", STORE)
    p.add_argument("--incomplete-older-than", type=parse_age, metavar="AGE",
                   help="remove incomplete caches with no commit for AGE (7d, 12h, 30m, 45s)")
    p.add_argument("--unused-since", type=parse_date, metavar="DATE",
                   help="remove caches (complete or not) last read or written before DATE (UTC)")
    p.add_argument("--unused-for", type=parse_age, metavar="AGE", help="same as --unused-since now minus AGE")
    p.add_argument("--dry-run", action="store_true", help="say what would be removed, remove nothing")
    args = p.parse_args(argv)
    unused = args.unused_since
    if args.unused_for is not None:
        unused = time.time() - args.unused_for if unused is None else max(unused, time.time() - args.unused_for)
    if args.incomplete_older_than is None and unused is None:
        p.error("say what to remove: --incomplete-older-than AGE and/or --unused-since DATE / --unused-for AGE")
    decisions = gc(args.store, incomplete_older_than=args.incomplete_older_than, unused_since=unused,
              dry_run=args.dry_run)
    for e, action, why in decisions:
        size = e.manifest.counts["bytes"] if e.manifest else 0
        print(f"{action:<13} {e.name}  ({e.state}, {size / 1e6:.1f} MB): {why}")
    removed = [e for e, a, _ in decisions if a in ("removed", "would remove")]
    freed = sum(e.manifest.counts["bytes"] for e in removed if e.manifest)
    verb = "would remove" if args.dry_run else "removed"
    print(f"{verb} {len(removed)} cache(s), {freed / 1e6:.1f} MB; kept {len(decisions) - len(removed)} matching "
          "cache(s) in use")
    return 0
