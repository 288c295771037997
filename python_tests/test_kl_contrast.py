"""``kivi_fast.kl``'s default: a Gaussian contrast of both sample sets around the paper's kernel
estimator (``kivi_fast.contrast.sample_contrast_kl``). Oracles: closed-form Gaussian KLs and their
gradients, a Monte Carlo KL for a non-Gaussian prior, the reference backend, and exact invariances."""

from __future__ import annotations

import math

import pytest
import torch

import kivi_fast
from kivi_fast import reference

f64 = {"dtype": torch.float64}


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_the_defaults_and_the_papers_form():
    p = torch.randn(60, 3, generator=gen(0), **f64)
    q = 0.5 * torch.randn(60, 3, generator=gen(1), **f64) + 0.2
    default = kivi_fast.kl(p, q, generator=gen(2))
    explicit = kivi_fast.kl(p, q, 1e-2, contrast="full", generator=gen(2))
    assert torch.equal(default, explicit)  # n > d: the full contrast at lam = 1e-2
    # n <= d: "auto" is the per-dimension contrast
    wide_p, wide_q = torch.randn(6, 8, generator=gen(3), **f64), torch.randn(6, 8, generator=gen(4), **f64)
    assert torch.equal(kivi_fast.kl(wide_p, wide_q, generator=gen(5)),
                       kivi_fast.kl(wide_p, wide_q, contrast="diagonal", generator=gen(5)))
    assert torch.equal(kivi_fast.kl(p, q, 1e-3, contrast="none"), kivi_fast.kernel_kl(p, q))


