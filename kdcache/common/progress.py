"""Progress bars that suit where they are written: live on a terminal; in a log file (stderr redirected, nohup)
an update every LOG_INTERVAL_S at most, as tqdm's mininterval gives, instead of every step (a demo's log held
265 KB of bar updates: set_postfix refreshes on every call unless told not to)."""
import sys

LOG_INTERVAL_S = 30.0


def bar(**kwargs):
    """tqdm(**kwargs), throttled to one update per LOG_INTERVAL_S where stderr is not a terminal."""
    from tqdm import tqdm

    class _LogBar(tqdm):
        def set_postfix(self, ordered_dict=None, refresh=False, **kw):    # shown with the next timed update
            super().set_postfix(ordered_dict, refresh=refresh, **kw)

    stream = kwargs.get("file") or sys.stderr
    if hasattr(stream, "isatty") and stream.isatty():
        return tqdm(dynamic_ncols=True, **kwargs)
    kwargs.setdefault("mininterval", LOG_INTERVAL_S)
    kwargs.setdefault("maxinterval", LOG_INTERVAL_S * 2)
    return _LogBar(dynamic_ncols=True, **kwargs)
