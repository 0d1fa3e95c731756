"""The stop flag shared by precompute and training: the first signal asks to stop, a second can exit at once."""
import os
import signal
import subprocess
import sys
import textwrap

from kdcache.common.signals import StopFlag
from tests.helpers.cli import user_env, user_project


def test_first_signal_sets_the_flag_and_restore_puts_handlers_back():
    # Under nohup SIGHUP stays ignored by design (tested below): then the first signal is SIGINT.
    first = signal.SIGINT if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN else signal.SIGHUP
    before = signal.getsignal(first)
    flag = StopFlag().install()
    try:
        assert not flag and flag.signal is None
        os.kill(os.getpid(), first)
        assert flag and flag.signal == first.name
        os.kill(os.getpid(), signal.SIGTERM)                 # without exit_on_second: still running, first kept
        assert flag.signal == first.name
    finally:
        flag.restore()
    assert signal.getsignal(first) is before


def test_second_signal_exits_at_once_when_asked():
    code = textwrap.dedent("""
        import os, signal, time
        from kdcache.common.signals import StopFlag
        flag = StopFlag("finishing, then stopping", exit_on_second=True).install()
        os.kill(os.getpid(), signal.SIGTERM)
        print("still here", flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        print("not reached", flush=True)
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=user_project(), env=user_env())
    assert res.returncode == 130
    assert "still here" in res.stdout and "not reached" not in res.stdout
    assert "SIGTERM: finishing, then stopping" in res.stderr and "SIGTERM again: exiting now" in res.stderr


def test_an_ignored_sighup_stays_ignored_as_nohup_asks():
    code = textwrap.dedent("""
        import os, signal
        from kdcache.common.signals import StopFlag
        signal.signal(signal.SIGHUP, signal.SIG_IGN)          # what nohup does before exec
        flag = StopFlag().install()
        os.kill(os.getpid(), signal.SIGHUP)
        assert not flag, "a hang-up under nohup stopped the run"
        os.kill(os.getpid(), signal.SIGTERM)                  # SIGTERM still stops it cleanly
        assert flag.signal == "SIGTERM"
        print("ok", flush=True)
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=user_project(), env=user_env())
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


def test_a_flag_installed_over_another_passes_signals_on_and_starts_set_if_it_is():
    """kdcache onpolicy runs its stages in its own process: a signal one of them stops on reaches the loop's flag,
    and a stage begun after a signal stops at once."""
    outer = StopFlag().install()
    try:
        inner = StopFlag().install()
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            assert inner.signal == "SIGTERM" and outer.signal == "SIGTERM"
        finally:
            inner.restore()
        assert signal.getsignal(signal.SIGTERM) == outer._handle
        later = StopFlag().install()
        later.restore()
        assert later.signal == "SIGTERM"                      # begun after the signal: set from the start
    finally:
        outer.restore()
    fresh = StopFlag().install()                              # no flag under it: starts clear
    fresh.restore()
    assert not fresh
