"""`kdcache train --nproc-per-node N`: N local ranks under a launcher that never cuts a checkpoint short.

torchrun's elastic agent and the DeepSpeed launcher handle SIGHUP and SIGTERM themselves: they
forward the signal, then SIGKILL the ranks about 30 s later (a large checkpoint can be cut mid-write),
and torchrun installs its SIGHUP handler even under `nohup`. This launcher does neither:
  - SIGHUP stays ignored if it was ignored when it started (nohup), in itself and in every rank;
  - SIGTERM, SIGINT (and a SIGHUP that is not ignored) are forwarded once to every rank, and the
    launcher waits for them to finish the step and the checkpoint, however long that takes;
  - the lock on --out is taken here, before any rank starts, and inherited by rank 0: a second trainer
    on the same --out is refused at once;
  - a rank that fails makes the launcher stop the others (SIGTERM, SIGKILL after GRACE_S) and exit
    with the failing rank's status.
Single node only; for several nodes use torchrun or the DeepSpeed launcher.
"""
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time

from .out_lock import FD_ENV, lock_out

# A failed rank's peers get this long to exit after SIGTERM before SIGKILL. Without the failed rank no
# collective (a checkpoint's barrier) can complete, so there is nothing left for them to finish: a peer still
# running is waiting for a rendezvous or a collective that will never come (a refusal on rank 0 left rank 1 in
# a 600 s rendezvous), and SIGKILL leaves the last complete checkpoint (checkpoints are published atomically).
GRACE_S = 3


def without_nproc(argv):
    """argv minus --nproc-per-node and its value (a rank must not launch ranks)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--nproc-per-node", "--nproc_per_node"):
            skip = True
        elif not a.startswith(("--nproc-per-node=", "--nproc_per_node=")):
            out.append(a)
    return out


PR_SET_PDEATHSIG = 1


def _die_with_launcher():
    """In each rank, before exec: SIGTERM when the launcher dies, kill -9 included (Linux prctl), so no rank is
    left training after it; SIGTERM lets the rank finish its step and save. Elsewhere a no-op."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM))
    except (OSError, AttributeError):
        pass


def launch(argv, nproc, out):
    """Run `kdcache train argv` as nproc ranks on this machine, holding the lock on `out` (--out) for them;
    returns the exit status."""
    lock = lock_out(out, 0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(nproc),
                LOCAL_WORLD_SIZE=str(nproc), KDCACHE_LAUNCH=f"--nproc-per-node {nproc}")
    cmd = [sys.executable, "-m", "kdcache", "train", *without_nproc(argv)]
    ranks = []
    forwarded = {}                         # signal -> how many ranks had started when it was forwarded

    def forward(signum, frame):
        if signum not in forwarded:        # a signal sent to the whole group reaches the ranks directly too
            forwarded[signum] = len(ranks)
            for p in ranks:
                if p.poll() is None:
                    p.send_signal(signum)

    handled = [signal.SIGTERM, signal.SIGINT]
    if signal.getsignal(signal.SIGHUP) != signal.SIG_IGN:
        handled.append(signal.SIGHUP)
    for sig in handled:                  # before the first rank starts: a signal meanwhile is forwarded too
        signal.signal(sig, forward)
    for r in range(nproc):
        lock_fd = {FD_ENV: str(lock.fd)} if r == 0 else {}
        ranks.append(subprocess.Popen(cmd, env=dict(base, RANK=str(r), LOCAL_RANK=str(r), **lock_fd),
                                      pass_fds=(lock.fd,) if r == 0 else (), preexec_fn=_die_with_launcher))
    for signum, started in list(forwarded.items()):   # came while the ranks started: the later ones get it too
        for p in ranks[started:]:
            p.send_signal(signum)
    return _wait(ranks)


def _wait(ranks):
    """Wait for every rank; if one fails, stop the rest. The first failure's status, else 0."""
    status = 0
    while any(p.poll() is None for p in ranks):
        failed = [p.returncode for p in ranks if p.returncode not in (None, 0)]
        if failed and not status:
            status = failed[0]
            for p in ranks:
                if p.poll() is None:
                    p.terminate()
            deadline = time.time() + GRACE_S
            while any(p.poll() is None for p in ranks) and time.time() < deadline:
                time.sleep(0.2)
            for p in ranks:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.2)
    failed = [p.returncode for p in ranks if p.returncode != 0]
    status = status or (failed[0] if failed else 0)
    return 128 - status if status < 0 else status      # killed by signal N: the shell's 128 + N
