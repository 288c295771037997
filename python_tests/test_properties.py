"""Invariances of the estimate and its statistical behaviour on distributions with a known KL."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kivi_fast


def samples(seed, n_p, n_q, d, shift=0.0, scale=1.0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(n_p, d, generator=g, dtype=dtype)
    q = torch.randn(n_q, d, generator=g, dtype=dtype) * scale + shift
    return p, q


@given(seed=st.integers(0, 2**16), d=st.integers(1, 6), reverse=st.booleans())
def test_permuting_samples_leaves_the_estimate_unchanged(impl, seed, d, reverse):
    p, q = samples(seed, 31, 27, d, shift=0.5)
    g = torch.Generator().manual_seed(seed + 1)
    perm_p, perm_q = torch.randperm(31, generator=g), torch.randperm(27, generator=g)
    q1 = q.clone().requires_grad_(True)
    q2 = q[perm_q].clone().requires_grad_(True)
    a = kivi_fast.kernel_kl(p, q1, reverse=reverse)
    b = kivi_fast.kernel_kl(p[perm_p], q2, reverse=reverse)
    a.backward()
    b.backward()
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(q1.grad[perm_q], q2.grad, rtol=1e-8, atol=1e-12)


@given(seed=st.integers(0, 2**16), d=st.integers(1, 6), offset=st.floats(-20, 20))
def test_rotation_and_translation_leave_the_estimate_unchanged(impl, seed, d, offset):
    p, q = samples(seed, 40, 35, d, shift=0.7, scale=0.6)
    g = torch.Generator().manual_seed(seed + 2)
    rotation, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    move = lambda x: x @ rotation.T + offset  # noqa: E731
    q1 = q.clone().requires_grad_(True)
    q2 = move(q).detach().requires_grad_(True)
    a = kivi_fast.kernel_kl(p, q1)
    b = kivi_fast.kernel_kl(move(p), q2)
    a.backward()
    b.backward()
    torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-9)
    # The gradient rotates with the samples.
    torch.testing.assert_close(q1.grad @ rotation.T, q2.grad, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("reverse", [True, False])
def test_batched_equals_a_loop_of_unbatched(impl, dtype, reverse):
    g = torch.Generator().manual_seed(11)
    p = torch.randn(5, 30, 4, generator=g, dtype=dtype)
    q = (torch.randn(5, 25, 4, generator=g, dtype=dtype) * torch.linspace(0.3, 2, 5, dtype=dtype)[:, None, None])
    qb = q.clone().requires_grad_(True)
    batched = kivi_fast.kernel_kl(p, qb, reverse=reverse)
    batched.sum().backward()
    assert batched.shape == (5,)
    for b in range(5):
        qi = q[b].clone().requires_grad_(True)
        single = kivi_fast.kernel_kl(p[b], qi, reverse=reverse)
        single.backward()
        assert single.shape == ()
        torch.testing.assert_close(batched[b], single, rtol=1e-5 if dtype == torch.float32 else 1e-12, atol=1e-6)
        torch.testing.assert_close(qb.grad[b], qi.grad, rtol=1e-5 if dtype == torch.float32 else 1e-10, atol=1e-7)


def test_q_equal_p_shrinks_toward_zero_as_n_grows(impl):
    """Same distribution on both sides: the estimate's mean magnitude decreases with n."""
    errors = []
    for n in (25, 100, 400):
        values = [kivi_fast.kernel_kl(*samples(seed, n, n, 2)).item() for seed in range(8)]
        errors.append(sum(abs(v) for v in values) / len(values))
    assert errors[0] > errors[1] > errors[2]
    assert errors[2] < 0.1


def test_estimate_grows_with_the_true_kl(impl):
    """q = N(mu 1, I) against p = N(0, I) in d = 2: KL = mu^2 (d / 2); the estimate must follow, within
    the paper's estimator's known upward bias and no further."""
    shifts = [0.0, 0.5, 1.0, 1.5]
    estimates = []
    for mu in shifts:
        vals = [kivi_fast.kernel_kl(*samples(seed, 200, 200, 2, shift=mu)).item() for seed in range(4)]
        estimates.append(sum(vals) / len(vals))
    assert all(a < b for a, b in zip(estimates, estimates[1:])), estimates
    # Not close to the true KL (mu^2) once q and p separate: the fitted p/q goes negative at q samples
    # far from p and is clipped, which inflates the estimate (see the kl-accuracy study). It is an
    # upper-side bias, never below the truth here, and bounded: measured 0.24, 1.03, 4.12 and 8.62 nats
    # (at mu = 2.5 most ratios are clipped and the estimate measures the clip, so it is left out).
    assert all(est >= mu**2 - 0.1 for est, mu in zip(estimates, shifts)), estimates
    assert all(est < bound for est, bound in zip(estimates, (0.5, 1.5, 5.5, 11.0))), estimates


def test_adaptive_contrast_on_a_gaussian_matches_the_exact_kl(impl):
    """Diagonal Gaussian q against N(0, I): closed-form KL vs. the adaptive-contrast estimate."""
    d = 4
    mean = torch.tensor([1.0, -0.5, 2.0, 0.0], dtype=torch.float64)
    std = torch.tensor([0.5, 1.5, 0.3, 1.0], dtype=torch.float64)
    exact = 0.5 * (std**2 + mean**2 - 1 - 2 * std.log()).sum().item()
    g = torch.Generator().manual_seed(0)
    estimates = []
    for _ in range(5):
        z = mean + std * torch.randn(200, d, generator=g, dtype=torch.float64)
        estimates.append(kivi_fast.adaptive_contrast_kl(z, generator=g).item())
    # The KIVI term of two standardized Gaussians carries a small positive bias (about 0.1-0.2 nats
    # at n = 200, d = 4; see test_q_equal_p_shrinks_toward_zero_as_n_grows).
    assert sum(estimates) / len(estimates) == pytest.approx(exact, rel=0.1)


