"""Examples -> token ids and trained positions, in training semantics.

Every assistant turn is a completion. Its targets run from the first token
after the generation prompt through the end-of-turn token (inclusive): the
position that predicts `<|im_end|>` (or the tokenizer's EOS) is always
trained. Template text rendered after the end-of-turn token (ChatML's "\n")
is not, because generation stops at the end-of-turn token.

A target j is trained at position j-1 (the cache's `positions`, cache_format.record.span_positions).
"""
from dataclasses import dataclass, replace

import numpy as np

from kdcache.cache_format.record import span_positions
from kdcache.common.chat import before_last_answer, chat_spans, end_of_turn_ids, render  # noqa: F401  (end_of_turn_ids: moved there)
from kdcache.common.errors import BadRow, ConfigError, SkipSample

from .data import IGNORE, Example


@dataclass
class Sample:
    """One encoded record on its way to the teacher: T tokens, P trained positions."""
    sample_id: int           # the record's index in the dataset
    input_ids: np.ndarray    # int32 [T] (score mode: the whole sequence; generate mode: the prompt)
    positions: np.ndarray    # int32 [P] (score mode); empty in generate mode
    truncated: bool = False
    teacher_ids: np.ndarray | None = None         # privileged context: the ids the teacher scores (None: input_ids)
    teacher_positions: np.ndarray | None = None   # int32 [P]: where in teacher_ids each position is scored

    @property
    def scored(self):
        """(ids, positions) the teacher scores: its own view where the record gives one."""
        if self.teacher_ids is None:
            return self.input_ids, self.positions
        return self.teacher_ids, self.teacher_positions


def with_completion(sample: Sample, new_ids, ended: bool) -> Sample:
    """Generate mode: the prompt plus the completion, trained on every generated token (the end-of-turn step
    included); with a teacher view, the teacher's prompt plus the same completion. No end-of-turn within the
    budget: flagged truncated."""
    new_ids = np.asarray(new_ids, dtype=np.int32)
    ids = np.concatenate([sample.input_ids, new_ids])
    s = replace(sample, input_ids=ids, positions=span_positions([(len(sample.input_ids), len(ids))]),
                truncated=not ended)
    if sample.teacher_ids is not None:      # the same completion after the teacher's prompt
        t_ids = np.concatenate([sample.teacher_ids, new_ids])
        s.teacher_ids, s.teacher_positions = t_ids, span_positions([(len(sample.teacher_ids), len(t_ids))])
    return s


MAX_MESSAGES = 1024      # messages per chat record, by default (a hostile record's template work is bounded)
DOCUMENT_ENDS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")   # Qwen, Llama 3, Mistral/Llama 2, Gemma


def document_end_id(tok, name="auto"):
    """The token that ends a plain-text record: `name`, or (auto) the tokenizer's document-end token where it
    has one (an instruct tokenizer's EOS is its turn end, which a document should not end with), else its EOS."""
    vocab = tok.get_vocab()
    if name != "auto":
        if name not in vocab:
            raise ConfigError(f"text_end: {name!r} is not a token of the tokenizer")
        return int(vocab[name])
    found = next((t for t in DOCUMENT_ENDS if t in vocab and t in tok.all_special_tokens), None)
    if found is not None:
        return int(vocab[found])
    if tok.eos_token_id is None:
        raise ConfigError("text_end: the tokenizer has no document-end or EOS token; name one with --text-end")
    return int(tok.eos_token_id)


