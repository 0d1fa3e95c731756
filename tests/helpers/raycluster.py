"""A Ray cluster of this test process's own: `ray start --head` on 127.0.0.1, in a session of its own.

Jobs that are not about Ray's own start, stop or signals (reference runs, fixtures' caches) join it with
`--ray-address` (tests/helpers/cli.py `precompute(..., shared_ray=True)`): a job that starts its own Ray spends
5-9 s of its 13-28 s here on Ray's start and stop. Such a job's workers get the job's KDCACHE_* variables (crash
points, retries, spools: pipeline.dispatch.cluster_env), and the rest of the cluster's environment. The workers of
jobs that pass none are forked from a server that has imported torch and transformers (tests/helpers/rayfork.py:
about 4 CPU-s less per job); KDCACHE_TEST_FORK=0 starts them as Ray does.
"""
import atexit
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

from tests.helpers.s3server import free_port

ENV = {"RAY_AUTH_MODE": "disabled"}          # a throwaway cluster on loopback: no token to share
# vLLM's engine in the teacher worker's own process, not in one it spawns: a spawned engine imports vLLM again,
# 11-12 CPU-s per job here. What the tests check (scores, samples, stops) is the engine's either way; vLLM's
# default layout runs in the jobs with a Ray of their own (tests/pipeline/test_vllm.py) and under `vllm serve`.
WORKER_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


class RayHead:
    def __init__(self, num_cpus=2):
        self.port, self.num_cpus, self.proc, self.forks, self.nodes = free_port(), num_cpus, None, None, []

    @property
    def address(self):
        return f"127.0.0.1:{self.port}"

    def start(self, timeout=120):
        ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
        ports = {flag: free_port() for flag in ("--ray-client-server-port", "--dashboard-agent-listen-port",
                                                 "--dashboard-agent-grpc-port", "--runtime-env-agent-port",
                                                 "--metrics-export-port")}
        # Started clean of KDCACHE_* (a test's crash point set when the head starts must not reach every later
        # job's workers): each job passes its own to its workers.
        env = {k: v for k, v in os.environ.items() if not k.startswith("KDCACHE_")}
        env.update(RAY_ADDRESS="", **ENV, **WORKER_ENV)
        # `ray start --block` in a session of its own: stopping it stops this cluster only (`ray stop` would stop
        # every Ray on the machine, including those of tests running beside this one).
        self.proc = subprocess.Popen([ray_bin, "start", "--head", "--block", f"--port={self.port}",
                                      "--node-ip-address=127.0.0.1", f"--num-cpus={self.num_cpus}",
                                      "--include-dashboard=false", "--disable-usage-stats",
                                      *[f"{k}={v}" for k, v in ports.items()]],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                                     start_new_session=True)
        deadline = time.time() + timeout
        while time.time() < deadline:
            assert self.proc.poll() is None, self.proc.stderr.read()[-2000:]
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", self.port)) == 0:
                    return self
            time.sleep(0.2)
        self.stop()
        raise AssertionError(f"the Ray head did not listen on {self.port} after {timeout} s")

    def add_node(self, num_cpus=1, timeout=120):
        """Another node of this cluster on this machine: a raylet of its own (`ray start --address`), in a session of
        its own. Returns once the cluster counts it alive."""
        ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
        ports = {flag: free_port() for flag in ("--dashboard-agent-listen-port", "--dashboard-agent-grpc-port",
                                                 "--runtime-env-agent-port", "--metrics-export-port")}
        env = {k: v for k, v in os.environ.items() if not k.startswith("KDCACHE_")}
        env.update(RAY_ADDRESS="", **ENV, **WORKER_ENV)
        proc = subprocess.Popen([ray_bin, "start", "--block", f"--address={self.address}",
                                 "--node-ip-address=127.0.0.1", f"--num-cpus={num_cpus}", "--disable-usage-stats",
                                 *[f"{k}={v}" for k, v in ports.items()]],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                                start_new_session=True)
        self.nodes.append(proc)
        want = 1 + len(self.nodes)
        count = ("import ray, sys; ray.init(address=sys.argv[1], log_to_driver=False); "
                 "print(sum(n['Alive'] for n in ray.nodes()))")
        deadline = time.time() + timeout
        while time.time() < deadline:
            assert proc.poll() is None, proc.stderr.read()[-2000:]
            res = subprocess.run([sys.executable, "-c", count, self.address], capture_output=True, text=True,
                                 env=env, timeout=timeout)
            if res.returncode == 0 and int(res.stdout.split()[-1]) >= want:
                return self
            time.sleep(0.5)
        raise AssertionError(f"the cluster at {self.address} did not count {want} nodes after {timeout} s")

    def start_forks(self):
        """The server that forks this head's workers for the jobs that join it with env() (tests/helpers/rayfork.py).
        Not waited for: until it listens, workers start as Ray starts them."""
        import tempfile
        self.fork_socket = os.path.join(tempfile.mkdtemp(prefix="kdcache-rayfork-"), "socket")
        env = {k: v for k, v in os.environ.items() if not k.startswith("KDCACHE_") and k != "PYTHONPATH"}
        self.forks = subprocess.Popen([sys.executable, os.path.join(os.path.dirname(__file__), "rayfork.py"), "serve",
                                       self.fork_socket], stdout=subprocess.DEVNULL, env=env, start_new_session=True)
        return self

    def env(self):
        """What a job's driver that joins this head gets: no token, and its workers forked where the server runs."""
        if self.forks is None:
            return dict(ENV)
        from tests.helpers.rayfork import py_executable
        job = {"runtime_env": {"py_executable": py_executable(self.fork_socket)}}
        return dict(ENV, RAY_JOB_CONFIG_JSON_ENV_VAR=json.dumps(job))

    def stop(self):
        """SIGKILL to the head's session, its children included (a throwaway cluster: nothing to save), and to the
        fork server's (its forked workers end with their clients, which are the head's)."""
        if self.forks is not None:
            _kill_session(self.forks)
            self.forks = None
            shutil.rmtree(os.path.dirname(self.fork_socket), ignore_errors=True)
        for node in self.nodes:
            _kill_session(node)
        self.nodes = []
        if self.proc is not None:
            _kill_session(self.proc)
            self.proc = None


def _kill_session(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=60)


_SHARED = []


def shared_head():
    """This process's shared head, started on first use and stopped at exit."""
    if not _SHARED:
        head = RayHead()
        if os.environ.get("KDCACHE_TEST_FORK", "1") != "0":        # as tests/helpers/cli.py's commands
            head.start_forks()
        _SHARED.append(head.start())
        atexit.register(_SHARED[0].stop)
    return _SHARED[0]
