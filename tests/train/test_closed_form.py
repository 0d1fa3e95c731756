"""The fused loss's closed-form gradients (train/losses.py _chunk) against autograd through the reference loss
(kd_loss_from_logits on the dense [N, V] logits), in every setting the loss supports, and each broken on purpose."""
from types import SimpleNamespace

import pytest
import torch

from kdcache.common.heads import logit_transform
from kdcache.train import losses
from kdcache.train.losses import LossConfig, chunked_kd_loss, kd_loss_from_logits

N, H, V, K = 13, 8, 37, 5


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| over max |want|: the gradient's error relative to its own scale."""
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def case(seed, *, pad=False, outside=False, cover=False, masked_row=False, no_target=False, scale=2.0):
    """Hidden states, head, and a teacher top-k of a random teacher, with the shapes users' caches have."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g) * scale
    weight = torch.randn(V, H, generator=g) / H**0.5
    bias = torch.randn(V, generator=g) * 0.3
    t = torch.log_softmax(torch.randn(N, V, generator=g) * scale, -1)
    lp, ids = t.topk(K, -1)
    tail = (1 - lp.double().exp().sum(-1)).clamp(0, 1).float()
    ids, lp = ids.clone(), lp.clone()
    if pad:                               # ragged rows: -1 in the middle and at the end
        ids[2, 1], lp[2, 1] = -1, float("-inf")
        ids[5, -2:], lp[5, -2:] = -1, float("-inf")
    if outside:                           # teacher ids past the student's rows: collate's rule, mass to the tail
        tail[3] += lp[3, -1].exp()
        tail[7] += lp[7, 0].exp()
        ids[3, -1], ids[7, 0] = -1, -1
    if masked_row:                        # a row whose every entry is padding
        ids[4], lp[4] = -1, float("-inf")
    if cover:                             # one row whose ids cover the whole vocabulary: no tail bucket
        ids = torch.cat([ids, torch.full((N, V - K), -1)], 1)
        lp = torch.cat([lp, torch.full((N, V - K), float("-inf"))], 1)
        ids[0], lp[0], tail[0] = t[0].argsort(descending=True), t[0].sort(descending=True).values, 0.0
    targets = ids[:, 0].clamp_min(0).clone()
    targets[1] = (targets[1] + 1) % V
    if no_target:
        targets[9] = -1
    return hidden, weight, bias, ids, lp.float(), tail, targets



def sampled_case(seed, stratified):
    """A sampled cache's entries: exact top entries (stratified) then drawn ids with their estimator weights."""
    g = torch.Generator().manual_seed(seed)
    hidden, weight, bias = torch.randn(N, H, generator=g) * 2, torch.randn(V, H, generator=g) / H**0.5, None
    t = torch.log_softmax(torch.randn(N, V, generator=g) * 2, -1)
    top = 2 if stratified else 0
    lp_sorted, ids_sorted = t.topk(top, -1) if top else (torch.zeros(N, 0), torch.zeros(N, 0, dtype=torch.long))
    rest = t.clone()
    if top:
        rest.scatter_(1, ids_sorted, float("-inf"))
    draws = 6
    drawn = torch.multinomial(rest.softmax(-1), draws, replacement=True, generator=g)
    ids_l, lp_l, w_l = [], [], []
    for n in range(N):
        uniq, count = drawn[n].unique(return_counts=True)
        tail_mass = 1 - float(lp_sorted[n].exp().sum()) if top else 1.0
        row_ids = torch.cat([ids_sorted[n], uniq])
        row_w = torch.cat([lp_sorted[n].exp(), tail_mass * count.float() / draws])
        pad = top + draws - len(row_ids)
        ids_l.append(torch.cat([row_ids, torch.full((pad,), -1)]))
        lp_l.append(torch.cat([t[n, row_ids], torch.full((pad,), float("-inf"))]))
        w_l.append(torch.cat([row_w, torch.zeros(pad)]))
    ids, lp, w = torch.stack(ids_l), torch.stack(lp_l), torch.stack(w_l)
    return hidden, weight, bias, ids, lp, torch.zeros(N), ids[:, 0].clamp_min(0), w


