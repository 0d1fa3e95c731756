"""Settling a precompute job before the dataset is read: its checks, the teacher backend, the tokenizer and its
end-of-turn ids, the storage settings and the fingerprint parts.

The checks that need no model loaded (paths, max_length against the teacher's context, top_k against its
vocabulary) are plain functions of the teacher's config, read as an object (transformers' AutoConfig) or as the
dict in config.json: the job's early Ray start (may_start_early) asks the same questions without importing
transformers.
"""
import json
import os
import sys
from dataclasses import dataclass, replace

from kdcache.cache_format import CacheError, Storage, hash_json, hash_tree
from kdcache.cache_format.location import Location
from kdcache.cache_format.manifest import MANIFEST_NAME
from kdcache.cache_format.store import is_store
from kdcache.cache_format.tokenizer_id import diff_identity, tokenizer_identity
from kdcache.common.env import default_threads
from kdcache.common.errors import ConfigError, DataError

from .data import is_cache, open_source_cache
from .dispatch import worker_gpus
from .encode import MAX_MESSAGES, Encoder, document_end_id, end_of_turn_ids
from .placement import check_tensor_parallel, gpus_by_node, gpus_per_worker, resolve_workers
from .ray_start import own_ray
from .teacher import choose_backend, is_url
from .versions import SERVED_MIN, VLLM_MIN, installed_vllm, require
from .worker import WorkerSpec

MAX_LENGTH_CAP = 2048    # the default max_length where the teacher's context is longer


@dataclass
class Job:
    """Everything settled before the dataset is read."""
    cfg: object              # PrecomputeConfig, with out resolved (a store's cache directory)
    encoder: Encoder
    tokenizer_id: dict       # cache_format.tokenizer_id.tokenizer_identity of the teacher's tokenizer
    turn_ends: list          # the ids that end a turn (the manifest's eos_token_ids)
    teacher_backend: str     # a key of pipeline.teacher.TEACHERS (`auto` resolved)
    backend_reason: str      # why that backend (printed, and recorded in the manifest's meta)
    server: dict | None      # a served teacher: what its server reports (pipeline.teacher_served.server_info)
    gpus: float              # per worker
    dtype: str               # teacher compute dtype (`auto` resolved)
    vocab_size: int
    storage: Storage         # how the cache stores the rows (the writer owns it; the workers write with it)
    parts: dict              # fingerprint parts (without the storage's, which the writer adds)
    t_start: float
    generator_backend: str | None = None    # --generator: hf or vllm, in the workers beside the teacher

    def worker_spec(self) -> WorkerSpec:
        cfg = self.cfg
        threads = cfg.threads or default_threads(cfg.workers)
        gen = None if cfg.mode != "generate" else dict(
            max_new_tokens=cfg.gen_max_new_tokens, temperature=cfg.gen_temperature, top_p=cfg.gen_top_p,
            seed=cfg.seed, turn_ends=self.turn_ends, max_length=cfg.max_length)
        return WorkerSpec(
            self.teacher_backend, cfg.teacher,
            teacher_kwargs=dict(dtype=self.dtype, max_length=cfg.max_length, max_top_k=cfg.top_k, seed=cfg.seed,
                                **(dict(full_distribution=True) if cfg.sample and self.teacher_backend == "vllm"
                                   else {}),
                                trust_remote_code=cfg.trust_remote_code, batch_tokens=cfg.batch_tokens,
                                threads=threads,
                                **({} if gpus_per_worker(cfg) == 1 else
                                   dict(tensor_parallel_size=cfg.tensor_parallel_size,
                                        pipeline_parallel_size=cfg.pipeline_parallel_size)),
                                **(dict(enforce_eager=True) if cfg.enforce_eager and self.teacher_backend == "vllm"
                                   else {}),
                                **({} if self.server is None else
                                   dict(requests_in_flight=cfg.requests_in_flight, expect=self.server))),
            storage=self.storage, vocab_size=self.vocab_size, generate=gen, seed=cfg.seed,
            generator=None if not cfg.generator else dict(
                backend=self.generator_backend, model_path=cfg.generator,
                kwargs=dict(dtype=self.dtype if self.dtype != "server" else "float32", max_length=cfg.max_length,
                            max_top_k=1, seed=cfg.seed, trust_remote_code=cfg.trust_remote_code,
                            batch_tokens=cfg.batch_tokens, threads=threads,
                            **(dict(logprobs_mode="processed_logprobs",
                                    enforce_eager=cfg.enforce_eager) if self.generator_backend == "vllm" else {}))))


