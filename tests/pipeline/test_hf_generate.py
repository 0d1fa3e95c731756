"""The hf backend decodes prompts together (left padding, a KV cache, one generator per sample): a sample's
completion and log-probs must not depend on the batch it fell in."""
import numpy as np
import pytest
import torch

from kdcache.pipeline.teacher_hf import HFTeacher


def prompts(tiny, first=0):
    """Seven demo prompts as the template renders them (generate mode's prompts), of other lengths: in one batch,
    most rows are padded."""
    from kdcache.common.chat import render
    tok = tiny["tok"]
    out = [np.array(tok(render(tok, r["messages"][:-1], gen_prompt=True), add_special_tokens=False)["input_ids"])
           for r in tiny["train"][first:first + 7]]
    assert len({len(p) for p in out}) > 2
    return out


@pytest.fixture(scope="module")
def end(tiny):
    return tiny["tok"].convert_tokens_to_ids("<|im_end|>")


def test_greedy_batches_equal_transformers_generate_one_prompt_at_a_time(tiny, stopping, end):
    """The greedy stopping teacher ends some completions at once and runs others to the budget, so rows of one
    batch finish at different steps; each equals transformers' own generate() on that prompt alone."""
    model = HFTeacher(stopping["greedy"], dtype="float32")
    ps = prompts(tiny)
    budgets = [12, 12, 4, 12, 12, 7, 12]
    out = model.generate(ps, max_new_tokens=budgets, temperature=0.0, top_p=1.0, seeds=[0] * len(ps),
                         turn_ends={end})
    for p, budget, (new, ended) in zip(ps, budgets, out):
        with torch.no_grad():
            ref = model.model.generate(torch.tensor([p.tolist()]), attention_mask=torch.ones(1, len(p),
                                                                                             dtype=torch.long),
                                       do_sample=False, max_new_tokens=budget, eos_token_id=end, pad_token_id=end)
        want = ref[0, len(p):].tolist()
        assert new == want and ended == (want[-1] == end)
        assert len(new) <= budget
    lengths = {len(new) for new, _ in out}
    assert any(ended for _, ended in out) and not all(ended for _, ended in out), out
    assert len(lengths) > 1                                                  # ragged: rows stopped apart


def test_sampled_rows_do_not_depend_on_their_batch_and_logprobs_are_what_they_were_drawn_with(tiny, stopping, end):
    """Temperature 0.8: the batch of seven equals seven batches of one, token for token (each sample's own seed),
    the split by batch_tokens changes nothing, and each log-prob is the log-softmax at 0.8 of a full forward pass
    over prompt + completion (no KV cache). With top-p 0.9 too, batched equals alone."""
    model = HFTeacher(stopping["sampled"], dtype="float32")
    ps = prompts(tiny, first=7)
    seeds = [11, 12, 13, 14, 15, 16, 17]
    args = dict(max_new_tokens=[10] * len(ps), temperature=0.8, top_p=1.0, seeds=seeds, turn_ends={end},
                logprobs=True)
    together = model.generate(ps, **args)
    alone = [model.generate([p], **dict(args, max_new_tokens=[10], seeds=[s]))[0] for p, s in zip(ps, seeds)]
    model.batch_tokens = 40                                                  # two or three prompts per batch
    split = model.generate(ps, **args)
    for (new, ended, lps), a, b in zip(together, alone, split):
        assert new == a[0] == b[0] and ended == a[1] == b[1]
        np.testing.assert_allclose(lps, a[2], atol=1e-5)
        np.testing.assert_allclose(lps, b[2], atol=1e-5)
    assert any(e for _, e, _ in together) and not all(e for _, e, _ in together)
    for p, (new, _, lps) in zip(ps, together):
        ids = torch.tensor([p.tolist() + new])
        with torch.no_grad():
            logits = model.model(input_ids=ids).logits[0].float()
        pos = torch.arange(len(p) - 1, len(p) - 1 + len(new))
        want = torch.log_softmax(logits[pos] / 0.8, dim=-1)[torch.arange(len(new)), torch.tensor(new)]
        np.testing.assert_allclose(lps, want.numpy(), atol=2e-5)
    model.batch_tokens = 8192
    top_p = dict(args, top_p=0.9)
    together = model.generate(ps, **top_p)
    for (new, _, lps), p, s in zip(together, ps, seeds):
        a = model.generate([p], **dict(top_p, max_new_tokens=[10], seeds=[s]))[0]
        assert new == a[0]
        np.testing.assert_allclose(lps, a[2], atol=1e-5)


@pytest.mark.parametrize("family", ["gemma", "llama3"])
def test_batches_equal_transformers_generate_on_other_families(family, tmp_path):
    """Gemma 2 (eager attention, soft-capped logits, sliding window) and Llama 3 (three stop ids), the templates'
    own prompts of other lengths: greedy batches equal transformers' generate() on each prompt alone, and sampled
    rows equal themselves decoded alone."""
    from kdcache.common.chat import render
    from tests.helpers.families import (
        CHATS,
        FAMILY_ARCH,
        corpus_texts,
        expected_refusal,
        family_model,
        family_tokenizer,
    )
    tok = family_tokenizer(family, str(tmp_path / "tok"), corpus_texts())
    family_model(tok, str(tmp_path / "m"), arch=FAMILY_ARCH[family])
    model = HFTeacher(str(tmp_path / "m"), dtype="float32")
    chats = [c["messages"] for c in CHATS if not expected_refusal(family, c["messages"])][:5]
    ps = [np.array(tok(render(tok, m[:-1], gen_prompt=True), add_special_tokens=False)["input_ids"]) for m in chats]
    assert len({len(p) for p in ps}) > 2
    ends = set(np.atleast_1d(model.model.generation_config.eos_token_id).tolist())
    out = model.generate(ps, max_new_tokens=[8] * len(ps), temperature=0.0, top_p=1.0, seeds=[0] * len(ps),
                         turn_ends=ends)
    for p, (new, ended) in zip(ps, out):
        with torch.no_grad():
            ref = model.model.generate(torch.tensor([p.tolist()]), attention_mask=torch.ones(1, len(p),
                                                                                             dtype=torch.long),
                                       do_sample=False, max_new_tokens=8, eos_token_id=sorted(ends),
                                       pad_token_id=sorted(ends)[0])
        assert new == ref[0, len(p):].tolist() and ended == (new[-1] in ends)
    args = dict(max_new_tokens=[8] * len(ps), temperature=1.0, top_p=1.0, seeds=list(range(len(ps))),
                turn_ends=ends, logprobs=True)
    together = model.generate(ps, **args)
    for i, (p, (new, _, lps)) in enumerate(zip(ps, together)):
        a = model.generate([p], **dict(args, max_new_tokens=[8], seeds=[i]))[0]
        assert new == a[0]
        np.testing.assert_allclose(lps, a[2], atol=1e-5)
