"""pipeline/reaper.py: the driver's process tree goes with the driver, however it dies."""
import os
import signal
import subprocess
import sys
import time

from tests.helpers.cli import user_env, user_project

DRIVER = """
import ctypes, signal, subprocess, sys, time
from kdcache.pipeline import reaper
mine = subprocess.Popen(["sleep", "300"])              # the calling program's own child, from before: not Ray's
open(sys.argv[1] + ".mine", "w").write(str(mine.pid))
r = reaper.start()
# like the raylet: a child that dies with the driver (PR_SET_PDEATHSIG) and has started a grandchild in a session
# of its own that does not (as Ray's agents are): once the driver is killed, the grandchild is nobody's child
die_with_parent = lambda: ctypes.CDLL(None).prctl(1, signal.SIGKILL)
subprocess.Popen(["sh", "-c", "setsid sleep 300 & echo $! > " + sys.argv[1] + "; sleep 300"],
                 preexec_fn=die_with_parent)
time.sleep(60)
"""


def test_a_driver_killed_by_sigkill_takes_its_orphaned_descendants_along_and_nothing_older(tmp_path):
    pidfile = tmp_path / "grandchild.pid"
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, str(pidfile)], cwd=user_project(), env=user_env())
    deadline = time.time() + 30
    while not (pidfile.exists() and pidfile.read_text().strip()) and time.time() < deadline:
        time.sleep(0.1)
    grandchild = int(pidfile.read_text())
    time.sleep(1.5)                                      # the reaper has looked at the tree since
    os.kill(grandchild, 0)                               # alive while the driver is
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    deadline = time.time() + 10
    while time.time() < deadline and _alive(grandchild):
        time.sleep(0.1)
    alive = _alive(grandchild)
    mine = int((tmp_path / "grandchild.pid.mine").read_text())
    kept = _alive(mine)
    for pid in (grandchild, mine):
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
    assert not alive, "the orphaned grandchild outlived the driver"
    assert kept, "the reaper killed a process the driver had started before it"


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return False