# -- checks that need no model loaded ---------------------------------------------------------------------------
def check_paths(cfg):
    """The teacher, tokenizer and dataset exist, before anything is loaded or started."""
    local = ("kdcache reads models from local directories: download a hub model first "
             "(huggingface-cli download NAME --local-dir DIR) and pass DIR")
    if is_url(cfg.teacher):
        if cfg.backend not in ("auto", "served"):
            raise ConfigError(f"backend: {cfg.backend!r} runs a local model directory, but the teacher is the URL "
                              f"{cfg.teacher}; use --backend served (or auto)")
        if not cfg.tokenizer:
            raise ConfigError(f"tokenizer: required with a served teacher ({cfg.teacher}): pass --tokenizer DIR, a "
                              "local copy of the served model's tokenizer files (and its config.json and "
                              "generation_config.json where you have them); kdcache tokenizes here and sends ids")
    elif cfg.backend == "served":
        raise ConfigError(f"backend: served needs the teacher as the URL of a vLLM server (http://HOST:PORT/v1), "
                          f"not {cfg.teacher!r}")
    elif not os.path.isfile(os.path.join(cfg.teacher, "config.json")):
        raise ConfigError(f"teacher: {cfg.teacher} is not a model directory (no config.json there); {local}")
    if cfg.tokenizer and not os.path.isdir(cfg.tokenizer):
        raise ConfigError(f"tokenizer: {cfg.tokenizer} is not a directory; {local}")
    if cfg.generator and cfg.mode != "generate":
        raise ConfigError(f"generator: {cfg.generator} writes completions, which only --mode generate asks for")
    if cfg.generator and not os.path.isfile(os.path.join(cfg.generator, "config.json")):
        raise ConfigError(f"generator: {cfg.generator} is not a model directory (no config.json there); {local}")
    if not is_cache(cfg.data) and not os.path.exists(cfg.data):
        raise DataError(f"dataset {cfg.data} does not exist (hub dataset names need network access: save the "
                        "dataset to disk with datasets' save_to_disk and pass the directory)")


def _get(conf, key):
    return conf.get(key) if isinstance(conf, dict) else getattr(conf, key, None)


def text_config(conf):
    """The text model's part of a model config (multimodal configs nest it), an object or a config.json dict."""
    return _get(conf, "text_config") or conf


def context_length(conf):
    """The teacher's context (max_position_embeddings, of the text model where it is nested), or None."""
    text = text_config(conf)
    return _get(text, "max_position_embeddings") or _get(text, "n_positions")


def settle_max_length(cfg, conf):
    """cfg with max_length resolved: the teacher's context capped at MAX_LENGTH_CAP by default; an explicit
    value above the context is refused here, before any Ray or teacher start-up."""
    ctx = context_length(conf)
    if cfg.max_length is None:
        return replace(cfg, max_length=min(ctx or MAX_LENGTH_CAP, MAX_LENGTH_CAP))
    if ctx and cfg.max_length > ctx:
        raise ConfigError(f"max_length: {cfg.max_length} is above the teacher's context of {ctx} tokens "
                          f"(max_position_embeddings in {cfg.teacher}/config.json); use --max-length {ctx} or less")
    return cfg


def check_sample(cfg, backend, vocab_size):
    """--sample needs the teacher's whole distribution at every position, and something left to draw from."""
    if not cfg.sample:
        return
    if backend == "served":
        raise ConfigError("sample: a served teacher cannot be sampled: a vLLM server returns at most its "
                          "--max-logprobs top entries per position, not the whole distribution the draws must come "
                          "from (drawing from a top-k would leave the tail out and bias the cache). Run the teacher "
                          "in the job instead: --backend vllm or hf")
    if vocab_size and cfg.top_k >= vocab_size:
        raise ConfigError(f"top_k: {cfg.top_k} exact entries leave nothing of the teacher's {vocab_size}-token "
                          "vocabulary to --sample from; lower --top-k, or drop --sample")


