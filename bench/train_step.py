"""A KD step from the cache against an SFT step, at real vocabularies (issue 43), in one sitting.

    .venv/bin/python bench/train_step.py [--vocabs 32000,151936,262144] [--hiddens 256,1024] [--steps 3]

For each vocabulary V and hidden size H: a 4-layer Qwen2 student (tied embeddings) and a batch of 8 x 256 tokens
read from a real cache (k = 64, a peaked random teacher, written and read by kdcache's own writer, reader and
collate). Each step is forward + backward + AdamW, with the trainer's own module (train/model.py DistillModule):
  hf_sft     the same student's Hugging Face SFT step: model(input_ids, labels=input_ids)
  sft_fused  kdcache's fused SFT (--objective sft): the same fused, chunked head
  kd_new     kdcache train's KD step (GKD beta 0.5, tail bucket), closed-form chunk gradients, default chunk
  kd_old     the same with each chunk's gradient through autograd (kdcache before issue 43), its default chunk
The methods alternate step by step (median of --steps after a warm-up each). Then the loss's peak memory (forward
+ backward, hidden states and head gradient included), measured in a fresh process at the batch's N positions,
against the dense [N, V] float32 logits of a micro-batch of 8 x 2,048 tokens.
"""
import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kdcache.train import model as kd_model  # noqa: E402
from kdcache.train.losses import LossConfig, chunked_kd_loss, default_chunk  # noqa: E402

OLD_CHUNK = {32000: 1024, 151936: 256, 262144: 128}     # the default before issue 43 (192 MiB of logits per chunk)
DENSE_N = 8 * 2048


def student(vocab, hidden, layers=4, seed=0):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 3,
                                        num_hidden_layers=layers, num_attention_heads=hidden // 32,
                                        num_key_value_heads=max(1, hidden // 128), max_position_embeddings=4096,
                                        tie_word_embeddings=True))


def cache_batch(vocab, k, rows, seq, directory):
    """Write a cache of `rows` records of `seq` tokens (every position after the first trained; the last token the
    end of turn), read it back and collate it: the Batch `kdcache train` would train."""
    import numpy as np

    from kdcache import CacheDataset, collate
    from kdcache.cache_format import Record, Storage, tail_mass_from_logprobs
    from kdcache.cache_format.writer import write_cache
    g = torch.Generator().manual_seed(1)
    records = []
    for i in range(rows):
        ids = torch.randint(3, vocab, (seq,), generator=g)
        ids[-1] = 2
        lp = torch.log_softmax(torch.randn(seq - 1, vocab, generator=g) * 4, -1)
        tlp, tid = lp.topk(k, -1)
        tlp = tlp.numpy().astype(np.float32)
        records.append(Record(i, ids.numpy().astype(np.int32), np.arange(seq - 1, dtype=np.int32),
                              tid.numpy().astype(np.int32), tlp, tail_mass_from_logprobs(tlp), False))
    write_cache(directory, records, shard_size=rows, storage=Storage("arrow", k), vocab_size=vocab,
                eos_token_ids=[2], fingerprint_parts={"teacher": "bench", "data": "bench"})
    return collate(list(CacheDataset(directory, shuffle=False)), pad_id=0, student_vocab=vocab)


def steps(args, vocab, hidden, batch):
    """Median seconds per step of each method, alternated step by step."""
    m = student(vocab, hidden)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-5)
    new_chunk, old_chunk = default_chunk(vocab), OLD_CHUNK.get(vocab, 256)
    kd = kd_model.DistillModule(m, LossConfig(beta=0.5, chunk_size=new_chunk))
    sft = kd_model.DistillModule(m, LossConfig(objective="sft", chunk_size=new_chunk))
    kd_old = kd_model.DistillModule(m, LossConfig(beta=0.5, chunk_size=old_chunk))
    old_loss = functools.partial(chunked_kd_loss, closed_form=False)

    def run(fn):
        t0 = time.perf_counter()
        loss = fn()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - t0

    def with_old():
        kd_model.chunked_kd_loss = old_loss
        try:
            return kd_old(batch)[0] / batch.n_positions
        finally:
            kd_model.chunked_kd_loss = chunked_kd_loss

    methods = {"hf_sft": lambda: m(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                                   labels=batch.input_ids).loss,
               "sft_fused": lambda: sft(batch)[0] / batch.n_positions,
               "kd_new": lambda: kd(batch)[0] / batch.n_positions,
               "kd_old": with_old}
    times = {name: [] for name in methods}
    for _ in range(args.steps + 1):
        for name, fn in methods.items():
            times[name].append(run(fn))
    return {name: statistics.median(t[1:]) for name, t in times.items()}, new_chunk, old_chunk