TRANSFORMS = {
    None: None,
    "softcap": logit_transform(SimpleNamespace(final_logit_softcapping=3.0)),          # Gemma 2 (cap 30 / 50 there)
    "cohere": logit_transform(SimpleNamespace(logit_scale=0.25)),
    "granite": logit_transform(SimpleNamespace(logits_scaling=4.0)),
    "scale+cap": logit_transform(SimpleNamespace(logit_scale=2.0, final_logit_softcapping=5.0)),
    "own": lambda z: z * 0.7 + torch.sin(z),             # a user's transform with no closed form: autograd VJP
}

# (name, LossConfig kwargs, case kwargs, transform, sampled: None / "pure" / "stratified", token-rkl behaviour)
SETTINGS = []
for beta in (0.0, 0.25, 0.5, 0.9, 1.0):
    for tail in ("tail", "renorm"):
        for tau in (1.0, 2.0):
            SETTINGS.append((f"gkd-b{beta}-{tail}-t{tau}", dict(beta=beta, tail=tail, temperature=tau), {}, None, None))
SETTINGS += [
    ("sft-term", dict(beta=0.5, sft_alpha=0.7), {}, None, None),
    ("sft-term-renorm-t2", dict(beta=0.0, tail="renorm", sft_alpha=0.3, temperature=2.0), {}, None, None),
    ("padded", dict(beta=0.5), dict(pad=True), None, None),
    ("padded-renorm", dict(beta=1.0, tail="renorm"), dict(pad=True), None, None),
    ("outside-vocab", dict(beta=0.0), dict(outside=True), None, None),
    ("outside-vocab-t2", dict(beta=0.5, temperature=2.0), dict(outside=True, pad=True), None, None),
    ("masked-row", dict(beta=0.5, sft_alpha=0.2), dict(masked_row=True), None, None),
    ("masked-row-renorm", dict(beta=0.0, tail="renorm"), dict(masked_row=True), None, None),
    ("covers-vocab", dict(beta=0.5), dict(cover=True), None, None),
    ("covers-vocab-rkl", dict(beta=1.0, sft_alpha=0.1), dict(cover=True), None, None),
    ("no-target", dict(beta=0.0, sft_alpha=1.0), dict(no_target=True), None, None),
    ("peaked-student", dict(beta=0.0), dict(scale=12.0), None, None),
    ("peaked-student-rkl", dict(beta=1.0, temperature=2.0), dict(scale=12.0), None, None),
    ("softcap", dict(beta=0.5), {}, "softcap", None),
    ("softcap-t2", dict(beta=0.0, temperature=2.0, sft_alpha=0.5), dict(scale=6.0), "softcap", None),
    ("softcap-renorm", dict(beta=1.0, tail="renorm"), {}, "softcap", None),
    ("cohere", dict(beta=0.5), {}, "cohere", None),
    ("granite-t2", dict(beta=0.0, temperature=2.0), {}, "granite", None),
    ("scale+cap", dict(beta=0.9, sft_alpha=0.4), dict(pad=True), "scale+cap", None),
    ("own-transform", dict(beta=0.5), {}, "own", None),
    ("sampled-pure", dict(), {}, None, "pure"),
    ("sampled-pure-t2", dict(temperature=2.0), {}, None, "pure"),
    ("sampled-stratified", dict(sft_alpha=0.3), {}, None, "stratified"),
    ("sampled-stratified-t2", dict(temperature=2.0), {}, None, "stratified"),
    ("sampled-t2-softcap", dict(temperature=2.0), {}, "softcap", "stratified"),
    ("token-rkl", dict(objective="token-rkl"), {}, None, "rkl-self"),
    ("token-rkl-importance", dict(objective="token-rkl"), {}, None, "rkl-behaviour"),
    ("token-rkl-sft", dict(objective="token-rkl", sft_alpha=0.5), {}, None, "rkl-behaviour"),
    ("token-rkl-no-importance", dict(objective="token-rkl", importance=False), {}, None, "rkl-behaviour"),
    ("sft-objective", dict(objective="sft"), {}, None, None),
    ("sft-objective-softcap", dict(objective="sft"), dict(no_target=True), "softcap", None),
]


def inputs(name, case_kw, sampled, seed):
    extra = {}
    if sampled in ("pure", "stratified"):
        hidden, weight, bias, ids, lp, tail, targets, w = sampled_case(seed, sampled == "stratified")
        extra["topk_weights"] = w
    else:
        hidden, weight, bias, ids, lp, tail, targets = case(seed, **case_kw)
    if sampled and sampled.startswith("rkl"):
        g = torch.Generator().manual_seed(seed + 1)
        extra["target_logprobs"] = -torch.rand(N, generator=g) * 3
        if sampled == "rkl-behaviour":
            extra["behavior_logprobs"] = -torch.rand(N, generator=g) * 3
    if "peaked" in name:
        bias = None
    return hidden, weight, bias, ids, lp, tail, targets, extra


