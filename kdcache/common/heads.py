"""What a model's *ForCausalLM.forward does to lm_head's output before it returns logits.

The student's loss and the teacher's stored log-probs must be those of the logits the model really
produces (and a saved student produces at inference), not of the bare lm_head. Read from the config:
  Cohere          logits * logit_scale              (CohereForCausalLM)
  Granite         logits / logits_scaling           (GraniteForCausalLM)
  Gemma 2, 3      tanh(logits / cap) * cap          (final_logit_softcapping)
applied in that order. Architectures without these keys (Qwen, Llama, Mistral) get None: no extra work.
"""


def logit_transform(config):
    """f(logits) -> logits as the model returns them, or None when lm_head's output is returned as is."""
    cfg = getattr(config, "text_config", None) or config            # multimodal configs nest the text model
    scale = getattr(cfg, "logit_scale", None)
    divide = getattr(cfg, "logits_scaling", None)
    cap = getattr(cfg, "final_logit_softcapping", None)
    scale = None if scale in (None, 1, 1.0) else float(scale)
    divide = None if divide in (None, 1, 1.0) else float(divide)
    cap = float(cap) if cap else None
    if scale is None and divide is None and cap is None:
        return None

    def transform(logits):
        if scale is not None:
            logits = logits * scale
        if divide is not None:
            logits = logits / divide
        if cap is not None:
            import torch
            logits = torch.tanh(logits / cap) * cap
        return logits

    transform.description = ", ".join(x for x in (scale and f"x{scale:g}", divide and f"/{divide:g}",
                                                  cap and f"softcap {cap:g}") if x)
    return transform
