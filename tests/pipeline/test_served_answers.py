"""Issue 42, items 5, 7, 10 and 11: what a served teacher's answers may not do.

A deadline bounds the whole exchange (status line, headers, chunk-size lines, body), for scoring and for
`GET /v1/models` alike; `/v1/models` and `/version` answers are capped; deep JSON and ids of 2^63 are malformed
answers, not tracebacks; a target ranked outside the top-k cannot be likelier than the k-th entry, nor take the mass
past 1. Each server here is a raw socket on 127.0.0.1 that misbehaves in exactly one way."""
import json
import socket
import threading
import time

import numpy as np
import pytest

from kdcache.pipeline.served_answers import parse_prompt_logprobs, parse_step_logprobs
from kdcache.pipeline.served_http import BadAnswer, Client, ServerError
from kdcache.pipeline.teacher_served import server_info


class RawServer:
    """Answers each connection with `reply(send)`, where send(bytes) writes; bytes are sent one at a time every
    `every` s when `trickle` is set. Bounded: gives up after 30 s."""

    def __init__(self, reply, every=0.2):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/v1"
        self.reply, self.every, self.stop = reply, every, threading.Event()
        self.requests = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn):
        t_end = time.monotonic() + 30

        def send(data, trickle=False):
            if not trickle:
                conn.sendall(data)
                return
            for i in range(len(data)):
                if self.stop.is_set() or time.monotonic() > t_end:
                    return
                conn.sendall(data[i:i + 1])
                time.sleep(self.every)
        try:
            self.requests.append(conn.recv(65536).split(b"\r\n", 1)[0].decode())
            self.reply(send)
        except OSError:
            pass
        finally:
            conn.close()

    def close(self):
        self.stop.set()
        self.sock.close()


def _json(obj):
    body = json.dumps(obj).encode() if not isinstance(obj, bytes) else obj
    return (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: %d\r\n\r\n"
            % len(body) + body)


