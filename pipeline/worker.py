"""A teacher worker: scores (or generates then scores) one shard's samples and writes the shard file.

Runs as a Ray actor; each worker is the only writer of the shards it is
given. It returns the shard's manifest entry; the driver commits it.
"""
import os
import time
from dataclasses import dataclass

from kdcache.cache_format import Record, Storage, write_shard_file
from kdcache.cache_format.compact import sampled_rows

from . import canary
from .encode import Sample, with_completion
from .teacher import SampleFailed, make_teacher


@dataclass
class WorkerSpec:
    """What every worker of a job is built from."""
    teacher_backend: str     # a key of pipeline.teacher.TEACHERS
    model_path: str
    teacher_kwargs: dict     # the Teacher's constructor keywords
    storage: Storage         # the cache's storage settings (its CacheWriter's: a shard written otherwise is refused)
    vocab_size: int          # the teacher's: every stored id lies below it
    generate: dict | None    # generate mode: max_new_tokens, temperature, top_p, seed, turn_ends, max_length
    generator: dict | None = None   # --generator: backend, model_path, kwargs (a Teacher that only generates)
    seed: int = 0                   # --sample: sample i's draws are seeded with seed + its id
    canary: dict | None = None      # a served teacher's: {canary (canary.Canary), reference (meta.canary), tolerance}


@dataclass
class Unit:
    """One shard of work: its samples and where its file goes."""
    directory: str
    shard_tag: str | None
    index: int
    sample_start: int        # [sample_start, sample_end): the dataset records this shard covers
    sample_end: int
    samples: list            # [Sample], in dataset order


class TeacherWorker:
    def __init__(self, spec: WorkerSpec | None = None):
        """With a spec, load the teacher now (ready() then says it is loaded). Without one: an actor started before
        the job was settled (pipeline.dispatch.prestart_workers), which imports what every local teacher backend needs
        (torch, transformers) while the driver settles the job, and loads the teacher when load(spec) comes."""
        self.spec = self.teacher = self.generator = None
        if spec is not None:
            self.load(spec)
        else:
            import torch  # noqa: F401
            from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    def load(self, spec: WorkerSpec):
        """Load spec's teacher and generator. A worker kept up for the next job (pipeline/pool.py) keeps its teacher
        when the spec names the same one; the generator is loaded again every time (in `kdcache onpolicy` it is the
        student, whose weights change each round at the same path)."""
        unblank_cuda_devices(spec.teacher_kwargs)
        keep = self.teacher is not None and _teacher_of(self.spec) == _teacher_of(spec)
        self.generator = None                 # the last job's, released before another is loaded
        if not keep:
            self.teacher = None
            self.teacher = make_teacher(spec.teacher_backend, spec.model_path, **spec.teacher_kwargs)
        if spec.canary is not None:           # a served teacher: still the weights the cache was started with
            c = spec.canary
            canary.check(c["reference"], c["canary"], canary.score(self.teacher, c["canary"]), c["tolerance"],
                         spec.model_path, "a teacher worker as it started")
        self.spec = spec
        g = spec.generator
        self.generator = None if g is None else make_teacher(g["backend"], g["model_path"], **g["kwargs"])
        return _node() or ""

    def ready(self) -> str:
        """Once the teacher is loaded: the Ray node this worker runs on ("" outside Ray)."""
        return _node() or ""

    def run(self, unit: Unit):
        """Score the unit's samples and write its shard. Returns {shard (a WrittenShard), teacher_s, tokens, retried,
        node (the Ray node it ran on), engine (the teacher engine's settings, or None)}."""
        t0 = time.perf_counter()
        retried = _retried(self.teacher)
        samples = unit.samples
        k = self.spec.storage.top_k
        behavior = [None] * len(samples)
        try:
            if self.spec.generate and samples:
                samples, scored, behavior = self._generate(samples, k)
            else:
                scored = self._score(samples, k) if samples else []
        except SampleFailed as e:          # one sequence failed on its own: name its sample
            raise e.named(samples) from None
        records = [_record(s, sc, d, b) for s, (sc, d), b in zip(samples, scored, behavior)]
        teacher_s = time.perf_counter() - t0
        shard = write_shard_file(unit.directory, unit.index, records, storage=self.spec.storage,
                                 vocab_size=self.spec.vocab_size, sample_start=unit.sample_start,
                                 sample_end=unit.sample_end, tag=unit.shard_tag)
        return {"shard": shard, "teacher_s": teacher_s, "tokens": int(sum(len(s.input_ids) for s in samples)),
                "retried": _retried(self.teacher) - retried, "node": _node(),
                "engine": self.teacher.engine_info() if hasattr(self.teacher, "engine_info") else None}

    def _score(self, samples: list[Sample], k: int):
        """(Scored, Draws or None) of each sample: with --sample, its draws too, seeded per sample (the job's
        seed plus the sample's id), so that a shard written again draws what it drew before."""
        seqs, positions = zip(*(s.scored for s in samples))     # the teacher's own view where a record has one
        seqs, positions = list(seqs), list(positions)
        n = self.spec.storage.sample
        if not n:
            return [(sc, None) for sc in self.teacher.score(seqs, positions, k)]
        return self.teacher.score_sampled(seqs, positions, k, n, [self.spec.seed + s.sample_id for s in samples])

    def _generate(self, samples: list[Sample], k: int):
        """Prompts -> (prompt + completion samples (see encode.with_completion), their (Scored, Draws or None),
        each one's behaviour log-probs or None). The teacher's completions: in one pass where the backend offers
        generate_scored (not with --sample), else generate then score; from the teacher's own prompt where the record
        gives a teacher view. A --generator's: it generates from the student's prompt (ids below the teacher's
        vocabulary only, with the log-prob of each sampled token), the teacher scores under its own view."""
        g = self.spec.generate
        prompts = [s.input_ids for s in samples]
        room = [g["max_length"] - max(len(s.input_ids), len(s.scored[0])) for s in samples]   # both views fit
        args = dict(max_new_tokens=[min(g["max_new_tokens"], r) for r in room],
                    temperature=g["temperature"], top_p=g["top_p"], seeds=[g["seed"] + s.sample_id for s in samples],
                    turn_ends=set(g["turn_ends"]))
        if self.generator is not None:
            gens = self.generator.generate(prompts, **args, logprobs=True, vocab_limit=self.spec.vocab_size)
            full = [with_completion(s, new, ended) for s, (new, ended, _) in zip(samples, gens)]
            return full, self._score(full, k), [lps for _, _, lps in gens]
        prompts = [s.scored[0] for s in samples]    # the teacher generates in its own view (privileged context)
        if hasattr(self.teacher, "generate_scored") and not self.spec.storage.sample:
            out = self.teacher.generate_scored(prompts, k=k, **args)
            full = [with_completion(s, new, ended) for s, (new, ended, _) in zip(samples, out)]
            return full, [(o[2], None) for o in out], [None] * len(out)
        gens = self.teacher.generate(prompts, **args)
        full = [with_completion(s, new, ended) for s, (new, ended) in zip(samples, gens)]
        return full, self._score(full, k), [None] * len(full)


