"""The token-rkl objective: reverse KL(S || T) estimated on sampled tokens, importance-weighted by the behaviour
policy's log-probs. Its mean gradient over samples is the exact full-vocabulary reverse-KL gradient."""
import pytest
import torch
import torch.nn.functional as F

from kdcache.common.errors import ConfigError
from kdcache.train.losses import LossConfig, chunked_kd_loss, kd_loss_from_logits

RKL = LossConfig(objective="token-rkl")
V = 6


def _exact_grad(z, t_logp):
    """d KL(S || T) / d z over the whole vocabulary (autograd), [V]."""
    z = z.clone().requires_grad_(True)
    s = F.log_softmax(z, -1)
    (s.exp() * (s - t_logp)).sum().backward()
    return z.grad


def _estimate(z, t_logp, ys, behavior):
    """The token-rkl gradient at every sampled token y_n (one position each, the same logits z): [n, V]."""
    n = len(ys)
    zz = z.expand(n, V).clone().requires_grad_(True)
    empty = torch.empty(n, 0)
    loss, _ = kd_loss_from_logits(zz, empty.long(), empty, torch.zeros(n), ys, RKL, target_logprobs=t_logp[ys],
                                  behavior_logprobs=behavior)
    loss.backward()
    return zz.grad


@pytest.mark.parametrize("behaviour", ["student", "another"])
def test_the_mean_gradient_over_samples_is_the_exact_reverse_kl_gradient(behaviour):
    """200,000 draws from the behaviour policy (the student itself, or another distribution with importance
    weights); each coordinate of the mean gradient within 5 standard errors of the exact one: a false failure
    about once in 1.7 million per coordinate (normal tails), 6 coordinates."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(V, generator=g, dtype=torch.float64).float()
    t_logp = F.log_softmax(torch.randn(V, generator=g) * 1.5, -1)
    mu_logp = F.log_softmax(z, -1) if behaviour == "student" else F.log_softmax(torch.randn(V, generator=g), -1)
    ys = torch.multinomial(mu_logp.exp(), 200_000, replacement=True, generator=g)
    per = _estimate(z, t_logp, ys, mu_logp[ys] if behaviour == "another" else None).double()
    mean, se = per.mean(0), per.std(0) / per.shape[0] ** 0.5
    exact = _exact_grad(z.double(), t_logp.double())
    assert (exact.abs() > 10 * se).any()                       # the gradient is not trivially zero
    assert ((mean - exact).abs() <= 5 * se + 1e-9).all(), (mean, exact, se)


def test_the_value_is_the_log_ratio_of_the_sampled_token_on_policy():
    z = torch.randn(4, V)
    t_logp = F.log_softmax(torch.randn(4, V), -1)
    ys = torch.tensor([0, 3, 5, 1])
    empty = torch.empty(4, 0)
    loss, parts = kd_loss_from_logits(z, empty.long(), empty, torch.zeros(4), ys, RKL,
                                      target_logprobs=t_logp[torch.arange(4), ys],
                                      behavior_logprobs=F.log_softmax(z, -1)[torch.arange(4), ys])
    want = (F.log_softmax(z, -1) - t_logp)[torch.arange(4), ys].sum()
    torch.testing.assert_close(loss, want)
    assert parts["kd"] == pytest.approx(float(want), rel=1e-6)


def test_a_student_equal_to_the_teacher_has_zero_loss_and_zero_gradient():
    z = torch.randn(5, V, requires_grad=True)
    t_logp = F.log_softmax(z.detach(), -1)
    ys = torch.tensor([0, 1, 2, 3, 4])
    empty = torch.empty(5, 0)
    loss, _ = kd_loss_from_logits(z, empty.long(), empty, torch.zeros(5), ys, RKL,
                                  target_logprobs=t_logp[torch.arange(5), ys],
                                  behavior_logprobs=torch.full((5,), -1.0))
    loss.backward()
    assert float(loss.detach()) == pytest.approx(0.0, abs=1e-6) and z.grad.abs().max() < 1e-6


def test_chunked_and_plain_agree_with_importance_weights():
    g = torch.Generator().manual_seed(1)
    n, h = 13, 8
    hidden = torch.randn(n, h, generator=g, requires_grad=True)
    w = torch.randn(V, h, generator=g, requires_grad=True)
    ys = torch.randint(0, V, (n,), generator=g)
    t_lp, b_lp = -torch.rand(n, generator=g) * 3, -torch.rand(n, generator=g) * 2
    empty = torch.empty(n, 0)
    plain, _ = kd_loss_from_logits(hidden @ w.T, empty.long(), empty, torch.zeros(n), ys, RKL, t_lp, b_lp)
    gp = torch.autograd.grad(plain, (hidden, w))
    cfg = LossConfig(objective="token-rkl", chunk_size=4)
    chunked, _ = chunked_kd_loss(hidden, w, empty.long(), empty, torch.zeros(n), ys, cfg, target_logprobs=t_lp,
                                 behavior_logprobs=b_lp)
    gc = torch.autograd.grad(chunked, (hidden, w))
    torch.testing.assert_close(chunked, plain)
    for a, b in zip(gc, gp):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("kw,key", [({"temperature": 2.0}, "temperature"), ({"beta": 0.5}, "beta"),
                                    ({"objective": "rkl"}, "objective")])
def test_settings_that_mean_nothing_for_token_rkl_are_refused(kw, key):
    with pytest.raises(ConfigError, match=key):
        LossConfig(**{"objective": "token-rkl", **kw})


def test_importance_weights_only_for_completions_a_policy_sampled():
    """token-rkl trains only completions a --generator sampled at a temperature > 0 (train/checks.py): greedy
    ones (a point mass), teacher-written ones and score-mode ones are not such data."""
    from kdcache.train.checks import sampled_completions as sampled
    assert sampled({"fingerprint_parts": {"capture": {"mode": "generate", "generator": "h", "temperature": 0.8}}})
    assert not sampled({"fingerprint_parts": {"capture": {"mode": "generate", "generator": "h", "temperature": 0}}})
    assert not sampled({"fingerprint_parts": {"capture": {"mode": "generate", "temperature": 0.8}}})
    assert not sampled({"fingerprint_parts": {"capture": {}}})          # score mode
