"""Cross-tokenizer alignment (issue 46): one text under two tokenizers, matched by the bytes each token covers.

A teacher's next-token distribution at a position is conditioned on the bytes before it. Where a student token
starts at the same byte offset as a teacher token, both models predict the next token after the same bytes, so
the teacher's top-k there is a distribution the student can be trained on once each teacher token is named by the
student token of equal bytes (ids with no such token: their mass goes to the tail bucket). Such a student position
is `aligned`; it is `one_to_one` where the two tokens also end together (GOLD's 1:1 case, TRL PR #5885). A student
token that starts inside a teacher token has no teacher distribution after its bytes: `inside`, for the student's
own cross-entropy (ULD and GOLD merge spans instead; kdcache keeps every trained distribution exact).

Byte strings of ids: byte-level BPE (GPT-2's byte-to-unicode alphabet: Qwen, Llama 3) and SentencePiece-style
vocabularies ("\u2581" for a space, "<0xNN>" byte fallback: Gemma, Mistral, Llama 2). Special and added tokens stand
for their text as the chat template writes it. A text is aligned only where each tokenizer gives its bytes back
exactly (a normalizer that rewrites text fails that, and the text is counted, never trained misaligned).
"""
import json
from dataclasses import dataclass

import numpy as np

ONE_TO_ONE, ALIGNED, INSIDE = 0, 1, 2          # kinds of student positions, in that order in coverage counts
KINDS = ("one_to_one", "aligned", "inside")


class NotByteExact(ValueError):
    """A text that a tokenizer does not give back byte for byte."""


def _byte_alphabet():
    """GPT-2's map from each byte to the printable character byte-level BPE writes for it."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) \
        + list(range(ord("\xae"), ord("\xff") + 1))
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return {c: b for b, c in chars.items()}


def _decoder_kind(tok) -> str:
    """'bytelevel' or 'sentencepiece', from the fast tokenizer's decoder; ValueError for any other."""
    spec = json.loads(tok.backend_tokenizer.to_str()).get("decoder") or {}
    kinds = {d.get("type") for d in spec.get("decoders", [spec])}
    if "ByteLevel" in kinds:
        return "bytelevel"
    if kinds & {"ByteFallback", "Metaspace", "Replace"}:
        return "sentencepiece"
    raise ValueError(f"tokenizer {getattr(tok, 'name_or_path', '')!r}: decoder {sorted(k for k in kinds if k)} is "
                     "neither byte-level BPE nor SentencePiece; its ids cannot be mapped to bytes")


def token_bytes(tok) -> list[bytes]:
    """The bytes each id of `tok` stands for, by id (len(tok) entries)."""
    kind = _decoder_kind(tok)
    alphabet = _byte_alphabet() if kind == "bytelevel" else None
    added = {i: t.content for i, t in tok.added_tokens_decoder.items()}
    out = [b""] * len(tok)
    for piece, i in tok.get_vocab().items():
        if i >= len(out):
            continue
        if i in added:
            out[i] = added[i].encode("utf-8")
        elif alphabet is not None:
            out[i] = bytes(alphabet[c] for c in piece) if all(c in alphabet for c in piece) else piece.encode()
        elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            out[i] = bytes([int(piece[3:5], 16)])
        else:
            out[i] = piece.replace("\u2581", " ").encode("utf-8")
    return out


def encode_exact(tok, pieces: list[bytes], text: str) -> list[int]:
    """`text`'s ids under `tok` (no special tokens added); NotByteExact unless their bytes are the text's."""
    ids = tok(text, add_special_tokens=False)["input_ids"]
    got = b"".join(pieces[i] for i in ids)
    want = text.encode("utf-8")
    if got != want:
        at = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        raise NotByteExact(f"{getattr(tok, 'name_or_path', 'tokenizer')!r} does not give the text back byte for "
                           f"byte: {len(got)} bytes against {len(want)}, first differing at byte {at} "
                           f"({want[max(0, at - 8):at + 8]!r})")
    return ids


