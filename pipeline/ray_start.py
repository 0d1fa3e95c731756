"""Starting (or joining) the job's Ray: in a background thread while the driver settles the job, with a reaper
for a Ray of the job's own. Below both dispatch.py and placement.py, so neither imports the other."""
import logging
import os
import threading
import time

from . import reaper


class _NotMainThread(logging.Filter):
    """Ray warns that it sets no SIGTERM handler when started off the main thread: the job installs its own."""

    def filter(self, record):
        return "not the main thread" not in record.getMessage()


def start_ray(ray_address):
    """Connect to ray_address (or $RAY_ADDRESS), else start a Ray for this job on 127.0.0.1, even if
    another one runs on this machine."""
    import ray
    if not ray.is_initialized():
        address = ray_address or os.environ.get("RAY_ADDRESS")
        if threading.current_thread() is not threading.main_thread():
            logging.getLogger("ray._private.worker").addFilter(_NotMainThread())
        if address:
            ray.init(address=address, log_to_driver=False)
        else:
            # The job's own Ray: no idle workers prestarted for a driver that runs no tasks of its own (each
            # imports Ray while the teacher loads; 0.8 s of a 12 s job on 2 cores, measured).
            os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
            ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,
                     _node_ip_address="127.0.0.1", configure_logging=False)
    return ray


def own_ray(ray_address):
    """Whether the job starts (and so shuts down) its Ray, rather than joining a cluster."""
    return not (ray_address or os.environ.get("RAY_ADDRESS"))


class RayStarter:
    """start_ray in a background thread, so the driver settles the job and reads the dataset meanwhile.

    The thread lives until close(): Ray's processes are started with PR_SET_PDEATHSIG, which fires when the
    thread that started them ends, not the process. A Ray of the job's own gets a reaper too (pipeline/reaper.py):
    some of Ray's processes outlive a driver killed by kill -9 otherwise."""

    def __init__(self, ray_address, prestart=None):
        """prestart(ray): called in the thread once Ray is up; returns (actors, their options), kept in
        self.prestarted for the Dispatcher (prestart_workers)."""
        self.ray_address, self.prestart = ray_address, prestart
        self.ray, self.error, self.up_at, self.prestarted = None, None, None, None
        self._up, self._release = threading.Event(), threading.Event()
        self._closed = False
        self._reaper = reaper.start() if own_ray(ray_address) else None
        self._thread = threading.Thread(target=self._run, name="kdcache ray start", daemon=True)
        self._thread.start()

    def _run(self):
        try:
            self.ray = start_ray(self.ray_address)
            self.up_at = time.time()
            reaper.announce(self._reaper, session_dir(self.ray))
            if self.prestart is not None:
                try:
                    self.prestarted = self.prestart(self.ray)
                except Exception:         # only a head start: the Dispatcher starts its own
                    self.prestarted = None
        except BaseException as e:        # raised in the driver by get()
            self.error = e
        finally:
            self._up.set()
        self._release.wait()

    def ready(self):
        return self._up.is_set()

    def get(self):
        self._up.wait()
        if self.error is not None:
            raise self.error
        return self.ray

    def close(self):
        """Shut down the job's own Ray (call while the job's signal handlers stand: Ray's own SIGTERM handler would
        exit mid-shutdown), then let the thread end. Waits for a start still in progress. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._up.wait()
        try:
            if self.ray is not None and own_ray(self.ray_address):
                self.ray.shutdown()
        finally:
            self._release.set()
            self._thread.join()
            reaper.stop(self._reaper)


def session_dir(ray):
    """The running Ray's session directory (its processes log there), or None where this Ray does not say."""
    try:
        return ray._private.worker._global_node.get_session_dir_path()
    except Exception:
        return None
