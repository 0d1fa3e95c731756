"""Checkpoint and final-model files on disk, without DeepSpeed: a fake engine writes and reads one file.

Covers: checkpoints belong to a run (pruning and `--resume auto` never touch or pick another run's steps),
`final/` is replaced whole, and CUDA RNG states travel with the checkpoint."""
import json
import os
from types import SimpleNamespace

import pytest
import torch

from kdcache.common.errors import TrainDataError
from kdcache.train import checkpoint, trainer
from kdcache.train.checkpoint import _checkpoints, resolve_resume, rng_state, set_rng_state

PLAN = {"cache_fingerprint": "f" * 64, "shards_sha256": "a" * 64, "num_shards": 2, "world_size": 1, "seed": 0,
        "shuffle": True}


class FakeEngine:
    """DeepSpeed's checkpoint calls, as far as train/checkpoint.py uses them."""

    def save_checkpoint(self, path, tag, client_state):
        os.makedirs(os.path.join(path, tag), exist_ok=True)
        with open(os.path.join(path, tag, "engine.json"), "w") as f:
            json.dump(client_state, f)

    def load_checkpoint(self, path, tag, load_optimizer_states, load_lr_scheduler_states):
        with open(os.path.join(path, tag, "engine.json")) as f:
            return path, json.load(f)


def save(out, step, keep=2):
    return checkpoint.save(FakeEngine(), str(out), step, rank=0, world=1, client_state={"step": step},
                           rank_state={"pos": step}, barrier=lambda: None, keep=keep, order=PLAN)


def steps(out):
    return [step for step, _path, _run in _checkpoints(str(out))]      # every run's, oldest first


def meta(path):
    with open(os.path.join(path, "complete.json")) as f:
        return json.load(f)


@pytest.fixture(autouse=True)
def _rank0(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)      # a launcher's RANK in the environment would change who writes


# ---------------------------------------------------------------------------- 1. checkpoints belong to a run
@pytest.fixture
def other_run(tmp_path):
    """OUT with checkpoints 50 and 60 of an earlier run, then a new run started there with --resume never."""
    out = tmp_path / "o"
    assert resolve_resume(str(out), "auto") is None
    save(out, 50)
    save(out, 60)
    assert resolve_resume(str(out), "never") is None
    return out


def test_pruning_keeps_the_checkpoint_just_written_beside_another_runs_higher_steps(other_run):
    save(other_run, 10)
    assert steps(other_run) == [10, 50, 60]          # the old code pruned step 10 right after writing it
    save(other_run, 20)
    save(other_run, 30)
    assert steps(other_run) == [20, 30, 50, 60]      # keep=2 of ours; the other run's are not ours to prune


def test_resume_auto_refuses_when_another_run_has_higher_steps(other_run):
    save(other_run, 10)
    with pytest.raises(TrainDataError) as e:
        resolve_resume(str(other_run), "auto")       # the old code resumed the other run's step 60
    msg = str(e.value)
    assert str(other_run) in msg and "60" in msg and "10" in msg
    assert "new --out" in msg and "--resume PATH" in msg


def test_resume_auto_refuses_when_only_another_runs_checkpoints_are_there(other_run):
    with pytest.raises(TrainDataError, match=r"50.*60.*new --out"):
        resolve_resume(str(other_run), "auto")


def test_resume_auto_takes_the_current_runs_latest_and_keeps_its_id(tmp_path):
    out = tmp_path / "o"
    assert resolve_resume(str(out), "auto") is None
    save(out, 2)
    save(out, 4)
    run_id = checkpoint.read_run_id(str(out))
    assert run_id and meta(checkpoint.step_dir(str(out), 4))["run_id"] == run_id
    assert resolve_resume(str(out), "auto") == checkpoint.step_dir(str(out), 4)
    save(out, 6)
    assert checkpoint.read_run_id(str(out)) == run_id and meta(checkpoint.step_dir(str(out), 6))["run_id"] == run_id
    assert steps(out) == [4, 6]


def test_checkpoints_from_before_run_ids_resume_as_before(tmp_path):
    out = tmp_path / "o"
    for step in (3, 7):
        d = tmp_path / "o" / "checkpoints" / f"step-{step:08d}"
        d.mkdir(parents=True)
        (d / "complete.json").write_text(json.dumps({"step": step, "world_size": 1, "data": PLAN}))
    assert resolve_resume(str(out), "auto") == checkpoint.step_dir(str(out), 7)
    save(out, 8)                                     # continued: ours from now on, and auto follows it
    assert resolve_resume(str(out), "auto") == checkpoint.step_dir(str(out), 8)
    assert steps(out) == [3, 7, 8]


def test_resume_path_of_an_older_step_starts_a_new_run(tmp_path):
    """A rewind: the rewound run's step 4 must not win a later `auto` over the steps saved after the rewind."""
    out = tmp_path / "o"
    resolve_resume(str(out), "auto")
    save(out, 2)
    save(out, 4)
    first = checkpoint.read_run_id(str(out))
    assert resolve_resume(str(out), checkpoint.step_dir(str(out), 4)) == checkpoint.step_dir(str(out), 4)
    assert checkpoint.read_run_id(str(out)) == first          # its latest: the same run goes on
    resolve_resume(str(out), checkpoint.step_dir(str(out), 2))
    assert checkpoint.read_run_id(str(out)) != first
    save(out, 3)
    assert steps(out) == [2, 3, 4]
    with pytest.raises(TrainDataError, match="4"):
        resolve_resume(str(out), "auto")