def grads_of(loss, leaves):
    return torch.autograd.grad(loss, leaves)


def compare(name, cfg_kw, case_kw, transform_name, sampled, chunk, seed=0):
    """(max relative error over d(hidden), d(weight), d(bias); the loss values' difference)."""
    hidden, weight, bias, ids, lp, tail, targets, extra = inputs(name, case_kw, sampled, seed)
    transform = TRANSFORMS[transform_name]
    leaves = [hidden.requires_grad_(), weight.requires_grad_()] + ([bias.requires_grad_()] if bias is not None
                                                                   else [])
    z = hidden @ weight.T + (bias if bias is not None else 0)
    want, want_parts = kd_loss_from_logits(transform(z) if transform else z, ids, lp, tail, targets,
                                           LossConfig(**cfg_kw), **extra)
    got, got_parts = chunked_kd_loss(hidden, weight, ids, lp, tail, targets, LossConfig(chunk_size=chunk, **cfg_kw),
                                     lm_head_bias=bias, logit_transform=transform, **extra)
    errors = [relative_error(a, b) for a, b in zip(grads_of(got, leaves), grads_of(want, leaves), strict=True)]
    value = abs(float(got) - float(want)) / max(1.0, abs(float(want)))
    assert got_parts["kd"] == pytest.approx(want_parts["kd"], rel=1e-5, abs=1e-5)
    assert got_parts["sft"] == pytest.approx(want_parts["sft"], rel=1e-5, abs=1e-5)
    return max(errors), value


@pytest.mark.parametrize("chunk", [4, 64])
@pytest.mark.parametrize("setting", SETTINGS, ids=[s[0] for s in SETTINGS])
def test_closed_form_equals_autograd(setting, chunk):
    name, cfg_kw, case_kw, transform_name, sampled = setting
    err, value = compare(name, cfg_kw, case_kw, transform_name, sampled, chunk)
    assert err <= 1e-5, f"{name}: closed-form gradient off by {err:.3g} (relative)"
    assert value <= 1e-5


def test_there_are_at_least_40_settings():
    assert len(SETTINGS) >= 40


@pytest.mark.parametrize("beta", [0.0, 0.5])
def test_a_student_with_a_tiny_rest_takes_the_log_space_path(beta):
    # Two rows whose student puts ~e^-150 outside the top-k: the float32 sum of the rest underflows, and the
    # chunk must take its tail (and the tail's gradient) in log space. The reference does the same densely.
    # Forward KL (beta 0) is where it shows: its tail gradient is -T_tail however small the student's tail is.
    hidden, weight, bias, ids, lp, tail, targets = case(3)
    z_bias = bias.clone()
    rows = (1, 6)
    hidden = hidden.clone()
    for row in rows:
        hidden[row] = 0.0
    # Row-specific logits need a per-row offset: fold it into an extra hidden unit, one head column per row.
    extra_h = torch.zeros(N, len(rows))
    extra_w = torch.zeros(V, len(rows))
    for j, row in enumerate(rows):
        extra_h[row, j] = 1.0
        extra_w[ids[row][ids[row] >= 0], j] = 150.0
    hidden = torch.cat([hidden, extra_h], 1).requires_grad_()
    weight = torch.cat([weight, extra_w], 1).requires_grad_()
    cfg = LossConfig(beta=beta, chunk_size=8)
    z = hidden @ weight.T + z_bias
    logp = torch.log_softmax(z.detach(), -1)
    rest = logp.scatter(1, ids.clamp_min(0), float("-inf")).logsumexp(-1)
    assert float(rest[1]) < losses.TINY_REST and float(rest[6]) < losses.TINY_REST      # the case does land
    want, _ = kd_loss_from_logits(z, ids, lp, tail, targets, cfg)
    got, _ = chunked_kd_loss(hidden, weight, ids, lp, tail, targets, cfg, lm_head_bias=z_bias)
    for a, b in zip(torch.autograd.grad(got, [hidden, weight]), torch.autograd.grad(want, [hidden, weight])):
        assert relative_error(a, b) <= 1e-5
    assert float(got) == pytest.approx(float(want), rel=1e-5)


