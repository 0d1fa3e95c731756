"""--cross-tokenizer (issue 46): a cache of one tokenizer family trained into a student of another.

The cache stays the teacher's exact record; the student's view of each sample is derived from it and from the
cache's source (SPEC.md 4.6: the conversation as text and the teacher's tokenizer files), the same way every time:

  1. The conversation is rendered by the teacher's template and tokenizer (from the source); the ids must be the
     cache's, else the sample is skipped and counted. It is rendered again by the student's own template and
     tokenizer: the student's role markup and end-of-turn token are its own.
  2. In each assistant turn, the answer's text (where each template wrote it) is matched byte for byte on both
     sides, and every student target token is sorted by where it starts (train/align.py):
       one_to_one   a teacher token starts and ends at the same bytes of the answer;
       aligned      a teacher token starts there (and ends elsewhere): both models predict after the same
                    bytes of the answer, so the teacher's distribution there applies;
       end_of_turn  the student's end-of-turn token, matched to the teacher's end-of-turn position (rule 1:
                    the student learns to stop across families);
       inside       it starts inside a teacher token: no teacher distribution after its bytes;
       template     the student's own markup around the answer (Qwen3's empty think block, a straddling token).
  3. At the first three kinds the teacher's top-k is mapped to student ids (train/align.py first_token_map,
     map_topk): a teacher token of the same bytes as a student token is that token; any other is the student
     token its bytes begin with in the student's own tokenization (were the teacher's token next, that would be
     the student's next token); the teacher's end-of-turn ids name the student's. Ids with no student
     equivalent (the teacher's other markup) leave the support and their mass joins the tail bucket, so each
     row still sums to 1. At inside and template positions
     the student trains its own cross-entropy on the reference token, as the GOLD and ULD papers do where no
     teacher distribution matches (kdcache never merges spans into approximate distributions).
A chat whose last answer was cut by its writer's budget (the source's "truncated", kdcache onpolicy's rollouts)
keeps every position of that answer but not its end of turn, which the templates add and its writer never wrote.
Samples that cannot be derived exactly (a tokenizer that does not give the text back byte for byte, an answer the
two templates write differently, a cut sample) are skipped, counted by reason and named, never trained misaligned.
"""
import bisect
import os
import tempfile
from collections import Counter, OrderedDict
from dataclasses import dataclass, field, replace

import numpy as np

from kdcache.cache_format.record import Record
from kdcache.cache_format.source import CacheSource
from kdcache.cache_format.tokenizer_id import diff_identity, tokenizer_identity
from kdcache.common.chat import before_last_answer, chat_turns, end_of_turn_ids
from kdcache.common.errors import BadRow, ConfigError, SkipSample, TokenizerMismatch

from .align import dummy_prefix, first_token_map, map_topk, sequence_pieces, starts, token_bytes, utf8_text

KINDS = ("one_to_one", "aligned", "end_of_turn", "inside", "template")
ONE_TO_ONE, ALIGNED, END_OF_TURN, INSIDE, TEMPLATE = range(len(KINDS))
TEACHER_KINDS = (ONE_TO_ONE, ALIGNED, END_OF_TURN)      # positions trained on the teacher's mapped distribution
REASONS = ("no_conversation", "text_record", "truncated", "template", "teacher_rendering", "not_byte_exact", "turns",
           "answer_text")                               # why a sample is skipped (Coverage.skipped)
CHATS_KEPT = 4                                          # shards' conversations kept decoded


@dataclass
class Coverage:
    """What the derivation did: positions by kind, the teacher's top-k mass mapped, samples skipped by reason."""
    positions: Counter = field(default_factory=Counter)
    topk_mass: float = 0.0           # teacher top-k mass at the positions trained on it
    mapped_mass: float = 0.0         # of it, on ids the student has
    samples: int = 0
    skipped: Counter = field(default_factory=Counter)
    first_skip: dict = field(default_factory=dict)     # reason -> "sample N: message"

    def summary(self) -> dict:
        n = sum(self.positions.values())
        return {"samples": self.samples, "positions": n,
                **{f"share_{k}": self.positions[i] / n if n else 0.0 for i, k in enumerate(KINDS)},
                "mass_mapped": self.mapped_mass / self.topk_mass if self.topk_mass else 0.0,
                "skipped": dict(self.skipped), "first_skipped": dict(self.first_skip)}


