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


def starts(pieces: list[bytes], ids) -> np.ndarray:
    """int64 [n + 1]: the byte offset where each token starts, then the end."""
    return np.concatenate([[0], np.cumsum([len(pieces[i]) for i in ids])]).astype(np.int64)


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


def map_topk(ids: np.ndarray, logprobs: np.ndarray, t2s: np.ndarray):
    """A teacher's top-k ([P, k] ids, log-probs; -1 ids pad) as student ids: (ids [P, k] with -1 where none, their
    log-probs (-inf there), the log of the tail's mass [P]). Teacher ids that name one student id are merged
    (their probabilities summed); the mass of ids with no student id joins the tail, so each row's mapped
    probabilities plus the tail sum to 1."""
    ids = np.asarray(ids)
    lp = np.asarray(logprobs, dtype=np.float64)
    s_ids = np.where(ids >= 0, t2s[np.maximum(ids, 0)], -1)
    p = np.where(s_ids >= 0, np.exp(lp), 0.0)
    out_ids = np.full(ids.shape, -1, dtype=np.int64)
    out_p = np.zeros(ids.shape)
    for r in range(ids.shape[0]):
        uniq, inv = np.unique(s_ids[r], return_inverse=True)
        sums = np.bincount(inv, weights=p[r], minlength=len(uniq))
        keep = uniq >= 0
        n = int(keep.sum())
        order = np.argsort(-sums[keep], kind="stable")
        out_ids[r, :n], out_p[r, :n] = uniq[keep][order], sums[keep][order]
    tail = np.clip(1.0 - out_p.sum(1), 0.0, 1.0)
    with np.errstate(divide="ignore"):
        return out_ids, np.where(out_ids >= 0, np.log(out_p), -np.inf).astype(np.float32), np.log(tail)
