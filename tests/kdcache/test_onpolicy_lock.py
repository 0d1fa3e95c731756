"""`kdcache onpolicy`'s lock on --out: a live holder is refused at once; a lock held only by the stages of a killed
loop (the file names a dead pid) is waited for, then taken (issue 42, section 4: both branches)."""
import os
import subprocess
import sys
import time

import pytest

from kdcache import onpolicy
from kdcache.cache_format.errors import LockedError

HOLD = ("import sys, time\nfrom kdcache.cache_format.lock import DirLock\n"
        "lock = DirLock(sys.argv[1], sys.argv[2]).acquire()\nprint('held', flush=True)\ntime.sleep(120)\n")


def _holder(out):
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(out), onpolicy.LOCK], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def test_a_live_holder_is_refused_at_once(tmp_path, monkeypatch):
    monkeypatch.setattr(onpolicy, "WAIT_S", 5)
    p = _holder(tmp_path)
    try:
        t0 = time.time()
        with pytest.raises(LockedError, match="Another `kdcache onpolicy` is running in this --out"):
            onpolicy._lock(str(tmp_path))
        assert time.time() - t0 < 2                   # not after WAIT_S
    finally:
        p.kill()
        p.wait()


def test_the_stages_of_a_killed_loop_are_waited_for_then_the_lock_is_taken(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(onpolicy, "WAIT_S", 60)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    p = _holder(tmp_path)                             # stands for a stage that inherited the killed loop's lock
    with open(os.path.join(tmp_path, onpolicy.LOCK), "w") as f:
        f.write(f"pid {dead.pid} on host")            # the file names the loop, which is gone
    t0 = time.time()
    try:
        import threading
        threading.Timer(1.5, p.kill).start()          # the stage finishes its checkpoint and exits
        lock = onpolicy._lock(str(tmp_path))
    finally:
        p.kill()
        p.wait()
    assert time.time() - t0 >= 1.4 and lock.fd is not None
    said = capsys.readouterr()
    assert "finishing their checkpoint; waiting for them" in said.out + said.err
    lock.release()