def same_tokenizer(student_tok, manifest) -> bool:
    want = manifest.meta.get("tokenizer")
    return want is not None and not diff_identity(want, tokenizer_identity(student_tok))


def load_teacher_tokenizer(source: CacheSource, manifest, where):
    """The teacher's tokenizer from the cache's source, checked to be the one the cache's ids came from."""
    from transformers import AutoTokenizer
    d = source.save_tokenizer(tempfile.mkdtemp(prefix="kdcache-teacher-tok-"))
    tok = AutoTokenizer.from_pretrained(d)
    want = manifest.meta.get("tokenizer")
    if want is None or diff_identity(want, tokenizer_identity(tok)):
        raise TokenizerMismatch(f"{where}: the tokenizer in the cache's source is not the one its ids came from "
                                "(meta.tokenizer); the source was written from another tokenizer")
    return tok


class CrossTokenizer:
    """convert(teacher-token Record) -> student-token Record with position_kinds, or None (skipped, counted)."""

    def __init__(self, cache, student_tok):
        """cache: a cache path or URL, or an open one (kdcache.open_cache); student_tok: the student's tokenizer."""
        if isinstance(cache, str | os.PathLike):
            from kdcache.cache_format.manifest import load_manifest
            cache_dir, manifest = str(cache), load_manifest(str(cache))
        else:
            cache_dir, manifest = cache.directory, cache.manifest
        capture = (manifest.fingerprint_parts or {}).get("capture", {})
        self.generated = capture.get("mode", "score") == "generate"    # the answers are the cache's own ids
        if manifest.sample:
            raise ConfigError(f"cross_tokenizer: {cache_dir} is a sampled cache (--sample); --cross-tokenizer maps "
                              "top-k caches only")
        self.source = CacheSource(cache_dir, manifest)
        self.teacher = load_teacher_tokenizer(self.source, manifest, cache_dir)
        self.student = student_tok
        if getattr(self.teacher, "chat_template", None) and not getattr(student_tok, "chat_template", None):
            raise ConfigError(f"cross_tokenizer: the student's tokenizer has no chat template, but {cache_dir}'s "
                              "teacher rendered its chats with one: the student must render them with its own. "
                              "Give the student a tokenizer with a chat template (--tokenizer)")
        if capture.get("template") == "raw":
            raise ConfigError(f"cross_tokenizer: {cache_dir} was made with --template raw; --cross-tokenizer "
                              "re-renders chats with each side's chat template")
        self.where, self.manifest = cache_dir, manifest
        self.t_pieces, self.s_pieces = token_bytes(self.teacher), token_bytes(student_tok)
        self.t_prefix, self.s_prefix = dummy_prefix(self.teacher), dummy_prefix(student_tok)
        self.t_added = set(self.teacher.added_tokens_decoder)      # (a property built anew at each access)
        self.s_added = set(student_tok.added_tokens_decoder)
        self.t_ends = set(manifest.eos_token_ids)
        self.s_ends = set(end_of_turn_ids(student_tok))
        s_eot = _template_end(student_tok, self.s_ends)
        self.t2s = first_token_map(self.t_pieces, student_tok, self.s_pieces, self.t_added,
                                   {t: s_eot for t in self.t_ends}, student_prefix=self.s_prefix)
        self.student_vocab = len(student_tok)
        self._starts = [s.sample_start for s in manifest.shards]
        self._chats = OrderedDict()
        self.coverage = Coverage()

    # -- the conversation of a sample ------------------------------------------------------
    def _chat(self, sample_id):
        i = bisect.bisect_right(self._starts, sample_id) - 1
        index = self.manifest.shards[i].index
        if index not in self._chats:
            ids, chats = self.source.chats(index)
            self._chats[index] = dict(zip(ids.tolist(), chats))
            if len(self._chats) > CHATS_KEPT:
                self._chats.popitem(last=False)
        self._chats.move_to_end(index)
        return self._chats[index].get(int(sample_id))

    def _skip(self, rec, reason, message):
        self.coverage.skipped[reason] += 1
        self.coverage.first_skip.setdefault(reason, f"{self.where} sample {int(rec.sample_id)}: {message}")
        return None

    # -- one sample ------------------------------------------------------------------------
    def convert(self, rec: Record) -> Record | None:
        chat = self._chat(rec.sample_id)
        if chat is None:
            return self._skip(rec, "no_conversation", "the source holds no conversation for it")
        if chat["kind"] == "text":
            return self._skip(rec, "text_record", "a plain-text record (cross-tokenizer training maps chats)")
        open_end = bool(chat.get("truncated"))       # its last answer was cut by a generation budget
        if rec.truncated and not open_end and not self.generated:
            return self._skip(rec, "truncated", "cut at the precompute's max_length")
        msgs = chat["messages"] if chat["kind"] == "chat" else \
            [{"role": "user", "content": chat["prompt"]}, {"role": "assistant", "content": chat["completion"]}]
        if self.generated:                           # the source holds the prompt; the answer is in the ids
            msgs, open_end = self._generated_chat(rec, msgs), bool(rec.truncated)
            if msgs is None:
                return self._skip(rec, "answer_text", "the generated completion is no text (bytes that are no "
                                  "UTF-8, or a special token inside it)")
        try:
            t_text, t_ids, t_turns = chat_turns(self.teacher, msgs, self.t_ends)
            s_text, s_ids, s_turns = chat_turns(self.student, msgs, self.s_ends)
        except (BadRow, SkipSample) as e:
            return self._skip(rec, "template", str(e))
        if self.generated:
            if not _generated_prefix(rec, t_ids, t_turns):
                return self._skip(rec, "teacher_rendering", "the teacher's generated ids are not how its tokenizer "
                                  "writes their text (a non-canonical tokenization)")
        elif list(t_ids) != rec.input_ids.tolist():
            if rec.truncated:
                return self._skip(rec, "truncated", "cut at the precompute's max_length")
            return self._skip(rec, "teacher_rendering", "the teacher's template renders it to other ids than the "
                              "cache holds")
        t_seq = sequence_pieces(self.t_pieces, t_ids, self.t_added, self.t_prefix)
        s_seq = sequence_pieces(self.s_pieces, s_ids, self.s_added, self.s_prefix)
        t_bytes, s_bytes = starts(t_seq), starts(s_seq)
        for side, text, seq in (("teacher", t_text, t_seq), ("student", s_text, s_seq)):
            if b"".join(seq) != text.encode("utf-8"):
                return self._skip(rec, "not_byte_exact", f"the {side}'s tokenizer does not give the rendered chat "
                                  "back byte for byte (a normalizer rewrites text)")
        if len(t_turns) != len(s_turns):
            return self._skip(rec, "turns", f"{len(t_turns)} assistant turns in the teacher's rendering, "
                              f"{len(s_turns)} in the student's")
        rows = {int(p): r for r, p in enumerate(rec.positions)}          # teacher position -> cache row
        pos, kind, src = [], [], []
        for turn, (tt, ts) in enumerate(zip(t_turns, s_turns)):
            if tt.text != ts.text:
                return self._skip(rec, "answer_text", "the two templates write an answer differently "
                                  f"({tt.text[:30]!r} against {ts.text[:30]!r})")
            w_t = len(t_text[:tt.at].encode("utf-8"))
            w_s = len(s_text[:ts.at].encode("utf-8"))
            n = len(tt.text.encode("utf-8"))
            t_at = {int(t_bytes[j]) - w_t: j for j in range(tt.start, tt.end)}     # answer offset -> teacher token
            for j in range(max(ts.start, 1), ts.end):
                k, jt = TEMPLATE, None
                rel = int(s_bytes[j]) - w_s
                if j == ts.end - 1 and s_ids[j] in self.s_ends:
                    if open_end and turn == len(s_turns) - 1:   # its writer never ended it: its end is not trained
                        continue
                    if t_ids[tt.end - 1] in self.t_ends:
                        k, jt = END_OF_TURN, tt.end - 1
                elif s_bytes[j + 1] == s_bytes[j]:        # a dummy-prefix token that covers no byte: markup
                    k = TEMPLATE
                elif 0 <= rel < n:
                    jt = t_at.get(rel)
                    if jt is None:
                        k = INSIDE
                    else:
                        same_end = int(s_bytes[j + 1]) - w_s == int(t_bytes[jt + 1]) - w_t
                        k = ONE_TO_ONE if same_end else ALIGNED
                r = rows.get(jt - 1, -1) if jt is not None else -1
                if k in TEACHER_KINDS and r < 0:               # the cache holds no distribution there
                    k = INSIDE if k != END_OF_TURN else TEMPLATE
                pos.append(j - 1)
                kind.append(k)
                src.append(r)
        return self._student_record(rec, np.asarray(s_ids, np.int32), np.asarray(pos, np.int32),
                                    np.asarray(kind, np.int8), np.asarray(src, np.int64), t_ids, open_end)

    def _generated_chat(self, rec, msgs):
        """A generate-mode sample's chat: the source's prompt, then the completion's text (the bytes of its ids
        before the end of turn); None where that is no text."""
        ids = rec.input_ids[int(rec.positions[0]) + 1:].tolist()
        if not rec.truncated and ids and ids[-1] in self.t_ends:
            ids = ids[:-1]
        if any(t in self.t_added for t in ids):
            return None
        text = utf8_text(b"".join(self.t_pieces[t] for t in ids), bool(rec.truncated))
        return None if text is None else before_last_answer(msgs) + [{"role": "assistant", "content": text}]

    def _student_record(self, rec, ids, pos, kind, src, t_ids, truncated=False):
        P = len(pos)
        k = max(rec.topk_ids.shape[1], 1)
        out_ids = np.full((P, k), -1, np.int64)
        out_lp = np.full((P, k), -np.inf, np.float32)
        tail = np.zeros(P, np.float32)
        target_lp = np.full(P, np.nan, np.float32)
        targets = ids[pos + 1]
        teach = np.isin(kind, TEACHER_KINDS)
        rows = src[teach]
        if len(rows):
            m_ids, m_lp, m_tail = map_topk(rec.topk_ids[rows], rec.topk_logprobs[rows], self.t2s)
            out_ids[teach], out_lp[teach] = m_ids, m_lp
            tail[teach] = np.exp(m_tail)
            top = np.exp(np.where(rec.topk_ids[rows] >= 0, rec.topk_logprobs[rows].astype(np.float64), -np.inf))
            self.coverage.topk_mass += float(top.sum())
            self.coverage.mapped_mass += float(np.exp(m_lp.astype(np.float64)).sum())
            if rec.target_logprobs is not None:              # the teacher's own target, where it is the student's
                t_targets = np.asarray(t_ids)[rec.positions[rows] + 1]
                same = self.t2s[t_targets] == targets[teach]
                target_lp[np.flatnonzero(teach)[same]] = rec.target_logprobs[rows][same]
        own = ~teach                                        # the student's cross-entropy on the reference token
        out_ids[own, 0], out_lp[own, 0], target_lp[own] = targets[own], 0.0, 0.0
        self.coverage.samples += 1
        self.coverage.positions.update(kind.tolist())
        return Record(rec.sample_id, ids, pos, out_ids, out_lp, tail, truncated, target_lp, position_kinds=kind)

    def reduced(self) -> dict:
        """Coverage.summary() over every rank (a collective: each rank calls it)."""
        from .distributed import all_reduce
        c = self.coverage
        flat = all_reduce([float(c.samples), c.topk_mass, c.mapped_mass] + [float(c.positions[i]) for i in
                                                                             range(len(KINDS))]
                          + [float(c.skipped[r]) for r in REASONS])
        total = Coverage(positions=Counter({i: int(flat[3 + i]) for i in range(len(KINDS))}), topk_mass=flat[1],
                         mapped_mass=flat[2], samples=int(flat[0]),
                         skipped=Counter({r: int(v) for r, v in zip(REASONS, flat[3 + len(KINDS):]) if v}),
                         first_skip=dict(c.first_skip))
        return total.summary()

    def convert_all(self, records):
        return [r for r in (self.convert(x) for x in records) if r is not None]


