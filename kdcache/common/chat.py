"""A chat as the teacher's template renders it, and which of its tokens the model writes.

The whole chat is rendered once and tokenized once: the cache holds exactly those ids (rule 2),
whatever the template does to earlier turns (Qwen3 drops their think blocks, Llama 3 writes a date
header). Each assistant turn is then located in that one rendering, anchored where the format puts it,
never by searching for the answer's text from the previous message (a short answer such as "a" or "end"
would be found inside the template's own markup):

  - it opens where the template's generation prompt ends (the text `add_generation_prompt` appends,
    e.g. `<|im_start|>assistant\\n`), the first such opening after the previous message;
  - it is trained from the first token that overlaps what comes after that opening (a token that
    straddles the template's newline and an answer starting with whitespace is trained, as Hugging
    Face's assistant masks do), through the first end-of-turn token after it (rule 1);
  - the answer's text must lie between the two, else the sample is skipped and counted ("template").
A template with no generation prompt (Mistral's) opens the turn after what it writes to close the user's
message (`[/INST]`); where neither can be told, the turn opens where the answer's text starts, searched
backwards from the turn's end-of-turn token.

So for a Qwen3 chat, the last assistant turn's `<think>\\n\\n</think>\\n\\n` (which the template writes
after the generation prompt) is trained: it is what the model emits before answering without thinking.
The generation prompt is rendered once per chat (from its first turns), so encoding a chat is linear in its
messages.
"""
from dataclasses import dataclass

import numpy as np

from kdcache.common.errors import BadRow, ConfigError, SkipSample

TEMPLATE_ERRORS = (ValueError, TypeError, KeyError, IndexError, AttributeError)   # plus jinja2's, below


def render(tok, messages, gen_prompt=False):
    """The template's text of `messages`; BadRow if the template refuses them (Gemma and a system role,
    Mistral and roles that do not alternate, a chat opening with the assistant)."""
    import jinja2
    try:
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen_prompt)
    except (jinja2.TemplateError, *TEMPLATE_ERRORS) as e:
        raise BadRow(f"the chat template refuses this chat: {type(e).__name__}: {e}") from None


def turn_opening(tok, head):
    """The text that opens an assistant turn after `head` (the chat before its first assistant message): the
    generation prompt, or for a template without one (Mistral), what it writes after the user's message
    (`[/INST]`): the model writes what follows. '' if neither can be told."""
    bare, opened = render(tok, head), render(tok, head, gen_prompt=True)
    prompt = opened[len(bare):] if opened.startswith(bare) else ""
    last = head[-1]["content"].strip() if head else ""
    k = opened.rfind(last) if last and not prompt else -1
    return prompt or (opened[k + len(last):] if k >= 0 else "")


def chat_spans(tok, messages, turn_ends, max_chars=None):
    """(ids, [(a, b)]): the token ids of the rendered chat, and each assistant turn's trained targets [a, b).

    max_chars: the rendering is cut there before tokenizing (the sample is then longer than max_length anyway,
    and the ids kept are the whole rendering's); a turn cut off is trained to the cut, turns after it not at all."""
    _, ids, turns = chat_turns(tok, messages, turn_ends, max_chars)
    return ids, [(t.start, t.end) for t in turns]


@dataclass
class Turn:
    """One assistant turn in a rendered chat: trained targets [start, end) (end-of-turn token last, unless cut
    off), and where the template wrote the answer's text: `text` at character `at` of the rendering."""
    start: int
    end: int
    at: int
    text: str


def chat_turns(tok, messages, turn_ends, max_chars=None):
    """(rendering, ids, [Turn]): chat_spans with the rendered text and where each answer lies in it."""
    full = render(tok, messages)
    cut = max_chars is not None and len(full) > max_chars
    if cut:
        full = full[:max_chars]
    enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = enc["input_ids"]
    starts = np.array([a for a, _ in enc["offset_mapping"]])
    ends = np.array([e for _, e in enc["offset_mapping"]])     # char offsets: ends are robust to trimmed starts
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
    opening = turn_opening(tok, messages[:first]) if first else ""
    spans, cursor = [], 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        if cut and (opening and full.find(opening, cursor) < 0 or cursor >= len(full)):
            break                        # this turn and the rest lie beyond the cut
        a, eot, at, text = _turn(full, ids, starts, ends, cursor, opening, m["content"], turn_ends, i, cut)
        if eot is None:                  # cut off before its end-of-turn token
            spans.append(Turn(a, len(ids), at, text))
            break
        spans.append(Turn(a, eot + 1, at, text))
        cursor = int(ends[eot])
    return full, ids, spans


def _answer_texts(content):
    """The text a template may write for an answer: trimmed (Llama 3, Gemma), or for Qwen3 only what follows its
    reasoning's `</think>`."""
    return content.strip(), content.split("</think>")[-1].strip()


def _turn(full, ids, starts, ends, cursor, opening, content, turn_ends, i, cut=False):
    """(first trained token, its end-of-turn token) of assistant turn i, the previous turn ending at `cursor`;
    the end-of-turn token is None where the rendering was cut before it."""
    k = full.find(opening, cursor) if opening else -1
    start = k + len(opening) if k >= 0 else cursor
    a = int(np.searchsorted(ends, start, side="right"))     # the first token overlapping what follows the opening
    eot = next((j for j in range(a, len(ids)) if ids[j] in turn_ends), None)
    if eot is None and cut:
        return a, None, start, full[start:]
    if eot is None:
        raise SkipSample("template", f"assistant turn {i}: no end-of-turn token {sorted(turn_ends)} follows it in "
                         "the rendered chat")
    stop = int(starts[eot])
    where, text = max(((full.rfind(t, start, stop), t) for t in _answer_texts(content)), default=(-1, ""))
    if where < 0:
        raise SkipSample("template", f"assistant turn {i}: its text is not in the chat as the template renders "
                         "it, so its tokens cannot be located")
    if k < 0:          # no generation prompt: the turn opens where the answer's text does
        a = int(np.searchsorted(ends, where, side="right"))
    return a, eot, where, text


def before_last_answer(messages) -> list:
    """The messages before the last assistant turn (what generate mode renders as the prompt); all of them
    where there is none."""
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=len(messages))
    return list(messages[:last])


def end_of_turn_ids(tok, extra=()):
    """Token ids that end an assistant turn: the tokenizer's EOS, the template's end-of-turn, extras."""
    ids = {int(t) for t in extra}
    if tok.eos_token_id is not None:
        ids.add(int(tok.eos_token_id))
    if getattr(tok, "chat_template", None):
        marker = "kdcacheANSWERkdcache"
        text = tok.apply_chat_template([{"role": "user", "content": "q"}, {"role": "assistant", "content": marker}],
                                       tokenize=False)
        after = text[text.index(marker) + len(marker):]
        enc = tok(after, add_special_tokens=False)["input_ids"]
        special = set(tok.all_special_ids)
        first = next((t for t in enc if t in special), None)
        if first is not None:
            ids.add(int(first))
    if not ids:
        raise ConfigError("the tokenizer defines no EOS token and its chat template no end-of-turn token; "
                          "name one with eos_tokens in the config")
    return sorted(ids)