def test_no_grad_gives_the_same_values():
    hidden, weight, bias, ids, lp, tail, targets = case(4, pad=True)
    cfg = LossConfig(beta=0.5, sft_alpha=0.5, chunk_size=4)
    with torch.no_grad():
        quiet, quiet_parts = chunked_kd_loss(hidden, weight, ids, lp, tail, targets, cfg, lm_head_bias=bias)
    loud, loud_parts = chunked_kd_loss(hidden.requires_grad_(), weight, ids, lp, tail, targets, cfg,
                                       lm_head_bias=bias)
    assert float(quiet) == pytest.approx(float(loud), rel=1e-6) and quiet_parts == loud_parts


def test_the_autograd_chunk_agrees_too():
    # closed_form=False (bench/train_step.py's "old" column) is the same loss through autograd per chunk.
    for name, cfg_kw, case_kw, transform_name, sampled in SETTINGS[::5]:
        hidden, weight, bias, ids, lp, tail, targets, extra = inputs(name, case_kw, sampled, 0)
        transform = TRANSFORMS[transform_name]
        leaves = [hidden.requires_grad_(), weight.requires_grad_()]
        cfg = LossConfig(chunk_size=5, **cfg_kw)
        a, _ = chunked_kd_loss(hidden, weight, ids, lp, tail, targets, cfg, logit_transform=transform, **extra)
        b, _ = chunked_kd_loss(hidden, weight, ids, lp, tail, targets, cfg, logit_transform=transform,
                               closed_form=False, **extra)
        for x, y in zip(grads_of(a, leaves), grads_of(b, leaves)):
            assert relative_error(x, y) <= 1e-5, name


# ---------------------------------------------------------------- broken on purpose, the comparison fails

def worst(settings, chunk=64):
    return max(compare(*s, chunk)[0] for s in settings)


def pick(*names):
    return [s for s in SETTINGS if s[0] in names]


def test_a_dropped_tail_correction_is_caught(monkeypatch):
    tail_settings = pick("gkd-b0.0-tail-t1.0", "gkd-b0.5-tail-t2.0", "softcap")
    assert worst(tail_settings) <= 1e-5
    monkeypatch.setattr(losses, "_rest_coef", lambda g_tail, rest, fast: torch.zeros_like(rest))
    assert worst(tail_settings) > 1e-2


def test_a_wrong_one_over_tau_is_caught(monkeypatch):
    tau_settings = pick("sampled-pure-t2", "sampled-stratified-t2")
    assert worst(tau_settings) <= 1e-5
    real = losses._tempered_grad
    monkeypatch.setattr(losses, "_tempered_grad", lambda q, q_total, g, cols, tau: real(q, q_total, g, cols, 1.0))
    assert worst(tau_settings) > 1e-2


def test_a_missing_softcap_derivative_is_caught(monkeypatch):
    cap_settings = pick("softcap", "softcap-t2", "scale+cap")
    assert worst(cap_settings) <= 1e-5
    for name in ("softcap", "scale+cap"):
        t = TRANSFORMS[name]
        factor = 2.0 if name == "scale+cap" else 1.0          # keep the scale, drop only the cap's 1 - (z/cap)^2
        monkeypatch.setattr(t, "grad_in_place", lambda z, dz, f=factor: dz.mul_(f))
    assert worst(cap_settings) > 1e-2


# ---------------------------------------------------------------- the values are the field's: TRL's GKD loss