def dummy_prefix(tok) -> str:
    """Where `tok` writes SentencePiece's dummy-prefix space, which is in no text: "every" text segment between
    added tokens (Llama 2's and Mistral v0.1's Prepend normalizer; a Metaspace pre-tokenizer of prepend_scheme
    "always"), "first" (a text that opens the input only: Metaspace "first", Mistral v0.3), or "" (none)."""
    spec = json.loads(tok.backend_tokenizer.to_str())

    def walk(node):
        if isinstance(node, dict):
            yield node
            for sub in (node.get("normalizers") or []) + (node.get("pretokenizers") or []):
                yield from walk(sub)

    if any(n.get("type") == "Prepend" for n in walk(spec.get("normalizer"))):
        return "every"
    for n in walk(spec.get("pre_tokenizer")):
        if n.get("type") == "Metaspace":
            scheme = n.get("prepend_scheme", "always" if n.get("add_prefix_space", True) else "never")
            return {"always": "every", "first": "first"}.get(scheme, "")
    return ""


def sequence_pieces(pieces: list[bytes], ids, added, prefix: str) -> list[bytes]:
    """The bytes of each token of one tokenized text as the text has them: pieces[id], less the dummy-prefix
    space (dummy_prefix) on the first token of each text segment the tokenizer prefixed (added: the ids of its
    added tokens, which split the text into segments). Such a token can cover no bytes at all."""
    out = [pieces[i] for i in ids]
    if prefix:
        for j, i in enumerate(ids):
            opens = j == 0 or (prefix == "every" and ids[j - 1] in added)
            if opens and i not in added and out[j].startswith(b" "):
                out[j] = out[j][1:]
    return out


