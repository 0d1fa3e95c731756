"""`kdcache precompute`: run the teacher once over a dataset and write a logit cache."""
import argparse
import sys

from cache_format import CacheError
from kdcache.config import ConfigError, add_flags, load, overrides_from

from .config import PrecomputeConfig


def main(argv=None):
    p = argparse.ArgumentParser(
        prog="kdcache precompute",
        description="Score a dataset with a teacher (vLLM or transformers) on Ray and write the top-k "
                    "log-probs of every completion position, end-of-turn included, to a resumable cache. "
                    "Rerun the same command after any interruption to continue.")
    p.add_argument("--config", help="YAML file with any of the settings below; flags override it")
    add_flags(p, PrecomputeConfig)
    args = p.parse_args(argv)
    try:
        cfg = load(PrecomputeConfig, args.config, overrides_from(args, PrecomputeConfig))
        from .data import DataError
        from .job import run_precompute
        try:
            run_precompute(cfg)
        except DataError as e:
            raise ConfigError(str(e)) from e
    except (ConfigError, CacheError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
