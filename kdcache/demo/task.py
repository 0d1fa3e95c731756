"""The demo task: read a job posting, list the required skills, stop.

Each skill is described by paraphrases that never name it ("containerize the
services" -> docker), so the model must map phrases to labels. The answer is
the skills in order of mention, comma separated, then the end-of-turn token.
Deterministic from a seed; train and held-out splits share no posting.
"""
import json
import random

SKILLS = {
    "python": ["write backend scripts in a snake-named language", "automate tasks with scripting in pip packages"],
    "sql": ["query relational databases", "write joins and aggregate reports over tables"],
    "docker": ["containerize the services", "package apps into container images"],
    "kubernetes": ["orchestrate container clusters", "run pods and deployments at scale"],
    "react": ["build single page web interfaces", "write frontend components with hooks"],
    "aws": ["manage cloud infrastructure on amazon", "deploy on lambda and s3"],
    "excel": ["maintain spreadsheets with pivot tables", "model budgets in workbooks"],
    "figma": ["design interface mockups", "prototype screens for designers"],
    "linux": ["administer unix servers", "tune the kernel and shell environment"],
    "git": ["review pull requests and branches", "manage version control history"],
    "spark": ["process big data in distributed jobs", "tune large batch dataframes on clusters"],
    "tableau": ["build business dashboards", "visualize sales metrics for managers"],
}
ROLES = ["data engineer", "web developer", "analyst", "platform engineer", "designer", "site reliability engineer",
         "product engineer", "consultant", "research engineer", "intern"]
OPENERS = ["We are hiring a {role}.", "Our team needs a {role}.", "Join us as a {role}.", "Open role: {role}."]
ASK = "List the required skills."


def make_example(rng: random.Random):
    n = rng.choice([1, 1, 2, 2, 3, 3, 4])
    skills = rng.sample(sorted(SKILLS), n)
    phrases = [rng.choice(SKILLS[s]) for s in skills]
    if n == 1:
        duties = phrases[0]
    else:
        duties = ", ".join(phrases[:-1]) + " and " + phrases[-1]
    opener = rng.choice(OPENERS).format(role=rng.choice(ROLES))
    user = f"Job posting: {opener} You will {duties}. {ASK}"
    return {"messages": [{"role": "user", "content": user},
                         {"role": "assistant", "content": ", ".join(skills)}]}


def make_splits(n_train, n_heldout, seed=0, make=None):
    """Disjoint train/held-out lists of chat records (held-out postings never appear in train). make: the example
    builder (default make_example; bench/onpolicy.py passes its long-answer one)."""
    rng = random.Random(seed)
    seen, train, held = set(), [], []
    while len(train) < n_train or len(held) < n_heldout:
        ex = (make or make_example)(rng)
        key = ex["messages"][0]["content"]
        if key in seen:
            continue
        seen.add(key)
        (held if len(held) < n_heldout and rng.random() < 0.2 or len(train) >= n_train else train).append(ex)
    return train, held


def write_jsonl(records, path):
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def labels(text):
    """An answer read as a set of comma-separated labels."""
    return {p.strip().lower() for p in text.split(",") if p.strip()}


def f1(pred, ref):
    if not pred and not ref:
        return 1.0
    tp = len(pred & ref)
    if tp == 0:
        return 0.0
    p, r = tp / len(pred), tp / len(ref)
    return 2 * p * r / (p + r)


def label_f1(answers, heldout_path):
    """The task's metric: mean label F1 of `answers` (eval.json's, in order) against the held-out references."""
    refs = [json.loads(line)["messages"][-1]["content"] for line in open(heldout_path) if line.strip()]
    return sum(f1(labels(a), labels(r)) for a, r in zip(answers, refs, strict=True)) / len(refs)


def corpus(records):
    """Plain texts for training a tokenizer."""
    for r in records:
        for m in r["messages"]:
            yield m["content"]
