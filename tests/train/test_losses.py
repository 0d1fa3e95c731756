"""Tests of train/losses.py: GKD generalized JSD over cached teacher top-k buckets, SFT term, chunked loss."""

import math
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from kdcache.common.errors import ConfigError
from kdcache.train import losses
from kdcache.train.losses import LossConfig, chunked_kd_loss, gkd_per_position, kd_loss_from_logits

BETAS = [0.0, 0.1, 0.5, 0.9, 1.0]
MODES = ["tail", "renorm"]
INF = float("inf")


def dense_reference(student_logits, teacher_logprobs_full, beta, temperature):
    """Test reference, [N, V] x [N, V] -> [N]: the same generalized JSD against the teacher's full distribution.

    No top-k, no tail, no masking; teacher tempered as softmax(teacher_logprobs_full / tau); tau^2 included.
    """
    s = F.softmax(student_logits.float() / temperature, dim=-1)
    t = F.softmax(teacher_logprobs_full.float() / temperature, dim=-1)

    def kl(p, q):  # xlogy gives 0 log 0 = 0
        return (torch.xlogy(p, p) - torch.xlogy(p, q)).sum(-1)

    if beta == 0:
        out = kl(t, s)
    elif beta == 1:
        out = kl(s, t)
    else:
        m = beta * t + (1 - beta) * s
        out = beta * kl(t, m) + (1 - beta) * kl(s, m)
    return out * temperature**2


def teacher_topk(teacher_logits, k):
    """Cache entries from full teacher logits [N, V]: ids [N, k], logprobs [N, k], tail [N], full logprobs [N, V]."""
    full = torch.log_softmax(teacher_logits.float(), dim=-1)
    lp, ids = full.topk(k, dim=-1)
    tail = (1.0 - lp.exp().sum(-1)).clamp_min(0.0)
    return ids, lp, tail, full