@pytest.mark.parametrize("contrast", ["full", "diagonal"])
@pytest.mark.parametrize("batched", [False, True])
def test_compiled_ops_match_the_reference(contrast, batched):
    shape = (3, 50, 4) if batched else (50, 4)
    p = torch.randn(*shape[:-2], 70, 4, generator=gen(0), **f64)
    q = (torch.randn(shape, generator=gen(1), **f64) * 0.7 + 0.3).requires_grad_(True)
    ours = kivi_fast.kl(p, q, contrast=contrast, generator=gen(7))
    (ours_grad,) = torch.autograd.grad(ours.sum(), q)
    ref = reference.kl(p, q, contrast=contrast, generator=gen(7))
    (ref_grad,) = torch.autograd.grad(ref.sum(), q)
    torch.testing.assert_close(ours, ref, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(ours_grad, ref_grad, rtol=1e-8, atol=1e-12)
    assert ours.shape == shape[:-2]


def test_gaussian_posterior_gradient_matches_the_closed_form():
    """q = N(m, L L^T) against samples of N(0, I): the mean gradient w.r.t. (m, L) over 40 draws is the
    true one, (m, L - diag(1 / L_ii)), within 10% (the paper's estimator: off by more than its norm)."""
    d, n, reps = 3, 200, 40
    m = torch.tensor([0.8, -0.4, 0.3], **f64, requires_grad=True)
    L0 = torch.tensor([[0.5, 0.0, 0.0], [0.3, 0.4, 0.0], [-0.2, 0.1, 0.6]], **f64)
    L = L0.clone().requires_grad_(True)
    z = m + torch.randn(reps, n, d, generator=gen(0), **f64) @ L.T
    prior = torch.randn(reps, n, d, generator=gen(1), **f64)
    gm, gL = torch.autograd.grad(kivi_fast.kl(prior, z, generator=gen(2)).mean(), (m, L))
    true_m, true_L = m.detach(), torch.tril(L0 - torch.diag(1 / L0.diagonal()))
    ours = torch.cat([gm, torch.tril(gL).flatten()])
    truth = torch.cat([true_m, true_L.flatten()])
    assert (ours - truth).norm() / truth.norm() < 0.1
    zd = z.detach().requires_grad_(True)
    paper = torch.autograd.grad(kivi_fast.kernel_kl(prior, zd).mean(), zd)[0]
    ours_z = torch.autograd.grad(kivi_fast.kl(prior, zd, generator=gen(2)).mean(), zd)[0]
    # the same comparison on the samples: the paper's per-sample gradient is far from ours
    assert (paper - ours_z).norm() > 0.5 * ours_z.norm()


def test_a_non_gaussian_prior_known_only_by_samples():
    """p = 0.5 N(-2, 1) + 0.5 N(2, 1), q = N(2, 1): KL(q || p) = 0.633 (Monte Carlo, 10^6 draws). The
    kernel term of the prior's side carries what the Gaussian fitted to p misses: a Gaussian prior
    N(0, 5) in its place would give 0.805; the paper's estimator gives 5-6 here."""
    g = gen(0)
    zz = 2 + torch.randn(10**6, generator=g, **f64)
    log_q = -0.5 * (zz - 2) ** 2
    log_p = torch.logsumexp(torch.stack([-0.5 * (zz - 2) ** 2, -0.5 * (zz + 2) ** 2]), 0) - math.log(2)
    truth = float((log_q - log_p).mean())
    reps, n = 8, 1000
    sign = torch.randint(0, 2, (reps, n, 1), generator=g).to(torch.float64) * 4 - 2
    p = sign + torch.randn(reps, n, 1, generator=g, **f64)
    q = 2 + torch.randn(reps, n, 1, generator=g, **f64)
    estimate = float(kivi_fast.kl(p, q, generator=g).mean())
    assert abs(estimate - truth) < 0.1, (estimate, truth)
    assert abs(estimate - truth) < abs(0.805 - truth)


@pytest.mark.parametrize("contrast", ["full", "diagonal"])
def test_invariant_to_a_shift_of_both_sample_sets(contrast):
    p = torch.randn(2, 80, 3, generator=gen(0), **f64)
    q = torch.randn(2, 60, 3, generator=gen(1), **f64) * 0.6 + 0.4
    shift = torch.tensor([3.0, -1.0, 0.5], **f64)
    a = kivi_fast.kl(p, q, contrast=contrast, generator=gen(2))
    b = kivi_fast.kl(p + shift, q + shift, contrast=contrast, generator=gen(2))
    torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


def test_bad_contrast_arguments_are_named():
    p, q = torch.randn(30, 2, **f64), torch.randn(30, 2, **f64)
    with pytest.raises(ValueError, match="contrast must be one of"):
        kivi_fast.kl(p, q, contrast="spherical")
    flat = torch.cat([p[:, :1], torch.ones(30, 1, **f64)], 1)  # no spread in one dimension: singular
    with pytest.raises(ValueError, match="prior_z's sample covariance is singular"):
        kivi_fast.kl(flat, q, contrast="full")
    with pytest.raises(ValueError, match="lam must be at least"):
        kivi_fast.kl(p, q, lam=1e-12)
    with pytest.raises(ValueError, match="q_z"):
        kivi_fast.kl(p, q[:1])


def test_float32_inputs_give_float64_results_within_1e_3():
    """The accuracy contract of kernel_kl holds for the composition too: its Gaussian terms and
    whitening run in float64, and the N(0, I) draws do not depend on the input dtype."""
    for seed in range(5):
        p = torch.randn(4, 100, 8, generator=gen(seed), **f64)
        q = torch.randn(4, 100, 8, generator=gen(seed + 100), **f64) * 0.3 + 0.5
        wide = kivi_fast.kl(p, q, generator=gen(1))
        narrow = kivi_fast.kl(p.float(), q.float(), generator=gen(1))
        assert narrow.dtype == torch.float32
        torch.testing.assert_close(narrow.double(), wide, rtol=0, atol=1e-3)
        ac64 = kivi_fast.adaptive_contrast_kl(q, generator=gen(1))
        ac32 = kivi_fast.adaptive_contrast_kl(q.float(), generator=gen(1))
        assert ac32.dtype == torch.float32
        torch.testing.assert_close(ac32.double(), ac64, rtol=0, atol=1e-3)