def check_top_k(cfg, vocab_size):
    if vocab_size and cfg.top_k > vocab_size:
        raise ConfigError(f"top_k: {cfg.top_k} is more than the teacher's vocabulary of {vocab_size} tokens; "
                          f"use --top-k {vocab_size} or less")


def may_start_early(cfg):
    """Whether Ray may start before the job is settled: a local teacher, a Ray of the job's own, --out neither a
    store nor a complete cache (either may well be reused without any teacher work), and none of the checks above
    failing on the teacher's config.json, nor an empty dataset, so that refusals still come before any Ray
    start-up."""
    if is_url(cfg.teacher) or not own_ray(cfg.ray_address) or cfg.store:
        return False
    try:
        check_paths(cfg)
        out = Location(cfg.out)
        if is_store(cfg.out) or (out.exists(MANIFEST_NAME) and out.read_json(MANIFEST_NAME).get("complete")):
            return False
        with open(os.path.join(cfg.teacher, "config.json")) as f:
            conf = json.load(f)
        settle_max_length(cfg, conf)
        check_top_k(cfg, _get(text_config(conf), "vocab_size"))
        if os.path.isfile(cfg.data) and os.path.getsize(cfg.data) < 4096:
            with open(cfg.data, "rb") as f:
                return bool(f.read().strip())
        return True
    except Exception:        # anything odd: settle says what, before any Ray start-up
        return False


# -- settling ---------------------------------------------------------------------------------------------------
def settle_served_max_length(cfg, server):
    """settle_max_length for a served teacher: the server's max_model_len, less the one token of room a scoring
    request needs (vLLM refuses a prompt that fills its context), capped at MAX_LENGTH_CAP by default."""
    room = server["max_model_len"] - 1
    if cfg.max_length is None:
        return replace(cfg, max_length=min(room, MAX_LENGTH_CAP))
    if cfg.max_length > room:
        raise ConfigError(f"max_length: {cfg.max_length} is more than the teacher server takes: its max_model_len is "
                          f"{server['max_model_len']} and a scoring request needs one token of room for the one it "
                          f"generates; use --max-length {room} or less, or restart the server with a larger "
                          "--max-model-len")
    return cfg


def served_model_config(cfg):
    """The served model's config.json where the tokenizer directory has one (its vocabulary size), else None."""
    if not os.path.isfile(os.path.join(cfg.tokenizer, "config.json")):
        return None
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(cfg.tokenizer, trust_remote_code=cfg.trust_remote_code)


def generation_eos_ids(model_dir):
    """The EOS ids of the teacher's generation_config.json (vLLM and transformers stop on them too: Qwen2.5
    stops on <|endoftext|> as well as <|im_end|>), so both backends stop on one recorded set."""
    try:
        with open(os.path.join(model_dir, "generation_config.json")) as f:
            eos = json.load(f).get("eos_token_id")
    except (OSError, ValueError):
        return []
    return [int(t) for t in (eos if isinstance(eos, list) else [eos]) if isinstance(t, int)]


def _teacher(cfg, backend):
    """(cfg with max_length resolved, the teacher's model config or None, the server's report or None)."""
    if backend != "served":
        from transformers import AutoConfig
        conf = AutoConfig.from_pretrained(cfg.teacher, trust_remote_code=cfg.trust_remote_code)
        return settle_max_length(cfg, conf), conf, None
    from .teacher_served import server_info
    if cfg.dtype != "auto":
        raise ConfigError(f"dtype: {cfg.dtype!r} cannot be set for a served teacher: it computes in the server's "
                          "dtype (vllm serve --dtype); drop --dtype")
    server = server_info(cfg.teacher)
    require(server["vllm_version"], SERVED_MIN, f"teacher server {cfg.teacher}")
    print(f"teacher server {cfg.teacher}: model {server['model']!r}, max_model_len {server['max_model_len']}, "
          f"vLLM {server['vllm_version']}" + (f", revision {cfg.teacher_revision!r}" if cfg.teacher_revision
                                              else " (no --teacher-revision)"))
    return settle_served_max_length(cfg, server), served_model_config(cfg), server


