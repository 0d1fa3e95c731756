"""A TCP proxy on 127.0.0.1 that can cut every connection and refuse new ones, then come back on the same port.

To a client this is a server killed and restarted: open requests are reset, new ones are refused until `resume()`.
The tests use it in front of the one real `vllm serve` of a module, so an outage costs no second vLLM start-up
(bench/chaos.py's served-restart kind kills and restarts the real server).
"""
import socket
import threading

from tests.helpers.s3server import free_port


class CuttableProxy:
    def __init__(self, target_port, port=None):
        self.target = ("127.0.0.1", target_port)
        self.port = port or free_port()
        self._lock = threading.Lock()
        self._socks = set()
        self._listener = None

    def url(self, path="/v1"):
        return f"http://127.0.0.1:{self.port}{path}"

    def resume(self):
        """Listen (again) on the same port."""
        ls = socket.socket()
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        ls.bind(("127.0.0.1", self.port))
        ls.listen(64)
        self._listener = ls
        threading.Thread(target=self._accept, args=(ls,), daemon=True).start()
        return self

    start = resume

    def cut(self):
        """Stop listening and reset every open connection (RST, as from a killed process)."""
        ls, self._listener = self._listener, None
        if ls is not None:
            ls.close()
        with self._lock:
            socks, self._socks = list(self._socks), set()
        for s in socks:
            try:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                s.close()
            except OSError:
                pass

    stop = cut

    def _accept(self, ls):
        while True:
            try:
                client, _ = ls.accept()
            except OSError:
                return                   # cut(): the listener is closed
            try:
                upstream = socket.create_connection(self.target, timeout=10)
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._listener is not ls:          # cut while connecting
                    client.close(), upstream.close()
                    return
                self._socks |= {client, upstream}
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src, dst):
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            with self._lock:
                self._socks.discard(src)
                self._socks.discard(dst)
