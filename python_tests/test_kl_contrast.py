"""``kivi_fast.kl``'s default: a Gaussian contrast of both sample sets around the paper's kernel
estimator (``kivi_fast.contrast.sample_contrast_kl``). Oracles: closed-form Gaussian KLs and their
gradients, a Monte Carlo KL for a non-Gaussian prior, the reference backend, and exact invariances."""

from __future__ import annotations

import math

import pytest
import torch

import kivi_fast
from kivi_fast import reference

from conftest import DeviceOps

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
    N(0, 5) in its place would give 0.805; the paper's estimator gives 5-6 here. The mean of 8
    estimates read 0.073 high with a standard deviation of 0.016 over 30 seeds; of 32, within 0.1 by
    3 of theirs."""
    g = gen(0)
    zz = 2 + torch.randn(10**6, generator=g, **f64)
    log_q = -0.5 * (zz - 2) ** 2
    log_p = torch.logsumexp(torch.stack([-0.5 * (zz - 2) ** 2, -0.5 * (zz + 2) ** 2]), 0) - math.log(2)
    truth = float((log_q - log_p).mean())
    reps, n = 32, 1000
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


@pytest.mark.parametrize("d", [8, 20])
def test_just_more_samples_than_dimensions_gives_a_kl_of_the_right_size(d):
    """With n_p = d + 1 to d + 4 prior samples the full contrast's plug-in precision has no finite mean
    or variance (it read q = p = N(0, I) thousands of nats high: median 61 and 1501 at n = d + 1, up to
    4587; at d + 3 and d + 4 up to 60); the prior's covariance is shrunk there. The KL is 0: a few nats, and up to ~15 at d = 8, are the full
    contrast's noise at so few samples (the kl docstring)."""
    for n in (d + 1, d + 2, d + 3, d + 4):
        values = torch.stack([kivi_fast.kl(torch.randn(n, d, generator=gen(s), **f64),
                                           torch.randn(n, d, generator=gen(s + 50), **f64), generator=gen(s + 100))
                              for s in range(8)])
        assert values.abs().median() < 4 and values.abs().max() < 25, (n, values)


def test_a_contrast_with_fewer_than_four_prior_samples_is_refused(impl):
    """The inverse of a variance fitted to n <= 3 samples has no finite mean, and it enters log r_p: at
    q = p = N(0, I) in d = 10 the default kl read a median 360 nats (up to 2.8e5) with 2 prior samples and
    28 with 3; with 4, a median 2 (the paper's estimator: 5). Those are refused, naming the way out."""
    q = torch.randn(50, 10, generator=gen(1), **f64)
    for n_p in (2, 3):
        p = torch.randn(n_p, 10, generator=gen(2), **f64)
        for contrast in ("auto", "diagonal", "full"):
            with pytest.raises(ValueError, match='prior_z must hold at least 4 samples for a Gaussian contrast.*'
                                                 'contrast="none"'):
                kivi_fast.kl(p, q, contrast=contrast, generator=gen(3))
        assert torch.isfinite(kivi_fast.kl(p, q, contrast="none"))
    values = torch.stack([kivi_fast.kl(torch.randn(4, 10, generator=gen(s), **f64), q, generator=gen(s + 50))
                          for s in range(20)])
    assert values.abs().median() < 5, values