def _encoder(cfg, tok, server):
    """The Encoder and the end-of-turn ids: the template's, the tokenizer's EOS, generation_config's, the extra
    --eos-tokens and the document-end token of plain-text records."""
    text_end = document_end_id(tok, cfg.text_end)
    extra = [tok.convert_tokens_to_ids(t) for t in cfg.eos_tokens] + \
        generation_eos_ids(cfg.tokenizer if server else cfg.teacher) + [text_end]
    ends = end_of_turn_ids(tok, extra)
    encoder = Encoder(tok, template=cfg.template, max_length=cfg.max_length, overlong=cfg.overlong,
                      turn_ends=ends, drop_end_of_turn=cfg.drop_end_of_turn, text_end=text_end,
                      max_messages=cfg.max_messages)
    if cfg.drop_end_of_turn:
        print("WARNING: --drop-end-of-turn leaves out every end-of-turn position (the bug kdcache exists to "
              "prevent); a student trained on this cache will not learn to stop.", file=sys.stderr)
    return encoder, ends


def settle(cfg, t_start) -> Job:
    """The Job: tokenizer, end-of-turn ids, teacher backend, dtype, storage and fingerprint parts."""
    from transformers import AutoTokenizer
    check_paths(cfg)
    backend, reason = choose_backend(cfg.backend, cfg.teacher)
    print(f"teacher backend: {backend} ({'auto: ' if cfg.backend == 'auto' else ''}{reason})")
    if backend == "vllm":
        require(installed_vllm(), VLLM_MIN, "backend vllm")
    check_sample(cfg, backend, None)         # before a server is asked anything
    cfg, model_config, server = _teacher(cfg, backend)
    if cfg.worker_cpus is None:       # a served teacher's workers only wait on HTTP
        cfg = replace(cfg, worker_cpus=0.25 if server else 1.0)
    tok = AutoTokenizer.from_pretrained(cfg.tokenizer or cfg.teacher, trust_remote_code=cfg.trust_remote_code)
    encoder, ends = _encoder(cfg, tok, server)
    gpus = max(cfg.worker_gpus, 0.0) if server else worker_gpus(cfg)     # a server's GPUs are its own
    if server is None and (cfg.workers is None or gpus_per_worker(cfg) > 1):
        per_node = gpus_by_node(cfg)
        cfg = replace(cfg, workers=resolve_workers(cfg, per_node))
        check_tensor_parallel(cfg, backend, model_config, sum(per_node), cfg.workers, per_node)
    elif gpus_per_worker(cfg) > 1:
        check_tensor_parallel(cfg, backend, model_config, 0, cfg.workers or 1)   # refused: not the vLLM backend
    cfg = replace(cfg, workers=cfg.workers or 1)
    dtype = "server" if server else cfg.dtype if cfg.dtype != "auto" else ("bfloat16" if gpus > 0 else "float32")
    if model_config is not None:
        vocab_size = text_config(model_config).vocab_size
    else:
        vocab_size = len(tok)
        print(f"note: {cfg.tokenizer} has no config.json: the teacher's vocabulary size is taken from its tokenizer "
              f"({vocab_size}); copy the served model's config.json there if its embeddings are padded beyond it")
    check_top_k(cfg, vocab_size)
    check_sample(cfg, backend, vocab_size)
    encoder.vocab_size = vocab_size          # token-id records are checked against the teacher's rows
    if server:
        from .teacher_served import check_top_k as check_server_top_k
        check_server_top_k(cfg.teacher, server, cfg.top_k)
    try:
        storage = cfg.storage()
    except CacheError as e:
        raise ConfigError(str(e)) from None
    tok_id = tokenizer_identity(tok)
    if is_cache(cfg.data):
        check_source_tokenizer(cfg.data, tok_id)
    gen_backend = check_generator(cfg, tok_id, backend)
    parts = fingerprint_parts(cfg, tok_id, ends, backend, dtype, server)
    return Job(cfg, encoder, tok_id, ends, backend, reason, server, gpus, dtype, vocab_size, storage, parts, t_start,
               gen_backend)