@pytest.mark.parametrize("beta,tau", [(0.0, 1.0), (0.5, 1.0), (1.0, 1.0), (0.3, 2.0), (0.9, 0.7)])
def test_the_fused_loss_is_trls_generalized_jsd_where_the_cache_holds_every_id(beta, tau, monkeypatch):
    # A cache whose ids cover the vocabulary has one bucket per token, so the bucket GKD is the full-vocabulary
    # GKD that TRL's GKDTrainer computes online (TRL leaves out the tau^2 factor: kdcache's is Hinton's).
    # Both the value and the gradient of the fused, closed-form path must match it.
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    gkd_trainer = pytest.importorskip("trl.experimental.gkd.gkd_trainer")
    g = torch.Generator().manual_seed(11)
    student = torch.randn(N, V, generator=g) * 2
    teacher = torch.randn(N, V, generator=g) * 2
    t_lp = torch.log_softmax(teacher, -1)
    lp, ids = t_lp.sort(-1, descending=True)
    targets = torch.randint(0, V, (N,), generator=g)
    hidden = student.clone().requires_grad_()
    got, _ = chunked_kd_loss(hidden, torch.eye(V), ids, lp, torch.zeros(N), targets,
                             LossConfig(beta=beta, temperature=tau, chunk_size=4))      # hidden @ I.T = logits
    (d_got,) = torch.autograd.grad(got, hidden)
    s = student.clone().requires_grad_()
    want = gkd_trainer.GKDTrainer.generalized_jsd_loss(s[None], teacher[None], beta=beta, temperature=tau,
                                                       reduction="sum") * tau**2
    (d_want,) = torch.autograd.grad(want, s)
    assert float(got) == pytest.approx(float(want), rel=1e-5)
    assert relative_error(d_got, d_want) <= 1e-5


# ---------------------------------------------------------------- the default chunk's memory

@pytest.mark.parametrize("setting", ["gkd-b0.5-tail-t1.0", "scale+cap", "sampled-stratified-t2", "sft-objective"])
def test_the_default_chunk_holds_at_most_four_blocks(setting):
    # --loss-chunk 0 is 512 rows, sized so that at most four [512, V] float32 blocks (0.125x the dense logits of a
    # micro-batch of 8 x 2,048) are alive at once, in the forward and backward together; autograd's chunk held
    # more (the contrast shows the measurement can fail).
    from kdcache.train.losses import default_chunk
    from tests.train.test_losses import LiveVocabTensors
    n, v = 1100, 3000
    name, cfg_kw, case_kw, transform_name, sampled = next(s for s in SETTINGS if s[0] == setting)
    g = torch.Generator().manual_seed(5)
    hidden, weight = torch.randn(n, H, generator=g, requires_grad=True), torch.randn(v, H, generator=g) / H**0.5
    weight.requires_grad_()
    lp, ids = torch.log_softmax(torch.randn(n, v, generator=g) * 2, -1).topk(K, -1)
    extra = {"topk_weights": lp.exp() / lp.exp().sum(-1, keepdim=True)} if sampled else {}
    tail = torch.zeros(n) if sampled else (1 - lp.exp().sum(-1)).clamp(0, 1)
    targets = ids[:, 0].clone()
    chunk = default_chunk(v)
    peaks = {}
    for closed in (True, False):
        cfg = LossConfig(chunk_size=chunk, **cfg_kw)
        with LiveVocabTensors(v, skip=[weight]) as mode:
            loss, _ = chunked_kd_loss(hidden, weight, ids, lp, tail, targets, cfg, closed_form=closed,
                                      logit_transform=TRANSFORMS[transform_name], **extra)
            loss.backward()
        peaks[closed] = mode.peak / (chunk * v)
    assert chunk == 512 and peaks[True] <= 4.0, peaks
    assert peaks[False] > peaks[True], peaks


def test_a_frozen_head_gets_no_gradient_and_the_hidden_states_the_same():
    hidden, weight, bias, ids, lp, tail, targets = case(6, pad=True)
    cfg = LossConfig(beta=0.5, sft_alpha=0.2, chunk_size=4)
    h1, h2 = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    w_frozen, w_live = weight.clone(), weight.clone().requires_grad_()
    a, _ = chunked_kd_loss(h1, w_frozen, ids, lp, tail, targets, cfg)
    b, _ = chunked_kd_loss(h2, w_live, ids, lp, tail, targets, cfg)
    a.backward()
    b.backward()
    assert w_frozen.grad is None and w_live.grad is not None
    torch.testing.assert_close(h1.grad, h2.grad, rtol=0, atol=0)


def test_a_second_backward_is_refused_not_scaled_twice():
    # The head's gradient is handed to .grad in place by the first backward (no [V, H] copy): a second one
    # (retain_graph=True) would return it scaled again, so it is refused by name.
    hidden, weight, bias, ids, lp, tail, targets = case(7)
    loss, _ = chunked_kd_loss(hidden.requires_grad_(), weight.requires_grad_(), ids, lp, tail, targets,
                              LossConfig(chunk_size=4))
    (2 * loss).backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="back-propagated twice"):
        loss.backward()