class LiveBytes:
    """Peak bytes of tensor storages alive while active (a dispatch mode), those of `skip` (the inputs: hidden
    states, the head's weight) left out: a view of an input seen inside would otherwise count it."""

    def __init__(self, skip=()):
        self.skip = {t.untyped_storage().data_ptr() for t in skip}

    def __enter__(self):
        import weakref

        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten
        outer = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_flatten(out)[0]:
                    if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in outer.skip:
                        st = t.untyped_storage()
                        outer.live.setdefault(id(st), (weakref.ref(st), st.nbytes()))
                outer.live = {k: v for k, v in outer.live.items() if v[0]() is not None}
                outer.peak = max(outer.peak, sum(n for _, n in outer.live.values()))
                return out

        self.live, self.peak, self.mode = {}, 0, Mode()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)


def loss_memory(vocab, hidden, n, k, chunk, closed):
    """Peak MB of tensors alive during one loss forward + backward over n positions (a fresh process)."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(n, hidden, generator=g, requires_grad=True)
    w = (torch.randn(vocab, hidden, generator=g) * 0.02).requires_grad_()
    tlp, tid = torch.log_softmax(torch.randn(n, 4 * k, generator=g) * 2, -1).topk(k, -1)
    tid = torch.randint(0, vocab, (n, k), generator=g)
    tid = torch.where(torch.arange(k) == 0, tid, (tid[:, :1] + torch.arange(k)) % vocab)       # unique per row
    tail = (1 - tlp.exp().sum(-1)).clamp(0, 1)
    with LiveBytes(skip=(h, w, tid, tlp, tail)) as mem:
        loss, _ = chunked_kd_loss(h, w, tid, tlp, tail, tid[:, 0], LossConfig(beta=0.5, chunk_size=chunk),
                                  closed_form=closed)
        loss.backward()
    return mem.peak / 2**20


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocabs", default="32000,151936,262144")
    ap.add_argument("--hiddens", default="256,1024")
    ap.add_argument("--k", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--memory-only", action="store_true", help="only the loss's peak memory (no step times)")
    ap.add_argument("--_memory", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._memory:
        print(json.dumps({"mb": loss_memory(*json.loads(args._memory))}))
        return
    print(f"{torch.get_num_threads()} threads; batch 8 x 256 from a cache, k = {args.k}; s/step median of "
          f"{args.steps}; memory vs the dense [{DENSE_N}, V] float32 logits", flush=True)
    head = (f"{'V':>8} {'H':>5} {'hf_sft':>7} {'sft_fused':>9} {'kd_old':>7} {'kd_new':>7} {'old/hf':>7} "
            f"{'new/hf':>7} {'new/sft_fused':>13} {'chunk old,new':>13} {'mem old':>8} {'mem new':>8}")
    print(head, flush=True)
    rows = []
    for vocab in (int(v) for v in args.vocabs.split(",")):
        for hidden in (int(h) for h in args.hiddens.split(",")):
            with tempfile.TemporaryDirectory() as d:
                batch = cache_batch(vocab, args.k, 8, 256, os.path.join(d, "cache"))
            if args.memory_only:
                nan = float("nan")
                t, new_chunk, old_chunk = dict.fromkeys(("hf_sft", "sft_fused", "kd_old", "kd_new"), nan), \
                    default_chunk(vocab), OLD_CHUNK.get(vocab, 256)
            else:
                t, new_chunk, old_chunk = steps(args, vocab, hidden, batch)
            mem = {}
            for label, chunk, closed in (("old", old_chunk, False), ("new", new_chunk, True)):
                if args.no_memory:
                    mem[label] = float("nan")
                    continue
                spec = json.dumps([vocab, hidden, batch.n_positions, args.k, chunk, closed])
                out = subprocess.run([sys.executable, __file__, "--_memory", spec], capture_output=True, text=True,
                                     check=True)
                mem[label] = json.loads(out.stdout.strip().splitlines()[-1])["mb"] / (DENSE_N * vocab * 4 / 2**20)
            row = dict(vocab=vocab, hidden=hidden, n=batch.n_positions, **t, chunk_old=old_chunk,
                       chunk_new=new_chunk, mem_old=mem["old"], mem_new=mem["new"])
            rows.append(row)
            print(f"{vocab:>8} {hidden:>5} {t['hf_sft']:>7.3f} {t['sft_fused']:>9.3f} {t['kd_old']:>7.3f} "
                  f"{t['kd_new']:>7.3f} {t['kd_old'] / t['hf_sft']:>7.2f} {t['kd_new'] / t['hf_sft']:>7.2f} "
                  f"{t['kd_new'] / t['sft_fused']:>13.2f} {f'{old_chunk},{new_chunk}':>13} "
                  f"{mem['old']:>7.3f}x {mem['new']:>7.3f}x", flush=True)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
