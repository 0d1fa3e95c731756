"""Small Qwen2-family models built from a config (no hub), for the demo and the tests."""
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

# vLLM's CPU attention needs head_dim >= 32.
SIZES = {
    "test":    dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                    num_key_value_heads=1),
    "student": dict(hidden_size=96, intermediate_size=256, num_hidden_layers=2, num_attention_heads=3,
                    num_key_value_heads=1),
    "teacher": dict(hidden_size=192, intermediate_size=512, num_hidden_layers=3, num_attention_heads=6,
                    num_key_value_heads=2),
}


def make_model(tok, size="test", seed=0, max_positions=512):
    """A freshly initialised Qwen2ForCausalLM sized for `tok` (float32)."""
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=len(tok), max_position_embeddings=max_positions, tie_word_embeddings=True,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, torch_dtype="float32", **SIZES[size])
    model = Qwen2ForCausalLM(cfg)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    return model


def save(model, tok, out_dir):
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    return out_dir
