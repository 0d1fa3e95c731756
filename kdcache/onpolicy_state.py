"""`kdcache onpolicy`'s run directory: summary.json, and the settings a rerun must share with the run it continues."""
import dataclasses
import json
import os

import yaml

from kdcache.common.atomic import atomic_write_bytes
from kdcache.common.errors import ConfigError
from kdcache.pipeline.config import PrecomputeConfig
from kdcache.train.config import TrainConfig

from .routing import BASE, teachers

SUMMARY, CONFIG, LOCK = "summary.json", "onpolicy_config.yaml", ".onpolicy.lock"


def load_summary(out):
    try:
        with open(os.path.join(out, SUMMARY)) as f:
            return json.load(f)
    except FileNotFoundError:
        return {"rounds": []}


def save_summary(out, summary):
    atomic_write_bytes(os.path.join(out, SUMMARY), (json.dumps(summary, indent=1) + "\n").encode())


# Settings of how a stage runs, not of what it makes: a rerun may change them (a restarted cluster, more workers).
RUNTIME = {"progress", "ray_address", "ray_pass_credentials", "workers", "worker_cpus", "worker_gpus", "threads",
           "max_in_flight", "requests_in_flight", "prefetch", "log_every", "save_every", "keep_checkpoints"}


PATHS = {"teacher", "student", "data", "out", "store", "offpolicy_cache", "tokenizer"}   # compared absolute


def _defaults(cls) -> dict:
    out = {}
    for f in dataclasses.fields(cls):
        out[f.name] = f.default_factory() if f.default is dataclasses.MISSING else f.default
    return out


def _resolved(part, values) -> dict:
    """A part's settings as they act: defaults filled in (an explicit `--seed 0` is the default, not a change),
    paths absolute (a relative --out is the same directory), runtime-only keys left out."""
    base = {"precompute": _defaults(PrecomputeConfig), "train": _defaults(TrainConfig)}.get(part, {})
    merged = {**base, **values}
    return {k: (os.path.abspath(v) if k in PATHS and isinstance(v, str) and "://" not in v
                and not (k == "teacher" and v == BASE) else _named_paths(v) if k == "teacher" else v)
            for k, v in merged.items() if k not in RUNTIME}


def _named_paths(v):
    """Routed teachers (NAME=DIR entries) with their directories absolute."""
    if not isinstance(v, list):
        return v
    return [f"{n}={p if p == BASE or '://' in p else os.path.abspath(p)}" for n, p in teachers(v).items()]


def _work_done(out) -> bool:
    """Whether any round in `out` has begun its work (a cache started, a stage done): before that a rerun may
    change the settings (a first run that failed on a bad flag must not lock them in)."""
    summary = load_summary(out)
    if any(e.get("stage") != "new" or e.get("cache") for e in summary.get("rounds", [])):
        return True
    rounds = os.path.join(out, "rounds")
    return os.path.isdir(rounds) and any(f.startswith("cache") and f.endswith(".txt")
                                         for d in os.listdir(rounds) for f in os.listdir(os.path.join(rounds, d)))


def check_same_run(cfg, pre, train):
    """A rerun continues the run in DIR only with its settings (other rounds or steps would be another schedule),
    and on the same prompts: the prompt file is fingerprinted by content (an edit at the same path is a change)."""
    from kdcache.cache_format.fingerprint import hash_tree
    path = os.path.join(cfg.out, CONFIG)
    now = {"onpolicy": {**{k: v for k, v in dataclasses.asdict(cfg).items() if k != "stages"},
                        "data_sha256": hash_tree(cfg.data)},
           "precompute": {k: v for k, v in pre.items() if k not in RUNTIME},
           "train": {k: v for k, v in train.items() if k not in RUNTIME}}
    if os.path.isfile(path) and _work_done(cfg.out):
        with open(path) as f:
            before = yaml.safe_load(f) or {}
        if "data_sha256" not in before.get("onpolicy", {}):      # written before prompts were fingerprinted
            now["onpolicy"].pop("data_sha256")
        a = {part: _resolved(part, before.get(part, {})) for part in now}
        b = {part: _resolved(part, now[part]) for part in now}
        differ = [f"{part}.{k}: {a[part].get(k)!r} then, {b[part].get(k)!r} now"
                  for part in now for k in sorted(set(a[part]) | set(b[part])) if a[part].get(k) != b[part].get(k)]
        if differ:
            raise ConfigError(f"{cfg.out} holds an on-policy run with other settings ({'; '.join(differ)}). Rerun "
                              "with the same settings (and prompts) to resume it, or pass another --out.")
        return
    atomic_write_bytes(path, yaml.safe_dump(now, sort_keys=True).encode())


def read_prompts(path, places=False):
    """The prompt records, one JSON text each: a JSONL file's non-blank lines as they are (precompute parses and
    reports them), or each row of a Parquet file or save_to_disk directory. places: also where each is
    ("FILE:LINE", or the row's place)."""
    if os.path.isfile(path) and path.endswith((".jsonl", ".json", ".ndjson")):
        with open(path, encoding="utf-8") as f:
            got = [(line.rstrip("\r\n"), f"{path}:{n}") for n, line in enumerate(f, start=1) if line.strip()]
    else:
        from kdcache.pipeline.data import iter_rows
        got = [(json.dumps(row.data), row.where) for row in iter_rows(path)]
    if not got:
        raise ConfigError(f"data: {path} holds no prompt records")
    rows = [g for g, _ in got]
    return (rows, [w for _, w in got]) if places else rows


def holder_pid(out):
    try:
        with open(os.path.join(out, LOCK)) as f:
            text = f.read().split()
        return int(text[1]) if len(text) > 1 and text[0] == "pid" else None
    except (OSError, ValueError):
        return None


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return pid != os.getpid()
