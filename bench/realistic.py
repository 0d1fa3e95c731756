"""A realistic small teacher for the storage-fidelity benchmark (issue 13): real text, a real tokenizer, a trained LM.

    .venv/bin/python bench/realistic.py [--workdir bench/work/realistic] [--steps 2000 | --minutes M] [--chats 300]

What it builds (deterministic with the default step budget; --minutes trains for a wall time instead):
  - text: the Python standard library's own source (.py files under the directory of `os.__file__`; tests,
    idlelib, lib2to3, encodings tables and files over 256 KB left out), in sorted order up to --megabytes (8);
    every 10th file is held out;
  - tokenizer: a byte-level BPE (tokenizers; Qwen2 pre-tokenizer) of 6000 tokens, <|endoftext|>, <|im_start|>,
    <|im_end|> last (as Qwen), EOS <|im_end|>, a ChatML template, saved as a PreTrainedTokenizerFast;
  - teacher: a Qwen2ForCausalLM from config (hidden 128, 3 layers, 4 heads of 32, 2 KV heads, MLP 384, tied
    embeddings, float32), trained from scratch on CPU (AdamW, warmup + cosine, batch 8 x 256 tokens), 70%
    windows of plain source and 30% of ChatML chats cut from the training files, so it knows the template and
    ends turns with <|im_end|>; its generation_config stops on <|im_end|>;
  - chats.jsonl: --chats ChatML chats cut from the HELD-OUT files (user: ~100-300 chars of source, assistant:
    the ~200-600 chars that follow, cut at line ends), the data the fidelity benchmark runs the teacher on;
  - report.json: perplexity and mean next-token entropy (nats, float32) over the held-out assistant tokens,
    exactly the positions kdcache caches (pipeline.chat.chat_spans: the answer through <|im_end|>), and how
    often a sampled answer ends its turn.

`build(workdir, minutes, chats)` reuses a finished build (the DONE marker records its settings).

Measured (defaults, Python 3.11.7's stdlib, 2 CPU cores, 2026-11-30): 402 files (8.0 MB; 40 held out), 1.88 M
training text tokens + 1.48 M chat tokens; 1.36 M parameters; 2000 steps (4.1 M tokens) at ~0.25 s/step on free
cores, so ~8-9 min (this run took 28 min: another job shared the cores). On the 300 held-out chats' 33843
assistant tokens: perplexity 61.4 (NLL 4.12 nats), mean entropy 4.01 nats, mean top-1 probability 0.31,
p(<|im_end|>) where due 0.20 on average; 38% of 32 sampled answers end their turn within 300 tokens (greedy
answers loop). A 4.6 M model (hidden 256, 4 layers) given 5 minutes (240 steps) reached only entropy 5.8.
"""
import argparse
import json
import math
import os
import random
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from kdcache.demo.tokenizer import CHATML, SPECIALS  # noqa: E402  (the demo's ChatML template and specials)

# transformers' Qwen2Tokenizer PRETOKENIZE_REGEX (as tests/helpers/families.py)
QWEN2_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
               r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
# stdlib folders that are tests, generated tables or third-party code rather than ordinary source
SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "idlelib", "lib2to3", "ensurepip",
             "turtledemo", "encodings", "pydoc_data", "__pycache__"}
MAX_FILE = 256 * 1024        # larger files are generated data (e.g. unicode tables)
HELD_OUT_EVERY = 10
SEQ, BATCH, PEAK_LR = 256, 8, 6e-3
CHAT_SHARE = 0.3
DEFAULTS = dict(minutes=None, steps=2000, chats=300, megabytes=8.0, vocab=6000, seed=0)


# ---------------------------------------------------------------------------------------------------------------
# Text
# ---------------------------------------------------------------------------------------------------------------
def stdlib_files(megabytes):
    """[(relative path, text)] of stdlib .py files, sorted by path, until the byte budget is spent."""
    root = os.path.dirname(os.__file__)
    paths = []
    for d, dirs, names in os.walk(root):
        dirs[:] = [x for x in dirs if x not in SKIP_DIRS and not x.startswith("config-")]
        paths += [os.path.join(d, n) for n in names if n.endswith(".py")]
    out, used, budget = [], 0, int(megabytes * 1e6)
    for p in sorted(paths, key=lambda p: os.path.relpath(p, root)):
        if os.path.getsize(p) > MAX_FILE:
            continue
        try:
            with open(p, encoding="utf-8") as f:
                text = f.read()
        except (UnicodeDecodeError, OSError):
            continue
        out.append((os.path.relpath(p, root), text))
        used += len(text.encode())
        if used >= budget:
            break
    return out


