"""A teacher worker: scores (or generates then scores) one shard's samples and writes the shard file.

Runs as a Ray actor; each worker is the only writer of the shards it is
given. It returns the shard's manifest entry; the driver commits it.
"""
import time

import numpy as np

from cache_format import Record, write_shard_file


def make_teacher(backend, model_path, **kw):
    if backend == "vllm":
        from .teacher_vllm import VLLMTeacher
        return VLLMTeacher(model_path, **kw)
    from .teacher_hf import HFTeacher
    return HFTeacher(model_path, **kw)


class TeacherWorker:
    def __init__(self, backend, model_path, teacher_kwargs, cache_kwargs, gen_kwargs, mode):
        self.teacher = make_teacher(backend, model_path, **teacher_kwargs)
        self.cache_kwargs, self.gen_kwargs, self.mode = cache_kwargs, gen_kwargs, mode

    def ready(self):
        return True

    def run(self, unit):
        """unit: {index, sample_start, sample_end, items: [(sample_id, ids, positions, truncated)]}."""
        t0 = time.perf_counter()
        items = unit["items"]
        if self.mode == "generate" and items:
            items = self._generate(items)
        seqs = [it[1] for it in items]
        pos = [it[2] for it in items]
        scored = self.teacher.score(seqs, pos, self.cache_kwargs["top_k"]) if items else []
        records = [Record(sid, np.asarray(ids, np.int32), p, tid, tlp, tail, trunc)
                   for (sid, ids, p, trunc), (tid, tlp, tail) in zip(items, scored)]
        teacher_s = time.perf_counter() - t0
        info = write_shard_file(unit["directory"], unit["index"], records, sample_start=unit["sample_start"],
                                sample_end=unit["sample_end"], tag=unit.get("shard_tag"), **self.cache_kwargs)
        return {"info": info, "teacher_s": teacher_s, "write_s": time.perf_counter() - t0 - teacher_s,
                "tokens": int(sum(len(s) for s in seqs))}

    def _generate(self, items):
        """Prompts -> prompt + teacher completion, trained on every generated token (EOS step included)."""
        g = self.gen_kwargs
        prompts = [it[1] for it in items]
        budgets = [min(g["max_new_tokens"], g["max_length"] - len(p)) for p in prompts]
        gens = self.teacher.generate(prompts, max_new_tokens=budgets, temperature=g["temperature"],
                                     top_p=g["top_p"], seeds=[g["seed"] + it[0] for it in items],
                                     eos_ids=set(g["eos_ids"]))
        out = []
        for (sid, prompt, _, _), (new, ended) in zip(items, gens):
            ids = list(prompt) + list(new)
            positions = np.arange(len(prompt) - 1, len(ids) - 1, dtype=np.int32)
            out.append((sid, ids, positions, not ended))   # no EOS within the budget: flagged truncated
        return out
