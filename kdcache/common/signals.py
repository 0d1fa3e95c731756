"""Stopping cleanly on SIGTERM, SIGHUP and SIGINT: the precompute job and the trainer share this flag.

The first signal sets the flag; the loop finishes the unit of work in hand (a shard, an optimizer step),
saves it and exits 0, and the same command resumes. With exit_on_second, a second signal exits at once
(whatever was committed is safe).

A SIGHUP that is ignored when the flag is installed stays ignored: `nohup` sets that, and a run started
with nohup must survive its terminal closing (the original report: a run lost 19 minutes in to a SIGHUP).

Flags nest: one installed over another passes each signal on to it, and starts set if it is, so `kdcache
onpolicy`, which runs its stages in its own process, learns of a signal its precompute or training stage stopped
on, and a stage begun after a signal stops at once.
"""
import os
import signal
import sys

SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


class StopFlag:
    def __init__(self, message="", exit_on_second=False):
        self.signal = None            # the name of the first signal received, e.g. "SIGTERM"
        self.signum = None
        self.message, self.exit_on_second = message, exit_on_second
        self._old = {}

    def install(self):
        for sig in SIGNALS:
            if sig == signal.SIGHUP and signal.getsignal(sig) == signal.SIG_IGN:
                continue                  # nohup: the user asked for hang-ups to be ignored
            self._old[sig] = signal.signal(sig, self._handle)
            outer = getattr(self._old[sig], "__self__", None)
            if isinstance(outer, StopFlag) and outer.signal and not self.signal:   # stopped before this one began
                self.signal, self.signum = outer.signal, outer.signum
        return self

    def restore(self):
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
        self._old = {}

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if self.signal and self.exit_on_second:
            print(f"\n{name} again: exiting now; what was committed is safe.", file=sys.stderr)
            os._exit(130)
        if not self.signal:
            self.signal, self.signum = name, signum
        if self.message:
            print(f"\n{name}: {self.message}", file=sys.stderr)
        outer = self._old.get(signum)
        if isinstance(getattr(outer, "__self__", None), StopFlag):   # a flag installed before this one
            outer(signum, frame)

    def __bool__(self):
        return self.signal is not None
