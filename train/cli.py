"""`kdcache train`: distil a student from a logit cache with DeepSpeed. Never runs the teacher."""
import argparse
import sys

from cache_format import CacheError
from kdcache.config import ConfigError, add_flags, load, overrides_from

from .config import TrainConfig


def main(argv=None):
    p = argparse.ArgumentParser(
        prog="kdcache train",
        description="Off-policy GKD from a logit cache (generalized JSD / forward / reverse KL, optional SFT) "
                    "under DeepSpeed. Checkpoints every N steps and on SIGHUP/SIGTERM/SIGINT; rerun the "
                    "same command to resume. Metrics: OUT/metrics.jsonl, OUT/tensorboard/, OUT/loss_curve.png.")
    p.add_argument("--config", help="YAML file with any of the settings below; flags override it")
    add_flags(p, TrainConfig)
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed launcher
    args = p.parse_args(argv)
    try:
        cfg = load(TrainConfig, args.config, overrides_from(args, TrainConfig))
        from .model import TokenizerMismatch
        from .trainer import train
        try:
            train(cfg)
        except (TokenizerMismatch, FileNotFoundError) as e:
            raise ConfigError(str(e)) from e
    except (ConfigError, CacheError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
