"""The final model: a student that stops where the teacher stops, saved whole or not at all."""
import contextlib
import os

from kdcache.common.atomic import publish, remove

from . import lora


def stops_like_the_teacher(model, tok, manifest, own_ends=None):
    """Make the saved student stop where the teacher stops (rule 1 at inference, not only in the loss): its
    generation config's EOS ids become the cache's end-of-turn ids, and its tokenizer gets the teacher's chat
    template. A base student's own generation config (EOS <|endoftext|>) would never stop at <|im_end|>, which
    it has just learned to emit, with stock generate() or vLLM. own_ends: a --cross-tokenizer student's own
    end-of-turn ids; it keeps its own chat template, which it was trained in."""
    eos = sorted(int(t) for t in (own_ends if own_ends is not None else manifest["eos_token_ids"]))
    model.generation_config.eos_token_id = eos
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
    template = manifest.get("meta", {}).get("chat_template")
    if template and own_ends is None:
        tok.chat_template = template


def save_final(model, tok, path, rank, stage):
    """save_pretrained on rank 0; under ZeRO-3 every rank first gathers the partitioned weights.

    Written into a temp sibling and swapped in whole (publish: fsync, old one aside, replace, old removed):
    a crash mid-save leaves the previous `final/` or none, never a half-written or mixed one."""
    gather = contextlib.nullcontext()
    if stage == 3:
        import deepspeed
        gather = deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None)
    with gather:
        if rank == 0:
            head, tail = os.path.split(os.path.abspath(path))
            tmp = os.path.join(head, f".{tail}.tmp-{os.getpid()}")
            remove(tmp)                     # our pid's leftover from an earlier crash, if any
            try:
                if lora.is_lora(model):             # the merged model, and the adapter as PEFT saves it
                    lora.merged(model).save_pretrained(tmp, safe_serialization=True)
                    model.save_pretrained(os.path.join(tmp, "adapter"), safe_serialization=True)
                else:
                    model.save_pretrained(tmp, safe_serialization=True)
                tok.save_pretrained(tmp)
                publish(tmp, path)
            except BaseException:
                remove(tmp)
                raise
