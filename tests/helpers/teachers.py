"""Teachers that stop: the random-init tiny teacher never emits its end-of-turn token, so generate mode's
"EOS step included" would never run on it.

A stopping teacher: one hidden dimension is raised in every token's input embedding except the generation
prompt's own tokens, and only the end-of-turn row of an untied head reads that dimension. Right after the
generation prompt the end-of-turn token is no likelier than before; once the teacher has written a token, it is
`kappa` logits times that dimension likelier. Measured on the tiny teacher's demo prompts (12 new tokens):
kappa 0.5 sampled at temperature 1 ends about half the completions, within 1-11 tokens; kappa 1.0 greedy ends
some at once and runs others to the budget.
"""
import torch

DIM, RAISE = 0, 4.0


def stopping_teacher(tok, out_dir, kappa, seed=0):
    """Save a stopping teacher for `tok` (ChatML) to out_dir; returns out_dir."""
    from kdcache.demo.models import make_model, save
    model = make_model(tok, "test", seed=seed)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    prompt = tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        head = emb.detach().clone()
        emb[:, DIM] += RAISE
        emb[prompt, DIM] -= RAISE
        head[:, DIM] = 0.0
        head[end, DIM] = kappa
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(head)
    save(model, tok, str(out_dir))
    return str(out_dir)
