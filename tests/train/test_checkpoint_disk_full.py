"""A checkpoint write that fails (a full disk: torch says only "file write failed") is reported with its path,
"disk full" where the disk is, and the checkpoint that is kept (issue 42, item 10)."""
import collections
import errno

import pytest

from kdcache.common.errors import TrainDataError
from kdcache.train import checkpoint


class _FailingEngine:
    def __init__(self, error):
        self.error = error

    def save_checkpoint(self, path, tag, client_state):
        raise self.error


def _save(tmp_path, error):
    return checkpoint.save(_FailingEngine(error), str(tmp_path), 3, rank=0, world=1, client_state={"step": 3},
                           rank_state={}, barrier=lambda: None, keep=2, order={})


def test_a_full_disk_is_named_with_the_path(tmp_path, monkeypatch):
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 4096, 4096))
    with pytest.raises(TrainDataError) as e:
        _save(tmp_path, RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 64 vs 0"))
    msg = str(e.value)
    assert "checkpoint of step 3: writing" in msg and ".tmp-step-00000003" in msg
    assert "disk full (4096 bytes free)" in msg and "no earlier checkpoint exists" in msg
    assert "free space, then rerun the same command" in msg


def test_other_write_errors_keep_their_words_and_the_path(tmp_path):
    with pytest.raises(TrainDataError, match=r"writing .*\.tmp-step-00000003 failed: \[Errno 13\] denied"):
        _save(tmp_path, PermissionError(errno.EACCES, "denied"))
    with pytest.raises(TrainDataError, match="disk full"):
        _save(tmp_path, OSError(errno.ENOSPC, "No space left on device"))