class Encoder:
    """Dataset examples -> Samples of token ids: encode() a whole sequence and its trained positions (score mode),
    encode_prompt() the prompt alone (generate mode). turn_ends: the ids that end a turn (default: the template's
    and the tokenizer's, end_of_turn_ids); the tokenizer's own EOS (self.eos) ends --template raw turns."""

    def __init__(self, tok, *, template="auto", max_length=2048, overlong="truncate", turn_ends=(),
                 drop_end_of_turn=False, text_end=None, max_messages=MAX_MESSAGES, vocab_size=None):
        self.tok = tok
        self.has_template = bool(getattr(tok, "chat_template", None))
        if template == "chat" and not self.has_template:
            raise ConfigError("template: 'chat' but the tokenizer has no chat_template; use --template raw")
        self.template = ("chat" if self.has_template else "raw") if template == "auto" else template
        self.max_length, self.overlong = max_length, overlong
        self.turn_ends = set(turn_ends) or set(end_of_turn_ids(tok))
        self.eos = int(tok.eos_token_id) if tok.eos_token_id is not None else min(self.turn_ends)
        self.text_end = document_end_id(tok) if text_end is None else int(text_end)
        self.max_messages = max_messages
        self.vocab_size = vocab_size               # the teacher's rows: ids records are checked against it
        self.drop_end_of_turn = drop_end_of_turn   # the bug other tools shipped; control experiments only
        # Text beyond this many characters cannot reach max_length tokens' worth of the sample: no token covers
        # more characters than its vocabulary string has, so it is cut before tokenizing (a 20 MB record costs
        # no more than a sample of max_length tokens). The ids kept are those of the whole text, cut.
        self.max_chars = (max_length + 16) * max(map(len, tok.get_vocab()), default=1)

    # -- score mode: whole sequence plus trained spans ---------------------------------
    def encode(self, ex: Example, sample_id: int = 0) -> Sample:
        if ex.kind == "ids":
            return self._ids(ex, sample_id)
        teacher = None
        if ex.kind in ("chat", "pair"):
            msgs = self._messages(ex) or [{"role": "user", "content": ex.prompt},
                                          {"role": "assistant", "content": ex.completion}]
            ids, spans = self._chat(msgs)
            if ex.teacher_messages:
                teacher = self._teacher_view(msgs, ids, spans, ex.teacher_messages)
        else:  # text: every token is a target; the document end appended so the end of a document is learned
            ids = self.tok(ex.text[:self.max_chars], add_special_tokens=True)["input_ids"] + [self.text_end]
            spans = [(1, len(ids))]
        positions = span_positions(spans)
        keep = np.ones(len(positions), bool)
        if self.drop_end_of_turn:
            keep = ~np.isin(np.asarray(ids)[positions + 1], list(self.turn_ends))
        cut = ex.truncated and ex.kind != "text" and len(positions) and ids[positions[-1] + 1] in self.turn_ends
        if cut:           # the last answer was cut by its writer: the end of turn the template adds is not its own
            keep[-1] = False
        if teacher is not None:
            teacher = (teacher[0], teacher[1][keep])
        s = self._limit(sample_id, ids, positions[keep], teacher)
        return replace(s, truncated=True) if ex.truncated else s

    def _chat(self, msgs):
        return chat_spans(self.tok, msgs, self.turn_ends, self.max_chars) if self.template == "chat" \
            else self._raw_chat(msgs)

    def _teacher_view(self, msgs, ids, spans, teacher_msgs):
        """(teacher ids, teacher positions [P]) of teacher_messages: its assistant turns must be those of messages,
        rendered to the same tokens, else BadRow naming the turn (never a shifted position)."""
        mine = [m["content"] for m in msgs if m["role"] == "assistant"]
        theirs = [m["content"] for m in teacher_msgs if m["role"] == "assistant"]
        if len(mine) != len(theirs):
            raise BadRow(f"teacher_messages has {len(theirs)} assistant turn(s), messages {len(mine)}: the teacher "
                         "scores the student's completions, so they must be the same turns")
        for n, (a, b) in enumerate(zip(mine, theirs)):
            if a != b:
                raise BadRow(f"teacher_messages: assistant turn {n} differs from messages' (the completions the "
                             "teacher scores must be the student's, word for word)")
        t_ids, t_spans = self._chat(teacher_msgs)
        if list(t_ids) == list(ids) and teacher_msgs != msgs:
            raise BadRow("teacher_messages differs from messages, but the chat template renders both to the same "
                         "tokens: the teacher's extra context is dropped (Mistral's template writes a system "
                         "message only into a chat's last turn, and only when that is a user turn); put the "
                         "context in a user turn")
        for n, ((a, b), (c, d)) in enumerate(zip(spans, t_spans)):
            if list(ids[a:b]) != list(t_ids[c:d]):
                j = next((j for j, (x, y) in enumerate(zip(ids[a:b], t_ids[c:d])) if x != y), min(b - a, d - c))
                raise BadRow(f"assistant turn {n} is not token-equal under the two renderings: {b - a} tokens under "
                             f"messages, {d - c} under teacher_messages, first differing at its token {j}; the "
                             "teacher must score exactly the student's tokens (a template that renders the turn "
                             "otherwise after another context cannot be used)")
        if len(t_spans) != len(spans):
            raise BadRow(f"{len(spans)} trained turn(s) under messages, {len(t_spans)} under teacher_messages (a turn "
                         "cut at max_length in one rendering only)")
        return t_ids, span_positions(t_spans)

    def _ids(self, ex: Example, sample_id: int) -> Sample:
        """A record's own token ids, as they are (rule 2 at the input: nothing templated or tokenized). It counts
        as truncated where its last trained target is no end-of-turn id (it never stops)."""
        ids = self._in_vocab(ex.input_ids)
        if len(ids) < 2:
            raise BadRow("input_ids holds one id: no position predicts another, nothing to distill")
        if ex.labels is None:
            positions = np.arange(len(ids) - 1)
        else:
            positions = np.nonzero(np.asarray(ex.labels[1:]) != IGNORE)[0]
        teacher = None
        if ex.teacher_input_ids is not None:
            teacher = self._teacher_ids(ids, positions, ex)
        if self.drop_end_of_turn:
            keep = ~np.isin(ids[positions + 1], list(self.turn_ends))
            positions, teacher = positions[keep], teacher and (teacher[0], teacher[1][keep])
        s = self._limit(sample_id, ids, positions, teacher)
        ends = len(s.positions) and int(s.input_ids[s.positions[-1] + 1]) in self.turn_ends
        return replace(s, truncated=s.truncated or ex.truncated or not ends)

    def _teacher_ids(self, ids, positions, ex: Example):
        """(teacher ids, teacher positions) of an id record's teacher_input_ids and teacher_labels: the same trained
        tokens in the same order, else BadRow naming the first that differs."""
        t_ids = self._in_vocab(ex.teacher_input_ids, "teacher_input_ids")
        t_pos = np.nonzero(np.asarray(ex.teacher_labels[1:]) != IGNORE)[0]
        mine, theirs = ids[positions + 1], t_ids[t_pos + 1]
        if len(mine) != len(theirs) or (mine != theirs).any():
            j = next((j for j, (x, y) in enumerate(zip(mine, theirs)) if x != y), min(len(mine), len(theirs)))
            raise BadRow(f"teacher_labels train {len(theirs)} tokens and labels {len(mine)}, first differing at "
                         f"trained token {j}: the teacher must score exactly the student's trained tokens, in order")
        return t_ids, t_pos

    def _in_vocab(self, input_ids, name="input_ids") -> np.ndarray:
        ids = np.asarray(input_ids, dtype=np.int64)
        bad = np.nonzero((ids < 0) | (ids >= (self.vocab_size or 2**31)))[0]
        if len(bad):
            t = int(bad[0])
            raise BadRow(f"{name}[{t}] = {int(ids[t])} is outside the teacher's vocabulary of "
                         f"{self.vocab_size or 2**31:,} ids ({len(bad)} such id(s) in this record)")
        return ids.astype(np.int32)

    def _messages(self, ex: Example):
        """The record's messages, refused (counted) past max_messages before the template sees any of them."""
        if ex.messages and len(ex.messages) > self.max_messages:
            raise SkipSample("too_many_messages", f"{len(ex.messages)} messages > max_messages {self.max_messages}")
        return ex.messages

    def _limit(self, sample_id, ids, positions, teacher=None):
        """The sample within max_length tokens; with a teacher view (ids, positions), both views are held to it
        and keep the positions that fit in both."""
        truncated = False
        views = [(ids, positions)] + ([teacher] if teacher is not None else [])
        if any(len(v) > self.max_length for v, _ in views):
            if self.overlong == "drop":
                raise SkipSample("too_long", f"{max(len(v) for v, _ in views)} tokens > max_length "
                                 f"{self.max_length} (overlong=drop)")
            truncated = True
            keep = min(int(np.sum(p <= self.max_length - 2)) for _, p in views)
            views = [(v[:self.max_length], p[:keep]) for v, p in views]
        (ids, positions), teacher = views[0], (views[1] if teacher is not None else None)
        if len(positions) == 0:
            raise SkipSample("no_targets", f"no completion token within max_length {self.max_length}"
                       if truncated else "no completion tokens")
        s = Sample(sample_id, np.asarray(ids, dtype=np.int32), positions.astype(np.int32), truncated)
        if teacher is not None:
            s.teacher_ids = np.asarray(teacher[0], dtype=np.int32)
            s.teacher_positions = np.asarray(teacher[1], dtype=np.int32)
        return s

    def _raw_chat(self, messages):
        """--template raw: the messages' tokens in order (BOS first where the tokenizer adds one), each assistant
        message trained through an EOS appended after it."""
        ids, spans = list(self.tok("", add_special_tokens=True)["input_ids"]), []
        for m in messages:
            t = self.tok(m["content"][:self.max_chars], add_special_tokens=False)["input_ids"]
            if m["role"] == "assistant":
                spans.append((len(ids), len(ids) + len(t) + 1))
                t = t + [self.eos]
            ids += t
        return ids, spans

    # -- generate mode: the prompt only ----------------------------------------------------
    def encode_prompt(self, ex: Example, sample_id: int = 0) -> Sample:
        """The prompt to generate from; with a teacher view, the teacher's prompt too (its teacher_ids, no
        positions yet): the completion then goes after each (with_completion)."""
        if ex.kind == "text":
            raise SkipSample("text_in_generate", "plain text records have no prompt to generate from")
        if ex.kind == "ids":        # the ids before the first trained one (all of them, without labels)
            teacher = None if ex.teacher_input_ids is None else \
                self._ids_prompt(ex.teacher_input_ids, ex.teacher_labels, "teacher_input_ids")
            return self._prompt(sample_id, self._ids_prompt(ex.input_ids, ex.labels), teacher)
        msgs = self._messages(ex) or [{"role": "user", "content": ex.prompt}]
        teacher = None if ex.teacher_messages is None else self._chat_prompt(ex.teacher_messages)
        return self._prompt(sample_id, self._chat_prompt(msgs), teacher)

    def _ids_prompt(self, input_ids, labels, name="input_ids"):
        ids = self._in_vocab(input_ids, name)
        first = None if labels is None else next(t for t, y in enumerate(labels) if t and y != IGNORE)
        return ids if first is None else ids[:first]

    def _chat_prompt(self, msgs):
        """The ids of msgs before their last assistant turn, with the generation prompt."""
        msgs = before_last_answer(msgs)
        if self.template == "chat":
            return self.tok(render(self.tok, msgs, gen_prompt=True), add_special_tokens=False)["input_ids"]
        return self._raw_chat(msgs)[0]

    def _prompt(self, sample_id, ids, teacher=None) -> Sample:
        longest = max(len(ids), len(teacher) if teacher is not None else 0)
        if longest >= self.max_length:
            view = "prompt" if len(ids) == longest else "teacher's prompt (teacher view)"
            raise SkipSample("too_long", f"{view} of {longest} tokens leaves no room under max_length "
                             f"{self.max_length}")
        s = Sample(sample_id, np.asarray(ids, dtype=np.int32), np.zeros(0, np.int32), False)
        if teacher is not None:
            s.teacher_ids, s.teacher_positions = np.asarray(teacher, dtype=np.int32), np.zeros(0, np.int32)
        return s
