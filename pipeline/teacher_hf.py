"""Reference teacher backend: transformers forward, log_softmax over the full vocabulary, top-k.

Also the fallback where vLLM cannot run a model. Meets pipeline.teacher.Teacher.
"""
import inspect

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from kdcache.common.batching import budget_groups
from kdcache.common.heads import check_head, decoder_of, logit_transform

from .draws import generator_for, top_and_draws
from .teacher import Draws, Scored

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class HFTeacher:
    engine = "transformers"

    def __init__(self, model_path, *, dtype="float32", device=None, trust_remote_code=False,
                 batch_tokens=0, threads=None, **_):
        if threads:
            torch.set_num_threads(threads)
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        # dtype is always explicit: "auto" would silently run a float32 checkpoint in bf16.
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code).to(self.device).eval()
        self.batch_tokens = batch_tokens or 8192          # --batch-tokens 0: the default
        # Positions scored per log_softmax: ~96 MiB of float32 [rows, V] at a time, so a 32k-token sample at a
        # 152k vocabulary needs 128 x V floats, not 32k x V (19.5 GB).
        vocab = self.model.get_output_embeddings().weight.shape[0]
        self.rows = max(16, (96 << 20) // (4 * vocab))
        self.transform = logit_transform(self.model.config)   # soft-capping, scaling: the model's own logits
        # Decoding needs the last position's logits only: a prefill of [B, L, V] logits is B * L * V floats (2.4 GB
        # for 66 prompts of 60 tokens at V = 152k). Models whose forward cannot be told so compute them all.
        takes = inspect.signature(self.model.forward).parameters
        self.last_logits = {"logits_to_keep": 1} if "logits_to_keep" in takes else {}
        # The fused path (decoder, then lm_head on the scored positions only) where it gives the model's own
        # logits; else the model's forward, which builds [B, T, V] logits for every token of the batch.
        self.own_forward = check_head(self.model, self.transform)
        if self.own_forward:
            print(f"kdcache: teacher {model_path}: {self.own_forward}; scoring through the model's own forward "
                  f"(logits for every token: {4 * self.model.config.get_text_config().vocab_size:,} bytes per "
                  "token of a batch in float32)", flush=True)

    def score(self, seqs, positions, k):
        """See pipeline.teacher.Teacher.score: one Scored per sequence."""
        return [sc for sc, _ in self._score(seqs, positions, k, 0, None)]

    def score_sampled(self, seqs, positions, k, n, seeds):
        """See pipeline.teacher.Teacher: [(Scored, Draws)], the draws from the full distribution here."""
        return self._score(seqs, positions, k, n, seeds)

    def score_at(self, seqs, positions, ids):
        """The log-probs of given ids (int32 [P_i, n] per sequence; -1: none, log-prob -inf) at the positions, as
        Scored with those ids in their order (kdcache verify --rescore: the cache's own top-k, scored here)."""
        k = max((np.asarray(a).shape[1] for a in ids), default=0)
        return [sc for sc, _ in self._score(seqs, positions, k, 0, None, at=ids)]

    @torch.no_grad()
    def _score(self, seqs, positions, k, sample, seeds, at=None):
        out = [None] * len(seqs)
        for idx in budget_groups(range(len(seqs)), lambda i: len(seqs[i]), max_tokens=self.batch_tokens):
            T = max(len(seqs[i]) for i in idx)
            ids = torch.zeros(len(idx), T, dtype=torch.long)
            mask = torch.zeros(len(idx), T, dtype=torch.long)
            for r, i in enumerate(idx):
                ids[r, :len(seqs[i])] = torch.from_numpy(np.asarray(seqs[i], dtype=np.int64))
                mask[r, :len(seqs[i])] = 1
            ids, mask = ids.to(self.device), mask.to(self.device)
            if self.own_forward:
                full = self.model(input_ids=ids, attention_mask=mask, use_cache=False).logits   # (B, T, V)
            else:
                hidden = decoder_of(self.model)(input_ids=ids, attention_mask=mask,          # no KV cache kept
                                                use_cache=False).last_hidden_state          # (B, T, H)
            head = self.model.get_output_embeddings()
            for r, i in enumerate(idx):
                pos_all = torch.as_tensor(np.array(positions[i], dtype=np.int64), device=self.device)
                seq = torch.as_tensor(np.asarray(seqs[i], dtype=np.int64), device=self.device)
                parts, drawn = [], []
                gen = generator_for(seeds[i], self.device) if sample else None
                for lo in range(0, len(pos_all), self.rows):     # at most `rows` x V log-probs at a time
                    pos = pos_all[lo:lo + self.rows]
                    if self.own_forward:
                        logits = full[r, pos].float()                           # (c, V)
                    else:
                        logits = head(hidden[r, pos]).float()                   # (c, V)
                        if self.transform is not None:
                            logits = self.transform(logits)
                    lp = torch.log_softmax(logits, dim=-1)
                    target_lp = lp.gather(1, seq[pos + 1][:, None])[:, 0].cpu().numpy().astype(np.float32)
                    if at is not None:          # score_at: the given ids
                        top_ids = np.asarray(at[i][lo:lo + len(pos)], dtype=np.int32)
                        want = torch.as_tensor(top_ids, dtype=torch.long, device=self.device).clamp(min=0)
                        top_lp = lp.gather(1, want).cpu().numpy().astype(np.float32)
                        top_lp[top_ids < 0] = -np.inf
                    elif sample:
                        top_ids, top_lp, draw_ids, draw_lp = top_and_draws(lp, k, sample, gen)
                        drawn.append((draw_ids, draw_lp))
                    else:
                        top_lp, top_ids = lp.topk(k, dim=-1)                   # (c, k), sorted descending
                        top_ids, top_lp = top_ids.int().cpu().numpy(), top_lp.cpu().numpy().astype(np.float32)
                    parts.append((top_ids, top_lp, target_lp))
                if not parts:
                    parts = [(np.empty((0, k), np.int32), np.empty((0, k), np.float32), np.empty(0, np.float32))]
                    drawn = [(np.empty((0, sample), np.int32), np.empty((0, sample), np.float32))]
                out[i] = (Scored(*(np.concatenate(x) for x in zip(*parts))),
                          Draws(*(np.concatenate(x) for x in zip(*drawn))) if sample else None)
        return out

    @torch.no_grad()
    def generate(self, prompts, *, max_new_tokens, temperature, top_p, seeds, turn_ends, logprobs=False,
                 vocab_limit=None):
        """See pipeline.teacher.Teacher.generate. As a --generator: vocab_limit, sample ids below it only (the
        teacher's rows); logprobs, also return each sampled token's log-prob (float32 [n]) under the distribution
        it was drawn from (temperature and top-p applied; 0 for greedy decoding).

        Prompts are decoded together in batches of up to batch_tokens (prompt + budget, padded on the left), each
        with a generator of its own seed that draws once per step, so a sample's tokens do not depend on the
        others in its batch (tests/pipeline/test_hf_generate.py)."""
        results = [None] * len(prompts)
        for idx in budget_groups(range(len(prompts)), lambda i: len(prompts[i]) + int(max_new_tokens[i]),
                                 max_tokens=self.batch_tokens):
            rows = self._generate_rows([prompts[i] for i in idx], [int(max_new_tokens[i]) for i in idx],
                                       [seeds[i] for i in idx], temperature, top_p, turn_ends, vocab_limit)
            for i, (new, lps) in zip(idx, rows):
                ended = bool(new) and new[-1] in turn_ends
                results[i] = (new, ended, np.array(lps, np.float32)) if logprobs else (new, ended)
        return results

    def _generate_rows(self, prompts, budgets, seeds, temperature, top_p, turn_ends, vocab_limit):
        """One batch: [(new ids, their log-probs)] per prompt, decoded with a KV cache."""
        B, L = len(prompts), max(len(p) for p in prompts)
        ids = torch.zeros(B, L, dtype=torch.long)
        mask = torch.zeros(B, L, dtype=torch.long)
        for r, p in enumerate(prompts):                      # left padding: every row's next token is at the end
            ids[r, L - len(p):] = torch.from_numpy(np.asarray(p, dtype=np.int64))
            mask[r, L - len(p):] = 1
        gens = [torch.Generator(device=self.device).manual_seed(int(s)) for s in seeds]
        new, lps = [[] for _ in range(B)], [[] for _ in range(B)]
        live = [b > 0 for b in budgets]
        x, mask = ids.to(self.device), mask.to(self.device)
        pos = (mask.cumsum(1) - 1).clamp(min=0)
        past = None
        while any(live):
            o = self.model(input_ids=x, attention_mask=mask, position_ids=pos, past_key_values=past, use_cache=True,
                           **self.last_logits)
            past = o.past_key_values
            logits = o.logits[:, -1].float()
            if vocab_limit is not None:
                logits = logits[:, :vocab_limit]
            step = [0] * B
            for r in range(B):
                if not live[r]:
                    continue
                tok, lp = _sample(logits[r], temperature, top_p, gens[r])
                new[r].append(tok)
                lps[r].append(lp)
                step[r] = tok
                live[r] = tok not in turn_ends and len(new[r]) < budgets[r]
            x = torch.tensor(step, device=self.device)[:, None]
            mask = torch.cat([mask, mask.new_ones(B, 1)], dim=1)
            pos = pos[:, -1:] + 1
        return list(zip(new, lps))


def _sample(logits, temperature, top_p, g):
    """(token id, its log-prob under the distribution it was drawn from)."""
    if temperature == 0:
        return int(logits.argmax()), 0.0
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sp, si = probs.sort(descending=True)
        keep = sp.cumsum(0) - sp < top_p
        probs = torch.zeros_like(probs).scatter(0, si[keep], sp[keep])
        probs = probs / probs.sum()
    tok = int(torch.multinomial(probs, 1, generator=g))
    return tok, float(torch.log(probs[tok]))