def test_two_samples_shrink_to_their_diagonal():
    """Two samples' correlations are +-1 whatever the law's, and the Schaefer-Strimmer variance of them
    0: the intensity is 1, not the formula's 0, which left the full contrast's covariance singular (an
    error on most draws, on the others a value of ~1e16 nats)."""
    from kivi_fast import contrast

    x = torch.randn(100, 2, 4, generator=gen(0), **f64)
    assert (contrast.shrinkage_intensity(x) == 1).all()
    values = torch.stack([kivi_fast.adaptive_contrast_kl(torch.randn(2, 3, generator=gen(s), **f64), contrast="full",
                                                         generator=gen(s + 50)) for s in range(20)])
    assert values.isfinite().all() and values.abs().max() < 20, values


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_samples_on_a_line_have_a_singular_covariance_on_every_draw(dtype):
    """Rounding lets a rank-1 covariance factor with tiny pivots (before: a ValueError on 26 of 40 draws,
    else a finite number up to 7.8e15); a pivot within 64 roundings (the samples' or the covariance's:
    contrast.SAMPLE_ROUNDINGS) is singular. Scales from 1e-3 to 1e3 together, a spread of 1e-2 at 10,
    and float32 samples 1e5 standard deviations from the origin, are not."""
    direction = torch.tensor([1.0, 2.0, 3.0], dtype=dtype)
    for seed in range(10):
        line = torch.randn(20, 1, generator=gen(seed), dtype=dtype) * direction
        other = torch.randn(20, 3, generator=gen(seed + 50), dtype=dtype)
        for p, q, name in ((other, line, "q_z"), (line, other, "prior_z")):
            with pytest.raises(ValueError, match=f"{name}'s sample covariance is singular"):
                kivi_fast.kl(p, q, contrast="full", generator=gen(seed))
        with pytest.raises(ValueError, match="q_z's sample covariance is singular"):
            kivi_fast.adaptive_contrast_kl(line, None, contrast="full", generator=gen(seed))
    scales = torch.tensor([1e3, 1.0, 1e-3], dtype=dtype)
    for spread, mean in ((scales, 0.0), (1e-2, 10.0), (1.0, 1e5)):
        p, q = (torch.randn(100, 3, generator=gen(s), dtype=dtype) * spread + mean for s in (1, 2))
        assert torch.isfinite(kivi_fast.kl(p, q, contrast="full", generator=gen(3)))


