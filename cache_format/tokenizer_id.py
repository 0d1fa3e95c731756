"""What identifies a tokenizer for token-exact distillation.

Duck-typed (any object with the Hugging Face tokenizer methods used below), so
cache_format stays free of transformers. The precompute job stores this in
the manifest (`meta.tokenizer`); the trainer recomputes it from the student's
tokenizer and refuses a mismatch, naming what differs.
"""
import json

from .fingerprint import hash_json

# Settings Hugging Face sets on the backend tokenizer at call time (truncation=..., padding=...) stay in its
# serialisation afterwards; the decoder only maps ids back to text. None of them changes which ids a text gets.
NOT_IDENTITY = ("truncation", "padding", "decoder")


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
        "tokenizer_json_sha256": _backend_sha256(tok),
    }


def _backend_sha256(tok):
    """sha256 of a fast tokenizer's full tokenizer.json (model with merges, normalizer, pre-tokenizer,
    post-processor, added tokens): the same vocabulary with other merges or normalisation gives other ids.
    None where the tokenizer has no such serialisation (a slow tokenizer)."""
    to_str = getattr(getattr(tok, "backend_tokenizer", None), "to_str", None)
    if not callable(to_str):
        return None
    doc = json.loads(to_str())
    for key in NOT_IDENTITY:
        doc.pop(key, None)
    model = doc.get("model")
    if isinstance(model, dict) and isinstance(model.get("merges"), list):
        # tokenizers < 0.20 wrote a merge as "a b", later ones as ["a", "b"]: the same merge either way
        model["merges"] = [m.split(" ", 1) if isinstance(m, str) else m for m in model["merges"]]
    return hash_json(doc)


def diff_identity(cache_id: dict, other_id: dict) -> list:
    """Human-readable differences that break token-exactness: the vocabulary (every token string and its id, the
    cache's end-of-turn tokens among them) and how text becomes ids (tokenizer.json).

    Which token a tokenizer calls its EOS, BOS or pad is not compared: a base student (EOS <|endoftext|>) of an
    instruct teacher (EOS <|im_end|>) has the same ids for every token, and training uses only ids. The chat
    template is not compared either. tokenizer_json_sha256 is compared only when both sides have it: older
    manifests lack it."""
    out = []
    if cache_id["vocab_size"] != other_id["vocab_size"]:
        out.append(f"vocabulary size {cache_id['vocab_size']} in the cache, {other_id['vocab_size']} here")
    elif cache_id["vocab_sha256"] != other_id["vocab_sha256"]:
        out.append("vocabulary (same size, different token strings or ids)")
    # Manifests written before this key existed (or a slow tokenizer) lack it: then nothing to compare.
    want, got = cache_id.get("tokenizer_json_sha256"), other_id.get("tokenizer_json_sha256")
    if want is not None and got is not None and want != got and not out:
        out.append("same vocabulary, but other merges, normalizer, pre-tokenizer, post-processor or added tokens "
                   "(tokenizer.json differs), so the same text gets other ids")
    return out
