"""Trainer settings: one typed dataclass, from YAML and flags."""
from dataclasses import dataclass

from kdcache.common.config import ConfigError, field, validate

from .loss_config import LossConfig, default_chunk


@dataclass
class TrainConfig:
    cache: str | list = field("", "logit cache directory written by `kdcache precompute`; several (repeat the "
                                  "flag, or a YAML list), each from its own teacher if need be: each micro-batch "
                                  "comes from one, drawn in proportion to the positions each has left (or by "
                                  "--cache-weights), so an epoch trains every position of every cache once",
                              repeat=True)
    cache_weights: str = field("", "with several caches: the chance each micro-batch comes from each, comma-"
                                   "separated in --cache order (e.g. 0.7,0.3; needs --max-steps: the caches "
                                   "cycle); empty: in proportion to the positions left")
    student: str = field("", "student model directory, or a config.json to initialise a fresh student")
    out: str = field("", "output directory: checkpoints, metrics, final model")
    tokenizer: str | None = field(None, "student tokenizer directory (default: the student directory)")
    # loss
    objective: str = field("gkd", "gkd: generalized JSD over the cached top-k and tail (--beta, --temperature, "
                                  "--tail); token-rkl: reverse KL on each sampled token, log S(y) - log T(y) as a "
                                  "negative advantage, importance-weighted by the stored behaviour log-probs (on-"
                                  "policy caches; needs only the teacher's target log-probs); sft: cross-entropy "
                                  "on the cached completion tokens alone (the same fused head)",
                           choices=("gkd", "token-rkl", "sft"))
    beta: float = field(0.0, "generalized JSD beta: 0 forward KL(T||S), 1 reverse KL(S||T)")
    temperature: float = field(1.0, "distillation temperature tau (loss scaled by tau^2)")
    tail: str = field("tail", "teacher mass outside top-k: tail bucket, or renorm over the top-k",
                      choices=("tail", "renorm"))
    sft_alpha: float = field(0.0, "weight of the cross-entropy term on the cached completion tokens")
    loss_chunk: int = field(0, "positions per loss chunk (bounds [chunk, vocab] float32 memory); 0 = by the "
                               "student's vocabulary: 512 up to 524,288 ids, fewer past that (train/loss_config.py)")
    # LoRA (PEFT)
    lora_r: int = field(0, "LoRA rank: train adapters through PEFT instead of every weight (0 = off, full weights)")
    lora_alpha: float = field(0.0, "LoRA alpha (0 = 2 x --lora-r)")
    lora_dropout: float = field(0.0, "LoRA dropout")
    lora_targets: str = field("", "modules that get adapters: names (comma-separated) or all-linear; default the "
                                  "attention and MLP projections the student has (the output head only if named)")
    # optimisation
    lr: float = field(5e-4, "peak learning rate (AdamW)")
    min_lr_ratio: float = field(0.1, "final learning rate as a fraction of lr (cosine decay)")
    warmup_steps: int = field(10, "linear warmup steps")
    weight_decay: float = field(0.0, "AdamW weight decay")
    grad_clip: float = field(1.0, "gradient norm clipping (0 = off)")
    batch_size: int = field(8, "samples per micro-batch per rank")
    max_tokens: int = field(0, "token budget per micro-batch (padded tokens; 0 = no budget); with --pack, "
                                "the length of a packed row")
    pack: bool = field(False, "pack several samples per row (block-diagonal attention, positions restart)")
    grad_accum: int = field(1, "micro-batches per optimizer step")
    max_steps: int = field(0, "optimizer steps (0 = run `epochs` epochs)")
    epochs: int = field(1, "passes over the cache when max_steps is 0")
    seed: int = field(0, "seed of the data order, initialisation and RNGs")
    shuffle: bool = field(True, "shuffle shards and samples each epoch (--no-shuffle: cache order)")
    # runtime
    nproc_per_node: int = field(1, "ranks to launch on this machine (kdcache's own launcher: survives a hang-up "
                                   "under nohup, lets every rank finish its checkpoint on SIGTERM)")
    deepspeed: str = field("0", "ZeRO stage 0-3, or a DeepSpeed JSON config file")
    save_every: int = field(100, "checkpoint every N optimizer steps (0 = only at the end and on signals)")
    keep_checkpoints: int = field(2, "complete checkpoints kept")
    resume: str = field("auto", "auto (latest complete checkpoint in out/), never, or a checkpoint path")
    skip_damaged_shards: bool = field(False, "skip (and count) shards that fail their checksum or "
                                             "value checks instead of stopping")
    cross_tokenizer: bool = field(False, "a student of another tokenizer family: derive its view of each sample from "
                                  "the cache's source (conversations, teacher tokenizer) by byte alignment "
                                  "(README, train/cross.py); with the teacher's tokenizer it is the token-exact path")
    require_eos: bool = field(True, "refuse a cache whose first batch lacks end-of-turn positions")
    prefetch: int = field(2, "shards decoded ahead in the background")
    log_every: int = field(1, "steps between metric lines")
    threads: int = field(0, "torch threads on CPU (0: $OMP_NUM_THREADS if set, else this process's cores / ranks)")
    trust_remote_code: bool = field(False, "allow model code from the student directory to run")
    progress: bool = field(True, "show a progress bar")
    mix_cache: str | None = field(None, "a second cache mixed in: each micro-batch comes from --cache with "
                                        "probability --mix-lambda, else from this one (GKD's lambda; kdcache "
                                        "onpolicy's --offpolicy-cache); needs --max-steps")
    mix_lambda: float = field(0.5, "with --mix-cache: the probability that a micro-batch comes from --cache")
    until_step: int = field(0, "end this run at this optimizer step as if it were the last one (final model "
                                   "saved); the learning-rate schedule still spans --max-steps (0 = off; kdcache "
                                   "onpolicy trains its rounds this way)")
    new_cache: bool = field(False, "resume a checkpoint made on another cache: keep its model, optimizer, schedule, "
                                   "step and RNG, and read this cache from its start (kdcache onpolicy's rounds); "
                                   "a checkpoint of this cache resumes as usual")
    stop_after: int = field(0, "testing aid: behave as if SIGTERM arrived after this step (0 = off)")

    def __post_init__(self):
        validate(self, required=("cache", "student", "out"), checks=[
            ("loss_chunk", self.loss_chunk >= 0, "must be >= 0 (0: by vocabulary)"),
            ("lora_r", self.lora_r >= 0, "must be >= 0 (0: full fine-tuning)"),
            ("lora_alpha", self.lora_alpha >= 0, "must be >= 0 (0: 2 x --lora-r)"),
            ("lora_dropout", 0.0 <= self.lora_dropout < 1.0, "must be in [0, 1)"),
            ("nproc_per_node", self.nproc_per_node >= 1, "must be >= 1"),
            ("lr", self.lr > 0, "must be > 0"),
            ("min_lr_ratio", 0 <= self.min_lr_ratio <= 1, "must be in [0, 1]"),
            ("warmup_steps", self.warmup_steps >= 0, "must be >= 0"),
            ("grad_clip", self.grad_clip >= 0, "must be >= 0"),
            ("batch_size", self.batch_size >= 1, "must be >= 1"),
            ("max_tokens", self.max_tokens >= 0, "must be >= 0"),
            ("grad_accum", self.grad_accum >= 1, "must be >= 1"),
            ("max_steps", self.max_steps >= 0, "must be >= 0"),
            ("epochs", self.epochs >= 1, "must be >= 1"),
            ("save_every", self.save_every >= 0, "must be >= 0"),
            ("keep_checkpoints", self.keep_checkpoints >= 1, "must be >= 1"),
            ("prefetch", self.prefetch >= 1, "must be >= 1"),
            ("log_every", self.log_every >= 1, "must be >= 1"),
            ("until_step", self.until_step >= 0, "must be >= 0"),
            ("mix_lambda", 0.0 <= self.mix_lambda <= 1.0, "must be in [0, 1]"),
            ("mix_cache", not self.mix_cache or self.max_steps > 0, "needs --max-steps (both caches cycle)"),
            ("mix_cache", not (self.mix_cache and len(self.caches) > 2),
             "is the two-cache case of several --cache: give every cache as --cache, with --cache-weights"),
            ("cache_weights", not (self.mix_cache and self.cache_weights),
             "does not go with --mix-cache (--mix-lambda weighs its two caches)"),
            ("cache_weights", not self.cache_weights or self.max_steps > 0, "needs --max-steps (the caches cycle)"),
            ("until_step", not (self.max_steps and self.until_step > self.max_steps), "must be <= max_steps"),
        ])
        twice = sorted({c for c in self.caches if self.caches.count(c) > 1})
        if twice:
            raise ConfigError(f"cache: {', '.join(twice)} given twice; give each cache once (--cache-weights "
                              "sets how often each is drawn)")
        if self.cache_weights:
            self.weights()
        if self.pack and not self.max_tokens:
            raise ConfigError("pack: needs max_tokens (the packed row length), e.g. --max-tokens 2048")
        if self.deepspeed not in ("0", "1", "2", "3") and not self.deepspeed.endswith(".json"):
            raise ConfigError(f"deepspeed: {self.deepspeed!r} must be a ZeRO stage 0-3 or a .json config file")
        self.loss_config()    # the loss's own checks: beta, temperature, tail, sft_alpha
        self.loss_config(objective="gkd")     # --beta of a token-rkl run's GKD micro-batches

    @property
    def caches(self) -> list[str]:
        """Every cache trained on: the --cache ones in order, then --mix-cache."""
        first = [self.cache] if isinstance(self.cache, str) else list(self.cache)
        return first + ([self.mix_cache] if self.mix_cache else [])

    def weights(self) -> list[float] | None:
        """Each cache's chance per micro-batch (the caches' order); None: in proportion to the positions left."""
        if self.mix_cache:
            return [self.mix_lambda, 1.0 - self.mix_lambda]
        if not self.cache_weights:
            return None
        caches = self.caches
        try:
            w = [float(x) for x in self.cache_weights.split(",")]
        except ValueError:
            raise ConfigError(f"cache_weights: {self.cache_weights!r} must be numbers, comma-separated") from None
        if len(w) != len(caches) or min(w) < 0 or sum(w) <= 0:
            raise ConfigError(f"cache_weights: {self.cache_weights!r} needs {len(caches)} non-negative number(s), "
                              f"one per --cache ({', '.join(caches)}), not all 0")
        return [x / sum(w) for x in w]

    def loss_config(self, vocab_size: int = 32000, objective: str | None = None) -> LossConfig:
        """The loss settings of micro-batches that train `objective` (default: the run's); --loss-chunk 0 resolved
        for the student's vocabulary. In a token-rkl run, --beta is the divergence of the micro-batches that train
        GKD (a --mix-cache of off-policy data: train/checks.py objectives); token-rkl itself has no beta."""
        objective = objective or self.objective
        chunk = self.loss_chunk or default_chunk(vocab_size)
        return LossConfig(beta=self.beta if objective == "gkd" else 0.0, temperature=self.temperature,
                          tail=self.tail, sft_alpha=self.sft_alpha, chunk_size=chunk, objective=objective)
