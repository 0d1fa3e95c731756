"""`kdcache train`: distil a student from a logit cache with DeepSpeed. Never runs the teacher."""
import argparse
import os
import sys

from kdcache.common.config import run_command

from .config import TrainConfig

DESCRIPTION = ("Off-policy GKD from a logit cache (generalized JSD / forward / reverse KL, optional SFT) under "
               "DeepSpeed. Checkpoints every N steps and on SIGHUP/SIGTERM/SIGINT; rerun the same command to "
               "resume. Metrics: OUT/metrics.jsonl, OUT/tensorboard/, OUT/loss_curve.png.")


def _launcher_args(p):
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed


def _run(cfg, argv):
    if cfg.nproc_per_node > 1 and "RANK" not in os.environ:
        from .launch import launch
        return launch(argv, cfg.nproc_per_node, cfg.out)
    from .trainer import train
    train(cfg)


def main(argv=None):
    argv = sys.argv[2:] if argv is None else list(argv)
    return run_command("kdcache train", DESCRIPTION, TrainConfig, lambda cfg: _run(cfg, argv), argv,
                       extra_args=_launcher_args)
