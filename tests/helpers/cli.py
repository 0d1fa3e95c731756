"""Running kdcache as users do: the `kdcache` command in a subprocess, from the repository root."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def write_jsonl(path, rows):
    """rows: dicts (written as JSON) or strings (written as they are, e.g. a broken line)."""
    with open(path, "w") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


def kdcache(*args, timeout=120, env=None):
    return subprocess.run([sys.executable, "-m", "kdcache", *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env=env)


def precompute(*args, timeout=300, extra_env=None):
    """`kdcache precompute` on a local Ray of its own (never a cluster named in the environment)."""
    env = dict(os.environ, RAY_ADDRESS="", PYTHONPATH=ROOT, **(extra_env or {}))
    return kdcache("precompute", "--no-progress", "--worker-cpus", "0.5", *args, timeout=timeout, env=env)
