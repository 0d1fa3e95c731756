"""Shared fixtures: a tokenizer trained here and a tiny teacher built from a config (no hub)."""
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """{'teacher': dir with a random-init Qwen2 + ChatML tokenizer, 'tok': tokenizer, 'records': demo records}."""
    from kdcache.demo.models import make_model, save
    from kdcache.demo.task import corpus, make_splits
    from kdcache.demo.tokenizer import train_tokenizer
    d = tmp_path_factory.mktemp("tiny")
    train, held = make_splits(120, 20, seed=0)
    tok = train_tokenizer(list(corpus(train)), str(d / "tok"), vocab_size=400)
    model = make_model(tok, "test", seed=0)
    save(model, tok, str(d / "teacher"))
    return {"teacher": str(d / "teacher"), "tok": tok, "train": train, "heldout": held, "dir": d}


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)
