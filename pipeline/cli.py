"""`kdcache precompute`: run the teacher once over a dataset and write a logit cache."""
from kdcache.common.config import run_command

from .config import PrecomputeConfig

DESCRIPTION = ("Score a dataset with a teacher (vLLM or transformers) on Ray and write the top-k log-probs of every "
               "completion position, end-of-turn included, to a resumable cache. Rerun the same command after any "
               "interruption to continue.")


def _run(cfg):
    from .job import run_precompute
    run_precompute(cfg)


def main(argv=None):
    return run_command("kdcache precompute", DESCRIPTION, PrecomputeConfig, _run, argv)
