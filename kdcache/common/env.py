"""Settings read from environment variables: one parser for sizes and one for durations, read when used (never at
import, so a bad value fails the command that needs it with the variable named, not every command)."""
import os
import re

from .errors import ConfigError

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?(?:e\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
_TIME = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|min|h|d)?\s*$", re.IGNORECASE)
_SECONDS = {None: 1.0, "ms": 1e-3, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}


def parse_size(text, name="size"):
    """Bytes from '8G', '512M', '1.5GiB', '65536' or '8e9' (K, M, G, T are powers of 1024)."""
    m = _SIZE.match(str(text))
    if not m:
        raise ConfigError(f"{name}: {text!r} is not a size (a number of bytes, or with K, M, G or T: 512M, 8G)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_seconds(text, name="duration"):
    """Seconds from '120', '30s', '2m', '1.5h', '1d' or '500ms'."""
    m = _TIME.match(str(text))
    if not m:
        raise ConfigError(f"{name}: {text!r} is not a duration (seconds, or with ms, s, m, h or d: 30s, 2m, 1h)")
    return float(m.group(1)) * _SECONDS[m.group(2).lower() if m.group(2) else None]


def env_size(name, default):
    value = os.environ.get(name)
    return int(default) if value in (None, "") else parse_size(value, name)


def env_seconds(name, default):
    value = os.environ.get(name)
    return float(default) if value in (None, "") else parse_seconds(value, name)


def default_threads(processes=1):
    """Torch threads for one of `processes` processes that share this machine, where the user set none: the
    PyTorch convention, OMP_NUM_THREADS when it is set (torchrun sets 1 per rank), else the cores this process
    may run on (its CPU affinity, not every core of the host) divided among the processes."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    if value:
        if not value.isdigit() or int(value) < 1:
            raise ConfigError(f"OMP_NUM_THREADS: {value!r} is not a whole number >= 1")
        return int(value)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, int(processes)))