def cross_converters(cfg, tok, streams) -> list:
    """Per cache of the run (cfg.caches' order): its CrossTokenizer, or None where the run is token-exact (no
    --cross-tokenizer, or the student's tokenizer is the cache's own)."""
    if not getattr(cfg, "cross_tokenizer", False):
        return [None] * len(cfg.caches)
    return [None if same_tokenizer(tok, s.cache.manifest) else CrossTokenizer(s.cache, tok) for s in streams]


def coverage_state(converters) -> list:
    """Each converter's counts so far (None where a cache is token-exact), for a checkpoint: a resumed run's
    coverage then covers every sample trained since step 1, not only its own."""
    return [None if c is None else {"positions": {str(k): v for k, v in c.coverage.positions.items()},
                                    "topk_mass": c.coverage.topk_mass, "mapped_mass": c.coverage.mapped_mass,
                                    "samples": c.coverage.samples, "skipped": dict(c.coverage.skipped),
                                    "first_skip": dict(c.coverage.first_skip)} for c in converters or ()]


def restore_coverage(converters, saved):
    """Set the converters' counts to a checkpoint's (coverage_state); nothing where it holds none or is of
    other caches."""
    if not saved or len(saved) != len(converters or ()):
        return
    for c, s in zip(converters, saved):
        if c is not None and s is not None:
            c.coverage = Coverage(positions=Counter({int(k): v for k, v in s["positions"].items()}),
                                  topk_mass=s["topk_mass"], mapped_mass=s["mapped_mass"], samples=s["samples"],
                                  skipped=Counter(s["skipped"]), first_skip=dict(s["first_skip"]))


