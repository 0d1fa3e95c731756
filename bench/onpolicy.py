"""On-policy against off-policy distillation at one teacher-token budget, and against a teacher in the loop.

    .venv/bin/python bench/onpolicy.py [--seeds 3] [--steps 120] [--batch 8] [--rounds 4] [--arms a,b,c]
                                       [--out runs/bench-onpolicy]

Task (long answers, where a student's own slips lead it astray): read a job posting and, for each required skill in
order of mention, write the skill and the duty that asks for it ("docker: containerize the services; linux:
administer unix servers"), then end the turn. A teacher (the demo's teacher size) is trained on it; a smaller
student is first fine-tuned briefly on the reference answers (every arm starts from that one student), then
distilled by:

  (a) off-policy: the teacher scores the reference answers of steps x batch prompts once (`kdcache precompute`),
      the student trains `steps` steps on that cache (`kdcache train`);
  (b) on-policy: `kdcache onpolicy`, `rounds` rounds of steps x batch / rounds prompts: the student's own sampled
      completions (temperature 1), scored by the teacher, trained on for steps / rounds steps each;
  (c) TRL's GKDTrainer with lmbda=1: the student samples every batch, the teacher scores it in the same step.

Every arm: generalized JSD beta 0.5, the same learning rate, batch and step count, and one prompt per sample (so
the teacher scores steps x batch samples in each). Reported per arm and seed: held-out KL(student || teacher) per
token on the student's own greedy completions (kdcache eval's on-policy figure), the teacher-forced KL on the
reference answers, exact match, stop rate, wall seconds per student step (everything the arm runs, rollouts and
teacher included, start-up too), the same after start-up ((b): its rounds after the first, which starts Ray, the
teacher worker and the trainer; (c): GKDTrainer.train(), after imports and model loading), and the teacher tokens
scored. Then each arm's answer to a SIGHUP mid-run.
"""
import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from kdcache.demo.task import OPENERS, ROLES, SKILLS, make_splits  # noqa: E402

ASK = "For each required skill, write the skill and the duty that asks for it."
LR, BETA, NEW_TOKENS = "1e-3", "0.5", 64


def make_example(rng):
    n = rng.choice([2, 3, 3, 4])
    skills = rng.sample(sorted(SKILLS), n)
    phrases = [rng.choice(SKILLS[s]) for s in skills]
    duties = ", ".join(phrases[:-1]) + " and " + phrases[-1]
    opener = rng.choice(OPENERS).format(role=rng.choice(ROLES))
    return {"messages": [{"role": "user", "content": f"Job posting: {opener} You will {duties}. {ASK}"},
                         {"role": "assistant", "content": "; ".join(f"{s}: {p}" for s, p in zip(skills, phrases))}]}


def splits(n_train, n_heldout, seed=0):
    return make_splits(n_train, n_heldout, seed, make=make_example)


def write_jsonl(rows, path):
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return path