def split_files(files):
    """(train texts, held-out texts): every HELD_OUT_EVERY-th file is held out."""
    train = [t for i, (_, t) in enumerate(files) if i % HELD_OUT_EVERY != HELD_OUT_EVERY - 1]
    held = [t for i, (_, t) in enumerate(files) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1]
    return train, held


def _line_end(text, pos, limit):
    """The end of the line at pos (after its newline); if that is past limit, the last line end before limit
    (or limit itself when there is none)."""
    nl = text.find("\n", pos)
    end = nl + 1 if nl >= 0 else len(text)
    if end <= limit:
        return end
    back = text.rfind("\n", pos, limit)
    return back + 1 if back >= 0 else limit


def cut_chats(texts, seed):
    """ChatML chats cut in order from each text: user ~100-300 chars, assistant the ~200-600 chars that follow.
    Cuts end at line ends; a random gap of 0-400 chars separates chats."""
    rng = random.Random(seed)
    chats = []
    for text in texts:
        pos = 0
        while True:
            u_end = _line_end(text, pos + rng.randint(100, 300), pos + 300)
            a_end = _line_end(text, u_end + rng.randint(200, 600), u_end + 600)
            if a_end >= len(text):
                break
            user, answer = text[pos:u_end].strip("\n"), text[u_end:a_end].lstrip("\n").rstrip()
            if user.strip() and answer.strip():
                chats.append({"messages": [{"role": "user", "content": user},
                                           {"role": "assistant", "content": answer}]})
            pos = text.find("\n", a_end + rng.randint(0, 400)) + 1
            if pos <= 0:
                break
    return chats


def pick_evenly(items, n):
    """n items spread evenly over the list (all of them if there are fewer)."""
    if len(items) <= n:
        return list(items)
    return [items[int(i * len(items) / n)] for i in range(n)]


# ---------------------------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------------------------
def train_tokenizer(texts, out_dir, vocab):
    """A byte-level BPE of `vocab` tokens (specials last, as Qwen) saved as a PreTrainedTokenizerFast."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab - len(SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                 extra_special_tokens=["<|im_start|>"], clean_up_tokenization_spaces=False)
    hf.chat_template = CHATML
    hf.save_pretrained(out_dir)
    return AutoTokenizer.from_pretrained(out_dir)


def token_stream(tok, texts):
    """All texts' ids in one int32 array, each followed by <|endoftext|>."""
    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    ids = tok(list(texts), add_special_tokens=False)["input_ids"]
    return np.fromiter((t for seq in ids for t in seq + [eot]), dtype=np.int32)


def chat_stream(tok, chats):
    """The chats rendered with the template, concatenated, as one int32 array."""
    rendered = [tok.apply_chat_template(c["messages"], tokenize=False) for c in chats]
    ids = tok(rendered, add_special_tokens=False)["input_ids"]
    return np.fromiter((t for seq in ids for t in seq), dtype=np.int32)


# ---------------------------------------------------------------------------------------------------------------
# Model and training
# ---------------------------------------------------------------------------------------------------------------
# Small on purpose: a CPU step costs ~1/3 of a 4.6 M model's (hidden 256, 4 layers), which after 5 minutes was
# still at held-out entropy 5.8 nats; this one reaches 4.0 in 2000 steps. head_dim 32: vLLM's CPU backend needs >= 32.
MODEL = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2)


def make_model(tok, seed, **sizes):
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM
    ids = tok.convert_tokens_to_ids
    cfg = Qwen2Config(vocab_size=len(tok), **{**MODEL, **sizes}, head_dim=32, max_position_embeddings=1024,
                      rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=ids("<|endoftext|>"),
                      eos_token_id=ids("<|im_end|>"), pad_token_id=ids("<|endoftext|>"), dtype="float32")
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg)
    model.generation_config = GenerationConfig(bos_token_id=ids("<|endoftext|>"), eos_token_id=ids("<|im_end|>"),
                                               pad_token_id=ids("<|endoftext|>"))
    return model


