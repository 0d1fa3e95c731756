"""The `kdcache` command: a thin dispatcher. Each subcommand lives in its package."""
import importlib
import os
import sys

from kdcache.common.errors import KdcacheError

# name -> (module, function, one-line help). Imported lazily so `kdcache verify`
# never pays for importing torch or vLLM.
COMMANDS = {
    "demo": ("kdcache.demo.run", "main", "the embedded default: teacher, cache, distilled student, report"),
    "precompute": ("kdcache.pipeline.cli", "main", "run the teacher once over a dataset and write a logit cache"),
    "train": ("kdcache.train.cli", "main", "distil a student from a logit cache (DeepSpeed, resumable)"),
    "onpolicy": ("kdcache.onpolicy", "main", "on-policy rounds: the student's own samples, scored by the teacher, "
                 "trained on (resumable)"),
    "eval": ("kdcache.train.eval", "main", "compare teacher and students on held-out prompts; writes report.md"),
    "inspect": ("kdcache.cache_format.cli", "inspect_main", "summarize a logit cache"),
    "verify": ("kdcache.pipeline.rescore", "verify_main", "check every checksum and invariant of a cache (and with "
               "--rescore, the engine gap)"),
    "source": ("kdcache.pipeline.source", "main", "add a cache's source (conversations and teacher tokenizer, for "
               "--cross-tokenizer) without rescoring"),
    "ls": ("kdcache.cache_format.cli", "ls_main", "list the caches in a store (a directory or a URL)"),
    "gc": ("kdcache.cache_format.cli", "gc_main", "remove incomplete or unused caches from a store (not in use)"),
}


def usage():
    lines = ["usage: kdcache COMMAND [options]   (kdcache COMMAND --help for details)", "", "commands:"]
    lines += [f"  {name:<12} {help_}" for name, (_, _, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    name = argv[0]
    if name not in COMMANDS:
        print(f"kdcache: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module, func, _ = COMMANDS[name]
    try:
        return getattr(importlib.import_module(module), func)(argv[1:]) or 0
    except (KdcacheError, OSError) as e:
        # The one place errors reach the user: the message names the file, shard or key and what to do.
        # OSError too: a disk that is full or a store that cannot be reached is not a kdcache bug.
        if os.environ.get("KDCACHE_TRACEBACK"):
            raise
        print(f"error: {e}", file=sys.stderr)
        return getattr(e, "exit_code", 2)


if __name__ == "__main__":
    sys.exit(main())