def _record(s: Sample, sc, draws, behavior) -> Record:
    """A sample, its Scored and Draws (or None) -> the Record the shard stores (a sampled cache's rows:
    compact.sampled_rows)."""
    ids, lps, counts = sc.ids, sc.logprobs, None
    if draws is not None:
        ids, lps, counts = sampled_rows(sc.ids, sc.logprobs, draws.ids, draws.logprobs)
    return Record(s.sample_id, s.input_ids, s.positions, ids, lps, truncated=s.truncated,
                  target_logprobs=sc.target_logprobs, behavior_logprobs=behavior, sample_counts=counts,
                  teacher_input_ids=s.teacher_ids, teacher_positions=s.teacher_positions)


def unblank_cuda_devices(teacher_kwargs: dict, environ=os.environ) -> bool:
    """A tensor- or pipeline-parallel worker takes no GPU itself (its vLLM workers take the placement group's), and
    Ray versions in the allowed range set CUDA_VISIBLE_DEVICES="" in such an actor: vLLM would then see no GPU at
    all. The blank value is removed there (the placement group decides the devices). True when it was."""
    parallel = int(teacher_kwargs.get("tensor_parallel_size", 1)) * int(teacher_kwargs.get("pipeline_parallel_size", 1))
    if parallel > 1 and environ.get("CUDA_VISIBLE_DEVICES") == "":
        del environ["CUDA_VISIBLE_DEVICES"]
        return True
    return False


def _teacher_of(spec: WorkerSpec | None):
    return spec and (spec.teacher_backend, spec.model_path, spec.teacher_kwargs)


def _node() -> str | None:
    """The Ray node this worker runs on (its id's first 12 hex digits), or None outside Ray."""
    try:
        import ray
        if not ray.is_initialized():          # get_runtime_context() would start a Ray here
            return None
        return ray.get_runtime_context().get_node_id()[:12]
    except Exception:
        return None


def _retried(teacher) -> int:
    """Requests a served teacher's client has retried so far (0 for in-process teachers)."""
    client = getattr(teacher, "client", None)
    return int(getattr(client, "retried", 0))
