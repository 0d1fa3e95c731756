"""Issue 42, item 7: a signal ends a precompute whose served teacher stopped answering.

Before, SIGTERM to the driver set the stop flag and the driver waited for the shards in flight for ever (the request
was held by the server); only kill -9 ended it. Now the shards in flight get KDCACHE_STOP_GRACE_S, then the job
stops without them (exit 128 + N, the shards named), and the rerun scores them: nothing lost, nothing twice."""
import signal
import subprocess
import sys
import threading
import time

import pytest

from kdcache.cache_format import open_cache, verify_cache
from tests.helpers.cli import precompute, user_env, user_project, write_jsonl
from tests.pipeline.test_served import FakeServer

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_sigterm_ends_a_job_held_by_a_silent_server_and_the_rerun_completes(tiny, tmp_path):
    answering = threading.Event()

    def hold(body, choice):                # scoring requests wait until the server answers again (the probe not)
        if body.get("prompt_logprobs") and body["prompt"] != [0, 0]:
            answering.wait(120)
        return choice
    srv = FakeServer(answer=hold)
    try:
        data = write_jsonl(tmp_path / "d.jsonl", [{"text": f"docker {w}"} for w in ("sql", "ray", "zarr", "arrow")])
        args = ["--teacher", srv.url, "--tokenizer", tiny["teacher"], "--data", str(data), "--top-k", "1",
                "--shard-size", "2", "--out", str(tmp_path / "c"), "--canary-positions", "0"]   # a shard's request held
        env = user_env(RAY_ADDRESS="", KDCACHE_STOP_GRACE_S="2")
        proc = subprocess.Popen([sys.executable, "-m", "kdcache", "precompute", "--no-progress", "--worker-cpus",
                                 "0.5", *args], cwd=user_project(), env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        deadline = time.time() + 240
        while time.time() < deadline and proc.poll() is None and \
                not any(p.get("prompt_logprobs") and p["prompt"] != [0, 0] for p in list(srv.posts)):
            time.sleep(0.1)
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.time() < deadline, "no scoring request reached the server"
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)                         # the driver only, as `kill PID` does
        try:
            output, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail("SIGTERM did not end the job within 60 s: " + proc.communicate()[0][-3000:])
        took = time.monotonic() - t0
        assert proc.returncode == 128 + signal.SIGTERM, output[-3000:]
        assert "waiting up to 2 s for the" in output and "still in flight when KDCACHE_STOP_GRACE_S ran out" in \
            output and "Rerun the same command" in output and "Traceback" not in output, output[-3000:]
        assert took < 45, took
        answering.set()
        res = precompute(*args)
        assert res.returncode == 0, res.stderr[-3000:]
        assert verify_cache(tmp_path / "c").ok
        assert [r.sample_id for r in open_cache(tmp_path / "c")] == [0, 1, 2, 3]
    finally:
        answering.set()
        srv.close()

