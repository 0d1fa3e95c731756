"""HTTP to a served teacher: one keep-alive connection per thread, bounded retries, one deadline per attempt.

Standard library only. Retries with exponential backoff on connection errors, timeouts, 5xx, 408 and 429 for up to
`retry_s` (attempts included); any other 4xx is the server refusing one sequence, raised as SampleFailed (the worker
names the sample). Each attempt has one deadline, `timeout_s`, over the whole exchange: connecting, sending, the
status line, the headers, chunk-size lines and the body. A socket timeout bounds only the wait for each read, which a
server that trickles a byte a second never reaches, so a timer shuts the socket down when the deadline passes. An
answer larger than the request can need is refused as soon as it is larger, and JSON nested deeper than Python's
parser goes is a malformed answer, not a RecursionError.
"""
import http.client
import json
import socket
import threading
import time
import urllib.parse

from kdcache.common.env import env_seconds
from kdcache.common.errors import KdcacheError

from .teacher import SampleFailed

RETRY_S = 120.0        # how long a request is retried on connection errors and 5xx (KDCACHE_SERVED_RETRY_S)
TIMEOUT_S = 600.0      # one HTTP request, queueing on the server included (KDCACHE_SERVED_TIMEOUT_S)
BACKOFF_MAX_S = 10.0
RETRYABLE = {408, 429}   # and every 5xx


class ServerError(KdcacheError):
    """The teacher server cannot be reached, keeps failing, or is not a vLLM server serving one model."""


class BadAnswer(SampleFailed, ServerError):
    """The server's answer for one sequence is malformed (the worker names the sample)."""


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
        expired = threading.Event()

        def expire():                 # the socket's own timeout bounds each read, not the exchange
            expired.set()
            sock = conn.sock
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

        def left():
            rest = deadline - time.monotonic()
            if rest <= 0 or expired.is_set():
                raise TimeoutError(f"no whole answer within {self.timeout_s:g} s (KDCACHE_SERVED_TIMEOUT_S)")
            if conn.sock is not None:
                conn.sock.settimeout(rest)
            return rest
        timer = threading.Timer(max(0.0, deadline - time.monotonic()), expire)
        timer.daemon = True
        try:
            conn.timeout = left()
            timer.start()
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
            left()                    # an answer cut short by the timer is not an answer
            data = b"".join(chunks)
        except BaseException as e:
            self._drop()
            if expired.is_set() and isinstance(e, (OSError, http.client.HTTPException)):
                raise TimeoutError(f"no whole answer within {self.timeout_s:g} s (KDCACHE_SERVED_TIMEOUT_S); the "
                                   "server was still sending it") from None
            raise
        finally:
            timer.cancel()
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
                    except (ValueError, RecursionError) as e:    # deep nesting: RecursionError
                        problem = f"HTTP {status} with a body that is not JSON ({type(e).__name__}): {data[:200]!r}"
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
    except (ValueError, RecursionError):
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
