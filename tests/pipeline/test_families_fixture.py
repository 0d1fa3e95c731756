"""Smoke tests for tests/helpers/families.py: each family's tokenizer, real chat template and tiny model, built
locally. They also pin down what each template does to the shared CHATS (refusals, trimming, think blocks)."""
import json

import jinja2
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kdcache.demo.task import corpus, make_splits
from tests.helpers.families import (
    CHAT,
    CHATS,
    CODE,
    FAMILIES,
    FAMILY_ARCH,
    SPECIALS,
    SYSTEM,
    TEMPLATE_SHA256,
    TEMPLATES,
    corpus_texts,
    expected_refusal,
    family_model,
    family_tokenizer,
    template_sha256,
    tokens_for,
)

WRITES_BOS = {"llama3", "gemma", "mistral"}      # templates that write the BOS text themselves
REFUSED = {                                       # CHATS each template raises on
    "qwen3": set(), "llama3": set(), "chatml": set(),
    "gemma": {"system_one_turn", "system_three_turns", "non_alternating"},
    "mistral": {"non_alternating"},
}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    texts = corpus_texts() + list(corpus(make_splits(60, 0, seed=0)[0]))
    for name in FAMILIES:
        family_tokenizer(name, str(root / name), texts)
    for name in ("llama3", "qwen3"):
        family_tokenizer(name, str(root / f"{name}-base"), texts, base=True)
    return root


def load(built, name):
    return AutoTokenizer.from_pretrained(str(built / name))


def render(tok, name, **kw):
    return tok.apply_chat_template(CHAT[name], tokenize=False, **kw)


def generation_eos_tokens(tok, directory):
    with open(directory / "generation_config.json") as f:
        eos = json.load(f)["eos_token_id"]
    return tok.convert_ids_to_tokens(eos if isinstance(eos, list) else [eos])


@pytest.mark.parametrize("name", FAMILIES)
def test_template_text_unchanged(name):
    assert template_sha256(name) == TEMPLATE_SHA256[name]


@pytest.mark.parametrize("name", FAMILIES)
def test_tokenizer_loads_with_family_specials(built, name):
    tok, spec, roles = load(built, name), SPECIALS[name], tokens_for(name)
    assert tok.chat_template == TEMPLATES[name]
    assert (tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token) == \
        (roles["bos"], roles["eos"], roles["pad"], roles["unk"])
    for t in spec["specials"]:
        assert t in tok.all_special_tokens
        assert len(tok(t, add_special_tokens=False).input_ids) == 1
    for t in spec["added"]:             # added but, as in the real Qwen vocab, not special
        assert t not in tok.all_special_tokens
        assert len(tok(t, add_special_tokens=False).input_ids) == 1
    assert generation_eos_tokens(tok, built / name) == roles["generation_eos"]
    ids = tok("a b", add_special_tokens=True).input_ids    # BOS prepended exactly where the real tokenizer does
    assert (ids[0] == tok.bos_token_id) == spec["add_bos"]
    assert tok("a b", add_special_tokens=False).input_ids == (ids[1:] if spec["add_bos"] else ids)


@pytest.mark.parametrize("name,eos", [("llama3", "<|end_of_text|>"), ("qwen3", "<|endoftext|>")])
def test_base_tokenizer_eos(built, name, eos):
    tok = load(built, f"{name}-base")
    assert tok.eos_token == eos
    assert generation_eos_tokens(tok, built / f"{name}-base") == [eos]


@pytest.mark.parametrize("name", FAMILIES)
def test_chats_render_round_trip_or_refuse(built, name):
    tok = load(built, name)
    markers = [t for t in SPECIALS[name]["specials"] + SPECIALS[name]["added"] if t != tok.unk_token]
    refused = set()
    for chat in CHATS:
        why = expected_refusal(name, chat["messages"])
        if why:
            refused.add(chat["name"])
            with pytest.raises(jinja2.TemplateError, match=why):
                tok.apply_chat_template(chat["messages"], tokenize=False)
            continue
        text = tok.apply_chat_template(chat["messages"], tokenize=False)
        ids = tok(text, add_special_tokens=False).input_ids
        assert tok.decode(ids) == text, chat["name"]
        for m in markers:               # every marker in the text is one token, never split into pieces
            assert ids.count(tok.convert_tokens_to_ids(m)) == text.count(m), (chat["name"], m)
        if name in WRITES_BOS:          # the template's BOS is the only one; add_special_tokens=True doubles it
            assert text.startswith(tok.bos_token) and ids[0] == tok.bos_token_id and ids[1] != tok.bos_token_id
            assert tok(text).input_ids[:2] == [tok.bos_token_id] * 2
        else:
            assert tok(text).input_ids == ids
    assert refused == REFUSED[name]


