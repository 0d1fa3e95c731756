"""Reference teacher backend: transformers forward, log_softmax over the full vocabulary, top-k.

Also the fallback where vLLM cannot run a model. Exact: the tail mass comes
from the full softmax.
"""
import numpy as np
import torch
from transformers import AutoModelForCausalLM

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class HFTeacher:
    name = "hf"

    def __init__(self, model_path, *, dtype="float32", device=None, trust_remote_code=False,
                 batch_tokens=8192, threads=None, **_):
        if threads:
            torch.set_num_threads(threads)
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        # dtype is always explicit: "auto" would silently run a float32 checkpoint in bf16.
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code).to(self.device).eval()
        self.vocab_size = self.model.config.vocab_size
        self.batch_tokens = batch_tokens
        self.softcap = getattr(self.model.config, "final_logit_softcapping", None)

    def _batches(self, seqs):
        """Index batches whose padded size stays under batch_tokens."""
        batch, longest = [], 0
        for i, s in enumerate(seqs):
            longest2 = max(longest, len(s))
            if batch and longest2 * (len(batch) + 1) > self.batch_tokens:
                yield batch
                batch, longest2 = [], len(s)
            batch.append(i)
            longest = longest2
        if batch:
            yield batch

    @torch.no_grad()
    def score(self, seqs, positions, k):
        """Top-k of P(x_{t+1} | x_<=t) at every t in positions[i] for each sequence i.

        Returns a list of (ids int32 [P,k], logprobs float32 [P,k], tail_mass float32 [P]).
        """
        out = [None] * len(seqs)
        for idx in self._batches(seqs):
            T = max(len(seqs[i]) for i in idx)
            ids = torch.zeros(len(idx), T, dtype=torch.long)
            mask = torch.zeros(len(idx), T, dtype=torch.long)
            for r, i in enumerate(idx):
                ids[r, :len(seqs[i])] = torch.tensor(seqs[i])
                mask[r, :len(seqs[i])] = 1
            hidden = self.model.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)
                                      ).last_hidden_state                     # (B, T, H)
            head = self.model.get_output_embeddings()
            for r, i in enumerate(idx):
                pos = torch.as_tensor(np.array(positions[i], dtype=np.int64), device=self.device)
                logits = head(hidden[r, pos]).float()                          # (P, V)
                if self.softcap:
                    logits = torch.tanh(logits / self.softcap) * self.softcap
                lp = torch.log_softmax(logits, dim=-1)
                top_lp, top_ids = lp.topk(k, dim=-1)                           # sorted descending
                top_lp64 = top_lp.double()
                tail = (1.0 - top_lp64.exp().sum(-1)).clamp(0.0, 1.0)
                out[i] = (top_ids.int().cpu().numpy(), top_lp.cpu().numpy().astype(np.float32),
                          tail.float().cpu().numpy())
        return out

    @torch.no_grad()
    def generate(self, prompts, *, max_new_tokens, temperature, top_p, seeds, eos_ids):
        """One sampled completion per prompt (per-prompt budget and seed). Returns [(ids, ended_with_eos)]."""
        results = []
        g = torch.Generator(device=self.device)
        for p, budget, seed in zip(prompts, max_new_tokens, seeds):
            g.manual_seed(int(seed))
            past, new = None, []
            x = torch.tensor([p], device=self.device)
            for _ in range(int(budget)):
                o = self.model(input_ids=x, past_key_values=past, use_cache=True)
                past = o.past_key_values
                logits = o.logits[0, -1].float()
                tok = _sample(logits, temperature, top_p, g)
                new.append(tok)
                if tok in eos_ids:
                    break
                x = torch.tensor([[tok]], device=self.device)
            results.append((new, bool(new) and new[-1] in eos_ids))
        return results


def _sample(logits, temperature, top_p, g):
    if temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sp, si = probs.sort(descending=True)
        keep = sp.cumsum(0) - sp < top_p
        probs = torch.zeros_like(probs).scatter(0, si[keep], sp[keep])
        probs = probs / probs.sum()
    return int(torch.multinomial(probs, 1, generator=g))
