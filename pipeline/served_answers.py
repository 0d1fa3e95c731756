"""Reading a served teacher's answers: every id, log-prob and echo is checked before it is believed.

vLLM's prompt_logprobs[j] is the distribution predicting prompt token j, keyed by token id (as a string) with its
logprob and rank; the entry holds the prompt token (any rank) and ranks 1..k. Our position t predicts token t+1: it
reads entry t+1. A generation's `logprobs` (with return_tokens_as_token_ids) holds each step's top-k.

Refused, as a BadAnswer the worker names the sample with: an id key that is not a canonical integer in [0, 2^31), a
log-prob that is not a finite number <= 0 (vLLM writes -inf as -9999), an id twice in a row, and a target that breaks
the format's target rule (cache_format/values.py): ranked outside the top-k yet likelier than the k-th entry, or
with a probability that takes the top-k mass past 1.
"""
import numpy as np

from kdcache.cache_format.values import MAX_EXCESS_MASS, TARGET_TOL, exact_figures, target_violations

from .served_http import BadAnswer, ServerError
from .teacher import Scored

MAX_ID = 2 ** 31 - 1    # token ids are stored as int32: a larger one is no vocabulary's


def _id(key, prefix=""):
    """A token id from the server's key `prefix<id>`: only the canonical spelling of an integer in [0, MAX_ID]."""
    digits = key[len(prefix):] if isinstance(key, str) and key.startswith(prefix) else None
    if (digits is None or not 0 < len(digits) <= 10 or not digits.isdigit() or not digits.isascii()
            or digits != str(int(digits))):
        raise BadAnswer(f"a token id key {str(key)[:40]!r} is not {prefix or ''}<a non-negative integer without "
                        "leading zeros>")
    if int(digits) > MAX_ID:
        raise BadAnswer(f"token id {digits} is over {MAX_ID} (int32): no vocabulary holds it")
    return int(digits)


