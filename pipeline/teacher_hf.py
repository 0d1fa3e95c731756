"""Reference teacher backend: transformers forward, log_softmax over the full vocabulary, top-k.

Also the fallback where vLLM cannot run a model. Meets pipeline.teacher.Teacher.
"""
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
                 batch_tokens=8192, threads=None, **_):
        if threads:
            torch.set_num_threads(threads)
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        # dtype is always explicit: "auto" would silently run a float32 checkpoint in bf16.
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code).to(self.device).eval()
        self.batch_tokens = batch_tokens
        # Positions scored per log_softmax: ~96 MiB of float32 [rows, V] at a time, so a 32k-token sample at a
        # 152k vocabulary needs 128 x V floats, not 32k x V (19.5 GB).
        vocab = self.model.get_output_embeddings().weight.shape[0]
        self.rows = max(16, (96 << 20) // (4 * vocab))
        self.transform = logit_transform(self.model.config)   # soft-capping, scaling: the model's own logits
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

    @torch.no_grad()
    def _score(self, seqs, positions, k, sample, seeds):
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
                    if sample:
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
        it was drawn from (temperature and top-p applied; 0 for greedy decoding)."""
        results = []
        g = torch.Generator(device=self.device)
        for p, budget, seed in zip(prompts, max_new_tokens, seeds):
            g.manual_seed(int(seed))
            past, new, lps = None, [], []
            x = torch.tensor([np.asarray(p).tolist()], device=self.device)
            for _ in range(int(budget)):
                o = self.model(input_ids=x, past_key_values=past, use_cache=True)
                past = o.past_key_values
                logits = o.logits[0, -1].float()
                if vocab_limit is not None:
                    logits = logits[:vocab_limit]
                tok, lp = _sample(logits, temperature, top_p, g)
                new.append(tok)
                lps.append(lp)
                if tok in turn_ends:
                    break
                x = torch.tensor([[tok]], device=self.device)
            ended = bool(new) and new[-1] in turn_ends
            results.append((new, ended, np.array(lps, np.float32)) if logprobs else (new, ended))
        return results


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
