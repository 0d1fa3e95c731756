"""Precompute settings: one typed dataclass, from YAML and flags."""
from dataclasses import dataclass

from kdcache.cache_format.compact import LOGPROB_DTYPES
from kdcache.cache_format.manifest import MAX_SAMPLE
from kdcache.cache_format.storage import FORMATS, MAX_ENTRIES, Storage
from kdcache.common.config import field, validate

from .encode import MAX_MESSAGES
from .teacher import TEACHERS

DEFAULT_TOP_K = 64


@dataclass
class PrecomputeConfig:
    teacher: str = field("", "teacher model directory (weights, config, tokenizer), or the URL of a vLLM server "
                             "(http://HOST:PORT/v1, `vllm serve`; needs --tokenizer)")
    teacher_revision: str | None = field(None, "served teacher: a name for the weights behind the URL (a commit, a "
                                               "date), recorded in the fingerprint, which cannot hash remote weights")
    data: str = field("", "dataset: .jsonl, .parquet, or a datasets save_to_disk directory")
    out: str = field("", "cache directory or URL (s3://, gs://, ...) to write, resumed if it holds the same job; "
                         "or a store root (see --store)")
    store: bool = field(False, "treat --out as a store root: the cache goes to OUT/<alias>--<fingerprint>, and a "
                               "later run with the same inputs finds and reuses it (on by itself if OUT is a store)")
    alias: str | None = field(None, "store: readable name of a new cache (default: teacher-dataset-k<top_k>)")
    location_file: str | None = field(None, "write the cache's path or URL to this file as soon as it is known (for "
                                            "scripts that run a job into a store; kdcache onpolicy does)")
    tokenizer: str | None = field(None, "tokenizer directory (default: the teacher's; required for a served teacher)")
    top_k: int | None = field(None, "teacher log-probs kept per position (default 64, or 0 with --sample; 0: none, "
                                    "only each target's own log-prob, all that kdcache train --objective token-rkl "
                                    "reads). With --sample: the exact top entries kept beside the draws")
    sample: int = field(0, "draws per position from the teacher's distribution at temperature 1 (with replacement; "
                           "from the rest after the exact --top-k when given), stored as distinct ids with their "
                           "counts and exact log-probs: an unbiased sparse cache (format 3; 1-255; 0: top-k only)")
    backend: str = field("auto", "teacher backend: vllm, hf, served (a URL teacher), or auto: served for a URL, "
                                 "vllm with a CUDA GPU, hf on CPU (faster there)",
                         choices=("auto", *TEACHERS))
    mode: str = field("score", "score the dataset's completions, or generate new ones with the teacher",
                      choices=("score", "generate"))
    format: str = field("arrow", "storage format of the shards", choices=tuple(FORMATS))
    codec: str | None = field(None, "compression codec (default: the storage format's smallest)")
    logprob_dtype: str = field("float16", "how log-probs are stored: float16, float32, or sqrt8 (one byte: sqrt(p) "
                                          "in 255 steps, entries ordered for compression; SPEC.md 4.3)",
                               choices=LOGPROB_DTYPES)
    top_p: float | None = field(None, "adaptive k: keep per position the smallest prefix of the top-k whose mass "
                                      "reaches this (e.g. 0.999), plus the exact mass outside it; default: all k")
    template: str = field("auto", "render records with the tokenizer's chat template, or raw concatenation",
                          choices=("auto", "chat", "raw"))
    max_length: int | None = field(None, "maximum tokens per sample, prompt + completion (default: the teacher's "
                                         "context, at most 2048)")
    overlong: str = field("truncate", "over-long samples: truncate (flagged in the cache) or drop (counted)",
                          choices=("truncate", "drop"))
    max_messages: int = field(MAX_MESSAGES, "messages per chat record at most; a longer chat is skipped and counted "
                                    "(\"too_many_messages\"): it bounds the template's work on a hostile record")
    on_bad_record: str = field("fail", "malformed records: fail the job, or skip them (counted and listed)",
                               choices=("fail", "skip"))
    shard_size: int = field(256, "samples per shard (the unit of work and of resume)")
    workers: int | None = field(None, "teacher workers (default: the visible GPUs / --tensor-parallel-size for a "
                                      "local teacher, else 1; on CPU, a count)")
    tensor_parallel_size: int = field(1, "vLLM backend: GPUs per teacher worker, the teacher split over them "
                                         "(tensor parallel; one Ray placement group per worker, on one node)")
    pipeline_parallel_size: int = field(1, "vLLM backend: pipeline stages per teacher worker, each of "
                                           "--tensor-parallel-size GPUs (a worker holds TP x PP GPUs of one node)")
    enforce_eager: bool = field(False, "vLLM backend: no torch.compile and no CUDA graphs (vLLM's enforce_eager): "
                                       "the teacher starts sooner and holds less memory, generation may be slower; "
                                       "the other backends ignore it")
    worker_cpus: float | None = field(None, "Ray CPUs reserved per worker (fractions allowed; default 1, or 0.25 for "
                                            "a served teacher, whose workers only wait on HTTP)")
    worker_gpus: float = field(-1.0, "Ray GPUs per worker; -1 = 1 if the cluster has GPUs, else 0")
    threads: int = field(0, "torch threads per hf worker (0: $OMP_NUM_THREADS, else this process's cores / workers)")
    max_in_flight: int = field(2, "shards queued per worker (bounds memory)")
    canary_positions: int = field(256, "served teacher: positions of the job's own data scored when the job "
                                       "starts, resumes or finds its cache, and when each worker starts; the first "
                                       "scores are kept in the manifest, a server that scores them otherwise is "
                                       "refused (0: off)")
    canary_tolerance: float = field(0.05, "served teacher: the largest mean difference (nats) of the canary's "
                                          "log-probs from the manifest's")
    requests_in_flight: int = field(8, "served teacher: HTTP requests in flight per worker (one sequence each)")
    batch_tokens: int = field(0, "tokens per teacher forward batch (vLLM: per engine step); 0 = 8192, or for vLLM "
                                 "on CPU its own CPU default, 4096 per TP x PP rank (7-10%% faster there), or "
                                 "--max-length up to 8192 where that is more")
    dtype: str = field("auto", "teacher compute dtype: auto = float32 on CPU, bfloat16 on GPU",
                       choices=("auto", "float32", "bfloat16", "float16"))
    ray_address: str | None = field(None, "existing Ray cluster (default: $RAY_ADDRESS, else a local Ray for the job)")
    ray_pass_credentials: bool = field(False, "with ray_address and a URL --out: copy this shell's AWS_*, GOOGLE_* and "
                                              "FSSPEC_* variables into the workers' runtime_env, where everyone who "
                                              "can use the cluster can read them (default: the nodes' own credentials)")
    trust_remote_code: bool = field(False, "allow model code from the teacher directory to run")
    eos_tokens: list = field([], "extra end-of-turn token strings (YAML only)")
    text_end: str = field("auto", "token appended to plain-text records: auto = the tokenizer's document-end token "
                                  "(<|endoftext|>, <|end_of_text|>, </s>, <eos>) where it has one, else its EOS")
    generator: str | None = field(None, "generate mode: the model directory that writes the completions (default: "
                                        "the teacher), each sampled token's log-prob stored as behavior_logprobs; "
                                        "the teacher scores them. Its tokenizer must be the teacher's")
    gen_max_new_tokens: int = field(256, "generate mode: maximum new tokens")
    gen_temperature: float = field(1.0, "generate mode: sampling temperature (0 = greedy)")
    gen_top_p: float = field(1.0, "generate mode: nucleus sampling threshold")
    seed: int = field(0, "seed for generation and --sample draws (sample i: seed + its id)")
    progress: bool = field(True, "show a progress bar")
    drop_end_of_turn: bool = field(False, "REPRODUCES A BUG, for control experiments only: leave out the "
                                          "positions that predict an end-of-turn token")

    def __post_init__(self):
        codecs = getattr(FORMATS.get(self.format), "CODECS", ())
        if self.top_k is None:
            self.top_k = 0 if self.sample else DEFAULT_TOP_K
        validate(self, required=("teacher", "data", "out"), checks=[
            ("top_k", 0 <= self.top_k <= MAX_ENTRIES - self.sample,
             f"must be in [0, {MAX_ENTRIES - self.sample}] (0: no top-k, only the target log-probs; a position's "
             f"entry count, top-k plus --sample, is stored in 16 bits)"),
            ("sample", 0 <= self.sample <= MAX_SAMPLE, f"must be in [0, {MAX_SAMPLE}] draws per position"),
            ("top_p", not (self.sample and self.top_p is not None), "does not combine with --sample (a sampled cache "
                                                                    "keeps an exact top-k plus draws from the rest)"),
            ("top_p", self.top_p is None or 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("codec", self.codec is None or self.codec in codecs,
             f"is not a codec of the {self.format} format (one of {list(codecs)})"),
            ("max_length", self.max_length is None or self.max_length >= 2, "must be >= 2"),
            ("max_messages", self.max_messages >= 1, "must be >= 1"),
            ("shard_size", self.shard_size >= 1, "must be >= 1"),
            ("workers", self.workers is None or self.workers >= 1, "must be >= 1"),
            ("tensor_parallel_size", self.tensor_parallel_size >= 1, "must be >= 1"),
            ("pipeline_parallel_size", self.pipeline_parallel_size >= 1, "must be >= 1"),
            ("worker_cpus", self.worker_cpus is None or self.worker_cpus > 0, "must be > 0"),
            ("max_in_flight", self.max_in_flight >= 1, "must be >= 1"),
            ("requests_in_flight", self.requests_in_flight >= 1, "must be >= 1"),
            ("canary_positions", self.canary_positions >= 0, "must be >= 0 (0: no canary)"),
            ("canary_tolerance", self.canary_tolerance >= 0, "must be >= 0"),
            ("batch_tokens", self.batch_tokens >= 0, "must be >= 0 (0: the backend's default)"),
            ("gen_max_new_tokens", self.gen_max_new_tokens >= 1, "must be >= 1"),
            ("gen_temperature", self.gen_temperature >= 0, "must be >= 0"),
            ("gen_top_p", 0 < self.gen_top_p <= 1, "must be in (0, 1]"),
            ("threads", self.threads >= 0, "must be >= 0"),
        ])

    def storage(self) -> Storage:
        """How the cache stores the teacher's rows (its CacheWriter owns this one object)."""
        return Storage(self.format, self.top_k, self.logprob_dtype, self.codec, self.top_p, self.sample)
