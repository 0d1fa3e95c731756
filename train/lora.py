"""LoRA students through PEFT (`kdcache train --lora-r R`): which modules get adapters, the settings a checkpoint
must match, and the two outputs (the merged model, and the adapter as PEFT saves it)."""
import copy
import os

from kdcache.common.errors import ConfigError

PEFT_MIN = (0, 13)
# The attention and MLP projections of Llama, Qwen, Mistral, Gemma, Phi-3 (fused qkv_proj, gate_up_proj) and GPT-2
# style (c_attn, c_proj, c_fc) models: --lora-targets' default, those of them the student has.
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "gate_proj", "up_proj", "down_proj",
                   "gate_up_proj", "c_attn", "c_proj", "c_fc", "query_key_value", "dense", "dense_h_to_4h",
                   "dense_4h_to_h")


def settings(cfg) -> dict | None:
    """The LoRA settings a checkpoint records and a resume must match; None without --lora-r."""
    if not cfg.lora_r:
        return None
    return {"r": int(cfg.lora_r), "alpha": float(cfg.lora_alpha or 2 * cfg.lora_r), "dropout": float(cfg.lora_dropout),
            "targets": cfg.lora_targets or "default"}


def check_peft():
    try:
        import peft
    except ImportError as e:
        raise ConfigError(f"lora_r: LoRA students need PEFT >= {'.'.join(map(str, PEFT_MIN))} (pip install "
                          "'peft>=0.13'); it is not installed") from e
    have = tuple(int(x) for x in peft.__version__.split(".")[:2] if x.isdigit())
    if have < PEFT_MIN:
        raise ConfigError(f"lora_r: LoRA students need PEFT >= {'.'.join(map(str, PEFT_MIN))}; this is "
                          f"{peft.__version__} (pip install -U 'peft>=0.13')")
    return peft


def refuse_adapter_dir(path):
    """A PEFT adapter directory as --student: never silently stack a second adapter on it."""
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "adapter_config.json")):
        raise ConfigError(f"student: {path} is a PEFT adapter (adapter_config.json), not a model. kdcache does not "
                          "stack a second adapter on it: pass the merged model (a kdcache run's OUT/final), or its "
                          "base model with --lora-r to train a new adapter")


def target_modules(model, targets: str):
    """PEFT's target_modules for --lora-targets: 'all-linear', or names (comma-separated) each of which must
    match a module of the model; the default is DEFAULT_TARGETS that the model has. The output head is never a
    target unless named."""
    import torch
    linear = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                     if isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D"})
    head = model.get_output_embeddings()
    head_names = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if m is head}
    if targets == "all-linear":
        return "all-linear"
    if not targets:
        chosen = [n for n in DEFAULT_TARGETS if n in linear and n not in head_names]
        if not chosen:
            raise ConfigError(f"lora_targets: none of the default projections {list(DEFAULT_TARGETS)} is a module of "
                              f"{type(model).__name__}; its linear modules are {linear}: name them, or 'all-linear'")
        return chosen
    names = [t.strip() for t in targets.split(",") if t.strip()]
    missing = [n for n in names if n not in linear]
    if missing:
        raise ConfigError(f"lora_targets: {missing} match no linear module of {type(model).__name__}; its linear "
                          f"modules are {linear}")
    return names


def wrap(model, cfg):
    """The student with LoRA adapters on the chosen modules: only the adapters train."""
    peft = check_peft()
    s = settings(cfg)
    config = peft.LoraConfig(r=s["r"], lora_alpha=s["alpha"], lora_dropout=s["dropout"],
                             target_modules=target_modules(model, cfg.lora_targets), task_type="CAUSAL_LM")
    import torch
    torch.manual_seed(cfg.seed)             # lora_A's random start: the same adapters for the same --seed
    return peft.get_peft_model(model, config)


def counts(model) -> dict:
    """{"trainable": N, "total": M} parameters."""
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"trainable": trainable, "total": total}


def check_resume(saved, want, path):
    """A checkpoint's LoRA settings against this run's: a change is refused by name."""
    if saved == want:
        return
    if saved is None or want is None:
        have = "full fine-tuning" if saved is None else f"LoRA {saved}"
        raise ConfigError(f"lora_r: {path} was saved by a run of {have}; this run asks for "
                          f"{'full fine-tuning' if want is None else f'LoRA {want}'}. Resume with the same "
                          "settings, or start a new --out")
    differ = [f"{k} {saved.get(k)!r} there, {want[k]!r} here" for k in want if saved.get(k) != want[k]]
    raise ConfigError(f"lora: {path} was saved with other LoRA settings ({'; '.join(differ)}). Resume with the same "
                      "--lora-r, --lora-alpha, --lora-dropout and --lora-targets, or start a new --out")


def is_lora(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "merge_and_unload")


def merged(model):
    """A merged copy of a PEFT student (the adapters folded into their weights), for OUT/final: stock
    from_pretrained and generate() load it. The training model itself is left as it is."""
    return copy.deepcopy(model).merge_and_unload()