def test_only_rank_0_records_the_run(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    assert resolve_resume(str(tmp_path / "o"), "never") is None
    assert not os.path.exists(tmp_path / "o" / checkpoint.RUN_FILE)


def test_finish_saves_our_last_step_even_when_another_run_has_that_step(other_run, monkeypatch):
    save(other_run, 8)                               # ours; the other run has 50 and 60
    saved = []
    monkeypatch.setattr(trainer, "save", lambda run: saved.append(run.step))
    run = SimpleNamespace(cfg=SimpleNamespace(out=str(other_run)), rank=1, step=60,
                          stream=SimpleNamespace(close=lambda: None))
    trainer.finish(run, "stopped by SIGTERM", "kdcache train ...")
    assert saved == [60]                             # the old code saw step 60 (theirs) and skipped it


# ---------------------------------------------------------------------------- 2. final/ is replaced whole
class FakeModel:
    def __init__(self, fail=False):
        self.fail, self.paths = fail, []

    def save_pretrained(self, path, safe_serialization):
        self.paths.append(path)
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "config.json"), "w") as f:
            f.write("new")
        if self.fail:
            raise OSError(28, "No space left on device")
        with open(os.path.join(path, "model.safetensors"), "w") as f:
            f.write("weights")


class FakeTok:
    def save_pretrained(self, path):
        with open(os.path.join(path, "tokenizer.json"), "w") as f:
            f.write("{}")


@pytest.fixture
def old_final(tmp_path):
    final = tmp_path / "final"
    final.mkdir()
    (final / "config.json").write_text("old")
    (final / "old-only.bin").write_text("from an earlier run")
    return final


def test_final_replaces_an_earlier_one_whole(old_final):
    model = FakeModel()
    trainer.save_final(model, FakeTok(), str(old_final), rank=0, stage=0)
    assert sorted(os.listdir(old_final)) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert (old_final / "config.json").read_text() == "new"
    assert model.paths == [str(old_final.parent / f".final.tmp-{os.getpid()}")]      # not final/ itself
    assert os.listdir(old_final.parent) == ["final"]                                  # nothing left beside it


def test_a_failed_save_leaves_the_earlier_final_untouched(old_final):
    with pytest.raises(OSError, match="No space"):
        trainer.save_final(FakeModel(fail=True), FakeTok(), str(old_final), rank=0, stage=0)
    assert sorted(os.listdir(old_final)) == ["config.json", "old-only.bin"]
    assert (old_final / "config.json").read_text() == "old"
    assert os.listdir(old_final.parent) == ["final"]


def test_only_rank_0_writes_the_final_model(tmp_path):
    model = FakeModel()
    trainer.save_final(model, FakeTok(), str(tmp_path / "final"), rank=1, stage=0)
    assert model.paths == [] and os.listdir(tmp_path) == []


# ---------------------------------------------------------------------------- 3. CUDA RNG states
CUDA = [torch.arange(16, dtype=torch.uint8), torch.arange(16, 32, dtype=torch.uint8)]


@pytest.fixture
def fake_cuda(monkeypatch):
    """Two CUDA devices as far as RNG goes; returns the list set_rng_state_all receives."""
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [t.clone() for t in CUDA])
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: restored.append([t.clone() for t in states]))
    return restored


def test_cuda_rng_states_round_trip_through_a_checkpoint(tmp_path, fake_cuda):
    out = tmp_path / "o"
    torch.manual_seed(3)
    path = save(out, 1)
    want = torch.rand(4)
    with open(os.path.join(path, "rank-00000.json")) as f:
        assert json.load(f)["rng"]["cuda"] == [t.tolist() for t in CUDA]      # absent in the old code's files
    torch.rand(100)
    client, reader = checkpoint.load(FakeEngine(), path, 0)
    assert client == {"step": 1} and reader == {"pos": 1}
    assert len(fake_cuda) == 1 and [t.tolist() for t in fake_cuda[0]] == [t.tolist() for t in CUDA]
    assert all(t.dtype == torch.uint8 for t in fake_cuda[0])
    assert torch.equal(torch.rand(4), want)                                    # CPU RNG still restored


def test_states_without_cuda_still_load(fake_cuda, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    st = json.loads(json.dumps(rng_state()))         # saved on a CPU-only machine, or before CUDA states
    assert "cuda" not in st
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    set_rng_state(st)
    assert fake_cuda == []


def test_more_saved_devices_than_present_restores_those_present(fake_cuda, monkeypatch):
    st = json.loads(json.dumps(rng_state()))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    set_rng_state(st)
    assert [t.tolist() for t in fake_cuda[0]] == [CUDA[0].tolist()]


def test_a_new_run_reaching_an_old_runs_step_keeps_both_checkpoints(tmp_path):
    """--resume PATH from step 2 starts a new run; its step 4 must not delete the old run's step 4 (issue 23,
    item 8: rmtree then replace lost it, and a kill between the two lost both)."""
    out = tmp_path / "o"
    resolve_resume(str(out), "auto")
    save(out, 2)
    old4 = save(out, 4)
    first = checkpoint.read_run_id(str(out))
    resolve_resume(str(out), checkpoint.step_dir(str(out), 2))        # a rewind: a new run
    second = checkpoint.read_run_id(str(out))
    assert second != first
    new4 = save(out, 4)
    assert new4 != old4 and os.path.basename(new4) == f"step-00000004-{second[:8]}"
    assert meta(old4)["run_id"] == first and meta(new4)["run_id"] == second          # both complete, each its own
    assert resolve_resume(str(out), "auto") == new4                 # the current run's latest
    save(out, 4)                                                    # saved again: replaced in place, still one
    assert sorted(os.listdir(out / checkpoint.CKPT_DIR)) == ["step-00000002", "step-00000004",
                                                             f"step-00000004-{second[:8]}"]
