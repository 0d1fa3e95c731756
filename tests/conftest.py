"""Shared fixtures: a tokenizer trained here and a tiny teacher built from a config (no hub)."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # so `tests.helpers` imports
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


class _NoBareNames:
    """The repository root is on sys.path here (for `tests.helpers`), which would let a stray `import pipeline`
    find the repository's folder and pass, while it fails for users (their train.py or pipeline/ comes first).
    kdcache installs one import root: refuse the bare names in the test process."""
    BARE = ("cache_format", "pipeline", "train")

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.partition(".")[0] in cls.BARE:
            raise ImportError(f"import {name!r}: kdcache's own code lives under kdcache.{name}; "
                              "a bare name would be a user's module")
        return None


sys.meta_path.insert(0, _NoBareNames)

# Under xdist, each worker (and every kdcache command it starts: they read OMP_NUM_THREADS, as PyTorch's tools
# do) gets its share of the cores. Two workers of two torch threads each on 2 cores oversubscribe them, and
# OpenMP's spinning threads then wait on descheduled ones: two quick demos side by side took 162 s that way,
# 104 s with one thread each (one alone: 66 s).
if os.environ.get("PYTEST_XDIST_WORKER_COUNT") and not os.environ.get("OMP_NUM_THREADS"):
    from kdcache.common.env import default_threads
    os.environ["OMP_NUM_THREADS"] = str(default_threads(int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

# `make test` runs files on two workers (xdist --dist loadfile --no-loadscope-reorder), handed out in collection
# order: the longest start first, so that short files fill the end and both workers finish together (a long file
# handed out last ran alone for minutes). Sums of their tests' durations on 2 cores, longest first (2026-12-01/02:
# 50-350 s each).
LONGEST_FILES = ("pipeline/test_precompute.py", "train/test_trainer.py", "train/test_trainer_resume.py",
                 "pipeline/test_sampled.py", "pipeline/test_served.py", "kdcache/test_onpolicy.py",
                 "kdcache/test_onpolicy_routed.py",
                 "kdcache/test_demo.py", "pipeline/test_generator.py", "pipeline/test_vllm_families.py",
                 "bench/test_chaos.py", "pipeline/test_remote_store.py", "pipeline/test_large_vocab.py",
                 "pipeline/test_ids_records.py", "examples/test_recipes.py", "pipeline/test_startup.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0].removeprefix("tests/"), len(rank)))


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


@pytest.fixture(scope="session")
def stopping(tiny):
    """{"sampled": a teacher that ends about half its sampled completions, "greedy": one whose greedy completions
    end at once for some prompts and never for others} (tests/helpers/teachers.py)."""
    from tests.helpers.teachers import stopping_teacher
    return {"sampled": stopping_teacher(tiny["tok"], tiny["dir"] / "stop-sampled", 0.5),
            "greedy": stopping_teacher(tiny["tok"], tiny["dir"] / "stop-greedy", 1.0)}


def _serving(server):
    """Start `server` for the session with its variables in this process's environment (its children inherit
    them); restore the environment and stop it after."""
    server.start()
    saved = {k: os.environ.get(k) for k in server.env()}
    os.environ.update(server.env())
    yield server
    server.stop()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def s3():
    """A real S3-compatible server (moto) on 127.0.0.1 for the whole session; this process and its children
    (Ray workers, trainers) reach it through AWS_ENDPOINT_URL. Tests make their own buckets."""
    from tests.helpers.s3server import S3Server
    yield from _serving(S3Server())


@pytest.fixture(scope="session")
def gcs():
    """A GCS-compatible server (gcp-storage-emulator) on 127.0.0.1 for the session, reached by gcsfs through
    STORAGE_EMULATOR_HOST (tests/helpers/gcsserver.py); this process and its children see it."""
    from tests.helpers.gcsserver import GCSServer
    yield from _serving(GCSServer())


@pytest.fixture
def gs_bucket(gcs, request):
    """A fresh bucket on the GCS emulator: gs://<name>."""
    import re
    import uuid
    name = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:40].strip("-") + "-" + uuid.uuid4().hex[:6]
    return gcs.make_bucket(name)


@pytest.fixture
def bucket(s3, request):
    """A fresh bucket: s3://<name>."""
    import re
    import uuid
    name = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:40].strip("-") + "-" + uuid.uuid4().hex[:6]
    return s3.make_bucket(name)
