"""Served teacher backend: an OpenAI-compatible vLLM server (`vllm serve`) over HTTP.

For teachers that live on their own nodes. Token-id prompts only (never text, so nothing is re-templated):
scoring is `/v1/completions` with the sequence as `prompt` (a list of ids), `max_tokens` 1 and vLLM's
`prompt_logprobs` k; generation is `/v1/completions` with `max_tokens`, the sampling settings, the job's
stop ids and `return_token_ids`, so the new ids come back as ids; with `logprobs` k and
`return_tokens_as_token_ids` the same request gives each generated step's top-k (generate_scored: one
request per sample). vLLM's prompt_logprobs[j] is the
distribution predicting prompt token j, keyed by token id (as a string) with its logprob and rank; the
entry holds the prompt token (any rank) and ranks 1..k. Our position t predicts token t+1: it reads entry t+1.

Standard library only (http.client and a thread pool): `requests_in_flight` requests per worker, retries
with exponential backoff on connection errors, timeouts, 5xx, 408 and 429 for up to `retry_s` (attempts
included); any other 4xx is the server refusing one sequence, raised as SampleFailed (the worker names the
sample). Each attempt has one deadline, `timeout_s`, across connecting, sending and every read (a server that
trickles a byte a second cannot hold it longer), and an answer larger than the request can need (from k and
the sequence's length) is refused before it is read whole.

Nothing the server says is trusted: an id key that is not a canonical non-negative integer, a log-prob that is
not a finite number <= 0 (vLLM writes -inf as -9999), an id twice in a row, a missing echo of the prompt ids,
more generated ids than max_tokens or a stop id before the last one: each is a BadAnswer naming the server,
and the worker names the sample. The mass and id checks every backend's records pass are the writer's
(cache_format.record.check_record).
"""
import http.client
import json
import threading
import time
import urllib.parse
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

import numpy as np

from kdcache.common.env import env_seconds
from kdcache.common.errors import KdcacheError

from .teacher import SampleFailed, Scored

RETRY_S = 120.0        # how long a request is retried on connection errors and 5xx (KDCACHE_SERVED_RETRY_S)
TIMEOUT_S = 600.0      # one HTTP request, queueing on the server included (KDCACHE_SERVED_TIMEOUT_S)
BACKOFF_MAX_S = 10.0
RETRYABLE = {408, 429}   # and every 5xx


class ServerError(KdcacheError):
    """The teacher server cannot be reached, keeps failing, or is not a vLLM server serving one model."""


class BadAnswer(SampleFailed, ServerError):
    """The server's answer for one sequence is malformed (the worker names the sample)."""


def _id(key, prefix=""):
    """A token id from the server's key `prefix<id>`: only the canonical spelling of a non-negative integer."""
    digits = key[len(prefix):] if isinstance(key, str) and key.startswith(prefix) else None
    if digits is None or not digits.isdigit() or not digits.isascii() or digits != str(int(digits)):
        raise BadAnswer(f"a token id key {key!r} is not {prefix or ''}<a non-negative integer without leading zeros>")
    return int(digits)