def check_generator(cfg, tok_id, teacher_backend):
    """--generator (generate mode and a model directory: check_paths): the teacher's tokenizer (its ids are the
    teacher's, never decoded and re-encoded). Returns the backend it runs on (the teacher's when in process, else
    auto's), or None without one."""
    if not cfg.generator:
        return None
    from transformers import AutoTokenizer
    gen_tok = AutoTokenizer.from_pretrained(cfg.generator, trust_remote_code=cfg.trust_remote_code)
    diffs = diff_identity(tok_id, tokenizer_identity(gen_tok))
    if diffs:
        raise ConfigError(f"generator: {cfg.generator} has another tokenizer than the teacher's "
                          f"({'; '.join(diffs).replace(' in the cache', ' for the teacher')}): its token ids "
                          "would mean other tokens to the teacher. Use a generator with the teacher's tokenizer, or "
                          "`kdcache onpolicy --cross-tokenizer`, whose rollouts reach the teacher as text")
    return teacher_backend if teacher_backend in ("hf", "vllm") else choose_backend("auto", cfg.generator)[0]


def check_source_tokenizer(path, tok_id):
    """A cache given as --data is rescored on its own ids: refused unless they were made with this job's tokenizer."""
    src = open_source_cache(path).manifest["meta"].get("tokenizer")
    if not isinstance(src, dict):
        raise ConfigError(f"dataset {path}: the cache records no tokenizer identity (meta.tokenizer), so nothing shows "
                          "its ids are this teacher's tokens; it cannot be rescored")
    diffs = diff_identity(src, tok_id)
    if diffs:
        raise ConfigError(f"dataset {path}: its token ids were made with another tokenizer than this job's "
                          f"({'; '.join(diffs)}): rescoring them would score other tokens than they mean. Use a "
                          "teacher (or --tokenizer) with the cache's tokenizer")


def teacher_part(cfg, server):
    """The teacher's fingerprint part: its weights and config by content, or, for a served teacher, what its
    server reports plus --teacher-revision (remote weights cannot be hashed: see the README)."""
    if server is None:
        return hash_tree(cfg.teacher)
    return {"served_model": server["model"], "max_model_len": server["max_model_len"],
            "vllm_version": server["vllm_version"], "revision": cfg.teacher_revision}


def data_part(path) -> str:
    """The dataset by content. A cache as --data: its fingerprint and its shards' checksums (its directory also
    holds reports and read stamps, which change when it is read, not what it holds)."""
    if not is_cache(path):
        return hash_tree(path)
    m = open_source_cache(path).manifest
    return hash_json({"cache": m["fingerprint"], "shards": [[s["path"], s["sha256"]] for s in m["shards"]]})


def fingerprint_parts(cfg, tok_identity, end_of_turn, backend, dtype, server=None):
    """The job's fingerprint parts; their keys are what existing caches recorded (do not rename them)."""
    capture = {"mode": cfg.mode, "max_length": cfg.max_length, "overlong": cfg.overlong,
               "template": cfg.template, "eos_token_ids": end_of_turn, "backend": backend, "dtype": dtype,
               "on_bad_record": cfg.on_bad_record, "text_end": cfg.text_end}
    if cfg.drop_end_of_turn:
        capture["drop_end_of_turn"] = True
    if cfg.max_messages != MAX_MESSAGES:          # recorded only when changed: older caches keep their fingerprint
        capture["max_messages"] = cfg.max_messages
    if cfg.mode == "generate":
        capture.update(max_new_tokens=cfg.gen_max_new_tokens, temperature=cfg.gen_temperature,
                       top_p=cfg.gen_top_p, seed=cfg.seed)
        if cfg.generator:          # recorded only when set: caches of teacher generations keep their fingerprint
            capture["generator"] = hash_tree(cfg.generator)
    if cfg.sample:                 # the draws' seed (the storage part records --sample itself)
        capture["seed"] = cfg.seed
    return {
        "teacher": teacher_part(cfg, server),              # weights + config, by content (or the server's word)
        "tokenizer": hash_json(tok_identity),
        "data": data_part(cfg.data),
        "capture": capture,
    }
