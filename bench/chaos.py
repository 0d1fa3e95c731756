"""Fault injection: kill precompute and training at random and at chosen moments; count what is lost.

    .venv/bin/python bench/chaos.py [--trials N per kind] [--kinds K,...] [--seed S]     (or: make chaos)
    .venv/bin/python bench/chaos.py --s3 --kinds precompute     (precompute into an S3-compatible server)

Every moment (kill times, crash-point counts, steps, shard sizes, rank counts) is drawn from one seed, printed at
the start: --seed S reruns the same trials.

Precompute: an uninterrupted reference run, then trials (each with its own --shard-size) that kill -9
the whole process tree at a random moment, send SIGTERM or SIGHUP to the whole process group (a
batch scheduler, a closed terminal), or SIGKILL a process exactly at a crash point (a worker just before it renames a
finished shard into place, or uploads it with --s3; the driver just before it replaces
manifest.json), or kill -9 a served teacher (`vllm serve`) mid-job and start it again (the job rides the
outage out or gives up and is rerun), then rerun the same command until it completes. With --s3 the caches are written
to an S3-compatible server (moto) started on 127.0.0.1. Each final cache is verified and compared
with the reference sample by sample: samples lost, samples duplicated, values different.

Training: an uninterrupted reference run per world size, then trials with 1 or 2 ranks (kdcache train
--nproc-per-node) that send SIGTERM, SIGHUP or SIGKILL at a random step, to the process or to the
whole process group, or SIGKILL exactly while a checkpoint is being committed, or SIGKILL to the
`--nproc-per-node` launcher alone (its ranks must stop, not train on as orphans), or start a second
trainer into the same --out (it must be refused while the first trains on), then rerun until
finished. The per-step losses must equal the reference's exactly.

On-policy: `kdcache onpolicy` (2 rounds) killed at a moment drawn within one of its four stages (round 1 or 2,
rollout and scoring or training; the stage drawn first, then a point in the reference run's time for it, counted
from when the trial's summary shows the stage begun): kill -9 of the loop and every process under it, SIGTERM to
the loop, or SIGHUP to its process group; rerun until done. Per-step losses and each round's cache must equal the
reference's. (With the stages kept up in the loop, round 1's rollout holds most of a short run's time: Ray, the
teacher worker and the trainer start there. Moments drawn over the whole run landed there 15 times in 15.)

A trial is counted only if the fault interrupted the job (the cache was incomplete, or training had
steps left, when the first run ended); the tables say which were.
"""
import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile

