"""Ray worker processes of the tests' shared Ray heads, forked from a server that has imported torch, transformers
and Ray, instead of started from nothing.

Each job on a shared head (tests/helpers/raycluster.py) gets a teacher actor, a fresh Python process that spends
about 5 CPU-s importing torch and transformers before it loads a tiny model; the suite makes about 50 of them on 2
cores. A job's driver that joins a shared head gets, through RAY_JOB_CONFIG_JSON_ENV_VAR (how `ray job submit`
gives a driver its job's runtime_env), a `py_executable` that is this file as a client: Ray starts it where it
would start `python default_worker.py ARGS`, and it asks this head's server (this file, `serve`) to fork a child
that becomes that worker:

- its argv, environment, working directory, stdin, stdout and stderr are the client's (passed over a Unix socket);
- sys.path is what `python default_worker.py` gets (the script's directory, then PYTHONPATH, then the
  interpreter's), and kdcache is not preloaded: the worker imports it as a fresh one would;
- the client forwards SIGTERM, SIGINT and SIGHUP to it and exits as it did (a signal's death as that signal); the
  child kills itself when the client dies (Ray kills a worker by the pid it registered: the child's).

If the server cannot be reached, the client runs the worker itself (exec), as Ray would have. Jobs that start a
Ray of their own, and the commands tests signal or kill, never use it.
"""
import array
import json
import os
import signal
import socket
import sys

# Not Ray: its native module reads its settings from the environment once (RAY_JOB_ID among them), which must be
# the worker's own.
PRELOAD = ["numpy", "pyarrow", "yaml", "tokenizers", "torch", "transformers", "transformers.models.auto.modeling_auto",
           "transformers.models.qwen2.modeling_qwen2", "transformers.models.llama.modeling_llama",
           "transformers.models.gemma2.modeling_gemma2", "transformers.models.mistral.modeling_mistral"]
FORWARD = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def py_executable(socket_path):
    """The runtime_env py_executable that runs a job's workers through the server at socket_path."""
    return f"{sys.executable} -S {os.path.abspath(__file__)} {socket_path}"


# ------------------------------------------------------------------------------------------------- the client
def _send(sock, payload, fds=()):
    data = json.dumps(payload).encode()
    head = len(data).to_bytes(8, "big")
    if fds:
        sock.sendmsg([head + data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    else:
        sock.sendall(head + data)


def _recv(sock, with_fds=0):
    fds = array.array("i")
    msg, anc, _, _ = sock.recvmsg(8, socket.CMSG_LEN(with_fds * fds.itemsize)) if with_fds else \
        (sock.recv(8), [], 0, None)
    if not msg:
        return None, []
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
    need, buf = int.from_bytes(msg, "big"), b""
    while len(buf) < need:
        chunk = sock.recv(need - len(buf))
        if not chunk:
            return None, list(fds)
        buf += chunk
    return json.loads(buf), list(fds)


def client(socket_path, argv):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(socket_path)
        _send(sock, {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}, fds=(0, 1, 2))
        started, _ = _recv(sock)
    except OSError:
        started = None
    if not started:                                  # no server: run the worker as Ray would have
        os.execv(sys.executable, [sys.executable, *argv])
    pid = started["pid"]
    for sig in FORWARD:
        signal.signal(sig, lambda s, _f: os.kill(pid, s))
    done, _ = _recv(sock)
    code = (done or {}).get("code", 1)
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


# ------------------------------------------------------------------------------------------------- the server
def _worker(conn, request, fds, base_path):
    """The forked child: become `python ARGV` (Ray's default_worker.py) and exit as it does."""
    import runpy
    import threading

    # this file's directory is first on the server's sys.path
    from zygote import exit_as_python
    os.setsid()                  # a group of its own: Ray ends a worker's process group, not the server's
    for fd, new in zip(fds, (0, 1, 2)):
        os.dup2(fd, new)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    script = request["argv"][0]
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [os.path.dirname(os.path.abspath(script)), *extra, *base_path]
    sys.argv = list(request["argv"])

    def die_with_client():                           # the client gone (killed): so is this worker
        try:
            while conn.recv(1):
                pass
        except OSError:
            pass
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=die_with_client, daemon=True).start()
    exit_as_python(lambda: runpy.run_path(script, run_name="__main__"))


def serve(socket_path):
    import importlib
    import select
    for name in PRELOAD:
        importlib.import_module(name)
    base_path = sys.path[1:]                          # the interpreter's own, without this script's directory
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path + ".tmp")
    os.rename(socket_path + ".tmp", socket_path)      # listening once the name exists
    listener.listen(16)
    children = {}                                     # pid -> the client's connection
    while True:
        ready, _, _ = select.select([listener], [], [], 0.05)
        if ready:
            conn, _ = listener.accept()
            try:
                request, fds = _recv(conn, with_fds=3)
            except OSError:
                request, fds = None, []
            if request is None or len(fds) != 3:
                conn.close()
                for fd in fds:
                    os.close(fd)
                continue
            pid = os.fork()
            if pid == 0:
                listener.close()
                for other in children.values():
                    other.close()
                _worker(conn, request, fds, base_path)
            for fd in fds:
                os.close(fd)
            children[pid] = conn
            try:
                _send(conn, {"pid": pid})
            except OSError:
                pass
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
                try:
                    _send(conn, {"code": code})
                except OSError:
                    pass
                conn.close()


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2])
    else:
        client(sys.argv[1], sys.argv[2:])
