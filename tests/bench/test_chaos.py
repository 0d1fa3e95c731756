"""`make chaos` itself, at a small N, in CI: the harness runs, its faults land, and it finds nothing lost.

The kinds here land by construction (crash points and signals at a logged step, not moments in a time window), so
each trial counts on any machine; RELIABILITY.md has the runs at 20 counted trials per kind."""
import json
import os
import subprocess
import sys

import pytest

from tests.helpers.cli import ROOT, user_env

pytestmark = [pytest.mark.ray, pytest.mark.deepspeed, pytest.mark.slow]

KINDS = ["precompute:driver-crash", "train:launcher-kill9"]      # the others: the suite's own crash-point tests


def test_chaos_at_a_small_n_counts_every_trial_and_loses_nothing(tiny, tmp_path):
    from kdcache.demo.models import make_model
    student = tmp_path / "student"
    make_model(tiny["tok"], "test", seed=5).config.save_pretrained(str(student))
    tiny["tok"].save_pretrained(str(student))
    out = tmp_path / "chaos.json"
    res = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "chaos.py"), "--teacher", tiny["teacher"],
                          "--student", str(student), "--trials", "1", "--kinds", ",".join(KINDS), "--records", "30",
                          "--steps", "8", "--seed", "7", "--json", str(out)],
                         capture_output=True, text=True, timeout=900, env=user_env(RAY_ADDRESS=""))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "seed 7" in res.stdout
    rows = json.loads(out.read_text())["rows"]
    assert sorted(r["kind"] for r in rows) == sorted(KINDS)
    for r in rows:
        assert r["interrupted"] and r["ok"], r                    # the fault landed, and nothing was lost
    for r in rows:
        if r["kind"].startswith("precompute:"):
            assert r["lost"] == r["duplicated"] == r["different"] == 0 and r["verify"], r
        else:
            assert r["losses_equal"] and r["half_checkpoints_left"] == 0, r
