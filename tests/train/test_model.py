"""The distillation forward: packing equals padding, and the student loss path matches the definitions."""
import dataclasses

import numpy as np
import pytest
import torch

from kdcache.train.batch import collate, pack_rows
from kdcache.train.losses import LossConfig
from kdcache.train.model import DistillModule
from tests.helpers.records import make_records

ARCHS = {   # transformers finds packed rows by attention implementation: Gemma 2 runs eager (its soft-capping)
    "qwen2": ("Qwen2", {}),
    "llama": ("Llama", {}),
    "mistral": ("Mistral", {"sliding_window": None}),
    "gemma2": ("Gemma2", {"final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0,
                          "query_pre_attn_scalar": 32, "sliding_window": 256, "_attn": "eager"}),
}


@pytest.fixture(scope="module", params=list(ARCHS))
def student(request):
    import transformers
    name, extra = ARCHS[request.param]
    extra = dict(extra)
    attn = extra.pop("_attn", None)
    torch.manual_seed(0)
    cfg = getattr(transformers, name + "Config")(vocab_size=300, hidden_size=64, intermediate_size=128,
                                                 num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                                 head_dim=32, max_position_embeddings=256, **extra)
    if attn:
        cfg._attn_implementation = attn
    return getattr(transformers, name + "ForCausalLM")(cfg).eval()


def test_pack_rows_first_fit():
    place, used = pack_rows([5, 3, 4, 2, 9], 8)
    assert place == [(0, 0), (0, 5), (1, 0), (1, 4), (2, 0)] and used == [8, 6, 9]


def test_packed_layout_restarts_positions():
    """Each packed row's position_ids are arange(len(sample)) for every sample in it, in order (the padding after
    the last one a segment of its own), so no sample's positions run on from the one before it."""
    recs = make_records(5, seed=2, min_len=6, max_len=20)
    b = collate(recs, pad_id=0, student_vocab=300, pack_len=40)
    assert b.attention_mask is None and b.input_ids.shape[0] < 5
    ids, pos_ids = b.input_ids.numpy(), b.position_ids.numpy()
    place, _ = pack_rows([len(r.input_ids) for r in recs], 40)
    rows = [[r for r, (row, _) in zip(recs, place) if row == i] for i in range(ids.shape[0])]
    assert max(map(len, rows)) >= 2                                     # some row holds more than one sample
    for i, row in enumerate(rows):
        used = sum(len(r.input_ids) for r in row)
        np.testing.assert_array_equal(ids[i, :used], np.concatenate([r.input_ids for r in row]))
        want = np.concatenate([np.arange(len(r.input_ids)) for r in row] + [np.arange(ids.shape[1] - used)])
        np.testing.assert_array_equal(pos_ids[i], want)
    # every target is still the next token of its own sample
    want = np.concatenate([r.targets for r in recs])
    np.testing.assert_array_equal(b.targets.numpy(), want)


@pytest.mark.parametrize("cfg", [LossConfig(beta=0.0), LossConfig(beta=0.5, tail="renorm", sft_alpha=0.3)])
def test_packing_gives_the_same_loss_and_gradients_as_padding(student, cfg):
    recs = make_records(6, seed=4, min_len=6, max_len=30)
    module = DistillModule(student, cfg)
    padded = collate(recs, pad_id=0, student_vocab=300)
    packed = collate(recs, pad_id=0, student_vocab=300, pack_len=64)
    assert packed.input_ids.shape[0] < padded.input_ids.shape[0]
    grads = []
    for batch in (padded, packed):
        student.zero_grad()
        loss, parts = module(batch)
        loss.backward()
        grads.append((float(loss.detach()), student.get_input_embeddings().weight.grad.clone()))
    (l1, g1), (l2, g2) = grads
    assert abs(l1 - l2) < 1e-4 * max(1.0, abs(l1))
    torch.testing.assert_close(g1, g2, atol=1e-5, rtol=1e-4)


def test_packing_without_isolation_would_differ(student):
    """The check above can fail: the same rows with one causal mask over the whole row differ."""
    recs = make_records(6, seed=4, min_len=6, max_len=30)
    module = DistillModule(student, LossConfig())
    padded = collate(recs, pad_id=0, student_vocab=300)
    packed = collate(recs, pad_id=0, student_vocab=300, pack_len=64)
    leaky = dataclasses.replace(packed, position_ids=None)               # positions run on across samples: no isolation
    with torch.no_grad():
        a = float(module(padded)[0])
        b = float(module(leaky)[0])
    assert abs(a - b) > 1e-3