def test_auto_takes_the_diagonal_of_a_batch_element_whose_samples_lie_on_a_subspace():
    """A generator with fewer noise dimensions than d puts its samples on a subspace, whose covariance
    "full" refuses. "auto" whitens that batch element by its diagonal: its whitened samples, E_q[log r]
    and their gradients are the diagonal contrast's (the oracle), the other elements' the full
    contrast's, and no gradient is NaN. kl and adaptive_contrast_kl are then finite."""
    from kivi_fast.contrast import GaussianFit, gaussian_contrast

    d = 6
    for seed in range(4):
        subspace = torch.randn(40, 3, generator=gen(seed), **f64) @ torch.randn(3, d, generator=gen(seed + 9), **f64)
        spread = torch.randn(40, d, generator=gen(seed + 20), **f64)
        batch = torch.stack([spread, subspace]).requires_grad_()
        z_hat, log_r = gaussian_contrast(batch, "auto")
        weights = torch.randn(2, 40, d, generator=gen(seed + 30), **f64)
        (grad,) = torch.autograd.grad((z_hat * weights).sum() + log_r.sum(), batch)
        assert torch.isfinite(grad).all()
        for element, oracle in ((0, "full"), (1, "diagonal")):
            x = batch[element].detach().clone().requires_grad_()
            z_o, log_r_o = gaussian_contrast(x, oracle)
            (grad_o,) = torch.autograd.grad((z_o * weights[element]).sum() + log_r_o, x)
            torch.testing.assert_close(z_hat[element], z_o, rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(log_r[element], log_r_o, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(grad[element], grad_o, rtol=1e-9, atol=1e-9)
        fit, diagonal = GaussianFit(batch.detach(), "full", fallback=True), GaussianFit(subspace, "diagonal")
        # (exactly the diagonal's constants at any n, d: n = 9, d = 7 is one where arithmetic rounds)
        small = GaussianFit(torch.stack([spread[:9, :7], subspace[:9, :7]]), "full", fallback=True)
        assert small.log_det_bias()[1].item() == GaussianFit(subspace[:9, :7], "diagonal").log_det_bias()
        assert fit.fell_back.tolist() == [False, True]
        assert fit.precision_factor()[1].item() == diagonal.precision_factor()
        assert fit.log_det_bias()[1].item() == diagonal.log_det_bias()
        assert fit.precision_factor()[0].item() == GaussianFit(spread, "full").precision_factor()
        with pytest.raises(ValueError, match="q_z's sample covariance is singular"):
            gaussian_contrast(subspace, "full")
        for half in (torch.bfloat16, torch.float16):  # their rounding is not spread: the same decisions
            assert GaussianFit(subspace.to(half).double(), "full", fallback=True,
                               sample_eps=torch.finfo(half).eps).fell_back.item()
            with pytest.raises(ValueError, match="q_z's sample covariance is singular"):
                kivi_fast.kl(spread.to(half), subspace.to(half), contrast="full")
        q = subspace.clone().requires_grad_()
        for estimate in (kivi_fast.kl(torch.randn(50, d, generator=gen(seed), **f64), q, generator=gen(seed)),
                         kivi_fast.kl(subspace, spread, generator=gen(seed)),  # the prior's side
                         kivi_fast.adaptive_contrast_kl(q, generator=gen(seed))):
            assert torch.isfinite(estimate)
            if estimate.requires_grad:
                assert torch.isfinite(torch.autograd.grad(estimate, q)[0]).all()


def test_a_hyperplane_in_64_dimensions_is_singular_and_just_more_samples_are_not():
    """The covariance's rounding grows with d (contrast.COVARIANCE_ROUNDINGS scales with sqrt(d eps)):
    samples on a hyperplane of d = 64 (float64, and rounded to float32) are singular on every draw,
    d + 1 draws of N(0, I), the fewest that span, on none."""
    from kivi_fast import contrast

    d = 64
    for seed in range(5):
        basis = torch.linalg.qr(torch.randn(d, d - 1, generator=gen(seed + 500), **f64))[0]
        plane = torch.randn(2 * d, d - 1, generator=gen(seed), **f64) @ basis.T
        for x, eps in ((plane, None), (plane.float().double(), torch.finfo(torch.float32).eps)):
            with pytest.raises(ValueError, match="sample covariance is singular"):
                contrast.whitening(x, "never", "x", eps)
    for seed in range(20):
        contrast.whitening(torch.randn(d + 1, d, generator=gen(seed), **f64), "never", "x")


@pytest.mark.parametrize("fallback", [False, True])
def test_a_devices_fit_makes_bad_elements_nan_and_leaves_the_others(monkeypatch, fallback):
    """On a GPU the contrast reads no value back (_validate.reads_values): a bad batch element's factor
    is NaN instead of the CPU's error. That branch, run here on CPU tensors: a dimension without spread
    (singular; under the fallback its diagonal does not factor either), a standard deviation below
    1e-150, a variance that overflows float64, a NaN sample. Each gives its element a NaN factor, and
    the good elements' fits are the CPU branch's."""
    from kivi_fast import _validate, contrast

    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 40, 3, generator=g, dtype=torch.float64) * torch.tensor([1.0, 2.0, 0.5]) + 0.3
    x[1, :, 2] = 0.5
    x[2] = x[2] * 1e-152
    x[3] = x[3] * 1e154
    x[4, 7, 1] = float("nan")
    good, bad = [0, 5], [1, 2, 3, 4]
    for i in bad:  # (the CPU's branch names each)
        with pytest.raises(ValueError):
            contrast.whitening(x[i:i + 1], fallback=fallback)
    want_mean, want_chol, want_rho = contrast.whitening(x[good], fallback=fallback)
    monkeypatch.setattr(_validate, "reads_values", lambda t: False)
    mean, chol, rho = contrast.whitening(x, fallback=fallback)
    assert chol[bad].isnan().all()
    torch.testing.assert_close(chol[good], want_chol, rtol=0, atol=0)
    torch.testing.assert_close(mean[good], want_mean, rtol=0, atol=0)
    torch.testing.assert_close(rho[good], want_rho, rtol=0, atol=0)
    contrast.check_std(x.std(-2, keepdim=True), "x")  # (the diagonal's check: nothing raised)


def test_bad_contrast_arguments_are_named():
    p, q = torch.randn(30, 2, **f64), torch.randn(30, 2, **f64)
    for kl in (kivi_fast.kl, reference.kl):
        with pytest.raises(ValueError, match="contrast must be one of 'auto', 'diagonal', 'full', 'none', got 'sph"):
            kl(p, q, contrast="spherical")
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


@pytest.mark.parametrize("to_standard_normal", [False, True])
@pytest.mark.parametrize("shape", [(20, 4), (3, 20, 4), (2, 5, 7)])
def test_the_diagonal_contrast_node_equals_autograd_through_its_composition(shape, to_standard_normal):
    """contrast._DiagonalContrast (whitening and -log det, or KL(r || N(0, I)) from the moments, in one
    node, the gradient in closed form) against autograd through the same composition, and against finite
    differences (gradcheck): with a cotangent on both outputs and on each alone."""
    from kivi_fast.contrast import _DiagonalContrast

    x = (torch.randn(*shape, generator=gen(3), **f64) * torch.linspace(0.5, 2.0, shape[-1], **f64) + 1.0)
    g_z = torch.randn(*shape, generator=gen(4), **f64)
    g_r = torch.randn(shape[:-2], generator=gen(5), **f64)
    bias = 0.25

    def composed(x):
        std, mean = x.std(-2, correction=0, keepdim=True), x.mean(-2, keepdim=True)
        if not to_standard_normal:
            return (x - mean) / std, -std.log().sum((-2, -1))
        # KL(N(m, s^2) || N(0, 1)) per dimension, summed: the textbook formula
        kl = (0.5 * (std.pow(2) + mean.pow(2) - 1) - std.log()).sum((-2, -1))
        return (x - mean) / std, kl + bias

    def node(x):
        return _DiagonalContrast.apply(x, "x", to_standard_normal, bias)

    for use_z, use_r in ((True, True), (True, False), (False, True)):
        grads = []
        for fn in (node, composed):
            xx = x.clone().requires_grad_()
            z, r = fn(xx)
            loss = (z * g_z).sum() * use_z + (r * g_r).sum() * use_r
            grads.append((z.detach(), r.detach(), torch.autograd.grad(loss, xx)[0]))
        for got, want in zip(*grads):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(node, x.clone().requires_grad_())


@pytest.mark.parametrize("shape", [(40, 3), (5, 30, 8), (2, 6, 9)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_kivi_ac_with_the_standard_normal_prior_equals_its_sample_average(shape, dtype):
    """adaptive_contrast_kl with log_prior None and the diagonal contrast takes E_q[log N(0, I)] in closed
    form from the fit's moments; passing the same log-density as a callable takes the sample average
    instead. Values and gradients agree (float64: to rounding; float32: the results' rounding)."""
    from kivi_fast.contrast import standard_normal_log_prob

    q = (torch.randn(*shape, generator=gen(6), **f64) * 1.5 + 0.4).to(dtype).requires_grad_()
    ref_z = torch.randn(*shape, generator=gen(7), **f64).to(dtype)
    w = torch.randn(shape[:-2], generator=gen(8), **f64).to(dtype)
    out = []
    for log_prior in (None, standard_normal_log_prob):
        kl = kivi_fast.adaptive_contrast_kl(q, log_prior, 1e-3, contrast="diagonal", reference_z=ref_z)
        out.append((kl, torch.autograd.grad((kl * w).sum(), q)[0]))
    tol = {"rtol": 1e-10, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-6, "atol": 1e-5}
    for got, want in zip(*out):
        assert got.dtype == dtype
        torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("contrast,shrink,n", [("diagonal", "auto", 30), ("diagonal", "auto", 3), ("full", "auto", 30),
                                               ("full", "always", 30), ("full", "auto", 4)])
def test_gaussian_contrast_gives_the_mean_log_density_of_its_fit(contrast, shrink, n):
    """gaussian_contrast's E_q[log r] (the whitened samples' mean square taken as d where the fit is the
    maximum-likelihood one, summed where the covariance was shrunk: shrink="always", or n <= d) against
    the mean of N(0, I)'s log-density at the whitened samples less the log-determinant, plus the bias
    correction, from GaussianFit."""
    from kivi_fast.contrast import GaussianFit, gaussian_contrast, standard_normal_log_prob

    q = torch.randn(2, n, 5, generator=gen(7), **f64) @ torch.randn(5, 5, generator=gen(8), **f64) + 0.5
    z_hat, mean_log_r = gaussian_contrast(q, contrast, shrink)
    fit = GaussianFit(q, contrast, shrink)
    want = (standard_normal_log_prob(fit.whiten(q)) - fit.log_det_scale()).mean(-1) + fit.log_det_bias()
    assert mean_log_r.shape == (2,)
    torch.testing.assert_close(z_hat, fit.whiten(q), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(mean_log_r, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("contrast,n,d", [("full", 20, 3), ("full", 60, 8), ("diagonal", 20, 3), ("diagonal", 60, 8)])
def test_the_fits_bias_corrections_match_a_monte_carlo_of_their_definitions(contrast, n, d):
    """GaussianFit's corrections for moments fitted to n Gaussian samples, against their definitions by
    Monte Carlo over 20,000 sample sets from N(m, S), S known and correlated: log_det_bias() is
    E[log |det S_hat^{1/2}|] - log |det S^{1/2}| (S_hat's diagonal for the diagonal fit), and c =
    precision_factor() makes c S_hat^{-1} unbiased for S^{-1}, here through E[c tr(S S_hat^{-1})] = d
    (the diagonal's: E[c sum_i S_ii / S_hat_ii] = d). Each within 4 standard errors of the Monte Carlo
    mean; an error of one in either formula's Wishart degrees of freedom is 30-40 of them."""
    from kivi_fast.contrast import GaussianFit

    sets, g = 20000, gen(11)
    a = torch.randn(d, d, generator=g, **f64)
    cov = a @ a.T / d + 0.5 * torch.eye(d, **f64)
    x = torch.randn(sets, n, d, generator=g, **f64) @ torch.linalg.cholesky(cov).T + 0.7
    fit = GaussianFit(x, contrast)
    if contrast == "full":
        true_log_det = torch.linalg.cholesky(cov).diagonal().log().sum()
        trace = (torch.cholesky_inverse(fit.chol) * cov).sum((-2, -1))
    else:
        true_log_det = 0.5 * cov.diagonal().log().sum()
        trace = (cov.diagonal() / fit.std[:, 0, :] ** 2).sum(-1)
    for stat, want in ((fit.log_det_scale()[:, 0] - true_log_det, fit.log_det_bias()),
                       (fit.precision_factor() * trace, float(d))):
        se = stat.std() / math.sqrt(sets)
        assert abs(stat.mean().item() - want) < 4 * se.item(), (stat.mean().item(), want, se.item())


def test_the_defaults_read_near_zero_at_q_equals_p():
    """At q = p = N(0, I) (d = 8, n = 100, 48 independent draws as one batch) the true KL is 0: kl and
    adaptive_contrast_kl, with their bias corrections, read within 0.2 nats of it on average (0.07 and
    0.03 on these draws); without the precision correction kl reads 0.53."""
    p = torch.randn(48, 100, 8, generator=gen(21), **f64)
    q = torch.randn(48, 100, 8, generator=gen(22), **f64)
    for name, values in (("kl", kivi_fast.kl(p, q, generator=gen(23))),
                         ("adaptive_contrast_kl", kivi_fast.adaptive_contrast_kl(q, None, generator=gen(24)))):
        mean, se = values.mean().item(), values.std().item() / math.sqrt(values.numel())
        assert abs(mean) < 0.2 and se < 0.05, (name, mean, se)


def test_the_kivi_ac_kl_of_a_vae_batch_takes_few_device_ops():
    """adaptive_contrast_kl at the VAE's shapes (128 x 100 samples in 8 dimensions, the diagonal contrast
    with the caller's N(0, I) draws), forward and backward: the ops that run on the device (the CPU's
    value checks and views left out), through ATen's composition of the contrast (the CUDA kernels'
    count: test_contrast_kernels.py). On a GPU each is a launch, and the KL's are most of a VAE step's
    small ops (bench/README.md, "GPU")."""
    z = torch.randn(128, 100, 8, generator=gen(1), requires_grad=True)
    prior = torch.randn(128, 100, 8, generator=gen(2))
    kivi_fast.adaptive_contrast_kl(z, None, 1e-3, contrast="diagonal", reference_z=prior).mean().backward()
    with DeviceOps() as count:
        kivi_fast.adaptive_contrast_kl(z, None, 1e-3, contrast="diagonal", reference_z=prior).mean().backward()
    assert "kivi_fast.kl.default" in count.names and "kivi_fast.kl_grad.default" in count.names
    # 38 with torch 2.13 (the caller's mean and its backward included); the bound leaves torch's own ops room
    assert len(count.names) <= 42, count.names


def test_the_q_equals_p_script_prints_each_estimators_mean(capsys):
    """scripts/bias_at_q_equals_p.py (the README's values at q = p): one line a dimension with every
    estimator's mean and standard error; bad arguments stop it with a usage error."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "bias_at_q_equals_p.py"
    spec = importlib.util.spec_from_file_location("bias_at_q_equals_p", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--n", "30", "--dims", "2,3", "--draws", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines[1:]] == ["d = 2", "d = 3"]
    for name in ("kl", 'kl, contrast="diagonal"', "adaptive_contrast_kl", "kernel_kl (lam 1e-3)"):
        assert all(f"; {name} " in "; " + line.split(": ", 1)[1] for line in lines[1:]), (name, lines)
    for bad in (["--draws", "1"], ["--dims", "8,x"]):
        with pytest.raises(SystemExit) as stop:
            script.main(bad)
        assert stop.value.code == 2
