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


LEFT_DRIVER = """
import subprocess, sys, time
from kdcache.pipeline import reaper
r = reaper.start()
subprocess.Popen(["sleep", "300"])                     # keeps the driver's tree non-empty at every look
# a subtree that leaves the tree while the driver lives: its parent exits after 2 s, the grandchild (a session of
# its own, logging nowhere) is then nobody's child, as Ray's agents are when a look runs mid-exit of the driver
subprocess.Popen(["sh", "-c", "setsid sleep 300 < /dev/null > /dev/null 2>&1 & echo $! > " + sys.argv[1] + "; sleep 2"])
time.sleep(60)
"""


def test_a_subtree_that_left_the_drivers_tree_between_looks_still_goes_with_the_driver(tmp_path):
    """The CI failure of 2026-12-06: the reaper's last look saw part of the tree (some children already moved to
    init), replaced what it had seen, and two agents outlived the driver. Looks now add up."""
    pidfile = tmp_path / "grandchild.pid"
    driver = subprocess.Popen([sys.executable, "-c", LEFT_DRIVER, str(pidfile)], cwd=user_project(), env=user_env())
    deadline = time.time() + 30
    while not (pidfile.exists() and pidfile.read_text().strip()) and time.time() < deadline:
        time.sleep(0.1)
    grandchild = int(pidfile.read_text())
    parent = _parent(grandchild)
    deadline = time.time() + 30
    while _parent(grandchild) == parent and time.time() < deadline:
        time.sleep(0.1)
    left = _parent(grandchild) != parent                 # the fault landed: its parent is gone, the driver lives
    time.sleep(1.5)                                      # a few looks at the tree without it
    assert driver.poll() is None
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    deadline = time.time() + 10
    while time.time() < deadline and _alive(grandchild):
        time.sleep(0.1)
    alive = _alive(grandchild)
    if alive:
        os.kill(grandchild, signal.SIGKILL)
    assert left, "the grandchild's parent never exited"
    assert not alive, "a process that left the driver's tree while it lived outlived the driver"


def _parent(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(") ", 1)[1].split()[1])
    except OSError:
        return None


SESSION_DRIVER = """
import subprocess, sys, time
from kdcache.pipeline import reaper
session, out = sys.argv[1], sys.argv[2]
r = reaper.start()
reaper.announce(r, session)
# never the driver's descendant at any look: started by a shell that exits at once (as an agent Ray restarts between
# two looks would be missed); one logs into the session directory, as every Ray process does, one elsewhere
for name, log in (("ray", session + "/logs/agent.out"), ("other", out + "/other.out")):
    subprocess.run(["sh", "-c", f"setsid sleep 300 > {log} 2>&1 & echo $! > {out}/{name}.pid"], check=True)
open(out + "/ready", "w").write("1")
time.sleep(60)
"""


def test_after_a_sigkill_what_logs_into_the_jobs_ray_session_goes_too_and_nothing_else(tmp_path):
    session = tmp_path / "session_1"
    (session / "logs").mkdir(parents=True)
    driver = subprocess.Popen([sys.executable, "-c", SESSION_DRIVER, str(session), str(tmp_path)],
                              cwd=user_project(), env=user_env())
    deadline = time.time() + 30
    while not (tmp_path / "ready").exists() and time.time() < deadline:
        time.sleep(0.1)
    ray_pid, other_pid = (int((tmp_path / f"{n}.pid").read_text()) for n in ("ray", "other"))
    time.sleep(1.0)                                      # the reaper has looked at the tree since
    assert _alive(ray_pid) and _alive(other_pid)
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    deadline = time.time() + 10
    while time.time() < deadline and _alive(ray_pid):
        time.sleep(0.1)
    gone, kept = not _alive(ray_pid), _alive(other_pid)
    for pid in (ray_pid, other_pid):
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
    assert gone, "a process logging into the job's Ray session outlived the driver"
    assert kept, "the reaper killed a process that is not the job's"


FORKING_DRIVER = """
import subprocess, sys, time
from kdcache.pipeline import reaper
out = sys.argv[1]
r = reaper.start()
# a child that starts a new grandchild every 20 ms, each in a session of its own and logging nowhere: whatever the
# reaper's last look saw, newer ones exist by the time the driver is killed (as Ray's agents started between looks)
subprocess.Popen(["sh", "-c", f"while true; do setsid sleep 300 < /dev/null > /dev/null 2>&1 & echo $! >> {out}/pids; "
                  "sleep 0.02; done"], stdout=subprocess.DEVNULL)
time.sleep(60)
"""


def test_processes_started_after_the_reapers_last_look_go_too_and_it_says_what_it_killed(tmp_path):
    driver = subprocess.Popen([sys.executable, "-c", FORKING_DRIVER, str(tmp_path)], cwd=user_project(),
                              env=user_env(), stderr=subprocess.PIPE, text=True)
    pids = tmp_path / "pids"
    deadline = time.time() + 30
    while not (pids.exists() and len(pids.read_text().split()) > 60) and time.time() < deadline:
        time.sleep(0.1)
    time.sleep(0.7)                                      # mid-way between two looks, on an idle machine
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    err = driver.stderr.read()                           # EOF once the reaper, which holds the same stderr, is done
    started = [int(p) for p in pids.read_text().split()]
    alive = [p for p in started if _alive(p)]
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    assert not alive, f"{len(alive)} of {len(started)} grandchildren outlived the driver and its reaper"
    line = [ln for ln in err.splitlines() if ln.startswith("kdcache reaper:")]
    assert line and f"(pid {driver.pid}) is gone" in line[0] and "sleep x" in line[0] and "sh" in line[0], err
    killed = int(line[0].split(" it left ")[1].split()[0])
    assert killed >= len(started) - 1, (killed, len(started))   # the last may have been forked after the freeze
