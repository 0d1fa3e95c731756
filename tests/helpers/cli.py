"""Running kdcache as users do: the `kdcache` command in a subprocess, started from a user's own project.

That project directory holds a `train.py`, a `pipeline/` and a `cache_format/` of the user's, each of which
exits the process when imported, and the subprocess gets no PYTHONPATH: kdcache must come from its install
(one import root, `kdcache.*`) and never import the user's files.
"""
import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_PROJECT = []
USER_FILES = {
    "train.py": 'raise SystemExit("the user\'s train.py was imported")\n',
    "pipeline/__init__.py": 'raise SystemExit("the user\'s pipeline/ was imported")\n',
    "pipeline/config.py": 'raise SystemExit("the user\'s pipeline/config.py was imported")\n',
    "cache_format/__init__.py": 'raise SystemExit("the user\'s cache_format/ was imported")\n',
}


def user_project():
    """A directory like a user's ML project (made once per process, removed at exit)."""
    if not _PROJECT:
        d = tempfile.mkdtemp(prefix="kdcache-user-project-")
        for name, text in USER_FILES.items():
            os.makedirs(os.path.dirname(os.path.join(d, name)), exist_ok=True)
            with open(os.path.join(d, name), "w") as f:
                f.write(text)
        atexit.register(shutil.rmtree, d, True)
        _PROJECT.append(d)
    return _PROJECT[0]


def user_env(**extra):
    """The environment a user's shell gives a command: this one, without PYTHONPATH, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update({k: str(v) for k, v in extra.items()})
    return env


def write_jsonl(path, rows):
    """rows: dicts (written as JSON) or strings (written as they are, e.g. a broken line)."""
    with open(path, "w") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


def kdcache(*args, timeout=120, env=None):
    """`python -m kdcache ARGS` from the user's project directory; env: a full environment (default user_env())."""
    env = user_env() if env is None else {k: v for k, v in env.items() if k != "PYTHONPATH"}
    return run([sys.executable, "-m", "kdcache", *map(str, args)], env, timeout)


def run(cmd, env, timeout):
    """subprocess.run(cmd) to its end from the user's project, output captured as text. `python -m kdcache ...` is
    forked from a process that has imported its libraries already (tests/helpers/zygote.py; KDCACHE_TEST_FORK=0:
    a fresh interpreter, as before)."""
    if cmd[:3] == [sys.executable, "-m", "kdcache"] and os.environ.get("KDCACHE_TEST_FORK", "1") != "0":
        from tests.helpers import zygote
        return zygote.run(cmd[3:], user_project(), env, timeout)
    return subprocess.run(cmd, cwd=user_project(), capture_output=True, text=True, timeout=timeout, env=env)


def precompute(*args, timeout=300, extra_env=None, shared_ray=False):
    """`kdcache precompute` on a local Ray of its own (never a cluster named in the environment), or with
    shared_ray on this test process's own cluster (tests/helpers/raycluster.py: for jobs that are not about Ray's
    own start and stop)."""
    env = user_env(RAY_ADDRESS="", **(extra_env or {}))
    if shared_ray:
        args, env = on_shared_ray(args, env)
    return kdcache("precompute", "--no-progress", "--worker-cpus", "0.5", *args, timeout=timeout, env=env)


def on_shared_ray(args, env):
    """(args, env) of a precompute that joins this test process's Ray head. Its workers get the job's KDCACHE_*
    variables (pipeline.dispatch.cluster_env), not the rest of its environment; those of a job without any are
    forked from a preloaded server (tests/helpers/rayfork.py)."""
    from tests.helpers.raycluster import shared_head
    head = shared_head()
    return (*args, "--ray-address", head.address), dict(env, **head.env())
