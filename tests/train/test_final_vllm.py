"""A base student's final/ stops at the teacher's end-of-turn under vLLM too (rule 1 at inference)."""
import json
import subprocess
import sys

import pytest
import torch

from tests.helpers.cli import user_project

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SCRIPT = """
import json, os, sys
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# The engine in this process (what is checked is its stop, not its layout): a spawned engine imports vLLM again,
# 25-30 CPU-s of this test here. vLLM's default layout runs in tests/pipeline/test_vllm.py and under `vllm serve`.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
from vllm import LLM, SamplingParams
if __name__ == "__main__":
    path, allowed = sys.argv[1], json.loads(sys.argv[2])
    llm = LLM(model=path, dtype="float32", max_model_len=256, enforce_eager=True)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}],
                       SamplingParams(max_tokens=8, temperature=0, allowed_token_ids=allowed))
    print("TOKENS", json.dumps(list(out[0].outputs[0].token_ids)))
"""


def test_vllm_stops_a_base_students_final_at_the_end_of_turn(tiny, tmp_path):
    import copy

    import vllm  # noqa: F401  (`make setup` installs vllm-cpu: a broken vLLM fails here, never skips)

    from kdcache.demo.models import make_model
    from kdcache.train.final import stops_like_the_teacher
    tok = copy.deepcopy(tiny["tok"])
    tok.eos_token, tok.chat_template = "<|endoftext|>", None              # a base student's tokenizer
    model = make_model(tok, "test", seed=3)                               # its generation config stops at EOS only
    with torch.no_grad():
        model.model.norm.weight.zero_()                                   # every logit 0: greedy takes the lowest id
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    other = im_end + 40
    manifest = {"eos_token_ids": [im_end], "meta": {"chat_template": tiny["tok"].chat_template}}
    stops_like_the_teacher(model, tok, manifest)
    model.save_pretrained(tmp_path / "final")
    tok.save_pretrained(tmp_path / "final")
    assert json.load(open(tmp_path / "final" / "generation_config.json"))["eos_token_id"] == [im_end]
    script = tmp_path / "gen.py"
    script.write_text(SCRIPT)
    res = subprocess.run([sys.executable, str(script), str(tmp_path / "final"), json.dumps([im_end, other])],
                         cwd=user_project(), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    tokens = json.loads(res.stdout.split("TOKENS", 1)[1].splitlines()[0])
    assert tokens == [im_end]            # emitted <|im_end|> and stopped (a base config would emit it 8 times)