def make_case(n=6, v=11, k=4, seed=0, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    student = torch.randn(n, v, generator=g) * scale
    ids, lp, tail, full = teacher_topk(torch.randn(n, v, generator=g) * scale, k)
    targets = torch.randint(0, v, (n,), generator=g)
    return student, ids, lp, tail, targets, full


def gkd(student, ids, lp, tail_mass, /, **cfg):
    return gkd_per_position(student, ids, lp, tail_mass, LossConfig(**cfg))


def explicit_buckets(student, ids, lp, tail, mode):
    """Teacher and student bucket probabilities [N, B] in float64, built directly from the definitions (tau = 1)."""
    s_top = torch.softmax(student.double(), dim=-1).gather(1, ids)
    t_top = lp.double().exp()
    if mode == "tail":
        return torch.cat([t_top, tail.double()[:, None]], 1), torch.cat([s_top, 1 - s_top.sum(-1, keepdim=True)], 1)
    return t_top / t_top.sum(-1, keepdim=True), s_top / s_top.sum(-1, keepdim=True)


def gjsd_on_probs(t, s, beta):
    """Generalized JSD between bucket probabilities [N, B] (all > 0), straight from the formula."""
    def kl(p, q):
        return (p * (p / q).log()).sum(-1)
    if beta == 0:
        return kl(t, s)
    if beta == 1:
        return kl(s, t)
    m = beta * t + (1 - beta) * s
    return beta * kl(t, m) + (1 - beta) * kl(s, m)


# 1. Top-k covering the whole vocabulary reduces to the dense loss.
@pytest.mark.parametrize("tau", [1.0, 2.0, 0.5])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("beta", BETAS)
def test_full_vocab_topk_matches_dense_reference(beta, mode, tau):
    student, ids, lp, _, _, full = make_case(v=9, k=9)
    student.requires_grad_(True)
    got = gkd(student, ids, lp, torch.zeros(len(ids)), beta=beta, temperature=tau, tail=mode)
    want = dense_reference(student, full, beta, tau)
    assert got.dtype == torch.float32 and got.shape == (len(ids),)
    assert (want > 1e-3).all()  # a non-trivial comparison
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    (g_got,) = torch.autograd.grad(got.sum(), student)
    (g_want,) = torch.autograd.grad(want.sum(), student)
    torch.testing.assert_close(g_got, g_want, rtol=1e-4, atol=1e-5)


# 2. Hand-computed values on V = 4, k = 2.
Z = [1.0, 2.0, 0.5, -1.0]  # student logits
IDS, P, TAIL = [1, 2], [0.6, 0.3], 0.1  # teacher top-2 and its tail


def tiny_inputs():
    return (torch.tensor([Z]), torch.tensor([IDS]), torch.tensor([[math.log(p) for p in P]]), torch.tensor([TAIL]))


def softmax_list(z):
    e = [math.exp(x) for x in z]
    return [x / sum(e) for x in e]


def three_values(t1, t2, tt, s1, s2, st):
    """Forward KL, reverse KL and beta = 0.5 JSD over three buckets, term by term."""
    log = math.log
    fwd = t1 * log(t1 / s1) + t2 * log(t2 / s2) + tt * log(tt / st)
    rev = s1 * log(s1 / t1) + s2 * log(s2 / t2) + st * log(st / tt)
    m1, m2, mt = (t1 + s1) / 2, (t2 + s2) / 2, (tt + st) / 2
    jsd = (0.5 * (t1 * log(t1 / m1) + t2 * log(t2 / m2) + tt * log(tt / mt))
           + 0.5 * (s1 * log(s1 / m1) + s2 * log(s2 / m2) + st * log(st / mt)))
    return fwd, rev, jsd


def test_hand_computed_tail_mode():
    s = softmax_list(Z)
    fwd, rev, jsd = three_values(0.6, 0.3, 0.1, s[1], s[2], s[0] + s[3])  # tail = ids 0 and 3
    for beta, want in [(0.0, fwd), (1.0, rev), (0.5, jsd)]:
        assert gkd(*tiny_inputs(), beta=beta).item() == pytest.approx(want, rel=1e-5, abs=1e-7)


def test_hand_computed_renorm_mode():
    s = softmax_list(Z)
    s1, s2 = s[1] / (s[1] + s[2]), s[2] / (s[1] + s[2])
    t1, t2 = 0.6 / 0.9, 0.3 / 0.9
    log = math.log
    fwd = t1 * log(t1 / s1) + t2 * log(t2 / s2)
    rev = s1 * log(s1 / t1) + s2 * log(s2 / t2)
    m1, m2 = (t1 + s1) / 2, (t2 + s2) / 2
    jsd = 0.5 * (t1 * log(t1 / m1) + t2 * log(t2 / m2)) + 0.5 * (s1 * log(s1 / m1) + s2 * log(s2 / m2))
    for beta, want in [(0.0, fwd), (1.0, rev), (0.5, jsd)]:
        assert gkd(*tiny_inputs(), beta=beta, tail="renorm").item() == pytest.approx(want, rel=1e-5, abs=1e-7)


# 3. The ends are exactly the KLs; near the ends the JSD is beta * KL, not KL.
@pytest.mark.parametrize("mode", MODES)
def test_beta_ends_are_forward_and_reverse_kl(mode):
    student, ids, lp, tail, _, _ = make_case(seed=1)
    t, s = explicit_buckets(student, ids, lp, tail, mode)
    fwd = F.kl_div(s.log(), t.log(), log_target=True, reduction="none").sum(-1)  # KL(T || S)
    rev = F.kl_div(t.log(), s.log(), log_target=True, reduction="none").sum(-1)  # KL(S || T)
    torch.testing.assert_close(gkd(student, ids, lp, tail, beta=0.0, tail=mode).double(), fwd, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gkd(student, ids, lp, tail, beta=1.0, tail=mode).double(), rev, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(fwd, rev, rtol=1e-2)  # the two directions really differ on this data


@pytest.mark.parametrize("mode", MODES)
def test_jsd_near_the_ends_is_beta_times_kl(mode):
    # beta KL(T||M) + (1-beta) KL(S||M) = beta KL(T||S) + O(beta^2): it tends to 0, not to forward KL, as beta -> 0,
    # which is why beta = 0 and 1 are special-cased. So small beta is continuous with 0, not with KL.
    student, ids, lp, tail, _, _ = make_case(seed=2)
    fwd = gkd(student, ids, lp, tail, beta=0.0, tail=mode)
    rev = gkd(student, ids, lp, tail, beta=1.0, tail=mode)
    eps = 1e-4
    torch.testing.assert_close(gkd(student, ids, lp, tail, beta=eps, tail=mode) / eps, fwd, rtol=1e-2, atol=1e-6)
    torch.testing.assert_close(gkd(student, ids, lp, tail, beta=1 - eps, tail=mode) / eps, rev, rtol=1e-2, atol=1e-6)
    assert (gkd(student, ids, lp, tail, beta=1e-6, tail=mode) < 1e-3 * fwd).all()


# 4. Non-negative, and zero (with zero gradient) when the student is the teacher.
@pytest.mark.parametrize("mode", MODES)
def test_loss_is_nonnegative(mode):
    for seed in range(3):
        student, ids, lp, tail, _, _ = make_case(seed=seed, k=3)
        for beta in BETAS:
            for tau in (0.5, 1.0, 2.0):
                loss = gkd(student, ids, lp, tail, beta=beta, temperature=tau, tail=mode)
                assert (loss >= -1e-6).all() and (loss > 1e-4).any()


@pytest.mark.parametrize("beta", BETAS)
def test_zero_when_student_equals_teacher(beta):
    z = torch.randn(5, 40, generator=torch.Generator().manual_seed(3)) * 2
    ids, lp, tail, _ = teacher_topk(z, 6)  # k < V: the tail bucket is non-trivial
    assert (tail > 0.05).all()
    z.requires_grad_(True)
    for mode in MODES:
        loss = gkd(z, ids, lp, tail, beta=beta, tail=mode)
        assert loss.abs().max() < 1e-6
        (grad,) = torch.autograd.grad(loss.sum(), z)
        assert grad.abs().max() < 1e-5  # the minimum: no pull anywhere


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("tau", [0.5, 1.0, 2.0])
def test_a_student_equal_to_the_teacher_is_the_minimum_at_every_temperature(tau, beta, mode):
    """Every accepted setting keeps the teacher the minimiser: zero loss, zero gradient (issue: at tau = 2 the
    tail bucket was tempered as one token on the teacher's side only, 0.16 per position with k = 8)."""
    z = (torch.randn(5, 600, generator=torch.Generator().manual_seed(4)) * 2).requires_grad_(True)
    ids, lp, tail, _ = teacher_topk(z.detach(), 8)
    loss = gkd(z, ids, lp, tail, beta=beta, temperature=tau, tail=mode)
    assert loss.abs().max() < 1e-4
    (grad,) = torch.autograd.grad(loss.sum(), z)
    assert grad.abs().max() < 1e-4


def test_the_tail_is_tempered_as_one_bucket_on_both_sides():
    """What tempering in tail mode means: the full-vocabulary tempered KL (unknowable from a top-k cache)
    differs from it, and a student away from the teacher still gets a positive loss."""
    z = torch.randn(5, 40, generator=torch.Generator().manual_seed(4)) * 2
    ids, lp, tail, full = teacher_topk(z, 6)
    other = z + torch.randn(5, 40, generator=torch.Generator().manual_seed(5))
    got = gkd(other, ids, lp, tail, temperature=2.0, tail="tail")
    assert (got > 1e-3).all()
    assert not torch.allclose(got, dense_reference(other, full, 0.0, 2.0), rtol=1e-3)


# 5. Temperature.
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("beta", BETAS)
def test_tau_one_is_the_untempered_loss(beta, mode):
    student, ids, lp, tail, _, _ = make_case(seed=5)
    t, s = explicit_buckets(student, ids, lp, tail, mode)
    got = gkd(student, ids, lp, tail, beta=beta, temperature=1.0, tail=mode)
    torch.testing.assert_close(got.double(), gjsd_on_probs(t, s, beta), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tau", [2.0, 0.5])
def test_tempered_values_by_hand(tau):
    s = softmax_list([z / tau for z in Z])
    raw = [p ** (1 / tau) for p in (*P, TAIL)]  # teacher p^(1/tau), renormalized over the stored buckets
    t1, t2, tt = (r / sum(raw) for r in raw)
    s1 = softmax_list(Z)                        # the student's buckets at tau = 1, tempered the same way
    raw_s = [p ** (1 / tau) for p in (s1[1], s1[2], s1[0] + s1[3])]
    a, b, c = (r / sum(raw_s) for r in raw_s)
    fwd, rev, jsd = three_values(t1, t2, tt, a, b, c)
    for beta, want in [(0.0, fwd), (1.0, rev), (0.5, jsd)]:
        got = gkd(*tiny_inputs(), beta=beta, temperature=tau).item()
        assert got == pytest.approx(tau**2 * want, rel=1e-5)
    # renorm mode: the tail bucket is not there at all
    r1, r2 = P[0] ** (1 / tau), P[1] ** (1 / tau)
    t1, t2 = r1 / (r1 + r2), r2 / (r1 + r2)
    s1, s2 = s[1] / (s[1] + s[2]), s[2] / (s[1] + s[2])
    want = tau**2 * (t1 * math.log(t1 / s1) + t2 * math.log(t2 / s2))
    assert gkd(*tiny_inputs(), temperature=tau, tail="renorm").item() == pytest.approx(want, rel=1e-5)


# 6. SFT term.
@pytest.mark.parametrize("alpha", [0.0, 0.3])
def test_sft_term(alpha):
    student, ids, lp, tail, targets, _ = make_case(seed=6)
    student.requires_grad_(True)
    cfg = LossConfig(beta=0.5, temperature=2.0, sft_alpha=alpha)
    loss, parts = kd_loss_from_logits(student, ids, lp, tail, targets, cfg)
    ce = F.cross_entropy(student, targets, reduction="sum")  # at tau = 1 even though the KD term uses tau = 2
    kd = gkd_per_position(student, ids, lp, tail, cfg).sum()
    assert parts["positions"] == len(targets)
    assert parts["sft"] == pytest.approx(ce.item(), rel=1e-6)  # logged even when alpha == 0
    assert parts["kd"] == pytest.approx(kd.item(), rel=1e-6)
    assert loss.dim() == 0 and loss.item() == pytest.approx(kd.item() + alpha * ce.item(), rel=1e-6)
    (g_got,) = torch.autograd.grad(loss, student)
    (g_want,) = torch.autograd.grad(kd + alpha * ce, student)
    torch.testing.assert_close(g_got, g_want)


# 7. Chunked equals plain, values and gradients.
CHUNK_CFGS = [dict(beta=0.5, temperature=2.0, tail="tail", sft_alpha=0.3), dict(beta=1.0, tail="renorm")]


@pytest.mark.parametrize("cfg_kw", CHUNK_CFGS)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("chunk", [1, 3, 7, 12])  # N = 7
def test_chunked_equals_plain(chunk, with_bias, cfg_kw):
    g = torch.Generator().manual_seed(7)
    n, h, v, k = 7, 6, 23, 4
    hidden = torch.randn(n, h, generator=g, requires_grad=True)
    weight = torch.randn(v, h, generator=g, requires_grad=True)
    bias = torch.randn(v, generator=g, requires_grad=True) if with_bias else None
    ids, lp, tail, _ = teacher_topk(torch.randn(n, v, generator=g) * 2, k)
    ids[1, -1], lp[1, -1] = -1, -INF  # a masked entry
    targets = torch.randint(0, v, (n,), generator=g)
    leaves = [x for x in (hidden, weight, bias) if x is not None]

    logits = hidden @ weight.T + (bias if with_bias else 0)
    want, want_parts = kd_loss_from_logits(logits, ids, lp, tail, targets, LossConfig(**cfg_kw))
    want_grads = torch.autograd.grad(want, leaves)
    got, got_parts = chunked_kd_loss(hidden, weight, ids, lp, tail, targets, LossConfig(chunk_size=chunk, **cfg_kw),
                                     lm_head_bias=bias)
    got_grads = torch.autograd.grad(got, leaves)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert got_parts["positions"] == want_parts["positions"] == n
    for key in ("kd", "sft"):
        assert got_parts[key] == pytest.approx(want_parts[key], rel=1e-5, abs=1e-5)
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


# 8. The chunked loss never holds the full [N, V] logits.
def memory_case(n, v=5000, h=16, k=8, seed=8):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, requires_grad=True)
    weight = torch.randn(v, h, generator=g, requires_grad=True)
    ids, lp, tail, _ = teacher_topk(torch.randn(n, v, generator=g), k)
    return hidden, weight, ids, lp, tail, torch.randint(0, v, (n,), generator=g)


def saved_shapes(fn):
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return shapes


def test_chunked_saves_no_vocab_sized_tensor():
    n, v = 64, 5000
    hidden, weight, ids, lp, tail, targets = memory_case(n, v)
    cfg = LossConfig(beta=0.5, chunk_size=8, sft_alpha=0.5)
    chunked = saved_shapes(lambda: chunked_kd_loss(hidden, weight, ids, lp, tail, targets, cfg))
    plain = saved_shapes(lambda: kd_loss_from_logits(hidden @ weight.T, ids, lp, tail, targets, cfg))
    assert chunked  # the hook did see the per-chunk graphs
    assert all(math.prod(s) < n * v for s in chunked)  # never [N, V] ...
    assert all(s[-1] != v or math.prod(s) <= 8 * v for s in chunked)  # ... only one chunk's [8, V] at a time
    assert any(math.prod(s) == n * v for s in plain)  # the same check does catch the unchunked path


class LiveVocabTensors(TorchDispatchMode):
    """Tracks the peak number of elements alive in tensors whose last dim is V (logits-like), ignoring `skip`."""

    def __init__(self, v, skip):
        super().__init__()
        self.v, self.skip, self.live, self.peak = v, {t.untyped_storage().data_ptr() for t in skip}, {}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[-1] == self.v:
                st = t.untyped_storage()  # storages keep their Python object while alive, so a weakref tracks them
                if st.data_ptr() not in self.skip:
                    self.live[id(st)] = (weakref.ref(st), st.nbytes() // t.element_size())
        self.live = {key: (r, n) for key, (r, n) in self.live.items() if r() is not None}
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


def peak_vocab_elements(n, chunk=4, v=5000):
    hidden, weight, ids, lp, tail, targets = memory_case(n, v)
    cfg = LossConfig(beta=0.5, chunk_size=chunk, sft_alpha=0.5)
    with LiveVocabTensors(v, skip=[weight]) as mode:
        loss, _ = chunked_kd_loss(hidden, weight, ids, lp, tail, targets, cfg)
        loss.backward()
    return mode.peak


def test_chunked_peak_memory_does_not_grow_with_n(monkeypatch):
    # Forward and backward together: the peak is one chunk's worth whatever N is ...
    v = 5000
    small, large = peak_vocab_elements(32, v=v), peak_vocab_elements(128, v=v)
    assert 0 < small == large < 128 * v
    # ... and the measurement does notice when the chunking is taken away (all N logits at once).
    def unchunked(hidden, weight, bias, ids, lp, tail, targets, cfg, transform=None, grad_mode=True, *_):
        loss, parts = losses.kd_loss_from_logits(hidden @ weight.T, ids, lp, tail, targets, cfg)
        return loss, torch.tensor(parts["kd"]), torch.tensor(parts["sft"])

    monkeypatch.setattr(losses._FusedChunks, "apply", unchunked)
    assert peak_vocab_elements(128, v=v) >= 128 * v


# 9. Masked entries contribute nothing.
@pytest.mark.parametrize("fill", [-INF, 0.0, 5.0, float("nan")])
@pytest.mark.parametrize("mode", MODES)
def test_masked_entries_contribute_nothing(mode, fill):
    student, ids, lp, tail, _, _ = make_case(seed=9, k=3)
    ids_p = torch.cat([ids, torch.full((len(ids), 2), -1)], 1)
    lp_p = torch.cat([lp, torch.full((len(ids), 2), fill)], 1)
    student.requires_grad_(True)
    for beta in BETAS:
        want = gkd(student, ids, lp, tail, beta=beta, tail=mode)
        got = gkd(student, ids_p, lp_p, tail, beta=beta, tail=mode)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(torch.autograd.grad(got.sum(), student)[0],
                                   torch.autograd.grad(want.sum(), student)[0])


def test_masked_entry_in_the_middle_of_a_row():
    # k = 3 with the middle entry masked must equal k = 2 with the other two (padding is not only at the end).
    student, ids, lp, tail, _, _ = make_case(seed=10, k=3)
    ids_m, lp_m = ids.clone(), lp.clone()
    ids_m[:, 1], lp_m[:, 1] = -1, 1.0
    keep = [0, 2]
    for mode in MODES:
        torch.testing.assert_close(gkd(student, ids_m, lp_m, tail, beta=0.5, tail=mode),
                                   gkd(student, ids[:, keep], lp[:, keep], tail, beta=0.5, tail=mode))


# 10. Empty input.
def test_empty_input():
    cfg = LossConfig(beta=0.5, sft_alpha=0.5)
    student = torch.zeros(0, 7, requires_grad=True)
    ids, lp = torch.zeros(0, 3, dtype=torch.long), torch.zeros(0, 3)
    tail, targets = torch.zeros(0), torch.zeros(0, dtype=torch.long)
    loss, parts = kd_loss_from_logits(student, ids, lp, tail, targets, cfg)
    assert loss.dim() == 0 and loss.item() == 0.0 and loss.grad_fn is not None
    loss.backward()
    assert student.grad.shape == (0, 7)
    assert parts == {"kd": 0.0, "sft": 0.0, "positions": 0}

    hidden, weight = torch.zeros(0, 5, requires_grad=True), torch.randn(7, 5, requires_grad=True)
    loss, parts = chunked_kd_loss(hidden, weight, ids, lp, tail, targets, cfg)
    loss.backward()
    assert loss.item() == 0.0 and parts["positions"] == 0
    assert torch.equal(weight.grad, torch.zeros(7, 5))


# 11. No NaN or inf at zero teacher probabilities and extreme student logits.
def assert_finite_everywhere(student, ids, lp, tail):
    student = student.clone().requires_grad_(True)
    for mode in MODES:
        for beta in BETAS:
            for tau in (0.5, 1.0, 2.0):
                loss = gkd(student, ids, lp, tail, beta=beta, temperature=tau, tail=mode)
                (grad,) = torch.autograd.grad(loss.sum(), student)
                assert torch.isfinite(loss).all(), (mode, beta, tau, loss)
                assert torch.isfinite(grad).all(), (mode, beta, tau)


def test_finite_when_teacher_tail_is_zero():
    student, ids, lp, _, _, _ = make_case(seed=11, k=3)
    lp = torch.log_softmax(lp, -1)  # the top-3 hold everything: tail_mass == 0 exactly
    assert_finite_everywhere(student, ids, lp, torch.zeros(len(ids)))
    assert_finite_everywhere(1e4 * torch.sign(student), ids, lp, torch.zeros(len(ids)))


def test_finite_when_teacher_top_entries_are_zero():
    student, ids, lp, tail, _, _ = make_case(seed=12, k=3)
    lp[:, -1] = -INF  # valid ids with zero teacher probability
    assert_finite_everywhere(student, ids, lp, tail)
    # everything masked, all mass in the tail (tail_mass == 1)
    ids_all, lp_all = torch.full_like(ids, -1), torch.full_like(lp, -INF)
    assert_finite_everywhere(student, ids_all, lp_all, torch.ones(len(ids)))
    for beta in BETAS:  # both sides then put everything in one bucket (tail), or have no bucket at all (renorm)
        for mode in MODES:
            assert gkd(student, ids_all, lp_all, torch.ones(len(ids)), beta=beta, tail=mode).abs().max() < 1e-6


def test_finite_at_extreme_student_logits():
    student, ids, lp, tail, _, _ = make_case(seed=13, k=3)
    assert_finite_everywhere(1e4 * torch.sign(student), ids, lp, tail)
    assert_finite_everywhere(-1e4 * torch.sign(student), ids, lp, tail)


def test_student_tail_is_accurate_when_tiny():
    # The student's top-3 hold all but ~3e-8 of its mass: 1 - sum(s_i) reads 0 in float32, the exact tail does not.
    v, k, big = 50, 3, 20.0
    student = torch.zeros(1, v)
    student[0, :k] = big
    ids = torch.arange(k)[None]
    lp = torch.log(torch.tensor([[0.5, 0.3, 0.19]]))
    tail = torch.tensor([0.01])
    log_s_tail = math.log(v - k) - big - math.log(k + (v - k) * math.exp(-big))  # float64, by hand
    log_s_top = -math.log(k + (v - k) * math.exp(-big))
    want = sum(p * (math.log(p) - log_s_top) for p in (0.5, 0.3, 0.19)) + 0.01 * (math.log(0.01) - log_s_tail)
    assert gkd(student, ids, lp, tail, beta=0.0).item() == pytest.approx(want, rel=1e-5)


def test_full_vocab_topk_ignores_rounding_noise_in_tail_mass():
    student, ids, lp, _, _, full = make_case(seed=14, v=9, k=9)
    noisy = torch.full((len(ids),), 3e-7)  # what 1 - sum(exp) can leave in float32
    got = gkd(student, ids, lp, noisy, beta=0.0)
    torch.testing.assert_close(got, dense_reference(student, full, 0.0, 1.0), rtol=1e-5, atol=1e-5)


# 12. Config validation.
@pytest.mark.parametrize("field,value", [
    ("beta", -0.1), ("beta", 1.5), ("beta", float("nan")), ("temperature", 0.0), ("temperature", -1.0),
    ("tail", "foo"), ("sft_alpha", -0.5), ("chunk_size", 0), ("chunk_size", 2.5),
])
def test_config_rejects_bad_values(field, value):
    with pytest.raises(ConfigError, match=rf"{field}.*{value}"):
        LossConfig(**{field: value})


@pytest.mark.parametrize("cfg", [LossConfig(beta=0), LossConfig(beta=1, temperature=1e-3, tail="renorm",
                                                                sft_alpha=0.0, chunk_size=1)])
def test_config_accepts_the_edges(cfg):
    """The edge values are accepted and give a finite loss, chunk by single positions equal to the plain one."""
    g = torch.Generator().manual_seed(21)
    hidden, weight = torch.randn(6, 5, generator=g), torch.randn(11, 5, generator=g)
    _, ids, lp, tail, targets, _ = make_case(seed=21)
    plain, parts = kd_loss_from_logits(hidden @ weight.T, ids, lp, tail, targets, cfg)
    chunked, _ = chunked_kd_loss(hidden, weight, ids, lp, tail, targets, cfg)
    assert torch.isfinite(plain) and float(plain) >= 0 and parts["positions"] == 6
    torch.testing.assert_close(chunked, plain, rtol=1e-5, atol=1e-5)


# 13. float32 inside, whatever comes in.
def test_bf16_inputs_are_computed_in_float32():
    student, ids, lp, tail, targets, _ = make_case(seed=15)
    s16 = student.bfloat16()
    got = gkd(s16, ids.int(), lp.bfloat16(), tail.bfloat16(), beta=0.5)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, gkd(s16.float(), ids, lp.bfloat16().float(), tail.bfloat16().float(), beta=0.5))
    with_sft, parts = kd_loss_from_logits(s16, ids, lp, tail, targets, LossConfig(sft_alpha=0.5))
    assert with_sft.dtype == torch.float32
    assert parts["sft"] == pytest.approx(float(F.cross_entropy(s16.float(), targets, reduction="sum")), rel=1e-6)

    g = torch.Generator().manual_seed(16)
    hidden, weight = torch.randn(6, 5, generator=g).bfloat16(), torch.randn(11, 5, generator=g).bfloat16()
    cfg = LossConfig(beta=0.5, chunk_size=4)
    got, _ = chunked_kd_loss(hidden, weight, ids, lp, tail, targets, cfg)
    want, _ = kd_loss_from_logits(hidden.float() @ weight.float().T, ids, lp, tail, targets, cfg)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want)


# 14. A student whose mass outside the top-k underflows keeps its tail bucket (issue 23, item 4).
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("chunked", [False, True])
def test_a_collapsed_students_tail_bucket_is_charged(beta, chunked):
    """Teacher: 0.7 on 4 ids, 0.3 outside. Student: every logit outside those 4 is 300 below them, so its mass there
    (about 7 e^-300) is 0 in float32. The tail bucket exists (4 ids of 11) and the loss is the float64 bucket KL."""
    n, v, k = 3, 11, 4
    ids = torch.arange(k).repeat(n, 1)
    lp = torch.full((n, k), math.log(0.7 / k))
    tail = torch.full((n,), 0.3)
    student = torch.full((n, v), -300.0)
    student[:, :k] = 0.0
    targets = torch.zeros(n, dtype=torch.long)
    cfg = LossConfig(beta=beta, chunk_size=2)
    if chunked:
        eye = torch.eye(v)
        loss, _ = chunked_kd_loss(student, eye, ids, lp, tail, targets, cfg)       # hidden @ I.T = the logits
    else:
        loss, _ = kd_loss_from_logits(student, ids, lp, tail, targets, cfg)
    s = torch.log_softmax(student.double(), -1)
    s_tail = torch.logsumexp(s[:, k:], -1)                                          # about -298, not -inf
    log_s = torch.cat([s[:, :k], s_tail[:, None]], 1)
    log_t = torch.cat([lp.double(), tail.double().log()[:, None]], 1)
    if beta == 0.0:
        want = (log_t.exp() * (log_t - log_s)).sum()
    elif beta == 1.0:
        want = (log_s.exp() * (log_s - log_t)).sum()
    else:
        m = torch.logsumexp(torch.stack([log_t + math.log(beta), log_s + math.log(1 - beta)]), 0)
        want = (beta * (log_t.exp() * (log_t - m)).sum(-1) + (1 - beta) * (log_s.exp() * (log_s - m)).sum(-1)).sum()
    assert float(loss) == pytest.approx(float(want), rel=1e-4)
    if beta == 0.0:
        assert float(loss) > 50 * n                # 0.3 x ~298 nats a position: not the 0.009 of a dropped bucket


# 15. An eval pass under torch.no_grad() builds no gradient in the fused loss (issue 23, item 14).
def test_the_fused_loss_builds_no_gradient_under_no_grad(monkeypatch):
    from kdcache.train import losses
    calls = []
    real = torch.autograd.grad
    monkeypatch.setattr(losses.torch.autograd, "grad", lambda *a, **k: calls.append(1) or real(*a, **k))
    student, ids, lp, tail, targets, _ = make_case(seed=21)
    hidden = torch.randn(student.shape[0], 5, requires_grad=True)
    weight = torch.randn(student.shape[1], 5, requires_grad=True)
    cfg = LossConfig(beta=0.5, chunk_size=2)
    with torch.no_grad():
        quiet, _ = chunked_kd_loss(hidden, weight, ids, lp, tail, targets, cfg)
    assert calls == [] and not quiet.requires_grad
    loud, _ = chunked_kd_loss(hidden, weight, ids, lp, tail, targets, cfg)
    assert calls and loud.requires_grad
    torch.testing.assert_close(quiet, loud.detach())


def test_the_default_chunk_follows_the_vocabulary():
    """--loss-chunk 0 (the default): 512 positions, fewer only where one [chunk, V] float32 block would pass
    CHUNK_LOGIT_BYTES (1 GiB)."""
    from kdcache.train.config import TrainConfig
    from kdcache.train.losses import CHUNK_LOGIT_BYTES, default_chunk
    for vocab, want in ((32000, 512), (151936, 512), (262144, 512), (400, 512), (1_048_576, 256), (2**26, 32)):
        c = default_chunk(vocab)
        assert c == want and (c * vocab * 4 <= CHUNK_LOGIT_BYTES or c == 32)
    cfg = TrainConfig(cache="c", student="s", out="o")
    assert cfg.loss_chunk == 0 and cfg.loss_config(151936).chunk_size == 512
    assert TrainConfig(cache="c", student="s", out="o", loss_chunk=16).loss_config(151936).chunk_size == 16
