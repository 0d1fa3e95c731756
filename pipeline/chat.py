"""A chat as the teacher's template renders it, and which of its tokens the model writes.

The whole chat is rendered once and tokenized once: the cache holds exactly those ids (rule 2),
whatever the template does to earlier turns (Qwen3 drops their think blocks, Llama 3 writes a date
header). Each assistant turn is then found in that one rendering:

  - it opens where the template's generation prompt ends (the text `add_generation_prompt` appends,
    e.g. `<|im_start|>assistant\\n`), right after the previous message;
  - it is trained from the first token that overlaps what comes after that opening (a token that
    straddles the template's newline and an answer starting with whitespace is trained, as Hugging
    Face's assistant masks do), through the first end-of-turn token after the answer's text (rule 1).

So for a Qwen3 chat, the last assistant turn's `<think>\\n\\n</think>\\n\\n` (which the template writes
after the generation prompt) is trained: it is what the model emits before answering without thinking.
"""
import numpy as np

from kdcache.common.errors import BadRow, SkipSample

TEMPLATE_ERRORS = (ValueError, TypeError, KeyError, IndexError, AttributeError)   # plus jinja2's, below


def render(tok, messages, gen_prompt=False):
    """The template's text of `messages`; BadRow if the template refuses them (Gemma and a system role,
    Mistral and roles that do not alternate, a chat opening with the assistant)."""
    import jinja2
    try:
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen_prompt)
    except (jinja2.TemplateError, *TEMPLATE_ERRORS) as e:
        raise BadRow(f"the chat template refuses this chat: {type(e).__name__}: {e}") from None


def generation_prompt(tok, messages):
    """The text the template appends to open the assistant's turn after `messages` ('' if none)."""
    bare, opened = render(tok, messages), render(tok, messages, gen_prompt=True)
    return opened[len(bare):] if opened.startswith(bare) else ""


def chat_spans(tok, messages, turn_ends):
    """(ids, [(a, b)]): the token ids of the rendered chat, and each assistant turn's trained targets [a, b)."""
    full = render(tok, messages)
    enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = enc["input_ids"]
    ends = np.array([e for _, e in enc["offset_mapping"]])     # char offsets: ends are robust to trimmed starts
    spans, cursor = [], 0
    for i, m in enumerate(messages):
        if m["role"] == "system":
            continue                     # templates may move it (Mistral puts it in the last user turn)
        where, size = _find(full, m["content"], cursor)
        if where < 0:
            if m["role"] != "assistant":
                continue                 # a template may reword other turns; only answers must be found
            raise SkipSample("template", f"assistant turn {i}: its text is not in the chat as the template renders "
                             "it, so its tokens cannot be located")
        if m["role"] == "assistant":
            spans.append(_turn_span(tok, messages[:i], full, ids, ends, cursor, where, size, turn_ends, i))
            cursor = int(ends[spans[-1][1] - 1])
        else:
            cursor = where + size
    return ids, spans


def _find(full, content, cursor):
    """(position, length) of a message's text in the rendering, from cursor. Templates may trim it (Llama 3,
    Gemma) or, for Qwen3, keep only what follows its reasoning's `</think>`; (-1, 0) if it is not there."""
    for text in (content.strip(), content.split("</think>")[-1].strip()):
        where = full.find(text, cursor)
        if where >= 0:
            return where, len(text)
    return -1, 0


def _turn_span(tok, before, full, ids, ends, cursor, where, size, turn_ends, i):
    opening = generation_prompt(tok, before)
    k = full.rfind(opening, cursor, where + 1) if opening else -1
    start = k + len(opening) if k >= 0 else where          # what the model writes after the opening
    a = int(np.searchsorted(ends, start, side="right"))     # the first token overlapping it
    c = int(np.searchsorted(ends, where + size, side="left"))
    eot = next((j for j in range(c, len(ids)) if ids[j] in turn_ends), None)
    if eot is None:
        raise SkipSample("template", f"assistant turn {i}: no end-of-turn token {sorted(turn_ends)} follows it in "
                         "the rendered chat")
    return a, eot + 1