def _logprob(value, where):
    """A log-prob the server gave: a finite number <= 0, or its -9999 for -inf."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value) or value > 1e-4:
        raise BadAnswer(f"{where}: log-prob {value!r} is not a finite number <= 0")
    return float(value)


def max_answer_bytes(positions, k):
    """The most an answer about `positions` positions of k entries each can need (JSON of generous size)."""
    return 65536 + int(positions) * (int(k) + 2) * 400


def _choice(resp):
    choices = resp.get("choices") if isinstance(resp, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise BadAnswer(f"the teacher server answered without choices: {str(resp)[:300]}")
    return choices[0]


def generated_ids(new, budget, stops):
    """The ids a generation answer reports: ints, at most `budget` of them, a stop id only as the last."""
    if not isinstance(new, list):
        raise BadAnswer("no token_ids in the answer to a generation request (return_token_ids needs vLLM 0.10.2 or "
                        "later)")
    if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= MAX_ID for t in new):
        raise BadAnswer(f"token_ids hold something other than integers in [0, {MAX_ID}]: {str(new[:8])[:200]}")
    if len(new) > budget:
        raise BadAnswer(f"{len(new)} token ids generated, more than the {budget} asked for (max_tokens)")
    early = [j for j, t in enumerate(new[:-1]) if t in stops]
    if early:
        raise BadAnswer(f"a stop id ({new[early[0]]}) at generated step {early[0]} of {len(new)}: generation goes "
                        "on past the job's end-of-turn ids")
    return list(new)


def parse_prompt_logprobs(plp, seq, positions, k):
    """Scored at `positions` from a vLLM completion's prompt_logprobs for the prompt `seq`.

    plp[j] is None for j = 0, else {"<token id>": {"logprob", "rank", "decoded_token"}} holding the prompt token
    seq[j] (any rank) and the top-k by rank 1..k (k entries when seq[j] is one of them). The server writes
    -inf as -9999.0.
    """
    seq = np.asarray(seq)
    if not isinstance(plp, list) or len(plp) != len(seq):
        n = len(plp) if isinstance(plp, list) else None
        raise BadAnswer(f"the teacher server returned prompt_logprobs for {n} positions, expected {len(seq)} "
                        "(is it vLLM, started with --max-logprobs at least top_k?)")
    P = len(positions)
    ids = np.empty((P, k), dtype=np.int32)
    lps = np.empty((P, k), dtype=np.float32)
    target_lp = np.empty(P, dtype=np.float32)
    for row, t in enumerate(np.asarray(positions, dtype=np.int64)):
        entry, target = plp[t + 1], int(seq[t + 1])
        if not isinstance(entry, dict):
            raise ServerError(f"the teacher server returned no prompt logprobs at position {t + 1}")
        slots, t_lp = [None] * k, None
        for key, v in entry.items():
            if not isinstance(v, dict) or "logprob" not in v:
                raise BadAnswer(f"prompt position {t + 1}: the entry of {key!r} is {v!r}, not {{logprob, rank}}")
            tid, rank = _id(key), v.get("rank")
            lp = _logprob(v["logprob"], f"prompt position {t + 1}, token {tid}")
            if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
                raise BadAnswer(f"prompt position {t + 1}, token {tid}: rank {rank!r} is not an integer")
            if tid == target:
                t_lp = lp
            # A prompt token that ties a top-k token can share its rank: the top-k token keeps the slot.
            if rank is not None and 1 <= rank <= k and (slots[rank - 1] is None or slots[rank - 1][0] == target):
                slots[rank - 1] = (tid, lp)
        if t_lp is None or any(s is None for s in slots):
            got = sum(s is not None for s in slots)
            raise BadAnswer(f"the teacher server gave {got} of the top-{k} entries at a prompt position, "
                            f"{'with' if t_lp is not None else 'without'} the prompt token")
        if len({s[0] for s in slots}) < k:
            raise BadAnswer(f"prompt position {t + 1}: one token id at two ranks of the top-{k}")
        ids[row] = [s[0] for s in slots]
        lps[row] = [s[1] for s in slots]
        target_lp[row] = t_lp
    pos = np.asarray(positions, dtype=np.int64)
    check_targets(ids, lps, seq[pos + 1], target_lp, lambda r: f"prompt position {pos[r] + 1}")
    return Scored(ids, lps, target_lp)


def parse_step_logprobs(logprobs, new_ids, k):
    """Scored at each generated step from a completion's `logprobs` (requested with logprobs k and
    return_tokens_as_token_ids): top_logprobs[j] maps "token_id:<id>" to the log-prob of each of the top k at
    step j, plus the generated token where it is outside them; token_logprobs[j] is the generated token's."""
    n = len(new_ids)
    if n == 0:
        return Scored(np.empty((0, k), np.int32), np.empty((0, k), np.float32), np.empty(0, np.float32))
    tops = logprobs.get("top_logprobs") if isinstance(logprobs, dict) else None
    own = logprobs.get("token_logprobs") if isinstance(logprobs, dict) else None
    if not isinstance(tops, list) or not isinstance(own, list) or len(tops) != n or len(own) != n:
        raise BadAnswer(f"the teacher server returned logprobs for {len(tops) if isinstance(tops, list) else None}"
                        f" generated steps, expected {n} (is it vLLM, started with --max-logprobs at least top_k?)")
    ids = np.empty((n, k), dtype=np.int32)
    lps = np.empty((n, k), dtype=np.float32)
    for j, entry in enumerate(tops):
        if not isinstance(entry, dict) or len(entry) < k:
            raise BadAnswer(f"the teacher server gave {len(entry) if isinstance(entry, dict) else 0} entries "
                            f"at generated step {j}, expected the top-{k}")
        pairs = []
        for key, lp in entry.items():
            if not (isinstance(key, str) and key.startswith("token_id:")):
                raise BadAnswer(f"the teacher server named a token {key!r}, not 'token_id:<id>' (it needs "
                                "return_tokens_as_token_ids: vLLM 0.5 or later)")
            pairs.append((-_logprob(lp, f"generated step {j}"), _id(key, "token_id:")))
        if len({t for _, t in pairs}) < len(pairs):
            raise BadAnswer(f"generated step {j}: one token id twice")
        pairs.sort()                                   # by log-prob, highest first; ties by id
        ids[j] = [t for _, t in pairs[:k]]
        lps[j] = [-lp for lp, _ in pairs[:k]]
    own_lp = np.asarray([_logprob(x, f"generated step {j}") for j, x in enumerate(own)], dtype=np.float32)
    check_targets(ids, lps, np.asarray(new_ids), own_lp, lambda j: f"generated step {j}")
    return Scored(ids, lps, own_lp)


def check_targets(ids, lps, targets, target_lp, where):
    """The format's mass and target rules (cache_format/values.py) on one answer: ids, lps [P, k] a row's top-k,
    targets [P] the token each row's target_lp [P] is for; BadAnswer naming where(row) of the first row that breaks
    one. The writer checks the same, but here the server is still the one to name."""
    among, kth, mass = exact_figures(ids, lps, targets)
    over_k = mass > 1 + MAX_EXCESS_MASS
    above, over, total = target_violations(among, kth, mass, target_lp, upper=lambda lp: lp,
                                           mass_limit=1 + MAX_EXCESS_MASS)
    for bad, why in ((over_k, lambda r: f"its top-{ids.shape[1]} probabilities sum to {mass[r]:.6f}, more than 1"),
                     (above, lambda r: f"token {int(targets[r])} is ranked outside the top-{ids.shape[1]} yet given "
                                       f"log-prob {float(target_lp[r]):.6g}, above the k-th entry's "
                                       f"{float(kth[r]):.6g} (+{TARGET_TOL:g})"),
                     (over, lambda r: f"token {int(targets[r])}, outside the top-{ids.shape[1]}, is given "
                                      f"probability {np.exp(float(target_lp[r])):.6f}, which takes the mass to "
                                      f"{total[r]:.6f}, more than 1")):
        if bad.any():
            r = int(np.flatnonzero(bad)[0])
            more = f" (and {int(bad.sum()) - 1} more)" if bad.sum() > 1 else ""
            raise BadAnswer(f"{where(r)}: {why(r)}{more}: not a distribution a teacher can give")
