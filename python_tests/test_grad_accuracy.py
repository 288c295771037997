"""Tests of ``kivi-fast grad-accuracy``: its closed forms, its gradient pipeline (given the exact KL in
place of the estimator it must give the exact gradient), the full-covariance adaptive contrast it
measures, and its command line (--quick writes its files; bad values are usage errors)."""

from __future__ import annotations

import json
import math
import statistics

import pytest
import torch

import kivi_fast
from kivi_fast import cli, contrast
from kivi_fast.experiments import grad_accuracy as ga


def _gaussian(d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    m = torch.randn(d, generator=gen, dtype=torch.float64)
    L = torch.tril(torch.randn(d, d, generator=gen, dtype=torch.float64), -1) * 0.5
    L = L + torch.diag(torch.rand(d, generator=gen, dtype=torch.float64) * 2 + 0.1)
    return m, L


@pytest.mark.parametrize("d", [1, 2, 8])
def test_closed_form_kl_and_gradient_match_torch_and_autograd(d):
    m, L = _gaussian(d, seed=d)
    q = torch.distributions.MultivariateNormal(m, scale_tril=L)
    p = torch.distributions.MultivariateNormal(torch.zeros(d, dtype=torch.float64),
                                               scale_tril=torch.eye(d, dtype=torch.float64))
    torch.testing.assert_close(ga.gaussian_kl(m, L), torch.distributions.kl_divergence(q, p))
    m_, L_ = m.clone().requires_grad_(), L.clone().requires_grad_()
    ga.gaussian_kl(m_, torch.tril(L_)).backward()
    gm, gL = ga.gaussian_kl_grad(m, L)
    torch.testing.assert_close(gm, m_.grad)
    torch.testing.assert_close(gL, torch.tril(L_.grad))
    assert bool((torch.triu(gL, 1) == 0).all())


def _moment_matched(reps: int, n: int, d: int, seed: int) -> torch.Tensor:
    """Standard-normal draws shifted and mapped so that each draw's sample mean is 0 and its
    (maximum-likelihood) sample covariance I exactly."""
    eps = torch.randn(reps, n, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    mean, chol, _ = contrast.whitening(eps, shrink="never")
    return contrast.whiten(eps, mean, chol)


@pytest.mark.parametrize("name", ["shift |m|=1.5", "iso s=0.05", "iso s=2", "corr s=0.2", "corr s=2", "blr x2"])
def test_pipeline_with_the_exact_kl_gives_the_exact_gradient(name):
    # With eps whose sample moments are exactly (0, I), the reparameterized gradient of the exact-density
    # KL estimate equals the closed-form gradient: this checks the plumbing (copies per draw, z = m + L eps,
    # the gradient vector's layout) with no Monte Carlo error in the way.
    case = next(c for c in ga.make_cases(["shift", "iso", "corr", "blr"], [3], 20.0, 0, seed=0) if c.name == name)
    eps = _moment_matched(5, 40, case.d, seed=len(name))
    prior = torch.randn(5, 40, case.d, dtype=torch.float64)
    grads, est = ga.draw_gradients(case, eps, prior, ga.exact_kl_estimate)
    torch.testing.assert_close(grads, case.true_grad.expand_as(grads), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(est, torch.full((5,), case.true_kl, dtype=torch.float64), rtol=1e-10, atol=1e-10)


def test_pipeline_with_the_exact_kl_matches_the_flow_truth():
    # The planar flow: the pipeline's per-draw gradients (each draw its own copy of the flow) against the
    # Monte Carlo truth computed on one flow. Independent samples on both sides, so a statistical check:
    # the mean gradient is within 4 standard errors (both sides' noise) of the truth.
    case = ga.FlowCase(2, truth_samples=40_000, seed=1)
    eps = torch.randn(40, 500, 2, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    grads, est = ga.draw_gradients(case, eps, eps, ga.exact_kl_estimate)
    stats = ga.gradient_stats(grads, case.true_grad)
    noise = math.hypot(stats["bias_noise"], case.true_grad_se / stats["true_norm"])
    assert stats["rel_error"] < 4 * noise and stats["cosine"] > 0.99, (stats, noise)
    assert abs(float(est.mean()) - case.true_kl) < 0.05


def test_full_covariance_contrast_is_near_exact_for_gaussians():
    # For a Gaussian q (n > d: no shrinkage) the whitened samples do not depend on (m, L), so the gradient
    # of the full-covariance adaptive contrast is the oracle's on the same draws, and unbiased. Asserted on
    # the same draws (equality) and as the median over 5 seeds of the rel. error of the mean gradient.
    cases = [c for c in ga.make_cases(["corr", "blr"], [8], 50.0, 0, seed=0) if c.name in ("corr s=1", "blr x0.5")]
    errors = {c.name: [] for c in cases}
    for case in cases:
        for seed in range(5):
            v = ga.Variant("ac-full", "median", 1.0, 1e-3, 100, 1)
            eps_seed, prior_seed = ga._seeds(seed, 0, v.n_q, v.n_p)
            eps = torch.randn(20, 100, case.d, generator=torch.Generator().manual_seed(eps_seed), dtype=torch.float64)
            prior = torch.randn(20, 100, case.d, generator=torch.Generator().manual_seed(prior_seed),
                                dtype=torch.float64)
            grads, _ = ga.draw_gradients(case, eps, prior, ga.estimator_fn(v, 1e-8, prior_seed))
            oracle, _ = ga.draw_gradients(case, eps, prior, ga.exact_kl_estimate)
            torch.testing.assert_close(grads, oracle, rtol=1e-7, atol=1e-9)
            errors[case.name].append(ga.gradient_stats(grads, case.true_grad)["rel_error"])
    for name, errs in errors.items():
        assert statistics.median(errs) < 0.05 and max(errs) < 0.1, (name, errs)


def test_shrinkage_intensity_matches_a_direct_computation():
    x = torch.randn(2, 15, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x[1, :, 1] += 2 * x[1, :, 0]  # a correlated pair
    for b in range(2):
        n = x.shape[1]
        y = (x[b] - x[b].mean(0)) / x[b].std(0)
        w = y[:, :, None] * y[:, None, :]                                  # [n, d, d]
        r = w.sum(0) / (n - 1)
        var_r = n / (n - 1) ** 3 * ((w - w.mean(0)) ** 2).sum(0)
        off = ~torch.eye(4, dtype=torch.bool)
        expected = min(1.0, float(var_r[off].sum() / r[off].pow(2).sum()))
        assert float(contrast.shrinkage_intensity(x)[b]) == pytest.approx(expected, rel=1e-10)
    # no correlation to keep: shrink (nearly) fully; a strong one seen in many samples: barely
    indep = torch.randn(1, 50, 20, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    assert float(contrast.shrinkage_intensity(indep)) > 0.7
    corr = ga.random_correlation(20, 50.0, seed=0)
    strong = torch.randn(1, 2000, 20, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    strong = strong @ torch.linalg.cholesky(corr).T
    assert float(contrast.shrinkage_intensity(strong)) < 0.05


def test_whitening_and_bandwidth_rules():
    q = torch.randn(3, 60, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 3 + 1
    p = torch.randn(3, 80, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    mean, chol, rho = contrast.whitening(q)
    z = contrast.whiten(q, mean, chol)
    torch.testing.assert_close(z.mean(1), torch.zeros(3, 5, dtype=torch.float64))
    torch.testing.assert_close(z.transpose(1, 2) @ z / 60, torch.eye(5, dtype=torch.float64).expand(3, 5, 5))
    assert bool((rho == 0).all())
    _, chol_small, rho_small = contrast.whitening(q[:, :4])  # n <= d: shrunk, still a valid Cholesky factor
    assert bool((rho_small > 0).all()) and bool(torch.isfinite(chol_small).all())
    med_q = kivi_fast.median_bandwidth(q)
    torch.testing.assert_close(ga.bandwidth("median", p, q), kivi_fast.median_bandwidth(torch.cat([p, q], 1)))
    torch.testing.assert_close(ga.bandwidth("median-q", p, q, 2.0), 2 * med_q)
    torch.testing.assert_close(ga.bandwidth("svgd", p, q), med_q / math.sqrt(2 * math.log(60)))
    corr = ga.random_correlation(6, 30.0, seed=3)
    torch.testing.assert_close(corr.diagonal(), torch.ones(6, dtype=torch.float64))
    assert float(torch.linalg.cond(corr)) == pytest.approx(30.0, rel=1e-6)


def test_diag_contrast_with_the_median_rule_is_the_library_call():
    # ac-diag/median must measure adaptive_contrast_kl exactly as users call it today
    q = torch.randn(4, 50, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 0.3 + 1
    eps = torch.randn(4, 80, 3, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    ours = ga.diag_contrast_kl(q, eps, 1e-3, prior_seed=9)
    library = kivi_fast.adaptive_contrast_kl(q, None, 1e-3, n_prior=80, contrast="diagonal",
                                             generator=torch.Generator().manual_seed(9))
    torch.testing.assert_close(ours, library, rtol=1e-12, atol=1e-12)


def test_quick_run_writes_its_files(tmp_path, capsys):
    run_dir = tmp_path / "ga"
    assert cli.main(["grad-accuracy", "--quick", "--no-progress", "--run-dir", str(run_dir)]) == 0
    for name in ("results.json", "table.md", "rel_error_vs_d.png", "cosine_vs_scale.png", "grid.png", "n_sweep.png"):
        assert (run_dir / name).stat().st_size > 0, name
    assert "| oracle (true ratio) |" in capsys.readouterr().out
    data = json.loads((run_dir / "results.json").read_text())
    assert len(data["cells"]) == len(data["cases"]) * len(data["variants"])
    assert "## Per case: the key variants" in (run_dir / "table.md").read_text()


BAD = ["--dims=0", "--reps=1", "--base-n=1", "--base-lam=0", "--rules=mean", "--factors=-1", "--lams=0",
       "--ns=1", "--prior-ratios=0", "--grid=all", "--condition=0.5", "--condition=nan", "--clip=0",
       "--flow-truth-samples=10", "--seed=-1", "--cases=mnist", "--base-lam=1e-300", "--seed=4294967296",
       "--base-n=3", "--ns=3", "--quick --base-n 3 --cases blr"]


@pytest.mark.parametrize("bad", BAD)
def test_bad_values_are_usage_errors(bad, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["grad-accuracy", *bad.split(), "--no-progress", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert err.startswith("usage: kivi-fast grad-accuracy") and "kivi-fast grad-accuracy: error: " in err
    assert "Traceback" not in err and not any(tmp_path.iterdir())


def test_derived_seeds_fit_torch_for_every_seed():
    """--seed up to 2**32 - 1 derived seeds above 2**64, which torch refused; below that they are unchanged."""
    assert ga._seeds(3, 2, 40, 80) == ((3 * 1_000_003 + 2 * 7_919) * 10_007 + 40,
                                       (3 * 1_000_003 + 2 * 7_919) * 10_007 + 5_003 + 40 * 1_013 + 80)
    for value in ga._seeds(2**32 - 1, 9, 200, 800):
        torch.Generator().manual_seed(value)


def test_every_case_has_a_gradient_to_compare_with_in_one_dimension_too():
    """The relative errors divide by the true gradient's norm: in d = 1 the corr family's s = 1 case is
    the prior itself (a zero gradient: `--dims 1` ended in a ZeroDivisionError), so corr starts at d = 2."""
    cases = ga.make_cases(list(ga.CASE_FAMILIES), [1, 2], 20.0, 0, seed=0)
    gaussians = [c for c in cases if isinstance(c, ga.GaussianCase)]
    assert all(sum(float(g.norm()) for g in ga.gaussian_kl_grad(c.m, c.L)) > 0 for c in gaussians)
    assert {c.d for c in cases if c.family == "corr"} == {2}
    assert {c.d for c in cases if c.family == "iso"} == {1, 2}
