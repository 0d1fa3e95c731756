"""bench/chaos.py's common parts: running kdcache, comparing caches, recording trials."""
import os
import shutil
import signal
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from kdcache.cache_format import open_cache, verify_cache  # noqa: E402,F401
from kdcache.cache_format.location import Location  # noqa: E402


def kdcache_cmd(*args):
    return [sys.executable, "-m", "kdcache", *map(str, args)]


def run(cmd, env=None, timeout=900):
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _terminal_default():
    """In the child: SIGHUP as a terminal's job has it, even when chaos itself runs under nohup (which would make
    every SIGHUP trial a no-op that cannot count)."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def start(cmd, env=None, log=None):
    """cmd in a session of its own; its stderr into the file `log`, if given."""
    err = open(log, "wb") if log else subprocess.DEVNULL
    try:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                                stderr=err, preexec_fn=_terminal_default)
    finally:
        if log:
            err.close()


LP_TOL = 1e-2   # float16 storage, and the teacher's batches differ when a trial uses another --shard-size


def same_record(a, b):
    """Token ids and positions exactly; teacher top-k within LP_TOL, ranks swapped only between near-ties."""
    if not (np.array_equal(a.input_ids, b.input_ids) and np.array_equal(a.positions, b.positions)):
        return False
    if not (np.allclose(a.topk_logprobs, b.topk_logprobs, rtol=2e-3, atol=LP_TOL)     # float16 ulps grow with |lp|
            and np.allclose(a.tail_mass, b.tail_mass, atol=LP_TOL)):
        return False
    rows, cols = np.nonzero(a.topk_ids != b.topk_ids)
    lp = a.topk_logprobs
    return all(any(abs(lp[r, c] - lp[r, n]) <= LP_TOL for n in (c - 1, c + 1) if 0 <= n < lp.shape[1])
               for r, c in zip(rows, cols))


def compare_caches(ref_dir, out_dir):
    ref, got = open_cache(ref_dir), open_cache(out_dir)
    ref_ids = [r.sample_id for r in ref]
    got_ids = [r.sample_id for r in got]
    lost = len(set(ref_ids) - set(got_ids))
    dup = len(got_ids) - len(set(got_ids))
    by_id = {r.sample_id: r for r in ref}
    differ = sum(by_id.get(r.sample_id) is None or not same_record(r, by_id[r.sample_id]) for r in got)
    return lost, dup, differ


def _committed(out):
    """Shards listed in the manifest at `out` (a directory or URL); 0 without one."""
    try:
        return len(Location(out).read_json("manifest.json")["shards"])
    except (OSError, ValueError):
        return 0


def _session(sid):
    """Live pids in session `sid` (a job started with start_new_session): what is left of it."""
    left = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[3]) == sid and fields[0] != "Z":
                left.append(int(pid))
        except (OSError, ValueError, IndexError):
            continue
    return left


def _complete(out):
    try:
        return bool(Location(out).read_json("manifest.json")["complete"])
    except (OSError, ValueError):
        return False


def keep_row(rows, row, out, args):
    """Record a trial's row, print its line, and remove its work directory (unless --keep)."""
    rows.append(row)
    print(f"  {row['kind']}: {row['trial']}: {'ok' if row['ok'] else 'FAIL'}"
          f"{'' if row['interrupted'] else ' (not counted)'}", flush=True)
    if not args.keep:
        shutil.rmtree(out, ignore_errors=True)


def by_kind(rows):
    """{kind: (trials, counted, failures among counted ones or not)}"""
    out = {}
    for r in rows:
        n, c, f = out.get(r["kind"], (0, 0, 0))
        out[r["kind"]] = (n + 1, c + bool(r["interrupted"]), f + (not r["ok"]))
    return out