import numpy as np
from chaos_common import ROOT, by_kind, kdcache_cmd  # noqa: E402
from chaos_onpolicy import ONPOLICY_KINDS, onpolicy_trials  # noqa: E402
from chaos_precompute import PRECOMPUTE_KINDS, precompute_trials, print_precompute  # noqa: E402
from chaos_train import TRAIN_KINDS, train_trials  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=2, help="trials per kind")
    ap.add_argument("--kinds", default="all", help="comma-separated kinds (default all): "
                    + ", ".join([f"precompute:{k}" for k in PRECOMPUTE_KINDS] + [f"train:{k}" for k in TRAIN_KINDS]
                                + [f"onpolicy:{k}" for k in ONPOLICY_KINDS])
                    + "; or precompute, train, onpolicy")
    ap.add_argument("--records", type=int, default=400)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seed", type=int, default=None, help="seed of every drawn moment (default: a fresh one, printed)")
    ap.add_argument("--json", default=None, help="also write every trial's row to this file")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--teacher", default=None, help="teacher directory (default: the demo's, trained if missing)")
    ap.add_argument("--student", default=None, help="student directory for the training trials (default: the demo's)")
    ap.add_argument("--lora-r", type=int, default=0, help="training trials train LoRA adapters of this rank (kdcache "
                    "train --lora-r) on a student with weights (default: the demo's student, its random start saved)")
    ap.add_argument("--s3", action="store_true", help="precompute into an S3-compatible server (moto) on 127.0.0.1")
    args = ap.parse_args()
    every = [f"precompute:{k}" for k in PRECOMPUTE_KINDS] + [f"train:{k}" for k in TRAIN_KINDS] + \
        [f"onpolicy:{k}" for k in ONPOLICY_KINDS]
    wanted = set()
    for k in args.kinds.split(","):
        k = k.strip()
        wanted |= set(every) if k == "all" else {e for e in every if e.split(":")[0] == k} if ":" not in k else {k}
    unknown = wanted - set(every)
    if unknown:
        sys.exit(f"unknown kinds: {sorted(unknown)}; known: {every}")
    args.kinds = wanted
    if args.seed is None:
        args.seed = int.from_bytes(os.urandom(4), "little")
    print(f"chaos: seed {args.seed} (rerun these moments with --seed {args.seed}), {args.trials} trial(s) per kind",
          flush=True)
    rng = np.random.default_rng(args.seed)
    random.seed(args.seed)
    teacher = args.teacher or os.path.join(ROOT, "runs", "demo", "teacher")
    if not args.teacher and not os.path.isfile(os.path.join(teacher, "teacher_training.json")):
        subprocess.run(kdcache_cmd("demo", "--stage", "teacher"), cwd=ROOT, check=True)
    work = tempfile.mkdtemp(prefix="kdchaos-")
    server = None
    try:
        root = work
        if args.s3:
            from tests.helpers.s3server import S3Server
            server = S3Server().start()
            os.environ.update(server.env())
            root = server.make_bucket("chaos")
        rows, duration, window = precompute_trials(args, work, teacher, rng, root)
        if duration is not None:
            print_precompute(args, rows, duration, window)
        trows = []
        if any(k.startswith("train:") for k in args.kinds):
            init = args.student or os.path.join(ROOT, "runs", "demo", "student_init")
            if not args.student and not os.path.isfile(os.path.join(init, "config.json")):
                from kdcache.demo.run import FULL, student_config
                student_config(os.path.join(ROOT, "runs", "demo"), teacher, FULL)
            if args.lora_r:
                init = with_weights(init, os.path.join(work, "lora-base"))
            trows = train_trials(args, work, f"{root}/pre-ref", init, rng)
            lora = f", LoRA r={args.lora_r}" if args.lora_r else ""
            print(f"\ntraining: {args.steps} steps, checkpoint every 5; 1 and 2 ranks (kdcache train --nproc-per-node)"
                  f"{lora}")
            print(f"{'trial':<58}{'counted':>8}{'exit':>6}{'logged':>8}{'resumed':>9}{'losses equal':>14}"
                  f"{'.tmp left':>10}")
            for r in trows:
                ok = "ok" if r["resumed_ok"] else "FAIL"
                print(f"{r['trial']:<58}{'yes' if r['interrupted'] else 'no':>8}{r['first_exit']:>6}"
                      f"{r['steps_logged_at_stop']:>8}{ok:>9}{str(r['losses_equal']):>14}"
                      f"{r['half_checkpoints_left']:>10}")
        orows = onpolicy_trials(args, work, teacher, rng) if any(k.startswith("onpolicy:") for k in args.kinds) \
            else []
        if orows:
            print(f"\non-policy: {'trial':<66}{'counted':>8}{'done':>6}{'losses equal':>14}{'lost':>6}{'dup':>5}"
                  f"{'diff':>6}{'orphans':>8}")
            for r in orows:
                print(f"{r['trial']:<76}{'yes' if r['interrupted'] else 'no':>8}{str(r['done']):>6}"
                      f"{str(r['losses_equal']):>14}{r['lost']:>6}{r['duplicated']:>5}{r['different']:>6}"
                      f"{r['orphans']:>8}")
        every_row = rows + trows + orows
        print(f"\n{'kind':<28}{'trials':>8}{'counted':>9}{'failures':>10}")
        for kind, (n, c, f) in by_kind(every_row).items():
            print(f"{kind:<28}{n:>8}{c:>9}{f:>10}")
        failures = sum(not r["ok"] for r in every_row)
        counted = sum(bool(r["interrupted"]) for r in every_row)
        print(f"\n{len(every_row)} trials, {counted} counted (the fault interrupted the job), {failures} failures, "
              f"{sum(r['lost'] for r in rows + orows)} samples lost, "
              f"{sum(r['duplicated'] for r in rows + orows)} duplicated "
              f"(seed {args.seed})")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"seed": args.seed, "trials_per_kind": args.trials, "records": args.records,
                           "steps": args.steps, "rows": every_row}, f, indent=1)
        return 1 if failures else 0
    finally:
        if server is not None:
            server.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


def with_weights(student, out):
    """A LoRA student needs weights to adapt: `student` itself if it has them, else its random start (seed 0),
    saved to `out`."""
    from kdcache.train.model import has_weights
    if has_weights(student):
        return student
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(student)).save_pretrained(out)
    AutoTokenizer.from_pretrained(student).save_pretrained(out)
    return out


if __name__ == "__main__":
    sys.exit(main())
