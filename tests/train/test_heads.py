"""The loss is the loss of the logits the model returns: soft-capped (Gemma 2), scaled (Cohere, Granite) or not."""
import pytest
import torch

from kdcache.common.heads import logit_transform
from kdcache.train.batch import collate
from kdcache.train.losses import LossConfig, kd_loss_from_logits
from kdcache.train.model import DistillModule
from tests.helpers.records import make_records

V = 300
COMMON = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, max_position_embeddings=128)


def tiny(arch):
    import transformers as tf
    torch.manual_seed(0)
    config = {
        "qwen2": lambda: tf.Qwen2Config(**COMMON),
        "gemma2": lambda: tf.Gemma2Config(**COMMON, head_dim=32, final_logit_softcapping=2.0),
        "cohere": lambda: tf.CohereConfig(**COMMON, logit_scale=0.25),
        "granite": lambda: tf.GraniteConfig(**COMMON, logits_scaling=4.0),
    }[arch]()
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():                                  # larger logits, so that a cap or a scale matters
        model.get_output_embeddings().weight.mul_(30.0)
    return model.eval()


@pytest.mark.parametrize("arch", ["qwen2", "gemma2", "cohere", "granite"])
@pytest.mark.parametrize("chunked", [True, False])
def test_the_loss_is_that_of_the_models_own_logits(arch, chunked):
    model = tiny(arch)
    assert (logit_transform(model.config) is None) == (arch == "qwen2")
    cfg = LossConfig(beta=0.5, sft_alpha=0.2, chunk_size=7)
    b = collate(make_records(4, seed=8, vocab=V, min_len=8, max_len=30), pad_id=0, student_vocab=V)
    loss, _ = DistillModule(model, cfg, chunked=chunked)(b)
    grad = torch.autograd.grad(loss, model.model.layers[0].mlp.up_proj.weight)[0]
    out = model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits      # what the model returns
    want, _ = kd_loss_from_logits(out[b.batch_index, b.positions], b.topk_ids, b.topk_logprobs, b.tail_mass,
                                  b.targets, cfg)
    want_grad = torch.autograd.grad(want, model.model.layers[0].mlp.up_proj.weight)[0]
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, want_grad, rtol=1e-4, atol=1e-6)
    if arch != "qwen2":                                    # and the bare head would have given another loss
        bare = model.get_output_embeddings()(model.model(input_ids=b.input_ids,
                                                         attention_mask=b.attention_mask).last_hidden_state)
        wrong, _ = kd_loss_from_logits(bare[b.batch_index, b.positions], b.topk_ids, b.topk_logprobs, b.tail_mass,
                                       b.targets, cfg)
        assert abs(float(wrong) - float(want)) > 1e-2 * abs(float(want))


@pytest.mark.parametrize("arch", ["qwen2", "gemma2", "granite"])
def test_the_hf_teacher_stores_the_log_probs_of_the_models_own_logits(arch, tmp_path):
    from kdcache.pipeline.teacher_hf import HFTeacher
    model = tiny(arch)
    model.save_pretrained(tmp_path)
    teacher = HFTeacher(str(tmp_path), dtype="float32", device="cpu")
    ids = torch.randint(3, V, (20,), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(4, 19)
    (top_ids, top_lp, target_lp), = teacher.score([ids.numpy().astype("int32")], [pos.numpy().astype("int32")], 8)
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=ids[None]).logits[0, pos].float(), -1)
    want_lp, want_ids = lp.topk(8, -1)
    torch.testing.assert_close(torch.from_numpy(top_lp), want_lp, rtol=1e-5, atol=1e-5)
    want_target = lp.gather(1, ids[pos + 1, None])[:, 0]
    torch.testing.assert_close(torch.from_numpy(target_lp), want_target, rtol=1e-5, atol=1e-5)
    assert (torch.from_numpy(top_ids).long() == want_ids).float().mean() > 0.95      # ties may swap ranks


def unknown_head(arch):
    """Real architectures whose logit scaling the table does not know (issue 23, item 2): Falcon-H1 multiplies by
    lm_head_multiplier; HyperCLOVA X multiplies by the logits_scaling that Granite divides by."""
    import transformers as tf
    torch.manual_seed(0)
    config = {
        "falcon_h1": lambda: tf.FalconH1Config(**COMMON, mamba_d_ssm=64, mamba_n_heads=2, mamba_d_head=32,
                                               mamba_d_state=16, mamba_chunk_size=16, lm_head_multiplier=0.25),
        "hyperclovax": lambda: tf.HyperCLOVAXConfig(**COMMON, logits_scaling=4.0),
    }[arch]()
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(30.0)
    return model


@pytest.mark.parametrize("arch", ["falcon_h1", "hyperclovax"])
@pytest.mark.parametrize("chunked", [True, False])
def test_a_head_the_table_gets_wrong_falls_back_to_the_models_own_logits(arch, chunked):
    from kdcache.common.heads import check_head
    model = unknown_head(arch)
    assert check_head(model, logit_transform(model.config)) is not None          # the table alone is wrong here
    cfg = LossConfig(beta=0.5, sft_alpha=0.2, chunk_size=7)
    b = collate(make_records(4, seed=8, vocab=V, min_len=8, max_len=30), pad_id=0, student_vocab=V)
    module = DistillModule(model, cfg, chunked=chunked)
    assert module.own_forward and model.training                 # the probe left the model as it found it
    model.eval()
    loss, _ = module(b)
    out = model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits
    want, _ = kd_loss_from_logits(out[b.batch_index, b.positions], b.topk_ids, b.topk_logprobs, b.tail_mass,
                                  b.targets, cfg)
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["qwen2", "gemma2", "cohere", "granite"])
def test_a_known_head_keeps_the_fused_path(arch):
    from kdcache.common.heads import check_head
    model = tiny(arch)
    assert check_head(model, logit_transform(model.config)) is None
    assert not DistillModule(model, LossConfig()).own_forward


@pytest.mark.parametrize("arch", ["falcon_h1", "hyperclovax"])
def test_the_hf_teacher_stores_the_log_probs_of_an_unknown_head(arch, tmp_path):
    from kdcache.pipeline.teacher_hf import HFTeacher
    model = unknown_head(arch).eval()
    model.save_pretrained(tmp_path)
    teacher = HFTeacher(str(tmp_path), dtype="float32", device="cpu")
    assert teacher.own_forward
    ids = torch.randint(3, V, (20,), generator=torch.Generator().manual_seed(1))
    pos = list(range(5, 19))
    (scored,) = teacher.score([ids.numpy()], [pos], 8)
    with torch.no_grad():
        lp = torch.log_softmax(teacher.model(input_ids=ids[None]).logits[0, pos].float(), -1)
    top_lp, top_ids = lp.topk(8, -1)
    assert (scored.ids == top_ids.numpy()).all()
    torch.testing.assert_close(torch.from_numpy(scored.logprobs), top_lp, rtol=1e-5, atol=1e-5)
