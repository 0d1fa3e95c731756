"""The embedded default, shortened: every stage runs, the artefacts are consistent, and rule 1 holds at this size:
the student distilled from the cache stops where the control (the cache without its end-of-turn positions) does not.

The full quality bars (stop rate >= 95%, F1 gap) are checked by `make demo` itself at full size.
"""
import json
import subprocess
import sys

import pytest

from kdcache.cache_format import open_cache, verify_cache
from tests.helpers.cli import run, user_env, user_project

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.deepspeed]


def test_quick_demo_chain(tmp_path):
    root = tmp_path / "demo"
    env = user_env()
    res = subprocess.run([sys.executable, "-m", "kdcache", "demo", "--quick", "--backend", "hf", "--root", str(root)],
                         cwd=user_project(), env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    # The control's cache came from the first job's Ray and teacher worker, not a second start-up.
    assert "Ray and 1 teacher worker(s) kept from an earlier job" in res.stdout + res.stderr
    for path in ("data/train.jsonl", "data/heldout.jsonl", "teacher/config.json", "teacher/teacher_training.json",
                 "student/final/config.json", "student_no_eos/final/config.json", "report/report.md",
                 "report/lengths.png", "report/loss_curves.png", "report/eval.json"):
        assert (root / path).exists(), path
    cache, control = open_cache(root / "cache"), open_cache(root / "cache_no_eos")
    assert len(cache) == len(control) == 48
    assert verify_cache(root / "cache").ok
    # The control cache is the EOS bug on purpose: verify must catch it on every sample.
    rep = verify_cache(root / "cache_no_eos")
    assert len(rep.problems) == 48 and all("end-of-turn" in why for _, why in rep.problems)
    eos = set(cache.eos_token_ids)
    for a, b in zip(cache, control):
        assert any(int(t) in eos for t in a.targets) and not any(int(t) in eos for t in b.targets)
        assert len(b.positions) == len(a.positions) - 1           # exactly the end-of-turn position is missing
    results = json.load(open(root / "report" / "eval.json"))
    assert set(results) == {"teacher", "student", "student_no_eos"}
    assert all(r["prompts"] == 12 for r in results.values())
    assert "kl_from_reference" in results["student"] and "kl_from_reference" not in results["teacher"]
    # Rule 1, end to end: from the cache alone the student learns to stop; without the end-of-turn positions the
    # control does not (measured here: 12/12 against 0/12).
    student, control = results["student"]["stop_rate"], results["student_no_eos"]["stop_rate"]
    assert student >= 0.75 and control <= student - 0.5, (student, control)
    report = (root / "report" / "report.md").read_text()
    assert "| student_no_eos |" in report and "lengths.png" in report
    # Rerun reuses everything and says so.
    res = run([sys.executable, "-m", "kdcache", "demo", "--quick", "--backend", "hf", "--root", str(root),
               "--stage", "train"], env, 600)
    assert res.returncode == 0
    assert "reusing the trained teacher" in res.stdout and "nothing to do" in res.stdout
    assert "reusing the trained student" in res.stdout