def loss_by_kind(kinds, cfg, loss_of):
    """The loss of a batch whose positions have kinds (Batch.position_kinds): cfg at the positions trained on the
    teacher's mapped distribution, the student's cross-entropy (the sft objective) at the others. loss_of(keep,
    cfg) -> (loss sum, parts) over the positions `keep` (an index tensor) selects. Returns (loss sum, parts) with
    parts["by_kind"] = {kind: [positions, loss sum]}."""
    import torch
    own = replace(cfg, objective="sft", sft_alpha=0.0, beta=0.0, temperature=1.0)
    total, parts = None, {"kd": 0.0, "sft": 0.0, "positions": int(kinds.numel()), "by_kind": {}}
    for k in torch.unique(kinds).tolist():
        keep = (kinds == k).nonzero().squeeze(1)
        loss, p = loss_of(keep, cfg if k in TEACHER_KINDS else own)
        total = loss if total is None else total + loss
        parts["kd"] += p["kd"]
        parts["sft"] += p["sft"]
        parts["by_kind"][KINDS[k]] = [int(keep.numel()), float(loss.detach())]
    return total, parts


def coverage_line(cache, cov: dict) -> str:
    shares = ", ".join(f"{k} {cov['share_' + k]:.1%}" for k in KINDS)
    skipped = "; ".join(f"{k} {v}" for k, v in sorted(cov["skipped"].items()))
    return (f"{cache}: --cross-tokenizer, {cov['samples']:,} samples, {cov['positions']:,} positions: {shares}; "
            f"teacher top-k mass mapped {cov['mass_mapped']:.1%}"
            + (f"; skipped {skipped} (first: {next(iter(cov['first_skipped'].values()))})" if skipped else ""))


