"""What the student benchmarks (hinted.py, cross_tokenizer.py) share: `kdcache` commands run to a log, and JSONL
files written."""
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_jsonl(rows, path):
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return path


def kdcache(*args, log):
    """`python -m kdcache ARGS` from the repository, its output appended to `log`; its wall time in seconds.
    SystemExit naming the command and the log if it fails."""
    cmd = [sys.executable, "-m", "kdcache", *map(str, args)]
    t0 = time.time()
    with open(log, "a") as out:
        res = subprocess.run(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    if res.returncode:
        raise SystemExit(f"failed ({res.returncode}): {' '.join(cmd)}; see {log}")
    return time.time() - t0
