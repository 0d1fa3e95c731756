"""`python -m kdcache ARGS` forked from a process that has already imported torch, transformers, DeepSpeed and
Ray, instead of started from nothing.

Each `kdcache` command a test starts spends 5-7 CPU-seconds importing those libraries before it does anything
(measured: `import torch, transformers, deepspeed, ray` and a model class, 6.9 CPU-s here), and the suite starts
about 170 of them on 2 cores. A multiprocessing forkserver imports them once per test process; each command is
then a fork of it that runs `kdcache` as `python -m kdcache` would:

- kdcache itself is not preloaded: the command imports it fresh, with the sys.path that `python -m kdcache`
  gets in the user's project (that directory first, no PYTHONPATH), so a user's `train.py` still comes first;
- its working directory, environment, argv, stdin (/dev/null), stdout and stderr (files) are the command's own;
- it exits as Python does: non-daemon threads joined, then atexit handlers, then the exit code (a signal's
  death reads as -N, as with subprocess).

Only commands that run to an end use it (tests/helpers/cli.py `run`, which `kdcache` and `precompute` call); a
test that signals, hangs up on or kills a command starts a real process (subprocess.Popen), as users do.
"""
import json
import os
import subprocess
import sys
import tempfile

# What every `kdcache` command imports before its work (transformers loads a model's module by its config's
# type: the families the tests build).
PRELOAD = ["numpy", "pyarrow", "zarr", "yaml", "tokenizers", "torch", "transformers", "deepspeed", "ray",
           "transformers.models.auto.modeling_auto", "transformers.models.qwen2.modeling_qwen2",
           "transformers.models.llama.modeling_llama", "transformers.models.gemma2.modeling_gemma2",
           "transformers.models.mistral.modeling_mistral", "tensorboard", "tests.helpers.zygote"]

_STATE = {}


def _context():
    import multiprocessing
    if "ctx" not in _STATE:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        _STATE["ctx"] = ctx
    return _STATE["ctx"]


def _python_path(cwd, env):
    """sys.path of `python -m kdcache` started in cwd with env (the directory itself first)."""
    key = (cwd, env.get("PYTHONPATH"))
    if key not in _STATE:
        out = subprocess.run([sys.executable, "-c", "import sys, json; print(json.dumps(sys.path))"],
                             cwd=cwd, env=env, capture_output=True, text=True, check=True).stdout
        _STATE[key] = [cwd if p == "" else p for p in json.loads(out)]
    return _STATE[key]


def _exit_code(code):
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)                 # SystemExit("message"), as the interpreter does
    return 1


def _command(args, cwd, env, path, out_path, err_path):
    """The forked child: become `python -m kdcache ARGS` and exit with its code."""
    import runpy
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    # Ray's native settings were read from the server's environment when it imported Ray: read them again from the
    # command's (RAY_AUTH_MODE=token there once made its own Ray's GCS refuse its driver).
    sys.modules["ray._raylet"].Config.initialize("")
    for fd, name, flags in ((0, os.devnull, os.O_RDONLY), (1, out_path, os.O_WRONLY), (2, err_path, os.O_WRONLY)):
        f = os.open(name, flags)
        os.dup2(f, fd)
        os.close(f)
    sys.path[:] = path
    sys.argv = ["kdcache", *args]
    exit_as_python(lambda: runpy.run_module("kdcache", run_name="__main__", alter_sys=True))


def exit_as_python(main):
    """Run main() in a forked child, then exit as the interpreter would: its exit code (SystemExit's, or 1 after a
    traceback), non-daemon threads joined, atexit handlers run, streams flushed."""
    import atexit
    import threading
    import traceback
    try:
        main()
        code = 0
    except SystemExit as e:
        code = _exit_code(e.code)
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        threading._shutdown()
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def run(args, cwd, env, timeout):
    """subprocess.run([python, -m, kdcache, *args], cwd=cwd, env=env, capture_output=True, text=True,
    timeout=timeout), forked from the preloaded server."""
    ctx = _context()
    with tempfile.TemporaryDirectory(prefix="kdcache-zygote-") as d:
        out, err = os.path.join(d, "stdout"), os.path.join(d, "stderr")
        for p in (out, err):
            open(p, "w").close()
        proc = ctx.Process(target=_command, args=(list(args), cwd, env, _python_path(cwd, env), out, err))
        proc.start()
        proc.join(timeout)
        argv = [sys.executable, "-m", "kdcache", *args]
        if proc.exitcode is None:
            proc.kill()
            proc.join()
            raise subprocess.TimeoutExpired(argv, timeout, _read(out), _read(err))
        return subprocess.CompletedProcess(argv, proc.exitcode, _read(out), _read(err))


def _read(path):
    with open(path, errors="replace") as f:
        return f.read()