def lr_at(frac, peak, warmup_frac=0.05):
    """Linear warmup, then cosine decay to 10% of peak; frac is the share of the budget spent."""
    if frac < warmup_frac:
        return peak * frac / warmup_frac
    t = min(1.0, (frac - warmup_frac) / (1 - warmup_frac))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def sample_batch(rng, text_ids, chat_ids, batch):
    """batch windows of SEQ tokens: each from the chat stream with probability CHAT_SHARE, else plain text."""
    rows = []
    for _ in range(batch):
        src = chat_ids if rng.random() < CHAT_SHARE else text_ids
        start = rng.integers(0, len(src) - SEQ)
        rows.append(src[start:start + SEQ])
    return np.stack(rows).astype(np.int64)


def train(model, text_ids, chat_ids, *, minutes=None, steps=None, seed=0, batch=BATCH, peak_lr=PEAK_LR,
          log_every=100):
    """Train for `minutes` of wall time if given, else `steps` steps (the LR schedule follows that budget);
    returns (steps taken, seconds)."""
    import torch
    torch.set_num_threads(2)
    rng = np.random.default_rng(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=peak_lr, betas=(0.9, 0.95), weight_decay=0.1)
    model.train()
    t0, step, recent = time.time(), 0, []

    def spent():
        return (time.time() - t0) / (minutes * 60) if minutes else step / steps

    while (frac := spent()) < 1:
        for g in opt.param_groups:
            g["lr"] = lr_at(frac, peak_lr)
        x = torch.from_numpy(sample_batch(rng, text_ids, chat_ids, batch))
        loss = model(input_ids=x, labels=x).loss   # HF shifts the labels itself
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step, recent = step + 1, recent + [loss.item()]
        if step % log_every == 0:
            print(f"  step {step:5d}  {time.time() - t0:6.0f}s  lr {opt.param_groups[0]['lr']:.2e}  "
                  f"loss {np.mean(recent):.3f}", flush=True)
            recent = []
    model.eval()
    return step, time.time() - t0


# ---------------------------------------------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------------------------------------------
def evaluate(model, tok, chats, n_generate=32):
    """Perplexity and mean next-token entropy (nats) over the assistant tokens kdcache would cache, the mean
    probability of <|im_end|> where it is due, and the share of sampled answers that end their turn."""
    import torch

    from kdcache.common.chat import chat_spans
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    nll, ent, top1, n, p_eos = 0.0, 0.0, 0.0, 0, []
    with torch.no_grad():
        for c in chats:
            ids, spans = chat_spans(tok, c["messages"], {eos})
            logits = model(input_ids=torch.tensor([ids])).logits[0].float()
            logp = torch.log_softmax(logits, dim=-1)
            for a, b in spans:
                lp, tgt = logp[a - 1:b - 1], torch.tensor(ids[a:b])
                nll -= lp.gather(1, tgt[:, None]).sum().item()
                ent -= (lp.exp() * lp).sum().item()
                top1 += lp.max(dim=-1).values.exp().sum().item()
                n += b - a
                p_eos.append(lp[-1, eos].exp().item())
    return {"assistant_tokens": n, "perplexity": math.exp(nll / n), "nll_nats": nll / n,
            "entropy_nats": ent / n, "mean_top1_prob": top1 / n, "mean_p_end_of_turn_when_due": float(np.mean(p_eos)),
            "sampled_ends_turn": stop_rate(model, tok, chats[:n_generate])}


def stop_rate(model, tok, chats, max_new=300, seed=0):
    """Share of chats whose sampled answer (temperature 1, from the user turn) emits <|im_end|> within max_new
    tokens. Sampled, not greedy: greedy decoding of a model this small falls into repetition loops."""
    import torch
    torch.manual_seed(seed)
    tok.padding_side = "left"
    prompts = [tok.apply_chat_template(c["messages"][:1], tokenize=False, add_generation_prompt=True) for c in chats]
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_new, do_sample=True, temperature=1.0, top_k=0)
    new = out[:, enc["input_ids"].shape[1]:]
    return float((new == tok.convert_tokens_to_ids("<|im_end|>")).any(dim=1).float().mean())


