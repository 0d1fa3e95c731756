"""`kdcache onpolicy`: on-policy distillation in rounds, with the teacher never in the training loop.

Round r: the current student (the initial one, then the previous round's) writes completions for the next P
prompts (`kdcache precompute --mode generate --generator STUDENT`, its log-prob of each sampled token kept as
behavior_logprobs); the teacher scores them into a cache in a store; the student trains N steps on that cache
(`kdcache train --until-step --new-cache`), one optimizer, schedule and step count across every round. With
--cross-tokenizer and a student of another tokenizer family, the completions reach the teacher as text
(kdcache/onpolicy_cross.py).

Each stage is what a kdcache command runs, and resumes as it does after kill -9, SIGTERM and SIGHUP: kept up in
this process across rounds (--stages kept: Ray, the teacher and the trainer start once), or a command of its own
per stage (--stages fresh; kdcache/stages.py). DIR/summary.json says which stages are done (written atomically
after each), so the same command, rerun, goes on where it stopped:

    DIR/onpolicy_config.yaml    the settings (a rerun with others is refused)
    DIR/summary.json            {"rounds": [{"round", "prompts", "cache", "stage", "done", "teacher_tokens",
                                 "steps": [first, last]}, ...]}
    DIR/rounds/round-RRRR/      prompts.jsonl, precompute.yaml, train.yaml, cache.txt (the cache's location)
    DIR/store/                  the round caches (or --store), each reusable by `kdcache train`
    DIR/metrics.jsonl, DIR/checkpoints/, DIR/tensorboard/, DIR/final/    as `kdcache train --out DIR` writes them
"""
import argparse
import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass

import yaml

from kdcache.cache_format.errors import LockedError
from kdcache.cache_format.lock import DirLock
from kdcache.cache_format.manifest import load_manifest
from kdcache.common.atomic import atomic_write_bytes
from kdcache.common.config import add_flags, coerce, field, load, validate
from kdcache.common.errors import ConfigError, KdcacheError
from kdcache.common.signals import StopFlag
from kdcache.pipeline.config import PrecomputeConfig
from kdcache.stages import make_stages
from kdcache.train.config import TrainConfig

from .onpolicy_cross import completions_line, cross_rounds, rollout_settings, scoring_settings, write_chats
from .onpolicy_state import LOCK, alive, check_same_run, holder_pid, load_summary, read_prompts, save_summary
from .routing import BASE, routes, teachers  # BASE: --teacher base, the LoRA student's own base weights

WAIT_S = 900     # how long a rerun waits for the stages of a killed run to finish their checkpoint


@dataclass
class OnpolicyConfig:
    teacher: str | list = field("", "teacher model directory, the URL of a vLLM server (as kdcache precompute), or "
                                    "`base`: with --lora-r, the student's own base weights (its adapter disabled) "
                                    "score every round, which is self-distillation (a directory named base is "
                                    "./base). Several: repeat as NAME=DIR with --route-field", repeat=True)
    route_field: str = field("", "with NAME=DIR teachers: the prompt field whose value names each prompt's teacher "
                                 "(e.g. domain); a round writes one cache per teacher and trains on all of them")
    student: str = field("", "initial student model directory: it writes round 1's completions")
    data: str = field("", "prompts: records as in generate mode (.jsonl, .parquet, save_to_disk); the list cycles")
    out: str = field("", "run directory: summary.json, rounds/, store/, checkpoints, metrics.jsonl, final/")
    rounds: int = field(1, "rounds of rollout, scoring and training")
    prompts_per_round: int = field(0, "prompts the student completes in each round")
    steps_per_round: int = field(0, "optimizer steps on each round's cache")
    store: str | None = field(None, "store of the round caches (default: OUT/store); a directory or a URL")
    offpolicy_cache: str | None = field(None, "an off-policy cache mixed into every round's training: each "
                                              "micro-batch comes from the round's cache with probability --lambda, "
                                              "else from this one (GKD's lambda)")
    lmbda: float = field(0.5, "with --offpolicy-cache (also --lambda): the probability that a micro-batch comes from "
                              "the round's cache")
    stages: str = field("auto", "kept: the stages run in this process and stay up across rounds (Ray, the teacher "
                                "and the trainer start once); fresh: each stage is a command of its own, which frees "
                                "its memory and GPUs when it ends; auto: kept unless a GPU is visible or "
                                "--nproc-per-node is above 1", choices=("auto", "kept", "fresh"))

    def __post_init__(self):
        validate(self, required=("teacher", "student", "data", "out", "prompts_per_round", "steps_per_round"),
                 checks=[("rounds", self.rounds >= 1, "must be >= 1"),
                         ("prompts_per_round", self.prompts_per_round >= 1, "must be >= 1"),
                         ("steps_per_round", self.steps_per_round >= 1, "must be >= 1"),
                         ("lmbda", 0.0 <= self.lmbda <= 1.0, "must be in [0, 1]")])
        named = "" not in teachers(self.teacher)
        if named != bool(self.route_field):
            raise ConfigError("route_field: NAME=DIR teachers and --route-field come together (each prompt's field "
                              "names its teacher)" if named else "route_field: needs NAME=DIR teachers (--teacher "
                              "math=DIR --teacher code=DIR2)")

    @property
    def routed(self) -> bool:
        return bool(self.route_field)