def test_qwen3_think_blocks_and_last_turn_stripping(built):
    tok = load(built, "qwen3")
    assert render(tok, "one_turn").endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nsql<|im_end|>\n")
    assert "<think>\nThe posting asks for containers and queries.\n</think>\n\ndocker, sql<|im_end|>" in \
        render(tok, "think_answer")
    two = render(tok, "think_two_turns")          # reasoning of turns before the last user message is dropped
    assert "First reasoning" not in two and "<|im_start|>assistant\nexcel<|im_end|>" in two
    assert "<think>\nSecond reasoning.\n</think>\n\nspark<|im_end|>" in two
    mixed = render(tok, "code_then_newline")      # earlier turn verbatim, last turn's leading newline stripped
    assert f"<|im_start|>assistant\n{CODE}<|im_end|>" in mixed
    assert mixed.endswith("</think>\n\nDone.<|im_end|>\n")
    assert render(tok, "newline_answer").endswith("</think>\n\nThe skills are python and sql.<|im_end|>\n")
    prompt = tok.apply_chat_template(CHAT["one_turn"][:1], tokenize=False, add_generation_prompt=True,
                                     enable_thinking=False)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_llama3_date_header_and_trimming(built):
    tok = load(built, "llama3")
    text = render(tok, "spaces_answer")
    assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: "
                           "December 2023\nToday Date: 26 Jul 2024\n\n<|eot_id|>")
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\naws, linux<|eot_id|>")
    assert render(tok, "code_answer").endswith("<|end_header_id|>\n\ndef f():\n        return 1<|eot_id|>")
    assert f"Today Date: 26 Jul 2024\n\n{SYSTEM['content']}<|eot_id|>" in render(tok, "system_one_turn")


def test_gemma_model_role_and_trimming(built):
    tok = load(built, "gemma")
    assert render(tok, "one_turn") == ("<bos><start_of_turn>user\nList the skills: write joins over tables."
                                       "<end_of_turn>\n<start_of_turn>model\nsql<end_of_turn>\n")
    assert render(tok, "code_answer").endswith("<start_of_turn>model\ndef f():\n        return 1<end_of_turn>\n")


def test_mistral_system_prompt_only_in_a_final_user_turn(built):
    tok = load(built, "mistral")
    assert render(tok, "one_turn") == "<s>[INST] List the skills: write joins over tables.[/INST] sql</s>"
    full = render(tok, "system_one_turn")         # ends with the assistant turn: the system prompt is dropped
    assert SYSTEM["content"] not in full
    assert full == "<s>[INST] List the skills: containerize the services.[/INST] docker</s>"
    prompt = tok.apply_chat_template(CHAT["system_one_turn"][:-1], tokenize=False, add_generation_prompt=True)
    assert prompt == f"<s>[INST] {SYSTEM['content']}\n\nList the skills: containerize the services.[/INST]"
    assert render(tok, "spaces_answer").endswith("[/INST] aws, linux</s>")


def test_chatml_default_system_and_verbatim_content(built):
    tok = load(built, "chatml")
    default = "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
    assert render(tok, "one_turn").startswith(default)
    assert not render(tok, "system_one_turn").startswith(default)
    assert render(tok, "code_answer").endswith(f"<|im_start|>assistant\n{CODE}<|im_end|>\n")


@pytest.mark.parametrize("name", FAMILIES)
def test_family_model_builds_and_runs(built, name, tmp_path):
    tok = load(built, name)
    out = tmp_path / "model"
    model = family_model(tok, str(out), arch=FAMILY_ARCH[name])
    ids = tok(render(tok, "two_turns"), add_special_tokens=False).input_ids
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), len(tok)) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    if name == "gemma":                           # final_logit_softcapping=30
        assert logits.abs().max() <= 30.0
    assert model.config.hidden_size == 64 and model.config.num_hidden_layers == 2
    assert model.config.head_dim >= 32 and model.config.max_position_embeddings == 512
    reloaded = AutoModelForCausalLM.from_pretrained(str(out))
    assert type(reloaded).__name__ == type(model).__name__
    assert AutoTokenizer.from_pretrained(str(out)).chat_template == TEMPLATES[name]
    assert generation_eos_tokens(tok, out) == tokens_for(name)["generation_eos"]
