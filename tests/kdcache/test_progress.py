"""Progress bars in a log file: an update every LOG_INTERVAL_S at most, not one per step."""
import subprocess
import sys


def _bar_bytes(tmp_path, name, setup=""):
    log = tmp_path / name
    code = ("import time\nfrom kdcache.common import progress\n" + setup +
            "b = progress.bar(total=400, unit='step', desc='train')\n"
            "for _ in range(400):\n    time.sleep(0.005)\n    b.update(1)\n    b.set_postfix(loss=0.5)\nb.close()\n")
    with open(log, "w") as f:
        subprocess.run([sys.executable, "-c", code], stderr=f, check=True, timeout=60)
    return log.read_text()


def test_a_bar_written_to_a_log_file_updates_seldom(tmp_path):
    text = _bar_bytes(tmp_path, "log")
    assert "400/400" in text                                   # the end is still written
    assert len(text.splitlines()) <= 5, len(text.splitlines())  # start, end: not 400 updates
    loose = _bar_bytes(tmp_path, "loose", "progress.LOG_INTERVAL_S = 0.0\n")
    assert len(loose.splitlines()) > 20        # what an unthrottled bar writes (the check can fail)