def _generated_prefix(rec, t_ids, t_turns) -> bool:
    """A generate-mode sample's ids are the teacher's rendering of its chat up to where generation stopped: its
    last answer's end of turn (the template writes a suffix after it), or for an answer cut by the budget, the
    token before that end of turn."""
    n = len(rec.input_ids)
    return bool(t_turns) and list(t_ids[:n]) == rec.input_ids.tolist() and \
        t_turns[-1].end == n + (1 if rec.truncated else 0)


def _template_end(tok, ends):
    """The id that closes an assistant turn in `tok`'s own template (what its end_of_turn_ids found after an
    answer), else its EOS."""
    marker = "kdcacheANSWERkdcache"
    text = tok.apply_chat_template([{"role": "user", "content": "q"}, {"role": "assistant", "content": marker}],
                                   tokenize=False)
    after = tok(text[text.index(marker) + len(marker):], add_special_tokens=False)["input_ids"]
    first = next((t for t in after if t in ends), None)
    if first is None and tok.eos_token_id is None:
        raise ConfigError("cross_tokenizer: the student's tokenizer has no end-of-turn token")
    return int(first if first is not None else tok.eos_token_id)


def cleanup(converters):
    """Remove the teacher tokenizers' temporary copies."""
    import shutil
    for c in converters or ():
        d = getattr(c.teacher, "name_or_path", "")
        if d and os.path.basename(d).startswith("kdcache-teacher-tok-"):
            shutil.rmtree(d, ignore_errors=True)
