"""Teacher workers kept up from one precompute job to the next in the same process.

`kdcache onpolicy` runs a precompute job every round with the same teacher. Started afresh each time, every round
pays for a Ray start and for loading the teacher (about 14 s of a 30 s round on 2 cores; minutes for a large teacher
on vLLM). A WorkerPool holds Ray and the job's teacher actors between jobs: the next job's Dispatcher takes them
back and sends them its spec (TeacherWorker.load keeps a teacher that is the same, and loads the generator again).

Workers go back to the pool only from a job that ended without error or signal; any other end kills them, so a
worker in an unknown state never serves a later job. close() stops them and the Ray the pool started.
"""
from .dispatch import prestart_workers
from .ray_start import RayStarter, own_ray
from .settle import may_start_early
from .teacher import is_url


class WorkerPool:
    def __init__(self, eager=False):
        """eager: the first job starts Ray and its actors at its start even where it might find its cache complete
        and need no teacher (a store: settle.may_start_early says no), as long as the teacher is local and the Ray
        the pool's own. For jobs that rarely find one: kdcache onpolicy's rounds, which start a Ray and a teacher
        worker once, while the first round settles."""
        self.eager, self.starter = eager, None
        self.workers, self.groups, self.key = [], [], None

    def start(self, cfg, early=False):
        """Ray for every job of the pool, started by the first job as a job starts its own: at its start (early,
        with its actors prestarted) where settle.may_start_early says so (or eager allows), else once it has
        work. None when early and not yet."""
        if self.starter is None:
            eager = self.eager and not is_url(cfg.teacher) and own_ray(cfg.ray_address)
            if early and not (eager or may_start_early(cfg)):
                return None
            self.starter = RayStarter(cfg.ray_address, prestart_workers(cfg) if early else None)
        return self.starter

    def take(self, key, n):
        """Up to n kept workers (and their placement groups) if they were started with settings `key`; those that
        were not are stopped."""
        if key != self.key:
            self.discard()
        workers, groups = self.workers[:n], self.groups[:n] if self.groups else []
        for w in self.workers[n:]:
            self.starter.ray.kill(w)
        for g in self.groups[n:]:
            self.starter.ray.util.remove_placement_group(g)
        self.workers, self.groups, self.key = [], [], None
        return workers, groups

    def keep(self, key, workers, groups):
        self.discard()
        self.workers, self.groups, self.key = list(workers), list(groups), key

    def discard(self):
        ray = self.starter.ray if self.starter is not None else None
        for w in self.workers:
            ray.kill(w)
        for g in self.groups:
            ray.util.remove_placement_group(g)
        self.workers, self.groups, self.key = [], [], None

    def close(self):
        try:
            if self.starter is not None and self.starter.ray is not None:
                self.discard()
        finally:
            if self.starter is not None:
                self.starter.close()
