"""What identifies a tokenizer for token-exact distillation.

Duck-typed (any object with the Hugging Face tokenizer methods used below), so
cache_format stays free of transformers. The precompute job stores this in
the manifest (`meta.tokenizer`); the trainer recomputes it from the student's
tokenizer and refuses a mismatch, naming what differs.
"""
from .fingerprint import hash_json


def tokenizer_identity(tok) -> dict:
    vocab = tok.get_vocab()                                  # token string -> id
    specials = {}
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = getattr(tok, name, None)
        specials[name] = None if value is None else [str(value), int(tok.convert_tokens_to_ids(str(value)))]
    added = sorted([str(t), int(tok.convert_tokens_to_ids(str(t)))] for t in tok.all_special_tokens)
    template = getattr(tok, "chat_template", None)
    return {
        "vocab_size": len(vocab),
        "vocab_sha256": hash_json(sorted([str(t), int(i)] for t, i in vocab.items())),
        "special_tokens": specials,
        "all_special_tokens": added,
        "chat_template_sha256": hash_json(template if isinstance(template, str) else None),
    }


def diff_identity(cache_id: dict, other_id: dict) -> list:
    """Human-readable differences that break token-exactness (chat template excluded)."""
    out = []
    if cache_id["vocab_size"] != other_id["vocab_size"]:
        out.append(f"vocabulary size {cache_id['vocab_size']} in the cache, {other_id['vocab_size']} here")
    elif cache_id["vocab_sha256"] != other_id["vocab_sha256"]:
        out.append("vocabulary (same size, different token strings or ids)")
    for name, want in cache_id["special_tokens"].items():
        got = other_id["special_tokens"].get(name)
        if want != got and want is not None:
            out.append(f"{name}: {want} in the cache, {got} here")
    if cache_id["all_special_tokens"] != other_id["all_special_tokens"] and not out:
        here = {tuple(t) for t in other_id["all_special_tokens"]}
        missing = {tuple(t) for t in cache_id["all_special_tokens"]} - here
        out.append(f"special tokens differ (cache has {sorted(missing)[:5]} not found here)")
    return out
