"""What a model's *ForCausalLM.forward does to lm_head's output before it returns logits.

The student's loss and the teacher's stored log-probs must be those of the logits the model really
produces (and a saved student produces at inference), not of the bare lm_head. Read from the config:
  Cohere          logits * logit_scale              (CohereForCausalLM)
  Granite         logits / logits_scaling           (GraniteForCausalLM)
  Gemma 2, 3      tanh(logits / cap) * cap          (final_logit_softcapping)
applied in that order. Architectures without these keys (Qwen, Llama, Mistral) get None: no extra work.
The table is only the fast path: check_head asks the model itself once at load time, and where lm_head plus
the table's transform is not what its forward returns, the caller uses the model's own forward.
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

    def grad_in_place(z, dz):
        """dL/dlogits from dL/dz, z = transform(logits), in closed form: dz * d/dlogits; z is overwritten."""
        if cap is not None:                                      # d(cap tanh(y / cap))/dy = 1 - (z / cap)^2
            dz.mul_(z.div_(cap).square_().neg_().add_(1.0))
        factor = (scale or 1.0) / (divide or 1.0)
        return dz.mul_(factor) if factor != 1.0 else dz

    transform.grad_in_place = grad_in_place
    transform.description = ", ".join(x for x in (scale and f"x{scale:g}", divide and f"/{divide:g}",
                                                  cap and f"softcap {cap:g}") if x)
    return transform


def decoder_of(model):
    """The model's decoder stack (what lm_head reads), or None where it cannot be told."""
    if hasattr(model, "get_decoder"):
        try:
            return model.get_decoder()
        except (AttributeError, NotImplementedError):
            pass
    return getattr(model, "model", None)


def check_head(model, transform, probe_len=12):
    """Whether lm_head + transform (the table above, the fast path) gives `model(x).logits` on a probe batch.

    A table misses the next architecture (Falcon-H1's lm_head_multiplier; HyperCLOVA X multiplies by the
    logits_scaling Granite divides by), so callers ask the model once at load time: where this returns a reason
    (not None) they take the model's own forward instead. Returns None when the fused path agrees."""
    import torch
    decoder, head = decoder_of(model), model.get_output_embeddings()
    if decoder is None or head is None:
        return "the model has no separate decoder and lm_head"
    vocab = head.weight.shape[0]
    device = head.weight.device
    ids = (torch.arange(probe_len, device=device) * 7919 + 3) % vocab     # a fixed, spread-out probe
    training = model.training
    model.eval()                        # no dropout: both paths must see the same weights and nothing random
    try:
        with torch.no_grad():
            own = model(input_ids=ids[None], use_cache=False).logits[0].float()
            fused = head(decoder(input_ids=ids[None], use_cache=False).last_hidden_state)[0].float()
            if transform is not None:
                fused = transform(fused)
    except Exception as e:              # an architecture whose pieces do not run apart: use its own forward
        return f"its decoder and lm_head do not run apart ({type(e).__name__}: {e})"
    finally:
        model.train(training)
    own, fused = own[:, :vocab], fused[:, :own.shape[1]]
    tol = (1e-2 if head.weight.dtype in (torch.bfloat16, torch.float16) else 1e-4) * (1.0 + float(own.abs().max()))
    err = float((own - fused).abs().max())
    if err > tol:
        what = getattr(transform, "description", None) or "no transform"
        return (f"lm_head + ({what}) differs from {type(model).__name__}(x).logits by up to {err:.3g} on a probe "
                "(an architecture that scales or caps its logits in a way kdcache's table does not know)")
    return None
