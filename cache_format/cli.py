"""`kdcache inspect` and `kdcache verify`."""
import argparse
import json
import sys

from .errors import CacheError
from .manifest import load_manifest
from .verify import verify_cache


def inspect_main(argv=None):
    p = argparse.ArgumentParser(prog="kdcache inspect",
                                description="Summarize a logit cache: counts, k, backend, fingerprint, "
                                            "bytes per position, and a per-shard table.")
    p.add_argument("cache", help="cache directory (holds manifest.json)")
    p.add_argument("--json", action="store_true", help="print the manifest plus derived figures as JSON")
    args = p.parse_args(argv)
    try:
        m = load_manifest(args.cache)
    except CacheError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    c = m["counts"]
    derived = {
        "bytes_per_position": c["bytes"] / c["positions"] if c["positions"] else None,
        "bytes_per_token": c["bytes"] / c["tokens"] if c["tokens"] else None,
        "shards_committed": len(m["shards"]),
    }
    if args.json:
        print(json.dumps({"manifest": m, "derived": derived}, indent=1, sort_keys=True))
        return 0
    meta = m.get("meta", {})
    rows = [
        ("cache", args.cache),
        ("format", f"{m['format']} v{m['format_version']}, backend {m['backend']}, "
                   f"logprobs {m['logprob_dtype']}"),
        ("status", ("complete" if m["complete"] else "INCOMPLETE") +
                   f" ({len(m['shards'])}/{m['num_shards_planned']} shards)"),
        ("samples", f"{c['samples']:,}"),
        ("tokens", f"{c['tokens']:,} (scored positions {c['positions']:,})"),
        ("top_k", m["top_k"]),
        ("vocab_size", m["vocab_size"]),
        ("eos_token_ids", m["eos_token_ids"]),
        ("size", f"{c['bytes'] / 1e6:.2f} MB, " + (f"{derived['bytes_per_position']:.1f} B/position"
                                                   if c["positions"] else "no positions")),
        ("fingerprint", m["fingerprint"][:16]),
    ] + [(k, v) for k, v in sorted(meta.items()) if isinstance(v, (str, int, float))]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    print()
    print(f"{'shard':<24} {'samples':>8} {'range':>15} {'tokens':>10} {'positions':>10} {'MB':>8}")
    for s in m["shards"]:
        rng = f"{s['sample_start']}-{s['sample_end']}"
        print(f"{s['path']:<24} {s['num_samples']:>8} {rng:>15} {s['num_tokens']:>10} "
              f"{s['num_positions']:>10} {s['bytes'] / 1e6:>8.2f}")
    return 0


def verify_main(argv=None):
    p = argparse.ArgumentParser(prog="kdcache verify",
                                description="Check every checksum and structural invariant of a cache. "
                                            "Exit 0 when sound, 1 with the shard and reason when not.")
    p.add_argument("cache", help="cache directory (holds manifest.json)")
    p.add_argument("--quick", action="store_true", help="checksums and sizes only; skip decoding records")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    args = p.parse_args(argv)
    rep = verify_cache(args.cache, structure=not args.quick)
    if args.json:
        print(json.dumps({"ok": rep.ok, "problems": rep.problems, "warnings": rep.warnings,
                          "shards_checked": rep.shards_checked, "samples_checked": rep.samples_checked}))
    else:
        for where, why in rep.warnings:
            print(f"warning  {where}: {why}")
        for where, why in rep.problems:
            print(f"FAIL     {where}: {why}")
        verdict = "OK" if rep.ok else f"{len(rep.problems)} problem(s)"
        print(f"{verdict}: {rep.shards_checked} shard(s) checksummed, {rep.samples_checked} sample(s) decoded")
    return 0 if rep.ok else 1