# What the loop sets on each stage itself; every other precompute and train setting passes through.
OWN_PRECOMPUTE = ("teacher", "data", "out", "store", "alias", "mode", "generator", "location_file")
OWN_TRAIN = ("cache", "student", "out", "max_steps", "epochs", "until_step", "new_cache", "resume", "stop_after",
             "mix_cache", "mix_lambda")


def _names(cls):
    return {f.name for f in dataclasses.fields(cls)}


def parse(argv):
    """(OnpolicyConfig, precompute settings, train settings): flags over --config YAML; unknown keys refused."""
    p = argparse.ArgumentParser(prog="kdcache onpolicy", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", help="YAML file with any of the settings below; flags override it")
    add_flags(p, OnpolicyConfig)
    p.add_argument("--lambda", dest="lmbda", default=None, metavar="LAMBDA", help="the same as --lmbda")
    own = _names(OnpolicyConfig)
    add_flags(p.add_argument_group("rollout and scoring (kdcache precompute's settings; --seed and --tokenizer "
                                   "apply to training too)"), PrecomputeConfig, skip=own | set(OWN_PRECOMPUTE))
    add_flags(p.add_argument_group("training (kdcache train's settings)"), TrainConfig,
              skip=own | set(OWN_TRAIN) | _names(PrecomputeConfig))
    args = p.parse_args(argv)
    values = {}
    if args.config:
        with open(args.config) as f:
            values = yaml.safe_load(f) or {}
        if not isinstance(values, dict):
            raise ConfigError(f"{args.config}: expected a mapping of keys to values")
    values.update({k: v for k, v in vars(args).items() if k != "config" and v is not None})
    pre_keys = _names(PrecomputeConfig) - set(OWN_PRECOMPUTE) - own
    train_keys = _names(TrainConfig) - set(OWN_TRAIN) - own
    unknown = sorted(set(values) - own - pre_keys - train_keys)
    if unknown:
        raise ConfigError(f"unknown or loop-owned key(s): {', '.join(unknown)} (the loop sets "
                          f"{', '.join(sorted(set(OWN_PRECOMPUTE) | set(OWN_TRAIN)))} on each stage itself)")
    cfg = load(OnpolicyConfig, None, {k: v for k, v in values.items() if k in own})
    pre = {k: coerce(PrecomputeConfig, k, v) for k, v in values.items() if k in pre_keys}
    train = {k: coerce(TrainConfig, k, v) for k, v in values.items() if k in train_keys}
    for t in teachers(cfg.teacher).values():                                                       # their checks
        pre_cfg = PrecomputeConfig(**dict(pre, teacher=cfg.student if t == BASE else t, data=cfg.data, out=cfg.out))
    train_cfg = TrainConfig(**dict(train, cache="-", student=cfg.student, out=cfg.out))
    if BASE in teachers(cfg.teacher).values() and not train_cfg.lora_r:
        raise ConfigError("teacher: `base` is the base weights under a LoRA student's adapter, and this run trains "
                          "every weight (no --lora-r): pass --lora-r R, or a teacher directory")
    if train_cfg.cross_tokenizer and (BASE in teachers(cfg.teacher).values() or train_cfg.objective == "token-rkl"):
        raise ConfigError("cross_tokenizer: " + ("`base` teachers share the student's tokenizer: drop "
                          "--cross-tokenizer" if train_cfg.objective != "token-rkl" else "token-rkl weighs the "
                          "student's sampled ids, which the teacher's tokens do not keep; use --objective gkd"))
    if train_cfg.objective == "token-rkl" and pre_cfg.gen_temperature <= 0:
        raise ConfigError("objective: token-rkl on greedy rollouts (--gen-temperature 0): a point mass is no "
                          "distribution to weight by, and the estimate on greedy tokens is not the reverse KL; "
                          "sample the rollouts (--gen-temperature 1), or use --objective gkd")
    if train_cfg.objective == "token-rkl" and train_cfg.beta and not cfg.offpolicy_cache:
        raise ConfigError(f"beta: {train_cfg.beta} with --objective token-rkl and no --offpolicy-cache: beta is the "
                          "divergence of off-policy (GKD) micro-batches, and this run has none")
    return cfg, pre, train


# ---------------------------------------------------------------------------- the loop
def run(cfg, pre, train):
    t_start = time.time()
    os.makedirs(cfg.out, exist_ok=True)
    lock = _lock(cfg.out)
    try:
        check_same_run(cfg, pre, train)
        prompts, places = read_prompts(cfg.data, places=True)
        if cfg.routed:
            routes(prompts, places, cfg.route_field, teachers(cfg.teacher))     # every prompt names a teacher
        stop = StopFlag().install()
        summary = load_summary(cfg.out)
        stages = make_stages(cfg.stages, train, lock)
        cross = cross_rounds(train, list(teachers(cfg.teacher).values()), cfg.student, pre.get("tokenizer"))
        try:
            for r in range(cfg.rounds):
                entry = _entry(summary, r, cfg, len(prompts))
                if stop and not entry["done"]:
                    return _stopped(stop, r, "between stages")
                if entry["stage"] == "new":
                    save_summary(cfg.out, summary)          # the round has begun
                    t0 = time.time()
                    if not _rollout(cfg, pre, r, prompts, entry, stop, stages, cross):
                        return _stopped(stop, r, "rollout and scoring")
                    entry.setdefault("seconds", {})["rollout"] = round(time.time() - t0, 2)
                    save_summary(cfg.out, summary)
                if entry["stage"] == "scored":
                    if stop:
                        return _stopped(stop, r, "between stages")
                    t0 = time.time()
                    if not _train(cfg, train, r, entry, stop, stages):
                        return _stopped(stop, r, "training")
                    entry.setdefault("seconds", {})["training"] = round(time.time() - t0, 2)
                    save_summary(cfg.out, summary)
        finally:
            stages.close()
        _print_summary(cfg, summary, stages.name, time.time() - t_start)
        return 0
    finally:
        lock.release()


def _rollout(cfg, pre, r, prompts, entry, stop, stages, cross=False):
    """Round r's completions by the current student, scored by the teacher into a cache. True when complete."""
    d = _round_dir(cfg.out, r)
    os.makedirs(d, exist_ok=True)
    start = r * cfg.prompts_per_round
    picked = [prompts[(start + i) % len(prompts)] for i in range(cfg.prompts_per_round)]
    named = teachers(cfg.teacher)
    groups = {"": picked}
    if cfg.routed:             # one job per teacher the round's prompts name, in --teacher order
        names = routes(picked, [f"round {r + 1} prompt {i}" for i in range(len(picked))], cfg.route_field, named)
        groups = {n: [p for p, m in zip(picked, names) if m == n] for n in named if n in names}
    done = {}
    for name, lines in groups.items():
        got = _score(cfg, pre, r, name, named[name], lines, stop, stages, cross)
        if got is None:
            return False
        done[name] = got
    if cross:                  # what the rollouts held as text (kdcache/onpolicy_cross.py)
        entry["completions"] = {n: c for n, (_, _, c) in done.items()} if cfg.routed else done[""][2]
    if not cfg.routed:
        entry.update(cache=done[""][0], stage="scored", teacher_tokens=done[""][1])
        return True
    entry.update(cache=[c for c, _, _ in done.values()], stage="scored",
                 teacher_tokens=sum(n for _, n, _ in done.values()),
                 teachers={n: {"cache": c, "prompts": len(groups[n]), "teacher_tokens": t}
                           for n, (c, t, _) in done.items()})
    return True


def _score(cfg, pre, r, name, teacher, lines, stop, stages, cross=False):
    """One precompute job of round r: `lines`' completions by the round's student, scored by `teacher` (named
    `name` among routed teachers, else ""); with cross (another tokenizer family), through text in three steps
    (kdcache/onpolicy_cross.py). (cache, teacher tokens, completion counts or None) when complete, else None."""
    d, start = _round_dir(cfg.out, r), r * cfg.prompts_per_round
    tag = f"-{name}" if name else ""
    prompts = os.path.join(d, f"prompts{tag}.jsonl")
    atomic_write_bytes(prompts, "".join(line + "\n" for line in lines).encode())
    gen, counts, base = student_of_round(cfg, r), None, teacher == BASE
    teacher = cfg.student if base else teacher
    common = dict(out=cfg.store or os.path.join(cfg.out, "store"), store=True,
                  alias=f"{os.path.basename(os.path.abspath(cfg.out))}-round-{r + 1}{tag}",
                  seed=int(pre.get("seed") or 0) + start)    # sample seeds: seed + the prompt's running number
    who = f"{(name + ': ') if name else ''}{teacher}"
    if not cross:
        stage = dict(pre, teacher=teacher, data=prompts, mode="generate", generator=gen, **common)
        _say(f"round {r + 1}/{cfg.rounds}: {len(lines)} completions by {gen}, scored by {who}"
             f"{' (the base weights, adapter disabled)' if base else ''}")
    else:
        roll = dict(rollout_settings(pre, gen), data=prompts, **dict(common, alias=common["alias"] + "-rollout"))
        _say(f"round {r + 1}/{cfg.rounds}: {len(lines)} completions by {gen} in its own tokens (--cross-tokenizer)")
        rolled = _job(roll, d, f"rollout{tag}", f"rollout{tag}.txt", stop, stages, f"round {r + 1}{tag} rollout")
        if rolled is None:
            return None
        counts = write_chats(os.path.join(d, f"chats{tag}.jsonl"), rolled[0], lines, gen, pre.get("tokenizer"))
        _say(f"round {r + 1}/{cfg.rounds}: {completions_line(counts)}; their text scored by {who}")
        stage = dict(scoring_settings(pre, teacher), data=os.path.join(d, f"chats{tag}.jsonl"), **common)
    done = _job(stage, d, f"precompute{tag}", f"cache{tag}.txt", stop, stages, f"round {r + 1}{tag}")
    return None if done is None else (done[0], int(done[1]["counts"]["tokens"]), counts)


def _job(stage, d, name, where, stop, stages, what):
    """Run one precompute stage from d/NAME.yaml, its cache's location written to d/WHERE. (cache, manifest) once
    the cache is complete, else None."""
    where = os.path.join(d, where)
    _write_yaml(os.path.join(d, f"{name}.yaml"), dict(stage, location_file=where))
    stages.precompute(os.path.join(d, f"{name}.yaml"), stop, what)
    if not os.path.isfile(where):      # stopped before it knew where its cache goes
        return None
    with open(where) as f:
        cache = f.read().strip()
    try:
        m = load_manifest(cache)
    except KdcacheError:
        if stop.signal:                # stopped before its first commit: nothing of it is kept
            return None
        raise
    return (cache, m) if m.complete else None


def _train(cfg, train, r, entry, stop, stages):
    """Round r's training: steps r*N+1 .. (r+1)*N on its cache, continuing the run in DIR. True when done."""
    d, n = _round_dir(cfg.out, r), cfg.steps_per_round
    until = (r + 1) * n
    stage = dict(train, cache=entry["cache"], student=cfg.student, out=cfg.out, max_steps=cfg.rounds * n,
                 until_step=until, new_cache=True, resume="auto")
    stage.update(offpolicy_mix(cfg, entry))
    _write_yaml(os.path.join(d, "train.yaml"), stage)
    _say(f"round {r + 1}/{cfg.rounds}: training steps {r * n + 1}-{until} on {entry['cache']}")
    stages.train(os.path.join(d, "train.yaml"), stop, f"round {r + 1}")
    try:
        with open(os.path.join(cfg.out, "train_summary.json")) as f:
            done = json.load(f)
    except (OSError, ValueError):
        return False
    if done.get("step") != until:
        return False
    entry.update(stage="trained", done=True, steps=[r * n + 1, until])
    return True


def offpolicy_mix(cfg, entry) -> dict:
    """The train settings that mix --offpolicy-cache into a round: a micro-batch comes from the round's caches with
    probability --lambda (routed teachers: shared among their caches in proportion to the positions each holds),
    else from the off-policy cache."""
    if not cfg.offpolicy_cache:
        return {}
    if not isinstance(entry["cache"], list):
        return {"mix_cache": cfg.offpolicy_cache, "mix_lambda": cfg.lmbda}
    tokens = [t["teacher_tokens"] for t in entry["teachers"].values()]     # in entry["cache"]'s order
    shares = [t / sum(tokens) for t in tokens] if sum(tokens) else [1 / len(tokens)] * len(tokens)
    weights = [cfg.lmbda * s for s in shares] + [1.0 - cfg.lmbda]
    return {"cache": entry["cache"] + [cfg.offpolicy_cache], "cache_weights": ",".join(f"{w:.6g}" for w in weights)}


def teacher_of(cfg):
    """The teacher that scores each round (the first, with routed teachers). `base` is --student itself: a LoRA
    student's base weights never train, so the model in --student is exactly the student with its adapter
    disabled (ms-swift's OPSD, tinker's SDFT)."""
    t = next(iter(teachers(cfg.teacher).values()))
    return cfg.student if t == BASE else t


def student_of_round(cfg, r):
    """Who writes round r's completions: the initial student, then the last round's (DIR/final)."""
    return cfg.student if r == 0 else os.path.join(cfg.out, "final")


# ---------------------------------------------------------------------------- the pieces
def _lock(out):
    """Hold DIR for this run. Held by another live `kdcache onpolicy`: refused. Held only by the stages of one
    that was killed (they inherit the lock and stop after their checkpoint): waited for."""
    lock = DirLock(out, LOCK, refusal="Another `kdcache onpolicy` is running in this --out: wait for it, stop it, "
                   "or pass another --out.")
    deadline = None
    while True:
        try:
            return lock.acquire()
        except LockedError:
            holder = holder_pid(out)
            if holder is not None and alive(holder):
                raise
            if deadline is None:
                deadline = time.time() + WAIT_S
                _say(f"the stages of a stopped run in {out} are finishing their checkpoint; waiting for them")
            if time.time() > deadline:
                raise
            time.sleep(0.5)


def _entry(summary, r, cfg, n_prompts):
    rounds = summary["rounds"]
    while len(rounds) <= r:
        k = len(rounds)
        rounds.append({"round": k + 1, "prompts": [k * cfg.prompts_per_round % n_prompts, cfg.prompts_per_round],
                       "cache": None, "stage": "new", "done": False, "teacher_tokens": 0, "steps": None})
    return rounds[r]


def _round_dir(out, r):
    return os.path.join(out, "rounds", f"round-{r + 1:04d}")


def _write_yaml(path, values):
    atomic_write_bytes(path, yaml.safe_dump(values, sort_keys=False).encode())


def _stopped(stop, r, what):
    _say(f"stopped{' by ' + stop.signal if stop.signal else ''} in round {r + 1} ({what}); what was committed "
         "is kept. Rerun the same command to resume.")
    return 0


def _print_summary(cfg, summary, stages, wall_s):
    from kdcache.train.metrics import read_metrics
    rows = {r["step"]: r for r in read_metrics(os.path.join(cfg.out, "metrics.jsonl"))}
    print("\non-policy summary\n  round  teacher tokens  steps        last loss  rollout s  training s  cache")
    for e in summary["rounds"][:cfg.rounds]:
        last = rows.get((e.get("steps") or [0, 0])[1], {}).get("loss")
        secs = e.get("seconds") or {}
        print(f"  {e['round']:>5}  {e['teacher_tokens']:>14,}  {str(e['steps']):<11}  "
              f"{'' if last is None else f'{last:9.4f}':>9}  {secs.get('rollout', ''):>9}  "
              f"{secs.get('training', ''):>10}  {e['cache']}")
    print(f"  stages: {stages}; this run's wall time {wall_s:.1f} s (a stage's seconds are those of the run that "
          "finished it)", flush=True)
    print(f"  final student: {os.path.join(cfg.out, 'final')}", flush=True)


def _say(msg):
    print(f"[onpolicy] {msg}", flush=True)


def main(argv=None):
    cfg, pre, train = parse(sys.argv[2:] if argv is None else list(argv))
    if not os.path.isfile(os.path.join(cfg.student, "config.json")):
        raise ConfigError(f"student: {cfg.student} is not a model directory (no config.json): round 1's "
                          "completions are its own")
    return run(cfg, pre, train)