TRICKLES = {
    "status line": lambda send: send(b"HTTP/1.1 200 OK\r\n" * 100, trickle=True),
    "headers": lambda send: (send(b"HTTP/1.1 200 OK\r\n"), send(b"X-Slow: " + b"a" * 500 + b"\r\n", trickle=True)),
    "chunk-size lines": lambda send: (send(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"),
                                      send(b"0" * 300 + b"1\r\n \r\n", trickle=True)),   # one size line
}


@pytest.mark.parametrize("part", list(TRICKLES))
def test_a_trickled_status_line_headers_or_chunk_sizes_cannot_outlast_the_deadline(part):
    """Before, each byte reset the socket's timeout: a server trickling the status line held a 3 s request 120 s."""
    srv = RawServer(TRICKLES[part])
    try:
        t0 = time.monotonic()
        with pytest.raises(ServerError, match=r"TimeoutError: no whole answer within 1\.5 s"):
            Client(srv.url, timeout_s=1.5, retry_s=1.0).request("POST", "/completions", {"prompt": [1]})
        took = time.monotonic() - t0
    finally:
        srv.close()
    assert took < 5.0, took         # attempts of 1.5 s and 0.5 s and a backoff: without the timer, 20 s or more
    assert len(srv.requests) >= 1


def test_the_model_list_is_bounded_by_the_deadline_too():
    srv = RawServer(TRICKLES["status line"])
    try:
        t0 = time.monotonic()
        with pytest.raises(ServerError, match=r"model list \(GET /v1/models\) .*TimeoutError"):
            server_info(srv.url, Client(srv.url, timeout_s=1.0, retry_s=0.5), say=None)
        assert time.monotonic() - t0 < 4.0
    finally:
        srv.close()
    assert srv.requests[0] == "GET /v1/models HTTP/1.1"


@pytest.mark.parametrize("route", ["/v1/models", "/version"])
def test_an_oversized_models_or_version_answer_is_refused_unread(route):
    """A 400 MB answer cost +1.2 GiB; now anything over 1 MiB is refused as soon as it is larger."""
    models = {"data": [{"id": "m", "max_model_len": 64, "parent": None}]}
    big = b"{" + b'"x": 0, ' * 400_000 + b'"version": "0.32.0"}'             # 3.2 MB of valid JSON

    def reply(send):
        if srv.requests[-1].startswith(f"GET {route} "):
            send(_json(big if route == "/version" else
                       json.dumps({**models, "pad": "x" * 3_000_000}).encode()))
        else:
            send(_json(models if "models" in srv.requests[-1] else {"version": "0.32.0"}))
    srv = RawServer(reply)
    try:
        with pytest.raises(ServerError, match=r"over 1,048,576 bytes"):
            server_info(srv.url, Client(srv.url, timeout_s=10, retry_s=1), say=None)
    finally:
        srv.close()


def test_deep_json_is_a_malformed_answer_not_a_recursion_error():
    srv = RawServer(lambda send: send(_json(b"[" * 100_000 + b"]" * 100_000)))
    try:
        with pytest.raises(ServerError, match=r"not JSON \(RecursionError\)"):
            server_info(srv.url, Client(srv.url, timeout_s=5, retry_s=0.5), say=None)
    finally:
        srv.close()


@pytest.mark.parametrize("models,why", [
    ({"data": "x"}, "serves 0 base models"),
    ([1, 2], "serves 0 base models"),
    ({"data": [{"id": "m", "max_model_len": 2 ** 70}]}, r"max_model_len '1180591620717411303424'"),
    ({"data": [{"id": "m", "max_model_len": "64"}]}, r"max_model_len '64' .*not a length"),
])
def test_a_model_list_of_the_wrong_shape_is_refused_by_name(models, why):
    srv = RawServer(lambda send: send(_json(models if "models" in srv.requests[-1] else {"version": "0.32.0"})))
    try:
        with pytest.raises(ServerError, match=why):
            server_info(srv.url, Client(srv.url, timeout_s=5, retry_s=0.5), say=None)
    finally:
        srv.close()


# ---------------------------------------------------------------- ids of 2^63 and more, and the target rule

def _entry(**v):
    return {str(t): {"logprob": lp, "rank": r} for t, (lp, r) in v.items()}


@pytest.mark.parametrize("key", [str(2 ** 63), str(2 ** 31), "9" * 5000])
def test_an_id_past_int32_is_a_bad_answer_not_an_overflow(key):
    plp = [None, {key: {"logprob": -0.5, "rank": 1}, "9": {"logprob": -1.0, "rank": 2}}]
    with pytest.raises(BadAnswer, match=r"over 2147483647|not <a non-negative integer"):
        parse_prompt_logprobs(plp, [0, 9], np.array([0]), 2)
    with pytest.raises(BadAnswer, match=r"over 2147483647|not token_id:<a non-negative integer"):
        parse_step_logprobs({"top_logprobs": [{f"token_id:{key}": -0.5}], "token_logprobs": [-0.5]}, [3], 1)


def test_generated_ids_past_int32_are_refused():
    from kdcache.pipeline.served_answers import generated_ids
    with pytest.raises(BadAnswer, match=r"integers in \[0, 2147483647\]"):
        generated_ids([5, 2 ** 63], 4, {7})


def test_a_prompt_target_ranked_outside_the_top_k_cannot_beat_the_kth():
    """The review's case: p = 0.99 for a target ranked outside the top-k passed the writer and verify."""
    ok = [None, {"4": {"logprob": -1.0, "rank": 1}, "5": {"logprob": -2.0, "rank": 2},
                 "9": {"logprob": -2.0, "rank": 3}}]                  # a tie with the k-th: allowed
    assert parse_prompt_logprobs(ok, [0, 9], np.array([0]), 2).target_logprobs[0] == np.float32(-2.0)
    likelier = [None, {"4": {"logprob": -1.0, "rank": 1}, "5": {"logprob": -2.0, "rank": 2},
                       "9": {"logprob": -0.01, "rank": 3}}]
    with pytest.raises(BadAnswer, match=r"prompt position 1: token 9 is ranked outside the top-2 yet given log-prob "
                                        r"-0\.01, above the k-th entry's -2"):
        parse_prompt_logprobs(likelier, [0, 9], np.array([0]), 2)


def test_a_prompt_target_that_takes_the_mass_past_one_is_refused():
    over = [None, {"4": {"logprob": np.log(0.5), "rank": 1}, "5": {"logprob": np.log(0.3), "rank": 2},
                   "9": {"logprob": np.log(0.29), "rank": 3}}]     # below the k-th, yet 0.5 + 0.3 + 0.29 > 1
    with pytest.raises(BadAnswer, match=r"token 9, outside the top-2, is given probability 0\.29.*mass to 1\.09"):
        parse_prompt_logprobs(over, [0, 9], np.array([0]), 2)
    top_over = [None, {"4": {"logprob": np.log(0.7), "rank": 1}, "9": {"logprob": np.log(0.6), "rank": 2}}]
    with pytest.raises(BadAnswer, match=r"top-2 probabilities sum to 1\.3"):
        parse_prompt_logprobs(top_over, [0, 9], np.array([0]), 2)


def test_a_generated_token_outside_the_top_k_cannot_beat_the_kth():
    answer = {"top_logprobs": [{"token_id:3": -0.5, "token_id:4": -1.5, "token_id:7": -3.0}],
              "token_logprobs": [-0.1]}             # 7 sampled: -3 in the step's list, yet -0.1 as the token's own
    with pytest.raises(BadAnswer, match=r"generated step 0: token 7 is ranked outside the top-2"):
        parse_step_logprobs(answer, [7], 2)
    fine = {"top_logprobs": [{"token_id:3": -0.5, "token_id:4": -1.5, "token_id:7": -3.0}], "token_logprobs": [-3.0]}
    assert parse_step_logprobs(fine, [7], 2).target_logprobs[0] == np.float32(-3.0)