def test_adaptive_contrast_uses_the_given_prior_and_gives_the_exact_gradient(impl):
    """q = N(m, s^2) against the prior N(0, 4), per dimension (m = 1, s = 0.5, d = 2), samples m + s eps:
    KL = log(2 / s) + (s^2 + m^2) / 8 - 1/2, with dKL/dm = m / 4 and dKL/ds = s / 4 - 1 / s, the latter
    mostly the entropy's -1/s, which the log prior's term alone would miss. Over 40 seeds of 24
    estimates: the mean value 0.044 high (standard deviation 0.024), the gradients within 0.005 (m)
    and 0.014 (s)."""
    g = torch.Generator().manual_seed(1)
    m = torch.full((24, 1, 2), 1.0, dtype=torch.float64, requires_grad=True)
    s = torch.full((24, 1, 2), 0.5, dtype=torch.float64, requires_grad=True)
    prior_std = 2.0

    def log_prior(x):
        return (-0.5 * (x / prior_std) ** 2 - math.log(prior_std) - 0.5 * math.log(2 * math.pi)).sum(-1)

    kl = kivi_fast.adaptive_contrast_kl(m + s * torch.randn(24, 100, 2, generator=g, dtype=torch.float64), log_prior,
                                        generator=g)
    assert kl.shape == (24,)
    exact = 2 * (math.log(prior_std / 0.5) + (0.25 + 1) / (2 * prior_std**2) - 0.5)
    assert kl.mean().item() == pytest.approx(exact, abs=0.15)
    kl.sum().backward()
    # (each estimate's gradient w.r.t. its own m and s; the mean over the batch against the closed form)
    assert m.grad.mean().item() == pytest.approx(1.0 / 4, abs=0.02)
    assert s.grad.mean().item() == pytest.approx(0.5 / 4 - 1 / 0.5, abs=0.05)


def _correlated_gaussian(d=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(d, generator=g, dtype=torch.float64)
    a = torch.randn(d, d, generator=g, dtype=torch.float64)
    cov = a @ a.T / d + 0.1 * torch.eye(d, dtype=torch.float64)
    return m, torch.linalg.cholesky(cov)


def _exact_kl_grad(m, L):
    """d/d(m, L) of KL(N(m, L L^T) || N(0, I)) = (m, L - diag(1 / L_ii)) for lower-triangular L."""
    return torch.cat([m, (L - torch.diag(1 / L.diagonal())).tril().reshape(-1)])


def _contrast_gradient_error(contrast, draws=8):
    """Relative error of the mean gradient of adaptive_contrast_kl w.r.t. (m, L) over draws."""
    m0, L0 = _correlated_gaussian()
    exact = _exact_kl_grad(m0, L0)
    g = torch.Generator().manual_seed(1)
    grads = []
    for _ in range(draws):
        m, L = m0.clone().requires_grad_(True), L0.clone().requires_grad_(True)
        z = m + torch.randn(300, 4, generator=g, dtype=torch.float64) @ L.tril().T
        kl = kivi_fast.adaptive_contrast_kl(z, contrast=contrast, generator=g)
        gm, gL = torch.autograd.grad(kl, (m, L))
        grads.append(torch.cat([gm, gL.tril().reshape(-1)]))
    return ((torch.stack(grads).mean(0) - exact).norm() / exact.norm()).item()


def test_full_contrast_gives_the_exact_gradient_for_a_correlated_gaussian(impl):
    """q = N(m, L L^T), z = m + L eps: whitened by the sample covariance the samples no longer depend
    on (m, L), so the kernel term carries no gradient and the analytic term's is exact on average.
    Per-dimension contrast leaves the correlation to the kernel term and misses the gradient (the
    grad-accuracy study measured it); it is what the full contrast must beat."""
    full = _contrast_gradient_error("full")
    diagonal = _contrast_gradient_error("diagonal")
    assert full < 0.08, full  # Monte Carlo noise: 0.026-0.046 over generator seeds 1-6
    assert diagonal > 2 * full, (diagonal, full)


def test_contrast_errors(impl):
    z = torch.randn(50, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match="contrast must be one of 'auto', 'diagonal', 'full'"):
        kivi_fast.adaptive_contrast_kl(z, contrast="spherical")
    flat = torch.cat([z[:, :2], torch.ones(50, 1, dtype=torch.float64)], dim=1)  # no spread in one dimension
    with pytest.raises(ValueError, match="sample covariance is singular"):
        kivi_fast.adaptive_contrast_kl(flat, contrast="full")
    with pytest.raises(ValueError, match="zero standard deviation"):
        kivi_fast.adaptive_contrast_kl(flat, contrast="diagonal")
    # n <= d: the covariance is shrunk toward its diagonal, and the estimate is defined
    assert torch.isfinite(kivi_fast.adaptive_contrast_kl(torch.randn(3, 8, dtype=torch.float64), contrast="full"))