def kdcache(*args, log=None):
    cmd = [sys.executable, "-m", "kdcache", *map(str, args)]
    t0 = time.time()
    with open(log, "a") if log else open(os.devnull, "w") as out:
        res = subprocess.run(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    if res.returncode:
        raise SystemExit(f"failed ({res.returncode}): {' '.join(cmd)}" + (f"; see {log}" if log else ""))
    return time.time() - t0


def setup(out, args):
    """Data, tokenizer, teacher and the fine-tuned student start, built once under out/."""
    from kdcache.demo.models import make_model
    from kdcache.demo.task import corpus
    from kdcache.demo.teacher import train_teacher
    from kdcache.demo.tokenizer import train_tokenizer
    d = os.path.join(out, "setup")
    if os.path.isfile(os.path.join(d, "done.json")):
        return json.load(open(os.path.join(d, "done.json")))
    os.makedirs(d, exist_ok=True)
    train, held = splits(3000, 64, seed=0)
    write_jsonl(train, os.path.join(d, "train.jsonl"))
    write_jsonl(held, os.path.join(d, "heldout.jsonl"))
    tok = train_tokenizer(list(corpus(train)), os.path.join(d, "tok"), vocab_size=512)
    t0 = time.time()
    train_teacher(tok, train, os.path.join(d, "teacher"), size="teacher", steps=args.teacher_steps)
    teacher_s = time.time() - t0
    train_teacher(tok, train[:200], os.path.join(d, "student"), size="test", steps=args.sft_steps, seed=1)
    sizes = {name: sum(p.numel() for p in make_model(tok, size).parameters())
             for name, size in (("teacher", "teacher"), ("student", "test"))}
    info = {"train": os.path.join(d, "train.jsonl"), "heldout": os.path.join(d, "heldout.jsonl"),
            "teacher": os.path.join(d, "teacher"), "student": os.path.join(d, "student"),
            "teacher_training_s": round(teacher_s, 1), "parameters": sizes}
    json.dump(info, open(os.path.join(d, "done.json"), "w"))
    return info


def prompts(info, n, offset):
    rows = [json.loads(line) for line in open(info["train"])]
    return rows[offset:offset + n]


def arm_offpolicy(info, work, seed, args):
    """(a): the teacher scores the reference answers of steps x batch prompts once; the student trains on them."""
    n = args.steps * args.batch
    data = write_jsonl(prompts(info, n, 200), os.path.join(work, "offpolicy.jsonl"))
    cache = os.path.join(args.out, "offpolicy-cache")           # one cache, every seed: the teacher ran once
    pre_s = 0.0
    if not os.path.isfile(os.path.join(cache, "manifest.json")):
        pre_s = kdcache("precompute", "--teacher", info["teacher"], "--data", data, "--out", cache, "--backend", "hf",
                        "--top-k", 32, "--no-progress", log=os.path.join(work, "log.txt"))
    out = os.path.join(work, "a")
    train_s = kdcache("train", "--cache", cache, "--student", info["student"], "--out", out, "--max-steps",
                      args.steps, "--batch-size", args.batch, "--beta", BETA, "--lr", LR, "--seed", seed,
                      "--warmup-steps", 10, "--save-every", 0, "--no-progress", log=os.path.join(work, "log.txt"))
    from kdcache.cache_format import open_cache
    tokens = open_cache(cache).manifest["counts"]["tokens"]
    return {"model": os.path.join(out, "final"), "seconds": pre_s + train_s, "train_s": train_s,
            "teacher_tokens": tokens, "precompute_s": pre_s}


def arm_onpolicy(info, work, seed, args):
    """(b): kdcache onpolicy, rounds of the student's own samples."""
    n = args.steps * args.batch
    data = write_jsonl(prompts(info, n, 200), os.path.join(work, "prompts.jsonl"))
    out = os.path.join(work, "b")
    secs = kdcache("onpolicy", "--teacher", info["teacher"], "--student", info["student"], "--data", data, "--out", out,
                   "--rounds", args.rounds, "--prompts-per-round", n // args.rounds, "--steps-per-round",
                   args.steps // args.rounds, "--batch-size", args.batch, "--beta", BETA, "--lr", LR, "--seed", seed,
                   "--warmup-steps", 10, "--save-every", 0, "--gen-temperature", 1, "--gen-max-new-tokens",
                   NEW_TOKENS, "--top-k", 32, "--backend", "hf", "--no-progress", log=os.path.join(work, "log.txt"))
    rounds = json.load(open(os.path.join(out, "summary.json")))["rounds"]
    later = rounds[1:]          # past the first round, which starts Ray, the teacher worker and the trainer
    loop = sum(r["seconds"]["rollout"] + r["seconds"]["training"] for r in later) / max(1, sum(
        r["steps"][1] - r["steps"][0] + 1 for r in later)) if later else None
    return {"model": os.path.join(out, "final"), "seconds": secs, "loop_s_per_step": loop,
            "teacher_tokens": sum(r["teacher_tokens"] for r in rounds)}


def arm_trl(info, work, seed, args):
    """(c): TRL's GKDTrainer, lmbda 1 (every batch the student's own samples), the teacher in the loop."""
    out = os.path.join(work, "c")
    t0 = time.time()
    res = subprocess.run([sys.executable, __file__, "--trl-arm", json.dumps(
        {"info": info, "out": out, "seed": seed, "steps": args.steps, "batch": args.batch})], cwd=ROOT,
        stdout=open(os.path.join(work, "log.txt"), "a"), stderr=subprocess.STDOUT)
    if res.returncode:
        raise SystemExit(f"the TRL arm failed ({res.returncode}); see {work}/log.txt")
    got = json.load(open(os.path.join(out, "trl.json")))
    return {"model": os.path.join(out, "final"), "seconds": time.time() - t0, "teacher_tokens": got["teacher_tokens"],
            "train_s": got["train_s"], "loop_s_per_step": got["train_s"] / args.steps}


def trl_main(spec):
    """The TRL arm in its own process: GKDTrainer on the same prompts, models and settings."""
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.experimental.gkd import GKDConfig, GKDTrainer
    info, out = spec["info"], spec["out"]
    torch.set_num_threads(os.cpu_count() or 1)
    tok = AutoTokenizer.from_pretrained(info["student"])
    student = AutoModelForCausalLM.from_pretrained(info["student"], dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(info["teacher"], dtype=torch.float32).eval()
    counted = {"tokens": 0}

    def count(module, a, kw):
        mask = kw.get("attention_mask")
        ids = kw.get("input_ids") if kw.get("input_ids") is not None else (a[0] if a else None)
        counted["tokens"] += int(mask.sum()) if mask is not None else int(ids.numel())
    teacher.register_forward_pre_hook(count, with_kwargs=True)
    rows = prompts(info, spec["steps"] * spec["batch"], 200)
    cfg = GKDConfig(output_dir=out, per_device_train_batch_size=spec["batch"], max_steps=spec["steps"],
                    learning_rate=float(LR), lr_scheduler_type="cosine", warmup_steps=10, lmbda=1.0,
                    beta=float(BETA), temperature=1.0, max_new_tokens=NEW_TOKENS, seed=spec["seed"],
                    logging_steps=10, save_strategy="no", report_to=[], use_cpu=True, bf16=False,
                    max_length=256, dataloader_num_workers=0)
    trainer = GKDTrainer(model=student, teacher_model=teacher, args=cfg, processing_class=tok,
                         train_dataset=datasets.Dataset.from_list(rows))
    t0 = time.time()
    trainer.train()
    train_s = time.time() - t0
    trainer.model.generation_config.eos_token_id = tok.eos_token_id
    trainer.save_model(os.path.join(out, "final"))
    tok.save_pretrained(os.path.join(out, "final"))
    json.dump({"teacher_tokens": counted["tokens"], "train_s": train_s}, open(os.path.join(out, "trl.json"), "w"))


def evaluate(info, models):
    from kdcache.train.eval import evaluate as run_eval
    res = run_eval({"teacher": info["teacher"], **models}, info["heldout"], reference="teacher",
                   max_new_tokens=NEW_TOKENS, batch_size=64)
    return res


def signal_trial(info, work, arm, args):
    """Start the arm's command, then mid-run SIGHUP its process group (a closed terminal) or, with --signal kill,
    SIGKILL its main process (kill -9); report what remains, and for (b) what the same command does rerun."""
    n = args.steps * args.batch
    data = write_jsonl(prompts(info, n, 200), os.path.join(work, "prompts.jsonl"))
    out = os.path.join(work, f"hup-{arm}")
    if arm == "b":
        cmd = [sys.executable, "-m", "kdcache", "onpolicy", "--teacher", info["teacher"], "--student", info["student"],
               "--data", data, "--out", out, "--rounds", args.rounds, "--prompts-per-round", n // args.rounds,
               "--steps-per-round", args.steps // args.rounds, "--batch-size", args.batch, "--beta", BETA,
               "--gen-max-new-tokens", NEW_TOKENS, "--top-k", 32, "--backend", "hf", "--no-progress"]
    else:
        cmd = [sys.executable, __file__, "--trl-arm", json.dumps({"info": info, "out": out, "seed": 0,
                                                                  "steps": args.steps, "batch": args.batch})]
    cmd = [str(c) for c in cmd]
    log = open(os.path.join(work, f"log-hup-{arm}.txt"), "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True, stdout=log, stderr=subprocess.STDOUT,
                            preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
    time.sleep(args.hup_after)
    sig = signal.SIGKILL if args.signal == "kill" else signal.SIGHUP
    if sig == signal.SIGKILL:
        os.kill(proc.pid, sig)
    else:
        os.killpg(proc.pid, sig)
    code = proc.wait()
    if arm == "b":
        rounds = json.load(open(os.path.join(out, "summary.json")))["rounds"]
        t0 = time.time()
        rerun = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode
        return (f"exit {code} after {sig.name} at {args.hup_after} s, rounds then {[r['stage'] for r in rounds]}; "
                f"the same command rerun: exit {rerun}, finished in {time.time() - t0:.0f} s from where it stopped")
    saved = os.path.exists(os.path.join(out, "final"))
    return (f"exit {code} (killed by {sig.name}: {code == -sig}) at {args.hup_after} s; final model saved: "
            f"{saved}; with save_strategy 'no' nothing remains, with checkpoints the Trainer resumes the last one "
            "but the step's samples are drawn again")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--teacher-steps", type=int, default=800)
    ap.add_argument("--sft-steps", type=int, default=60)
    ap.add_argument("--hup-after", type=float, default=20.0)
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "bench-onpolicy"))
    ap.add_argument("--arms", default="a,b,c", help="the arms to run, e.g. b,c (a timing run of more steps)")
    ap.add_argument("--tag", default="", help="suffix of this run's seed-N directories and results.json (beside "
                                              "the default run's, on the same teacher and student)")
    ap.add_argument("--only-sighup", action="store_true", help="only the signal trials (after a full run)")
    ap.add_argument("--signal", choices=["hup", "kill"], default="hup",
                    help="the trials' signal: SIGHUP to the arm's process group, or SIGKILL to its main process")
    ap.add_argument("--trl-arm", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trl_arm:
        return trl_main(json.loads(args.trl_arm))
    os.makedirs(args.out, exist_ok=True)
    info = setup(args.out, args)
    print(f"setup: teacher trained in {info['teacher_training_s']} s; parameters {info['parameters']}; {args.steps} "
          f"steps x batch {args.batch} per arm, {args.rounds} rounds for (b)", flush=True)
    table = []
    for seed in range(0 if args.only_sighup else args.seeds):
        work = os.path.join(args.out, f"seed-{seed}{args.tag}")
        shutil.rmtree(work, ignore_errors=True)
        os.makedirs(work)
        runs = {"a_offpolicy": arm_offpolicy, "b_onpolicy": arm_onpolicy, "c_trl_gkd": arm_trl}
        arms = {k: f(info, work, seed, args) for k, f in runs.items() if k[0] in args.arms.split(",")}
        res = evaluate(info, {k: v["model"] for k, v in arms.items()})
        for k, v in arms.items():
            r = res[k]
            row = {"seed": seed, "arm": k, "onpolicy_kl": r["onpolicy_kl"], "kl_from_teacher": r["kl_from_reference"],
                   "exact_match": r["exact_match"], "stop_rate": r["stop_rate"],
                   "s_per_step": v["seconds"] / args.steps, "teacher_tokens": v["teacher_tokens"],
                   **({"loop_s_per_step": v["loop_s_per_step"]} if v.get("loop_s_per_step") else {})}
            table.append(row)
            print(json.dumps(row), flush=True)
        table.append({"seed": seed, "arm": "teacher", "exact_match": res["teacher"]["exact_match"],
                      "stop_rate": res["teacher"]["stop_rate"]})
        table.append({"seed": seed, "arm": "student_start", **{k: v for k, v in evaluate(
            info, {"start": info["student"]})["start"].items() if k in ("onpolicy_kl", "exact_match", "stop_rate")}})
    if table:
        json.dump(table, open(os.path.join(args.out, f"results{args.tag}.json"), "w"), indent=1)
    print("\n| arm | KL(S‖T) own samples | KL(T‖S) reference | exact match | stop rate | s/step | s/step after "
          "start-up | teacher tokens |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for arm in ("student_start", "a_offpolicy", "b_onpolicy", "c_trl_gkd", "teacher"):
        rows = [r for r in table if r["arm"] == arm]

        def cell(key, fmt, rows=rows):
            vals = [r[key] for r in rows if key in r]
            if not vals:
                return "-"
            sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
            return f"{fmt.format(statistics.mean(vals))} ± {fmt.format(sd)}"
        print(f"| {arm} | {cell('onpolicy_kl', '{:.3f}')} | {cell('kl_from_teacher', '{:.3f}')} | "
              f"{cell('exact_match', '{:.2f}')} | {cell('stop_rate', '{:.2f}')} | {cell('s_per_step', '{:.2f}')} | "
              f"{cell('loop_s_per_step', '{:.3f}')} | "
              f"{cell('teacher_tokens', '{:,.0f}')} |")
    if args.hup_after > 0:
        work = os.path.join(args.out, f"sig{args.signal}")
        shutil.rmtree(work, ignore_errors=True)
        os.makedirs(work)
        for arm in ("b", "c"):
            print(f"SIG{args.signal.upper()}, arm {arm}: {signal_trial(info, work, arm, args)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
