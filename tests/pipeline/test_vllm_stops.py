"""vLLM generations stop at the teacher's turn ends and nowhere else, as hf's do: a --generator whose
generation_config names another EOS (a base student's <|endoftext|>) must not stop there on vLLM only."""
import pytest

from kdcache.pipeline.teacher_vllm import stop_only_at

pytestmark = [pytest.mark.vllm]


def test_a_generator_config_eos_adds_no_stop_on_vllm():
    from vllm import SamplingParams
    turn_ends = {7, 3}
    params = SamplingParams(max_tokens=8, **stop_only_at(turn_ends))
    # what vLLM's engine does with every request: the model's generation_config and tokenizer EOS join in
    params.update_from_generation_config({"eos_token_id": [11, 12]}, eos_token_id=11)
    assert sorted(params.stop_token_ids) == [3, 7]
    assert params.eos_token_id is None            # the tokenizer's EOS does not stop it either
    # without ignore_eos, vLLM would have stopped at 11 and 12 too: what the hf generator never does
    plain = SamplingParams(max_tokens=8, stop_token_ids=sorted(turn_ends))
    plain.update_from_generation_config({"eos_token_id": [11, 12]}, eos_token_id=11)
    assert set(plain.stop_token_ids) | {plain.eos_token_id} == {3, 7, 11, 12}
