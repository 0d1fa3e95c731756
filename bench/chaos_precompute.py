"""bench/chaos.py's precompute trials: crash points, signals and kill -9 (the tree, or the driver alone), and a
served teacher killed and restarted mid-job."""
import os
import shutil
import signal
import sys
import time

from chaos_common import _committed, _complete, _session, compare_caches, kdcache_cmd, run, start, verify_cache

SHARD_SIZES = (7, 10, 13, 25)      # each trial draws one: resume must be exact under every plan


def _reference_precompute(args, common, ref):
    """The uninterrupted run; returns (duration, commit window in seconds)."""
    t0 = time.time()
    proc = start(kdcache_cmd(*common, "--shard-size", 10, "--out", ref))
    first = last = None
    while proc.poll() is None:          # the commit window: first shard committed -> last shard committed
        n = _committed(ref)
        if n and first is None:
            first = time.time()
        if n == args.records // 10 and last is None:
            last = time.time()
        time.sleep(0.02)
    if proc.returncode or first is None:
        sys.exit(f"the reference precompute failed (exit {proc.returncode})")
    return time.time() - t0, (last or time.time()) - first


def _interrupt_precompute(cmd, out, how, log):
    """Run cmd and interrupt it as `how` says: ("crash", point), ("kill9", delay) to the process tree,
    ("kill9-driver", delay) to the driver alone, or (signal, delay) to the whole process group. Returns
    (landed: the job stopped before finishing, what a driver kill left: see _reaped)."""
    kind, value = how
    if kind == "crash":
        first = run(cmd, env=dict(os.environ, KDCACHE_CRASH_AT=value))
        return first.returncode != 0 and not _complete(out), {}
    proc = start(cmd, log=log)
    while proc.poll() is None and not _committed(out):
        time.sleep(0.05)
    time.sleep(value)
    if proc.poll() is not None:
        return False, {}                 # finished before the kill: this trial cannot count
    if kind == "kill9-driver":
        reaper = _reaper_of(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        return not _complete(out), _reaped(proc.pid, reaper, log)
    os.killpg(proc.pid, signal.SIGKILL if kind == "kill9" else kind)
    proc.wait()
    return not _complete(out), {}


REAPER_WAIT_S = 120     # only a bound on a hung reaper: its exit, not a fixed wait, ends the watch


def _reaper_of(driver):
    """The pid of the driver's reaper (pipeline/reaper.py), or None."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"kdcache.pipeline.reaper" in argv and str(driver).encode() in argv:
            return int(pid)
    return None


def _reaped(driver, reaper, log):
    """After the driver alone was killed: wait for its reaper to exit, then count what is left of the job's
    session. {"orphans": n, "orphan_names": [...], "reaper": its report line, "reaper_s": its time}."""
    t0 = time.time()
    while reaper is not None and os.path.exists(f"/proc/{reaper}") and time.time() < t0 + REAPER_WAIT_S:
        try:
            with open(f"/proc/{reaper}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
        except OSError:
            break
        time.sleep(0.05)
    seconds = time.time() - t0
    left = _session(driver)
    names = []
    for pid in left:
        try:
            names.append(open(f"/proc/{pid}/comm").read().strip())
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    lines = [ln for ln in open(log, errors="replace") if ln.startswith("kdcache reaper:")] if os.path.exists(log) \
        else []
    return {"orphans": len(left), "orphan_names": names, "reaper_s": round(seconds, 2),
            "reaper": lines[-1].strip() if lines else ("no reaper found" if reaper is None else "")}


PRECOMPUTE_KINDS = ("worker-crash", "driver-crash", "sigterm", "sighup", "kill9-tree", "kill9-driver",
                    "served-restart")


def _precompute_plans(args, rng, window, s3, kinds):
    """(kind, label, how, shard size): args.trials of each of `kinds`, moments drawn from rng."""
    plans = []
    for _ in range(args.trials):                      # round robin: a run cut short still covers every kind
        for kind in kinds:
            size = int(rng.choice(SHARD_SIZES))
            shards = -(-args.records // size)
            if kind == "worker-crash":
                n = int(rng.integers(1, shards))
                point = f"before-upload@{n}" if s3 else f"before-publish@{n}"
                label, how = f"crash point: worker, before shard {n}'s {'upload' if s3 else 'rename'}", ("crash", point)
            elif kind == "driver-crash":
                n = int(rng.integers(2, shards + 1))
                label, how = f"crash point: driver, before manifest.json replace {n}", \
                    ("crash", f"before-replace-manifest.json@{n}")
            elif kind in ("sigterm", "sighup"):
                sig, t = getattr(signal, kind.upper()), float(rng.uniform(0, window))
                label, how = f"{sig.name} to the group {t:.2f} s after the first commit", (sig, t)
            elif kind == "served-restart":
                t, down = float(rng.uniform(0, window)), float(rng.choice([0.0, rng.uniform(0, 20)]))
                label = f"served teacher kill -9 {t:.2f} s after the first commit, restarted {down:.1f} s later"
                how = ("served-restart", (t, down))
            else:
                t = float(rng.uniform(0, window))
                alone = kind == "kill9-driver"
                label = f"kill -9 {'driver alone' if alone else 'tree'} {t:.2f} s after the first commit"
                how = ("kill9-driver" if alone else "kill9", t)
            plans.append((f"precompute:{kind}", f"{label}, shards of {size}", how, size))
    return plans


def precompute_trials(args, work, teacher, rng, root):
    """The in-process trials (hf teacher) and, for the served-restart kind, trials against a real `vllm serve` of the
    same teacher. Returns (rows, reference duration, commit window)."""
    from kdcache.demo.task import make_splits, write_jsonl
    args.work = work
    data = os.path.join(work, "data.jsonl")
    write_jsonl(make_splits(args.records, 0, seed=3)[0], data)
    common = ["precompute", "--teacher", teacher, "--data", data, "--backend", "hf", "--top-k", 16,
              "--no-progress", "--worker-cpus", 0.5]
    s3 = root.startswith("s3://")
    local = [k for k in PRECOMPUTE_KINDS if f"precompute:{k}" in args.kinds and k != "served-restart"]
    rows, duration, window = [], None, None
    if local or any(k.startswith("train:") for k in args.kinds):     # the training trials read this cache
        duration, window = _reference_precompute(args, common, f"{root}/pre-ref")
    if local:
        plans = _precompute_plans(args, rng, window, s3, local)
        rows += _run_precompute_trials(args, common, f"{root}/pre-ref", root, "pre", plans)
    if "precompute:served-restart" in args.kinds:
        from tests.helpers.vllm_server import VLLMServer
        server = VLLMServer(teacher, max_logprobs=16, log_path=os.path.join(work, "vllm.log")).start()
        try:
            common_s = ["precompute", "--teacher", server.url, "--tokenizer", teacher, "--data", data, "--top-k", 16,
                        "--no-progress", "--worker-cpus", 0.5, "--requests-in-flight", 2]
            d, w = _reference_precompute(args, common_s, f"{root}/served-ref")
            print(f"served teacher (vllm serve): reference run {d:.1f} s, {w:.1f} s from its first shard commit to "
                  "its last", flush=True)
            duration, window = duration or d, window or w
            plans = _precompute_plans(args, rng, w, s3, ["served-restart"])
            rows += _run_precompute_trials(args, common_s, f"{root}/served-ref", root, "served", plans, server)
        finally:
            server.stop()
    return rows, duration, window


def _run_precompute_trials(args, common, ref, root, prefix, plans, server=None):
    rows = []
    for i, (kind, label, how, size) in enumerate(plans):
        out = f"{root}/{prefix}-{i}"
        cmd = kdcache_cmd(*common, "--shard-size", size, "--out", out)
        log = os.path.join(args.work, f"{prefix}-{i}.stderr")      # the job's stderr: the reaper reports there
        if how[0] == "served-restart":
            interrupted, reaped = _restart_server_mid_job(cmd, out, server, *how[1]), {}
        else:
            interrupted, reaped = _interrupt_precompute(cmd, out, how, log)
        orphans = reaped.get("orphans", 0)
        committed = _committed(out)
        sound_after_kill = verify_cache(out).ok if committed else True
        for _ in range(3):
            res = run(cmd)
            if res.returncode == 0:
                break
        rep = verify_cache(out)
        lost, dup, differ = compare_caches(ref, out)
        ok = rep.ok and sound_after_kill and res.returncode == 0 and not (lost or dup or differ or orphans)
        rows.append({"kind": kind, "trial": label, "interrupted": interrupted, "shards_at_kill": committed,
                     "sound_after_kill": sound_after_kill, "resumed_ok": res.returncode == 0, "verify": rep.ok,
                     "lost": lost, "duplicated": dup, "different": differ, "orphans": orphans, "ok": ok, **reaped})
        print(f"  {kind}: {label}: {'ok' if ok else 'FAIL'}{'' if interrupted else ' (not counted)'}", flush=True)
        if reaped:
            print(f"    reaper done {reaped['reaper_s']:.2f} s after the kill; "
                  f"{reaped['reaper'] or 'the reaper found nothing left'}"
                  + (f"; left after it: {', '.join(reaped['orphan_names'])}" if reaped["orphans"] else ""), flush=True)
        if not args.keep and not root.startswith("s3://"):
            shutil.rmtree(out, ignore_errors=True)
    return rows


SERVED_RETRY_S = 30    # a restart takes 20-60 s here: some trials ride the outage out, others give up and resume


def _restart_server_mid_job(cmd, out, server, t, down):
    """kill -9 the served teacher (its whole process group) t s after the job's first commit, start it again on the
    same port `down` s later. The job rides the outage out if the server is back within KDCACHE_SERVED_RETRY_S,
    else it gives up and the rerun resumes. Returns landed: the cache was incomplete at the kill."""
    proc = start(cmd, env=dict(os.environ, KDCACHE_SERVED_RETRY_S=str(SERVED_RETRY_S)))
    while proc.poll() is None and not _committed(out):
        time.sleep(0.05)
    time.sleep(t)
    if proc.poll() is not None:
        return False
    landed = not _complete(out)
    t0 = time.time()
    server.kill()
    time.sleep(down)
    server.start()
    proc.wait()
    print(f"    the server was down {time.time() - t0:.0f} s: the job "
          f"{'rode it out' if proc.returncode == 0 else f'gave up (exit {proc.returncode}); the rerun resumes'}",
          flush=True)
    return landed


def print_precompute(args, rows, duration, window):
    print(f"precompute into {'an S3-compatible server' if args.s3 else 'local disk'}: {args.records} records; "
          f"reference run {duration:.1f} s, {window:.1f} s from its first shard commit to its last (kill times "
          "are drawn in that window)")
    print(f"{'trial':<72}{'counted':>8}{'shards':>7}{'verify':>8}{'lost':>6}{'dup':>5}{'diff':>6}{'orphans':>8}")
    for r in rows:
        ok = "ok" if r["verify"] and r["sound_after_kill"] else "FAIL"
        print(f"{r['trial']:<72}{'yes' if r['interrupted'] else 'no':>8}{r['shards_at_kill']:>7}{ok:>8}"
              f"{r['lost']:>6}{r['duplicated']:>5}{r['different']:>6}{r['orphans']:>8}")