# ---------------------------------------------------------------------------------------------------------------
# Build
# ---------------------------------------------------------------------------------------------------------------
def _write_jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def build(workdir="bench/work/realistic", minutes=DEFAULTS["minutes"], chats=DEFAULTS["chats"],
          steps=DEFAULTS["steps"], megabytes=DEFAULTS["megabytes"], vocab=DEFAULTS["vocab"], seed=DEFAULTS["seed"]):
    """Build (or reuse) the teacher, the held-out chats and the report; returns dict(teacher, chats, report).
    Training runs `steps` steps, or `minutes` of wall time when minutes is given."""
    workdir = os.path.abspath(workdir if os.path.isabs(workdir) else os.path.join(ROOT, workdir))
    settings = dict(minutes=minutes, steps=None if minutes else steps, chats=chats, megabytes=megabytes,
                    vocab=vocab, seed=seed, python=sys.version.split()[0])
    paths = dict(teacher=os.path.join(workdir, "teacher"), chats=os.path.join(workdir, "chats.jsonl"))
    marker, report_path = os.path.join(workdir, "DONE"), os.path.join(workdir, "report.json")
    if os.path.exists(marker):
        with open(marker) as f:
            if json.load(f) == settings:
                with open(report_path) as g:
                    return dict(paths, report=json.load(g))
        print(f"{workdir}: built with other settings; rebuilding", flush=True)
        os.remove(marker)
    os.makedirs(paths["teacher"], exist_ok=True)
    report = _build(paths, settings)
    with open(report_path, "w") as f:
        json.dump(report, f, indent=2)
    with open(marker, "w") as f:
        json.dump(settings, f)
    return dict(paths, report=report)


def _build(paths, s):
    t0 = time.time()
    files = stdlib_files(s["megabytes"])
    train_texts, held_texts = split_files(files)
    print(f"text: {len(files)} stdlib files, {sum(len(t) for _, t in files) / 1e6:.1f} M chars "
          f"({len(held_texts)} files held out)", flush=True)
    tok = train_tokenizer(train_texts, paths["teacher"], s["vocab"])
    held_chats = pick_evenly(cut_chats(held_texts, s["seed"]), s["chats"])
    _write_jsonl(paths["chats"], held_chats)
    text_ids = token_stream(tok, train_texts)
    chat_ids = chat_stream(tok, cut_chats(train_texts, s["seed"] + 1))
    print(f"tokenizer: {len(tok)} tokens; train {len(text_ids) / 1e6:.2f} M text + {len(chat_ids) / 1e6:.2f} M chat "
          f"tokens; {len(held_chats)} held-out chats  ({time.time() - t0:.0f}s)", flush=True)
    model = make_model(tok, s["seed"])
    n_params = sum(p.numel() for p in model.parameters())
    budget = f"{s['minutes']} min" if s["minutes"] else f"{s['steps']} steps"
    print(f"teacher: Qwen2, {n_params / 1e6:.2f} M parameters; training for {budget}", flush=True)
    steps, secs = train(model, text_ids, chat_ids, minutes=s["minutes"], steps=s["steps"], seed=s["seed"])
    model.save_pretrained(paths["teacher"])
    tok.save_pretrained(paths["teacher"])
    report = dict(parameters=n_params, vocab=len(tok), train_steps=steps, train_seconds=round(secs, 1),
                  train_tokens=steps * BATCH * SEQ, files=len(files), held_out_files=len(held_texts),
                  chats=len(held_chats), **evaluate(model, tok, held_chats), settings=s)
    report["total_seconds"] = round(time.time() - t0, 1)
    return report


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default="bench/work/realistic")
    ap.add_argument("--steps", type=int, default=DEFAULTS["steps"], help="training steps (batch 8 x 256 tokens)")
    ap.add_argument("--minutes", type=float, default=DEFAULTS["minutes"],
                    help="train for this wall time instead of --steps")
    ap.add_argument("--chats", type=int, default=DEFAULTS["chats"], help="held-out chats to write")
    ap.add_argument("--megabytes", type=float, default=DEFAULTS["megabytes"], help="stdlib text budget")
    a = ap.parse_args()
    out = build(a.workdir, minutes=a.minutes, chats=a.chats, steps=a.steps, megabytes=a.megabytes)
    r = out["report"]
    print(f"teacher {out['teacher']}\nchats   {out['chats']}\n"
          f"held-out assistant tokens {r['assistant_tokens']}: perplexity {r['perplexity']:.2f}, "
          f"entropy {r['entropy_nats']:.3f} nats, mean top-1 p {r['mean_top1_prob']:.3f}, "
          f"sampled answers ending their turn {r['sampled_ends_turn']:.0%}")


if __name__ == "__main__":
    main()
