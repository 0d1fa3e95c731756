"""Issue 42, item 8: a rank that fails (a refusal on rank 0) ends its peers within seconds, even a peer that keeps
SIGTERM (start-up keeps a signal to stop before step 1) while it waits for a rendezvous that will never come."""
import signal
import subprocess
import sys
import time

from kdcache.train.launch import GRACE_S, _wait

PEER = ("import signal, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: None)   # kept, as start-up keeps it\n"
        "print('waiting', flush=True)\n"
        "time.sleep(600)                                   # a rendezvous with a rank that refused\n")


def test_a_refusal_on_one_rank_ends_a_peer_that_keeps_sigterm_within_seconds():
    peer = subprocess.Popen([sys.executable, "-c", PEER], stdout=subprocess.PIPE, text=True)
    assert peer.stdout.readline() == "waiting\n"                    # its handler is in place
    refused = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(2)"])
    t0 = time.monotonic()
    status = _wait([refused, peer])
    took = time.monotonic() - t0
    assert status == 2                                               # the refusing rank's status
    assert peer.returncode == -signal.SIGKILL                       # SIGTERM was kept: the grace ran out
    assert took < GRACE_S + 5 and GRACE_S <= 5, took
