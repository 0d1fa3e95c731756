"""Served teacher backend: an OpenAI-compatible vLLM server (`vllm serve`) over HTTP.

For teachers that live on their own nodes. Token-id prompts only (never text, so nothing is re-templated):
scoring is `/v1/completions` with the sequence as `prompt` (a list of ids), `max_tokens` 1 and vLLM's
`prompt_logprobs` k; generation is `/v1/completions` with `max_tokens`, the sampling settings, the job's
stop ids and `return_token_ids`, so the new ids come back as ids; with `logprobs` k and
`return_tokens_as_token_ids` the same request gives each generated step's top-k (generate_scored: one
request per sample). `requests_in_flight` requests per worker, from a thread pool.

The parts: served_http.py (the client: retries, one deadline over each whole exchange, bounded answers),
served_answers.py (reading answers: nothing the server says is trusted), this module (the Teacher protocol, and
what the server reports about itself). A missing echo of the prompt ids, more generated ids than max_tokens or a
stop id before the last one is a BadAnswer naming the server, and the worker names the sample. The mass and id
checks every backend's records pass are the writer's (cache_format.record.check_record).
"""
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

import numpy as np

from .served_answers import _choice, generated_ids, max_answer_bytes, parse_prompt_logprobs, parse_step_logprobs
from .served_http import BadAnswer, Client, ServerError  # noqa: F401  (BadAnswer, ServerError: the backend's errors)
from .teacher import SampleFailed

INFO_BYTES = 1 << 20        # the most a /v1/models or /version answer may hold (a real one is a few KB)
MAX_MODEL_LEN = 1 << 24     # 16M tokens: beyond any context window served today


def server_info(url, client=None, say=print):
    """What the server reports about itself, the fingerprint's teacher part: {model, max_model_len, vllm_version}.

    Refuses a server that is not vLLM (no /version: prompt_logprobs is a vLLM extension) or that serves
    several base models."""
    client = client or Client(url)
    try:
        models = client.request("GET", "/models", what="model list (GET /v1/models)", say=say, max_bytes=INFO_BYTES)
    except SampleFailed as e:
        raise ServerError(f"teacher: {client.url} is not an OpenAI-compatible server ({e})") from None
    data = models.get("data") if isinstance(models, dict) else None
    base = [m for m in data if isinstance(m, dict) and not m.get("parent")] if isinstance(data, list) else []
    if len(base) != 1:
        names = ", ".join(repr(m.get("id"))[:100] for m in base[:8]) or "none"
        raise ServerError(f"teacher: {client.url} serves {len(base)} base models ({names}); kdcache needs a "
                          "server of exactly one")
    try:
        answer = client.request("GET", "/version", what="version (GET /version)", api=False, max_bytes=INFO_BYTES)
    except SampleFailed as e:
        raise ServerError(f"teacher: {client.url} does not look like a vLLM server ({e}); kdcache needs vLLM's "
                          "prompt_logprobs (vllm serve)") from None
    version = answer.get("version") if isinstance(answer, dict) else None
    m = base[0]
    n = m.get("max_model_len")
    if isinstance(n, bool) or not isinstance(n, int) or not 2 <= n <= MAX_MODEL_LEN:
        raise ServerError(f"teacher: {client.url} reports max_model_len {str(n)[:40]!r} for {str(m.get('id'))[:100]!r}"
                          f", not a length in [2, {MAX_MODEL_LEN:,}]")
    if not isinstance(version, str) or not isinstance(m.get("id"), str) or len(version) > 200 or len(m["id"]) > 4096:
        raise ServerError(f"teacher: {client.url} reports a model id or vLLM version that is not a short string "
                          f"({str(m.get('id'))[:100]!r}, {str(version)[:100]!r})")
    return {"model": m["id"], "max_model_len": n, "vllm_version": version}


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