def _logprob(value, where):
    """A log-prob the server gave: a finite number <= 0, or its -9999 for -inf."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value) or value > 1e-4:
        raise BadAnswer(f"{where}: log-prob {value!r} is not a finite number <= 0")
    return float(value)


def max_answer_bytes(positions, k):
    """The most an answer about `positions` positions of k entries each can need (JSON of generous size)."""
    return 65536 + int(positions) * (int(k) + 2) * 400


class Client:
    """JSON over HTTP to one server, one keep-alive connection per thread, with bounded retries."""

    def __init__(self, url, *, retry_s=None, timeout_s=None):
        u = urllib.parse.urlsplit(url.rstrip("/"))
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ServerError(f"teacher: {url} is not an http:// or https:// URL")
        path = u.path.rstrip("/")
        self.api = path if path.endswith("/v1") else path + "/v1"    # OpenAI routes
        self.root = self.api[:-len("/v1")]                            # /version, /health
        self.url = f"{u.scheme}://{u.netloc}{self.api}"
        self._conn_args = (u.hostname, u.port)
        self._https = u.scheme == "https"
        self.retry_s = env_seconds("KDCACHE_SERVED_RETRY_S", RETRY_S) if retry_s is None else retry_s
        self.timeout_s = env_seconds("KDCACHE_SERVED_TIMEOUT_S", TIMEOUT_S) if timeout_s is None else timeout_s
        self._local = threading.local()
        self.retried = 0              # requests that failed at least once and were tried again (summary.json)
        self._count = threading.Lock()

    def _conn(self):
        c = getattr(self._local, "conn", None)
        if c is None:
            cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
            c = self._local.conn = cls(*self._conn_args, timeout=self.timeout_s)
        return c

    def _drop(self):
        c = getattr(self._local, "conn", None)
        self._local.conn = None
        if c is not None:
            c.close()

    def _once(self, method, path, body, deadline, max_bytes):
        """(status, body) of one attempt, all of it before `deadline` (time.monotonic()); TimeoutError past it.
        A body over max_bytes is refused (BadAnswer) as soon as it is larger."""
        conn = self._conn()
        headers = {"Content-Type": "application/json", "Accept": "application/json"}

        def left():
            rest = deadline - time.monotonic()
            if rest <= 0:
                raise TimeoutError(f"no whole answer within {self.timeout_s:g} s (KDCACHE_SERVED_TIMEOUT_S)")
            if conn.sock is not None:
                conn.sock.settimeout(rest)
            return rest
        try:
            conn.timeout = left()
            conn.request(method, path, body=body, headers=headers)
            left()
            resp = conn.getresponse()
            chunks, size = [], 0
            while True:
                left()
                chunk = resp.read1(65536) if hasattr(resp, "read1") else resp.read(65536)
                if not chunk:
                    break
                size += len(chunk)
                if max_bytes and size > max_bytes:
                    raise BadAnswer(f"the answer is over {max_bytes:,} bytes, more than this request can need")
                chunks.append(chunk)
            data = b"".join(chunks)
        except BaseException:
            self._drop()
            raise
        if resp.will_close:
            self._drop()
        return resp.status, data

    def request(self, method, route, payload=None, *, what="request", api=True, say=None, max_bytes=None):
        """The decoded JSON answer of a 2xx. Retries transient failures (say(message) at the first one, if given)
        while the retry budget lasts, attempts included; raises SampleFailed on other 4xx (`what` names the request
        in the message) and ServerError once retrying is over. max_bytes: the largest answer accepted."""
        path = (self.api if api else self.root) + route
        body = None if payload is None else json.dumps(payload).encode()
        t0, delay, attempt = time.monotonic(), 0.5, 0
        while True:
            attempt += 1
            # The first attempt may take timeout_s (a long queue on the server is normal); a retry only what is
            # left of the retry budget.
            budget = self.timeout_s if attempt == 1 else max(0.5, min(self.timeout_s, t0 + self.retry_s -
                                                                     time.monotonic()))
            try:
                status, data = self._once(method, path, body, time.monotonic() + budget, max_bytes)
            except BadAnswer as e:
                raise BadAnswer(f"the teacher server at {self.url} ({what}): {e}") from None
            except (OSError, http.client.HTTPException) as e:
                problem = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            else:
                if status < 300:
                    try:
                        return json.loads(data)
                    except ValueError:
                        problem = f"HTTP {status} with a body that is not JSON: {data[:200]!r}"
                elif status < 500 and status not in RETRYABLE:
                    raise SampleFailed(f"the teacher server refused the {what} (HTTP {status} from "
                                       f"{method} {self.url_of(path)}): {_error_message(data)}")
                else:
                    problem = f"HTTP {status}: {_error_message(data)}"
            waited = time.monotonic() - t0          # attempts and waits alike
            if attempt == 1:
                with self._count:
                    self.retried += 1
            if say and attempt == 1:
                say(f"the teacher server at {self.url} did not answer the {what} ({problem}); retrying for up to "
                    f"{self.retry_s:g} s (KDCACHE_SERVED_RETRY_S)")
            if waited + delay >= self.retry_s:
                raise ServerError(
                    f"the teacher server at {self.url} failed the {what} {attempt} time(s) over {waited:.0f} s "
                    f"(last: {problem}); giving up after KDCACHE_SERVED_RETRY_S={self.retry_s:g} s. Check that "
                    "the server runs and answers, then rerun the same command to resume")
            time.sleep(delay)
            delay = min(delay * 2, BACKOFF_MAX_S)

    def url_of(self, path):
        scheme = "https" if self._https else "http"
        host, port = self._conn_args
        return f"{scheme}://{host}{'' if port is None else f':{port}'}{path}"


def _error_message(data):
    """The server's error message: vLLM's {"error": {"message": ...}}, an older {"message": ...}, or the text."""
    try:
        obj = json.loads(data)
    except ValueError:
        return data[:500].decode("utf-8", "replace").strip() or "(empty body)"
    if isinstance(obj, dict):
        err = obj.get("error", obj)
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str):
            return err
        if obj.get("detail"):
            return str(obj["detail"])
    return json.dumps(obj)[:500]


def server_info(url, client=None, say=print):
    """What the server reports about itself, the fingerprint's teacher part: {model, max_model_len, vllm_version}.

    Refuses a server that is not vLLM (no /version: prompt_logprobs is a vLLM extension) or that serves
    several base models."""
    client = client or Client(url)
    try:
        models = client.request("GET", "/models", what="model list (GET /v1/models)", say=say)
    except SampleFailed as e:
        raise ServerError(f"teacher: {client.url} is not an OpenAI-compatible server ({e})") from None
    base = [m for m in models.get("data", []) if isinstance(m, dict) and not m.get("parent")]
    if len(base) != 1:
        names = ", ".join(repr(m.get("id")) for m in base) or "none"
        raise ServerError(f"teacher: {client.url} serves {len(base)} base models ({names}); kdcache needs a "
                          "server of exactly one")
    try:
        version = client.request("GET", "/version", what="version (GET /version)", api=False).get("version")
    except SampleFailed as e:
        raise ServerError(f"teacher: {client.url} does not look like a vLLM server ({e}); kdcache needs vLLM's "
                          "prompt_logprobs (vllm serve)") from None
    m = base[0]
    if not m.get("max_model_len"):
        raise ServerError(f"teacher: {client.url} does not report max_model_len for {m.get('id')!r}")
    return {"model": str(m["id"]), "max_model_len": int(m["max_model_len"]), "vllm_version": str(version)}


def check_top_k(url, server, k, client=None):
    """Refuse, before any work, a top_k the server does not give (its --max-logprobs is below it)."""
    client = client or Client(url)
    body = {"model": server["model"], "prompt": [0, 0], "max_tokens": 1, "prompt_logprobs": int(k), **NEUTRAL}
    try:
        client.request("POST", "/completions", body, what=f"probe request (prompt_logprobs={k})")
    except SampleFailed as e:
        from kdcache.common.errors import ConfigError
        raise ConfigError(f"top_k: {k} is refused by the teacher server at {client.url}: {e}. Start the server with "
                          f"--max-logprobs {k} or more (vllm serve ... --max-logprobs {k}), or lower --top-k") from None


# Sampling settings sent with every request: what the in-process backends use, so that the server's
# defaults (vllm serve applies the model's generation_config.json) never change a result.
NEUTRAL = {"top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}


class ServedTeacher:
    """A teacher behind `vllm serve`, reached at model_path = http(s)://HOST:PORT/v1. Meets pipeline.teacher.Teacher."""
    engine = "http.client"     # the standard library: always importable

    def __init__(self, model_path, *, requests_in_flight=8, expect=None, seed=0, retry_s=None, timeout_s=None, **_):
        self.client = Client(model_path, retry_s=retry_s, timeout_s=timeout_s)
        self.info = server_info(model_path, self.client, say=None)
        if expect is not None and self.info != expect:
            raise ServerError(f"the teacher server at {self.client.url} now reports {self.info}, but this job "
                              f"started against {expect}; rerun the command to fingerprint the server anew")
        self.model = self.info["model"]
        self.max_model_len = self.info["max_model_len"]
        self.pool = ThreadPoolExecutor(max_workers=max(1, int(requests_in_flight)), thread_name_prefix="served")

    # -- the Teacher protocol

    def score(self, seqs, positions, k):
        """See pipeline.teacher.Teacher.score: one Scored per sequence, one request per sequence."""
        return self._map(lambda s, p: self._score_one(np.asarray(s), np.asarray(p), k), seqs, positions)

    def generate(self, prompts, *, max_new_tokens, temperature, top_p, seeds, turn_ends):
        """See pipeline.teacher.Teacher.generate: stops at the job's end-of-turn ids, returns the new ids as the
        server reports them (token ids, never re-tokenized text)."""
        stop = sorted(int(t) for t in turn_ends)
        return self._map(lambda p, n_seed: self._generate_one(np.asarray(p), *n_seed, temperature, top_p, stop,
                                                              set(stop)),
                         prompts, list(zip(max_new_tokens, seeds)))

    def generate_scored(self, prompts, *, k, max_new_tokens, temperature, top_p, seeds, turn_ends):
        """generate() and the top-k at each generated step from the same request (`logprobs` k): one request per
        prompt, where generate-then-score takes two. Returns [(new ids, ended, Scored)]. The step log-probs are
        the model's own (vllm serve's default --logprobs-mode raw_logprobs: before temperature and top-p)."""
        stop = sorted(int(t) for t in turn_ends)
        return self._map(lambda p, n_seed: self._generate_one(np.asarray(p), *n_seed, temperature, top_p, stop,
                                                              set(stop), k=k),
                         prompts, list(zip(max_new_tokens, seeds)))

    # -- one request each

    def _score_one(self, seq, pos, k):
        if len(seq) + 1 > self.max_model_len:
            raise SampleFailed(f"it is {len(seq)} tokens and the teacher server's max_model_len is "
                               f"{self.max_model_len}: a scoring request needs at most {self.max_model_len - 1}")
        body = {"model": self.model, "prompt": seq.tolist(), "max_tokens": 1, "prompt_logprobs": int(k),
                "return_token_ids": True, "temperature": 1.0, "top_p": 1.0, **NEUTRAL}
        what = f"scoring request ({len(seq)} tokens, prompt_logprobs={k})"
        choice = _choice(self.client.request("POST", "/completions", body, what=what,
                                             max_bytes=max_answer_bytes(len(seq), k)))
        try:
            echoed = choice.get("prompt_token_ids")
            if echoed is None:
                raise BadAnswer("no prompt_token_ids in the answer, although return_token_ids was sent (it needs "
                                "vLLM 0.10.2 or later): nothing shows which ids were scored")
            if echoed != body["prompt"]:
                raise BadAnswer("it scored other token ids than it was sent (it reports "
                                f"{len(echoed) if isinstance(echoed, list) else echoed!r} prompt tokens for "
                                f"{len(seq)} sent)")
            return parse_prompt_logprobs(choice.get("prompt_logprobs"), seq, pos, k)
        except BadAnswer as e:
            raise BadAnswer(f"the teacher server at {self.client.url} ({what}): {e}") from None

    def _generate_one(self, prompt, budget, seed, temperature, top_p, stop, eos, k=None):
        """(new ids, ended), and their Scored when k is given (the request then asks for `logprobs` k)."""
        if int(budget) < 1:
            return ([], False) if k is None else ([], False, parse_step_logprobs(None, [], k))
        body = {"model": self.model, "prompt": prompt.tolist(), "max_tokens": int(budget),
                "temperature": float(temperature), "top_p": float(top_p), "seed": int(seed),
                "stop_token_ids": stop, "return_token_ids": True, "skip_special_tokens": False, **NEUTRAL}
        if k is not None:
            body.update(logprobs=int(k), return_tokens_as_token_ids=True)
        what = f"generation request ({len(prompt)} prompt tokens{'' if k is None else f', logprobs={k}'})"
        choice = _choice(self.client.request("POST", "/completions", body, what=what,
                                             max_bytes=max_answer_bytes(int(budget), k or 1)))
        try:
            new = generated_ids(choice.get("token_ids"), int(budget), eos)
            ended = bool(new) and new[-1] in eos
            return (new, ended) if k is None else (new, ended, parse_step_logprobs(choice.get("logprobs"), new, k))
        except BadAnswer as e:
            raise BadAnswer(f"the teacher server at {self.client.url} ({what}): {e}") from None

    def _map(self, fn, xs, ys):
        """fn over the pairs, at most requests_in_flight at once, results in order. The first failure cancels what has
        not started and is raised; a SampleFailed carries the index of its sequence."""
        def run(i, x, y):
            try:
                return fn(x, y)
            except SampleFailed as e:
                e.index = i
                raise
        futures = [self.pool.submit(run, i, x, y) for i, (x, y) in enumerate(zip(xs, ys))]
        done, rest = wait(futures, return_when=FIRST_EXCEPTION)
        failed = [f for f in futures if f in done and f.exception() is not None]
        if failed:
            for f in rest:
                f.cancel()
            raise failed[0].exception()
        return [f.result() for f in futures]

    def close(self):
        self.pool.shutdown(wait=False, cancel_futures=True)


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
    if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in new):
        raise BadAnswer(f"token_ids hold something other than non-negative integers: {new[:8]!r}")
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
    return Scored(ids, lps, np.asarray([_logprob(x, f"generated step {j}") for j, x in enumerate(own)],
                                       dtype=np.float32))