def utf8_text(data: bytes, cut: bool = False) -> str | None:
    """Generated bytes as text; None where they are no UTF-8. cut: the generation was cut by its budget and may end
    inside a character, whose bytes (at most 3) are then dropped."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        if cut and e.reason == "unexpected end of data" and e.end == len(data):
            return utf8_text(data[:e.start])
        return None


def starts(pieces: list[bytes], ids=None) -> np.ndarray:
    """int64 [n + 1]: the byte offset where each token starts, then the end (ids given: of pieces[id] for each
    id; else of each of `pieces`, a sequence's own, sequence_pieces)."""
    lengths = [len(pieces[i]) for i in ids] if ids is not None else [len(b) for b in pieces]
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


@dataclass
class Alignment:
    """Student tokens against teacher tokens of one byte string."""
    kind: np.ndarray        # int8 [n_student]: ONE_TO_ONE, ALIGNED or INSIDE
    teacher: np.ndarray     # int64 [n_student]: the teacher token starting where the student's does (-1: inside)

    def counts(self) -> dict:
        return {name: int((self.kind == k).sum()) for k, name in enumerate(KINDS)}


def align(teacher_starts: np.ndarray, student_starts: np.ndarray) -> Alignment:
    """Match the tokens of two tokenizations of one byte string by their byte offsets (see the module text)."""
    if teacher_starts[-1] != student_starts[-1]:
        raise NotByteExact(f"the two tokenizations cover {teacher_starts[-1]} and {student_starts[-1]} bytes")
    t_start, t_end = teacher_starts[:-1], teacher_starts[1:]
    s_start, s_end = student_starts[:-1], student_starts[1:]
    j = np.searchsorted(t_start, s_start)
    j_ok = np.minimum(j, max(len(t_start) - 1, 0))
    same_start = (j < len(t_start)) & (t_start[j_ok] == s_start) if len(t_start) else np.zeros(len(s_start), bool)
    same_end = same_start & (t_end[j_ok] == s_end)
    kind = np.where(same_end, ONE_TO_ONE, np.where(same_start, ALIGNED, INSIDE)).astype(np.int8)
    return Alignment(kind, np.where(same_start, j_ok, -1).astype(np.int64))


def vocab_map(teacher_pieces: list[bytes], student_pieces: list[bytes], specials: dict | None = None) -> np.ndarray:
    """int64 [teacher vocab]: the student id of equal bytes for each teacher id, -1 where the student has none.
    The student's ordinary tokens win over its added ones of the same text; `specials` ({teacher id: student id},
    the end-of-turn token's) map ids whose bytes differ by role."""
    by_bytes = {}
    for i, b in enumerate(student_pieces):
        if b and b not in by_bytes:
            by_bytes[b] = i
    out = np.array([by_bytes.get(b, -1) if b else -1 for b in teacher_pieces], dtype=np.int64)
    for t, s in (specials or {}).items():
        out[t] = s
    return out


def first_token_map(teacher_pieces: list[bytes], student_tok, student_pieces: list[bytes], teacher_added=(),
                    specials: dict | None = None, student_prefix: str = "") -> np.ndarray:
    """int64 [teacher vocab]: for each teacher id, the student token its bytes begin with, -1 where none.

    A teacher token of the same bytes as a student token is that token (vocab_map). Any other ordinary teacher
    token is the first token of the student's own tokenization of its text: if the teacher's token came next,
    that is the student's next token, so the teacher's probability of it is mass on that student token (a
    teacher " docker" is the student's " d" where the student writes " d" "oc" "ker"). A teacher token whose bytes
    are not whole UTF-8 (a byte-level fragment) takes the longest student token they begin with. Added and
    special teacher tokens (markup) map only by equal bytes or through `specials` ({teacher id: student id}).
    student_prefix: the student's dummy_prefix. Such a student tokenizes a text on its own after a dummy space it
    never writes inside a text, which changes its first tokens ("\u2581" "\u2581docker" for " docker"), so each
    teacher token takes the longest student token its bytes begin with."""
    out = vocab_map(teacher_pieces, student_pieces, specials)
    by_bytes = {}
    for i, b in enumerate(student_pieces):
        if b and b not in by_bytes:
            by_bytes[b] = i
    added = set(int(t) for t in teacher_added) | set((specials or {}).keys())
    todo = [t for t, b in enumerate(teacher_pieces) if out[t] < 0 and b and t not in added]
    texts, fragments = [], []
    for t in todo:
        try:
            texts.append((t, teacher_pieces[t].decode("utf-8")))
        except UnicodeDecodeError:
            fragments.append(t)
    if student_prefix:
        fragments += [t for t, _ in texts]
    elif texts:
        enc = student_tok([x for _, x in texts], add_special_tokens=False)["input_ids"]
        for (t, _), ids in zip(texts, enc):
            if ids and teacher_pieces[t].startswith(student_pieces[ids[0]]) and student_pieces[ids[0]]:
                out[t] = ids[0]
            else:
                fragments.append(t)
    for t in fragments:
        b = teacher_pieces[t]
        out[t] = next((by_bytes[b[:n]] for n in range(len(b) - 1, 0, -1) if b[:n] in by_bytes), -1)
    return out


def map_topk(ids: np.ndarray, logprobs: np.ndarray, t2s: np.ndarray):
    """A teacher's top-k ([P, k] ids, log-probs; -1 ids pad) as student ids: (ids [P, k] with -1 where none, their
    log-probs (-inf there), the log of the tail's mass [P]). Teacher ids that name one student id are merged
    (their probabilities summed); the mass of ids with no student id joins the tail, so each row's mapped
    probabilities plus the tail sum to 1."""
    ids = np.asarray(ids)
    lp = np.asarray(logprobs, dtype=np.float64)
    P, k = ids.shape
    s_ids = np.where(ids >= 0, t2s[np.maximum(ids, 0)], -1)
    p = np.where(s_ids >= 0, np.exp(lp), 0.0)
    # Equal student ids of a row become one entry: sort each row by id, sum each run of equal ids.
    order = np.argsort(s_ids, axis=1, kind="stable")
    sid = np.take_along_axis(s_ids, order, axis=1)
    ps = np.take_along_axis(p, order, axis=1)
    first = np.ones((P, k), bool)
    first[:, 1:] = sid[:, 1:] != sid[:, :-1]
    group = np.cumsum(first, axis=1) - 1 + np.arange(P)[:, None] * k            # a run's slot, row-major
    sums = np.bincount(group.ravel(), weights=ps.ravel(), minlength=P * k).reshape(P, k)
    gid = np.full(P * k, -1, np.int64)
    gid[group[first]] = sid[first]
    gid = gid.reshape(P, k)
    sums = np.where(gid >= 0, sums, 0.0)
    # Descending probability, unused slots (-1) last.
    rank = np.argsort(np.where(gid >= 0, -sums, np.inf), axis=1, kind="stable")
    out_ids = np.take_along_axis(gid, rank, axis=1)
    out_p = np.take_along_axis(sums, rank, axis=1)
    tail = np.clip(1.0 - out_p.sum(1), 0.0, 1.0)
    with np.errstate(divide="ignore"):
        return out_ids, np.where(out_ids >= 0, np.log(np.where(out_ids >= 0, out_p, 1.0)), -np.inf).astype(
            np.float32), np.log(tail)
