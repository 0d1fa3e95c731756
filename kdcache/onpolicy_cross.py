"""`kdcache onpolicy --cross-tokenizer`: a round whose student is of another tokenizer family than the teacher.

The student's token ids mean nothing to the teacher, so a round's rollout is carried as text (GOLD's on-policy
step, from a cache). Three steps, each resumable as the same-tokenizer round is:

  1. rollout:  `kdcache precompute --mode generate --teacher STUDENT --top-k 1`: the student writes its
               completions from its own rendering of each prompt (its template, its ids) into a cache of its
               own (rounds/round-RRRR/rollout.txt names it);
  2. text:     each completion's ids are turned into their bytes (the student's tokenizer files map ids to
               bytes) and written as a chat: the prompt's messages and the answer's text
               (rounds/round-RRRR/chats.jsonl). A completion cut by --gen-max-new-tokens is marked
               "truncated": its answer is trained, the end of turn the templates add is not (bytes of a
               character the cut split are dropped). A completion that is not text (bytes that are no UTF-8,
               a special token of the student's inside it, only whitespace) is counted by reason and left out,
               never scored as something else;
  3. scoring:  `kdcache precompute --teacher TEACHER --data chats.jsonl`: the teacher renders and scores each
               chat in its own template, a score-mode cache with its source (SPEC.md 4.6).
Training then runs with --cross-tokenizer (train/cross.py): the student renders the same chats with its own
template, and the teacher's rows are mapped onto its positions by byte offsets, its end of turn included.
"""
import json
import os

from kdcache.cache_format.manifest import load_manifest
from kdcache.cache_format.reader import open_cache
from kdcache.cache_format.tokenizer_id import diff_identity, tokenizer_identity
from kdcache.common.atomic import atomic_write_bytes
from kdcache.common.chat import before_last_answer
from kdcache.common.errors import ConfigError, KdcacheError

REASONS = ("not_utf8", "special_token", "blank")   # why a completion is left out of the scoring


def cross_rounds(train: dict, teachers: list[str], student: str, tokenizer: str | None = None) -> bool:
    """True when the rounds go through text: --cross-tokenizer, and the student's tokenizer is not a teacher's
    (with the same tokenizer the flag changes nothing: the rounds are token-exact, and the loop says so)."""
    if not train.get("cross_tokenizer"):
        return False
    from transformers import AutoTokenizer
    s_tok = AutoTokenizer.from_pretrained(tokenizer or student)
    differ = False
    for teacher in teachers:
        if "://" in teacher:
            raise ConfigError("cross_tokenizer: a served teacher (a URL) with --cross-tokenizer: its tokenizer "
                              "would need a flag of its own beside the student's --tokenizer; use a teacher "
                              "directory")
        t_tok = AutoTokenizer.from_pretrained(teacher)
        differ = differ or bool(diff_identity(tokenizer_identity(t_tok), tokenizer_identity(s_tok)))
        if not getattr(t_tok, "chat_template", None):
            raise ConfigError(f"cross_tokenizer: the teacher {teacher}'s tokenizer has no chat template: each side "
                              "renders the round's chats with its own")
    if not differ:
        print("[onpolicy] --cross-tokenizer: the student's tokenizer is the teacher's; the rounds are token-exact",
              flush=True)
        return False
    if not getattr(s_tok, "chat_template", None):
        raise ConfigError("cross_tokenizer: the student's tokenizer has no chat template: each side renders the "
                          "round's chats with its own")
    return True


def rollout_settings(pre: dict, student: str) -> dict:
    """The student's own rollout job: precompute's settings with the student as the model that generates and
    scores (one entry per position: only its ids are used), never sampled draws or adaptive k."""
    out = dict(pre, teacher=student, mode="generate", top_k=1, sample=0, top_p=None)
    return out


def scoring_settings(pre: dict, teacher: str) -> dict:
    """The teacher's scoring job of the round's chats (--tokenizer names the student's, so it is not passed)."""
    out = {k: v for k, v in pre.items() if k not in ("tokenizer",) and not k.startswith("gen_")}
    return dict(out, teacher=teacher, mode="score")


def completion_chats(rollout_cache: str, prompt_lines: list[str], student_tok) -> tuple[list[dict], dict]:
    """(chat records, counts): each completion of the rollout cache as a chat record (the prompt's messages before
    its last answer, then the completion's text), in sample order. counts: prompts, completions, truncated,
    each REASONS' number with the first sample it named, and rollout_samples: the rollout's sample id of each
    chat record (chat record i is sample i of the scoring cache)."""
    from kdcache.pipeline.data import parse_row
    from kdcache.train.align import token_bytes, utf8_text
    pieces = token_bytes(student_tok)
    special = set(student_tok.all_special_ids)
    ends = set(int(t) for t in load_manifest(rollout_cache).eos_token_ids)
    rows, counts = [], {"prompts": len(prompt_lines), "completions": 0, "truncated": 0,
                        **{r: 0 for r in REASONS}, "first_left_out": {},
                        "rollout_samples": []}
    with open_cache(rollout_cache) as cache:
        records = sorted(cache, key=lambda r: r.sample_id)
    for rec in records:
        counts["completions"] += 1
        ids = rec.input_ids[int(rec.positions[0]) + 1:].tolist()
        if not rec.truncated and ids and ids[-1] in ends:
            ids = ids[:-1]
        reason = "special_token" if any(t in special for t in ids) else None
        text = utf8_text(b"".join(pieces[t] for t in ids), rec.truncated)
        if text is None:
            text, reason = "", reason or "not_utf8"
        if not reason and not text.strip():      # a dataset's answer is never blank (pipeline/data.py)
            reason = "blank"
        if reason:
            counts[reason] += 1
            counts["first_left_out"].setdefault(reason, f"{rollout_cache} sample {int(rec.sample_id)}")
            continue
        ex = parse_row(json.loads(prompt_lines[int(rec.sample_id)]))
        answer = [{"role": "assistant", "content": text}]
        row = {"messages": before_last_answer(ex.messages or [{"role": "user", "content": ex.prompt}]) + answer}
        if ex.teacher_messages:
            row["teacher_messages"] = before_last_answer(ex.teacher_messages) + answer
        if rec.truncated:
            row["truncated"] = True
            counts["truncated"] += 1
        rows.append(row)
        counts["rollout_samples"].append(int(rec.sample_id))
    return rows, counts


def write_chats(path, rollout_cache, prompt_lines, student_dir, tokenizer=None) -> dict:
    """Write the round's chats (atomically; the same rollout gives the same file) and return their counts."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tokenizer or student_dir)
    rows, counts = completion_chats(rollout_cache, prompt_lines, tok)
    if not rows:
        raise KdcacheError(f"{rollout_cache}: none of the student's {counts['completions']} completions is text "
                           f"the teacher can score ({completions_line(counts)}); nothing to train this round on")
    atomic_write_bytes(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8"))
    atomic_write_bytes(path + ".counts.json", json.dumps(counts, indent=1).encode())
    return counts


def completions_line(counts) -> str:
    left = [f"{r} {counts[r]}" for r in REASONS if counts[r]]
    return (f"{counts['completions']} of {counts['prompts']} prompts completed, {counts['truncated']} cut by "
            f"--gen-max-new-tokens (their end of turn not trained)"
            + (f", left out: {', '.join(left)} (first: {next(iter(counts['first_left_out'].values()))})"
               if left else ""))


def read_location(where):
    if not os.path.isfile(where):
        return None
    with open(where) as f:
        return f.read().strip()
