"""`kdcache eval`'s measures on models whose answers are known: one that always ends at once, one that never
ends, and two copies of one model."""
import json

import pytest
import torch

from kdcache.train.eval import evaluate
from tests.helpers.cli import write_jsonl

DIM = 0


def fixed_model(tok, out_dir, emit):
    """A tiny model whose greedy choice is `emit` at every step: every input embedding gets a large value on one
    dimension (so the normed hidden state is large and positive there), and only `emit`'s row of an untied head
    reads it."""
    from kdcache.demo.models import make_model, save
    model = make_model(tok, "test", seed=1)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, DIM] += 50.0
        head = torch.zeros_like(model.model.embed_tokens.weight)
        head[emit, DIM] = 10.0
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(head)
    return save(model, tok, str(out_dir))


@pytest.fixture(scope="module")
def models(tiny, tmp_path_factory):
    tok, d = tiny["tok"], tmp_path_factory.mktemp("eval")
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.eos_token_id == end                      # what generation_config stops on
    word = tok.convert_tokens_to_ids(tok.tokenize("docker")[0])
    return {"ends": fixed_model(tok, d / "ends", end), "never": fixed_model(tok, d / "never", word),
            "data": write_jsonl(d / "heldout.jsonl", tiny["heldout"][:5]), "tok": tok, "word": word}


def test_stop_rate_length_and_kl_of_models_whose_answers_are_known(models):
    res = evaluate({"ends": models["ends"], "never": models["never"], "same": models["ends"]}, models["data"],
                   reference="ends", max_new_tokens=6)
    ends, never, same = res["ends"], res["never"], res["same"]
    assert ends["prompts"] == never["prompts"] == 5
    assert ends["stop_rate"] == 1.0 and ends["lengths"] == [1] * 5 and ends["answers"] == [""] * 5
    assert never["stop_rate"] == 0.0 and never["lengths"] == [6] * 5 and never["max_length"] == 6
    assert never["exact_match"] == 0.0
    assert never["answers"] == [models["tok"].decode([models["word"]] * 6).strip()] * 5        # what it was made to say
    assert same["kl_from_reference"] == pytest.approx(0.0, abs=1e-9)              # a model against itself
    assert never["kl_from_reference"] > 10                                     # every answer token far apart
    assert "kl_from_reference" not in ends
    json.dumps(res)                                                            # eval.json can hold it


def test_the_kl_is_a_mean_per_answer_token(models, tmp_path):
    """One held-out chat five times over gives the KL of that chat once: a mean per token, not a total."""
    from tests.helpers.cli import write_jsonl as write
    chat = open(models["data"]).readline()
    one, five = write(tmp_path / "one.jsonl", [chat.strip()]), write(tmp_path / "five.jsonl", [chat.strip()] * 5)
    pair = {"ends": models["ends"], "never": models["never"]}
    kl1 = evaluate(pair, one, reference="ends", max_new_tokens=2)["never"]["kl_from_reference"]
    kl5 = evaluate(pair, five, reference="ends", max_new_tokens=2)["never"]["kl_from_reference"]
    assert kl1 > 10 and kl5 == pytest.approx(kl1, rel=1e-6)


def test_the_onpolicy_kl_is_on_the_models_own_completions(models, tiny):
    """KL(model || reference) per token at the positions of the model's own greedy completion: 0 for a copy of
    the reference; for the model that never stops, its six tokens against the reference that always stops,
    equal to the figure worked out here from both models' forward passes."""
    from transformers import AutoModelForCausalLM
    res = evaluate({"ends": models["ends"], "never": models["never"], "same": models["ends"]}, models["data"],
                   reference="ends", max_new_tokens=6)
    assert res["same"]["onpolicy_kl"] == pytest.approx(0.0, abs=1e-9)
    tok = models["tok"]
    never, ends = (AutoModelForCausalLM.from_pretrained(models[m], dtype=torch.float32) for m in ("never", "ends"))
    total, n = 0.0, 0
    for row in tiny["heldout"][:5]:
        head = tok(tok.apply_chat_template(row["messages"][:-1], tokenize=False, add_generation_prompt=True),
                   add_special_tokens=False)["input_ids"]
        x = torch.tensor([head + [models["word"]] * 6])
        with torch.no_grad():
            a, b = (torch.log_softmax(m(x).logits[0, len(head) - 1:len(head) + 5], -1) for m in (never, ends))
        total += float((a.exp() * (a - b)).sum())
        n += 6
    assert res["never"]["onpolicy_kl"] == pytest.approx(total / n, rel=1e-5)
    assert res["never"]["onpolicy_kl"] > 10
    assert "onpolicy_kl" not in res["ends"]
