"""``kivi-fast grad-accuracy``: how accurate is the gradient of KIVI's KL estimate? (a diagnostic)

VI follows the gradient of the KL term, not its value (the paper's Eq. 8): this study measures that
gradient against the truth, for posteriors q whose KL(q || N(0, I)) and its gradient w.r.t. q's own
parameters are known, and for the estimator choices that could become defaults (issue 27).

Cases (prior p = N(0, I)):

* Gaussians q = N(m, L L^T), reparameterized as z = m + L eps, parameters (m, lower-triangular L):
  ``shift`` (|m| = 1.5, L = I), ``iso s=...`` (L = s I: shrunk 0.05x-0.5x, widened 2x), ``corr s=...``
  (L = s chol(R), R a random correlation matrix with condition number ``--condition``, drawn with
  the eigenvalues fixed, Davies & Higham 2000, ``scipy.stats.random_correlation``), in each d of
  ``--dims``; and ``blr xc`` in d = 2: the mean and c^2 times the covariance of the ``blr``
  posterior (HMC, results/diagnostics/blr/metrics.json; correlation -0.83), the issue's probe.
  KL = (||L||_F^2 + ||m||^2 - d) / 2 - sum log |L_ii|, and its gradient is (m, L - diag(1/L_ii)).
* ``planar flow``: :class:`kivi_fast.nn.PlanarFlow` (4 layers, the one ``kl-accuracy`` uses), the
  parameters its (u, w, b). log q is exact at the flow's samples, so the true gradient is the
  reparameterized gradient of E_q[log q(z) - log p(z)] over ``--flow-truth-samples`` draws (its
  standard error is reported).

For each cell (case, d, variant), ``--reps`` independent draws of n_q posterior and n_p prior samples
are batched as [B, n, d] into one estimator call; autograd through z = z(eps; params) gives one
gradient g_b per draw. With g* the truth and g_bar the mean over draws:

* step cosine: cos(g_b, g*), the median over the draws: how well one draw's gradient points, bias and
  noise together (0 for a zero gradient); it ranks the variants.
* cosine: cos(g_bar, g*); rel. error: ||g_bar - g*|| / ||g*|| (the bias; its own noise is about
  spread / sqrt(reps), reported as ``bias_noise``, and ``rel_bias_corrected`` takes it out); spread:
  sqrt(sum_k var_b(g_bk)) / ||g*||, the std of one draw's gradient relative to the true norm (Bessel's
  correction).
* Draws are shared between variants with the same n_q and n_p (common random numbers), so variants
  are compared on the same samples.

Estimators (``variant.estimator``):

* ``oracle``: -mean log(p/q)(z) with q's exact log-density: the reparameterized gradient with the
  true ratio, i.e. the noise floor of n_q samples, no density-ratio error.
* ``plain``: ``kivi_fast.kernel_kl(prior, q, lam, bandwidth=sigma)`` with sigma from a bandwidth rule.
* ``kl``: ``kivi_fast.kl(prior, q, lam)``, the library's default: a Gaussian contrast of both sample
  sets (:func:`kivi_fast.contrast.sample_contrast_kl`), median rule on the whitened samples.
* ``ac-diag``: ``kivi_fast.adaptive_contrast_kl(contrast="diagonal")`` (per-dimension
  standardization, the paper's Appendix D).
* ``ac-full``: adaptive contrast by a full-covariance Gaussian (:func:`full_contrast_kl`); the
  covariance is shrunk toward its diagonal when n_q <= d (``ac-full-shrink``: always), by the
  Schaefer & Strimmer (2005) intensity (:func:`shrinkage_intensity`).
* ``whitened``: ``kivi_fast.kernel_kl`` on both sample sets mapped by q's sample whitening (held fixed, no
  gradient through the map): KL is invariant under one invertible map applied to both (issue 27), and
  this amounts to a kernel with q's Mahalanobis metric.

Bandwidth rules (:func:`bandwidth`), each times ``factor``: ``median`` (median distance over the
n_p + n_q points, the paper's and the library's), ``median-q`` (over q's points only),
``svgd`` (SVGD's h = med_q^2 / log n_q in exp(-r^2 / h) (Liu & Wang 2016, Sec. 5), i.e. in kivi's
exp(-r^2 / (2 sigma^2)) sigma = med_q / sqrt(2 log n_q)), ``silverman`` (the normal-reference rule of
Silverman 1986, Ch. 4, H = (4 / ((d + 2) n))^(2 / (d + 4)) S as in R's ks::Hns and kernelboot::bw.silv,
made isotropic: sigma = s_q (4 / ((d + 2) n_q))^(1 / (d + 4)), s_q the root mean per-dimension variance
of q's samples).

The default grid (``--grid default``) runs at the base n_q (``--base-n``, 100): plain with every rule x
factor (1, 0.5x, 2x) x lam x n_p / n_q (1, 4); ``ac-diag`` and ``ac-full`` with every rule x lam x
n_p / n_q; ``kl`` (median) with every lam x n_p / n_q; ``ac-full-shrink`` per lam; ``whitened`` per
rule; the oracle per n_q. Then it runs the n_q sweep (``--ns``) of the paper's setting (plain,
median, lam 1e-3, n_p = n_q) and of the best variant of plain, ``kl``, ``ac-diag`` and ``ac-full``
(:func:`best_variants`: the highest median step cosine over the cells, to 2 decimals; ties go to
more good cells, then to the smaller worst rel. error). ``--grid full`` runs every combination
instead, n_q included (about 10x longer: an hour on 2 cores).

Outputs: ``results.json`` (every cell, one line each: the fields of ``cell_columns``, case and variant as
indices into ``cases`` and ``variants``), ``table.md`` (the key variants, overall and by regime, per case
the best variant of each estimator, every variant over all cells, every case x variant with the medians over d),
``rel_error_vs_d.png``, ``cosine_vs_scale.png`` (key variants), ``grid.png`` (step cosine over rule x
factor x lam x n_p / n_q) and ``n_sweep.png``.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import math
import statistics
import time
import warnings
from dataclasses import asdict, dataclass, replace

import torch
from tqdm.auto import tqdm

import kivi_fast
from kivi_fast.contrast import DEFAULT_LAM, GaussianFit, gaussian_contrast, standard_normal_log_prob, whiten, whitening

from ..nn import PlanarFlow
from . import runs
from .options import (add_common, apply_quick, check_prior_samples, int_at_least, kivi_clip, kivi_lam,
                      plural, positive_float, positive_int, random_seed)

NAME = "grad-accuracy"
RULES = ("median", "median-q", "svgd", "silverman")
ESTIMATORS = ("oracle", "plain", "kl", "ac-diag", "ac-full", "ac-full-shrink", "whitened")
ISO_SCALES = (0.05, 0.2, 0.5, 2.0)
CORR_SCALES = (0.2, 1.0, 2.0)
BLR_SCALES = (0.5, 1.0, 2.0)
CASE_FAMILIES = ("shift", "iso", "corr", "blr", "flow")
# The blr posterior by HMC (results/diagnostics/blr/metrics.json, "hmc": 10,000 draws), rounded.
BLR_MEAN = (-1.139, 0.9615)
BLR_COV = ((0.02857, -0.02035), (-0.02035, 0.02080))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seed", type=random_seed, default=0, help="random seed")
    parser.add_argument("--dims", type=positive_int, nargs="+", default=[2, 8, 32, 128],
                        help="dimensions d of the shift, iso, corr and flow cases (blr is 2-D; corr needs d >= 2)")
    parser.add_argument("--cases", choices=CASE_FAMILIES, nargs="+", default=list(CASE_FAMILIES),
                        help="case families to run")
    parser.add_argument("--reps", type=int_at_least(2), default=40,
                        help="independent draws per cell (one batched estimator call)")
    parser.add_argument("--base-n", type=int_at_least(2), default=100, help="n_q of the base setting")
    parser.add_argument("--base-lam", type=kivi_lam, default=1e-3, help="lam of the base setting")
    parser.add_argument("--rules", choices=RULES, nargs="+", default=list(RULES), help="bandwidth rules")
    parser.add_argument("--factors", type=positive_float, nargs="+", default=[0.5, 2.0],
                        help="multiples of each rule's bandwidth (plain; every estimator with --grid full)")
    parser.add_argument("--lams", type=kivi_lam, nargs="+", default=[1e-4, 1e-3, 1e-2, 1e-1],
                        help="ridge coefficients lam")
    parser.add_argument("--ns", type=int_at_least(2), nargs="+", default=[50, 100, 200],
                        help="posterior sample sizes n_q of the n_q sweep")
    parser.add_argument("--prior-ratios", type=positive_int, nargs="+", default=[1, 4],
                        help="n_p / n_q (prior samples are cheap)")
    parser.add_argument("--grid", choices=("default", "full"), default="default",
                        help="which grid: 'default' (the default) runs every rule x factor x lam x n_p/n_q at the "
                             "base n_q, then an n_q sweep of the best variants; 'full' every combination with "
                             "every n_q")
    parser.add_argument("--condition", type=float_at_least_one, default=50.0,
                        help="condition number of the corr cases' correlation matrix")
    parser.add_argument("--clip", type=kivi_clip, default=1e-8, help="lower clip of the density ratio")
    parser.add_argument("--flow-truth-samples", type=int_at_least(2000), default=200_000,
                        help="Monte Carlo draws for the planar flow's true gradient")
    add_common(parser, name=NAME, quick="a small grid that runs in seconds")


def float_at_least_one(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {text!r}") from None
    if not (math.isfinite(value) and value >= 1):
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {text!r}")
    return value


QUICK = {"dims": [2, 8], "cases": ["iso", "corr", "blr", "flow"], "reps": 6, "base_n": 40, "rules": ["median", "svgd"],
         "factors": [2.0], "lams": [1e-3, 1e-1], "ns": [40], "prior_ratios": [1, 2], "flow_truth_samples": 4000}


# ----------------------------------------------------------------------------------------------------
# Closed forms for Gaussians


def gaussian_kl(m: torch.Tensor, L: torch.Tensor) -> torch.Tensor:
    """KL(N(m, L L^T) || N(0, I)) for a lower-triangular L: (||L||_F^2 + ||m||^2 - d) / 2 - sum log |L_ii|."""
    d = m.shape[-1]
    return 0.5 * (L.pow(2).sum((-2, -1)) + m.pow(2).sum(-1) - d) - L.diagonal(dim1=-2, dim2=-1).abs().log().sum(-1)


def gaussian_kl_grad(m: torch.Tensor, L: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradient of :func:`gaussian_kl` w.r.t. m and the lower triangle of L: (m, L - diag(1 / L_ii))."""
    return m.clone(), torch.tril(L) - torch.diag_embed(1.0 / L.diagonal(dim1=-2, dim2=-1))


def random_correlation(d: int, condition: float, seed: int) -> torch.Tensor:
    """A random d x d correlation matrix with condition number ``condition``: eigenvalues spaced
    geometrically from 1 to ``condition`` (scaled to sum to d), random eigenvectors that keep a unit
    diagonal (Davies & Higham 2000, via ``scipy.stats.random_correlation``)."""
    if d == 1:
        return torch.ones(1, 1, dtype=torch.float64)
    import numpy as np
    from scipy.stats import random_correlation as rc

    eig = np.geomspace(1.0, condition, d)
    eig = eig * d / eig.sum()
    eig[-1] = d - eig[:-1].sum()  # the sum must be d to rounding
    corr = torch.from_numpy(rc.rvs(eig, random_state=np.random.default_rng(seed), tol=1e-10))
    return 0.5 * (corr + corr.T)


# ----------------------------------------------------------------------------------------------------
# Cases: a q with parameters, per-draw copies of them, its samples with exact log q, and the truth


class GaussianCase:
    """q = N(m, L L^T); parameters (m, lower triangle of L)."""

    def __init__(self, name: str, family: str, scale: float, m: torch.Tensor, L: torch.Tensor):
        self.name, self.family, self.scale = name, family, scale
        self.m, self.L = m.double(), torch.tril(L.double())
        self.d = self.m.shape[0]
        self.rows, self.cols = torch.tril_indices(self.d, self.d)
        gm, gL = gaussian_kl_grad(self.m, self.L)
        self.true_grad = torch.cat([gm, gL[self.rows, self.cols]])
        self.true_grad_se = 0.0
        self.true_kl = float(gaussian_kl(self.m, self.L))
        self.n_m = self.d  # the first n_m entries of a gradient vector are m's, the rest L's

    def leaves(self, reps: int) -> list[torch.Tensor]:
        return [self.m.expand(reps, -1).clone().requires_grad_(),
                self.L.expand(reps, -1, -1).clone().requires_grad_()]

    def sample(self, leaves, eps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """z = m + L eps ([B, n, d]) and the exact log q(z) [B, n]. log N(z; m, L L^T) at z = m + L eps
        is log N(eps; 0, I) - log|det L|, with the same total derivative, so it is written so."""
        m, L = leaves[0], torch.tril(leaves[1])
        z = m.unsqueeze(-2) + eps @ L.transpose(-1, -2)
        log_q = standard_normal_log_prob(eps) - L.diagonal(dim1=-2, dim2=-1).abs().log().sum(-1, keepdim=True)
        return z, log_q

    def grad_vectors(self, leaves) -> torch.Tensor:
        return torch.cat([leaves[0].grad, leaves[1].grad[:, self.rows, self.cols]], dim=1)


class FlowCase:
    """q = a planar flow of N(0, I); parameters its (u, w, b). The truth is Monte Carlo."""

    family, scale = "flow", None

    def __init__(self, d: int, truth_samples: int, seed: int):
        self.name, self.d = "planar flow", d
        self.flow = PlanarFlow.random(d, 4, generator=torch.Generator().manual_seed(1000 + d)).double()
        gen = torch.Generator().manual_seed(seed)
        # 20 chunks: the truth is their weighted mean, its standard error their spread / sqrt(20)
        sizes = [len(c) for c in torch.arange(truth_samples).chunk(20)]
        grads, kls = [], []
        for size in sizes:
            x = torch.randn(1, size, d, generator=gen, dtype=torch.float64)
            z, log_q = self.sample([self.flow], x)
            obj = (log_q - standard_normal_log_prob(z)).mean()
            grads.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(obj, list(self.flow.parameters()))]))
            kls.append(float(obj.detach()))
        g, w = torch.stack(grads), torch.tensor(sizes, dtype=torch.float64) / truth_samples
        self.true_grad = (w[:, None] * g).sum(0)
        self.true_grad_se = float(g.std(0).norm()) / math.sqrt(len(sizes))
        self.true_kl = float((w * torch.tensor(kls, dtype=torch.float64)).sum())
        self.n_m = None

    def leaves(self, reps: int) -> list[PlanarFlow]:
        return [copy.deepcopy(self.flow) for _ in range(reps)]

    def sample(self, leaves, eps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = [flow(e) for flow, e in zip(leaves, eps)]
        z = torch.stack([o[0] for o in out])
        log_q = standard_normal_log_prob(eps) - torch.stack([o[1] for o in out])
        return z, log_q

    def grad_vectors(self, leaves) -> torch.Tensor:
        return torch.stack([torch.cat([p.grad.reshape(-1) for p in flow.parameters()]) for flow in leaves])


def make_cases(families, dims, condition: float, truth_samples: int, seed: int) -> list:
    cases = []
    for d in dims:
        for family in families:
            if family == "shift":
                cases.append(GaussianCase("shift |m|=1.5", family, 1.0,
                                          torch.full((d,), 1.5 / math.sqrt(d)), torch.eye(d)))
            elif family == "iso":
                cases += [GaussianCase(f"iso s={s:g}", family, s, torch.zeros(d), s * torch.eye(d)) for s in ISO_SCALES]
            elif family == "corr" and d >= 2:  # (in one dimension corr s=1 is the prior: no gradient to compare)
                chol = torch.linalg.cholesky(random_correlation(d, condition, seed=10_000 + d))
                cases += [GaussianCase(f"corr s={s:g}", family, s, torch.zeros(d), s * chol) for s in CORR_SCALES]
            elif family == "flow":
                cases.append(FlowCase(d, truth_samples, seed=seed * 7919 + d))
    if "blr" in families:
        chol = torch.linalg.cholesky(torch.tensor(BLR_COV, dtype=torch.float64))
        cases += [GaussianCase(f"blr x{c:g}", "blr", c, torch.tensor(BLR_MEAN), c * chol) for c in BLR_SCALES]
    return cases


# ----------------------------------------------------------------------------------------------------
# Candidate bandwidth rules and estimators (candidates to measure; not library API)


def bandwidth(rule: str, prior_z: torch.Tensor, q_z: torch.Tensor, factor: float = 1.0) -> torch.Tensor:
    """The bandwidth sigma [B] of a rule for batched samples [B, n, d] (no gradient); see the module doc."""
    prior_z, q_z = prior_z.detach(), q_z.detach()
    n, d = q_z.shape[-2], q_z.shape[-1]
    if rule == "median":
        sigma = kivi_fast.median_bandwidth(torch.cat([prior_z, q_z], dim=-2))
    elif rule == "median-q":
        sigma = kivi_fast.median_bandwidth(q_z)
    elif rule == "svgd":
        sigma = kivi_fast.median_bandwidth(q_z) / math.sqrt(2 * math.log(n))
    elif rule == "silverman":
        s = q_z.var(-2).mean(-1).sqrt()
        sigma = s * (4.0 / ((d + 2) * n)) ** (1.0 / (d + 4))
    else:
        raise ValueError(f"unknown bandwidth rule {rule!r}")
    return sigma * factor


def full_contrast_kl(q_z: torch.Tensor, prior_eps: torch.Tensor, lam: float, *, rule: str = "median",
                     factor: float = 1.0, shrink: str = "auto", clip: float = 1e-8) -> torch.Tensor:
    """``adaptive_contrast_kl(contrast="full")`` against N(0, I) with given contrast samples
    ``prior_eps`` [B, n_p, d] and the bandwidth of ``rule`` on them and the whitened q (the library's
    :func:`kivi_fast.contrast.gaussian_contrast`, so the study measures the library's math)."""
    z_hat, log_r = gaussian_contrast(q_z, "full", shrink)
    eps_hat = GaussianFit(prior_eps, "full", shrink).whiten(prior_eps)  # as contrast.reference_draws
    sigma = bandwidth(rule, eps_hat, z_hat, factor)
    kernel_part = kivi_fast.kernel_kl(eps_hat, z_hat, lam, clip=clip, bandwidth=sigma)
    return kernel_part + log_r - standard_normal_log_prob(q_z).mean(-1)


def whitened_kl(prior_z: torch.Tensor, q_z: torch.Tensor, lam: float, *, rule: str = "median",
                factor: float = 1.0, clip: float = 1e-8) -> torch.Tensor:
    """``kivi_fast.kernel_kl`` after mapping both sample sets by q's sample whitening, the map held fixed (KL is
    invariant under one invertible map of both; the gradient flows through q's samples only)."""
    with torch.no_grad():
        mean, chol, _ = whitening(q_z)
    p_hat, q_hat = whiten(prior_z, mean, chol), whiten(q_z, mean, chol)
    return kivi_fast.kernel_kl(p_hat, q_hat, lam, clip=clip, bandwidth=bandwidth(rule, p_hat, q_hat, factor))


def diag_contrast_kl(q_z: torch.Tensor, prior_eps: torch.Tensor, lam: float, *, rule: str = "median",
                     factor: float = 1.0, clip: float = 1e-8, prior_seed: int = 0) -> torch.Tensor:
    """``kivi_fast.adaptive_contrast_kl`` (per-dimension), its contrast samples drawn from a generator
    seeded with ``prior_seed`` (they equal ``prior_eps``) and the bandwidth of ``rule`` on them and the
    standardized q (the standardization of adaptive_contrast_kl: std dividing by n)."""
    q_hat = (q_z - q_z.mean(-2, keepdim=True)) / q_z.std(-2, correction=0, keepdim=True)
    eps_hat = GaussianFit(prior_eps, "diagonal").whiten(prior_eps)  # the draws as the library whitens them
    sigma = bandwidth(rule, eps_hat, q_hat, factor)
    return kivi_fast.adaptive_contrast_kl(q_z, None, lam, contrast="diagonal", n_prior=prior_eps.shape[-2], clip=clip,
                                          bandwidth=sigma, generator=torch.Generator().manual_seed(prior_seed))


# ----------------------------------------------------------------------------------------------------
# Variants and the gradient pipeline


@dataclass(frozen=True)
class Variant:
    estimator: str
    rule: str
    factor: float
    lam: float
    n_q: int
    prior_ratio: int

    @property
    def n_p(self) -> int:
        return self.n_q * self.prior_ratio

    @property
    def method(self) -> str:
        """Estimator and bandwidth, e.g. ``plain/median-q x2``."""
        if self.estimator == "oracle":
            return "oracle (true ratio)"
        return f"{self.estimator}/{self.rule}" + (f" x{self.factor:g}" if self.factor != 1 else "")

    @property
    def name(self) -> str:
        if self.estimator == "oracle":
            return f"{self.method} n_q={self.n_q}"
        return f"{self.method} lam={self.lam:g} n_q={self.n_q} n_p={self.n_p}"


def exact_kl_estimate(prior_z, q_z, log_q):
    """-mean log(p/q)(z) with q's exact log-density: the pipeline's oracle (and its plumbing check)."""
    return (log_q - standard_normal_log_prob(q_z)).mean(-1)


def estimator_fn(variant: Variant, clip: float, prior_seed: int):
    """``f(prior_z, q_z, log_q) -> [B]`` for a variant."""
    v = variant
    if v.estimator == "oracle":
        return exact_kl_estimate
    if v.estimator == "plain":
        return lambda p, q, _: kivi_fast.kernel_kl(p, q, v.lam, clip=clip, bandwidth=bandwidth(v.rule, p, q, v.factor))
    if v.estimator == "kl":
        return lambda p, q, _: kivi_fast.kl(p, q, v.lam, clip=clip, generator=torch.Generator().manual_seed(prior_seed))
    if v.estimator == "ac-diag":
        return lambda p, q, _: diag_contrast_kl(q, p, v.lam, rule=v.rule, factor=v.factor, clip=clip,
                                                prior_seed=prior_seed)
    if v.estimator in ("ac-full", "ac-full-shrink"):
        shrink = "always" if v.estimator == "ac-full-shrink" else "auto"
        return lambda p, q, _: full_contrast_kl(q, p, v.lam, rule=v.rule, factor=v.factor, shrink=shrink, clip=clip)
    if v.estimator == "whitened":
        return lambda p, q, _: whitened_kl(p, q, v.lam, rule=v.rule, factor=v.factor, clip=clip)
    raise ValueError(f"unknown estimator {v.estimator!r}")


def draw_gradients(case, eps: torch.Tensor, prior_z: torch.Tensor, estimate) -> tuple[torch.Tensor, torch.Tensor]:
    """The reparameterized gradient of ``estimate(prior_z, z, log_q)`` w.r.t. the case's parameters, one
    per draw: z = z(eps; params) for eps [B, n, d], each draw with its own copy of the parameters.
    Returns the gradients [B, P] and the estimates [B]."""
    leaves = case.leaves(eps.shape[0])
    z, log_q = case.sample(leaves, eps)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", kivi_fast.ClippingWarning)  # part of what is measured, not news
        est = estimate(prior_z, z, log_q)
    est.sum().backward()
    return case.grad_vectors(leaves), est.detach()


def gradient_stats(grads: torch.Tensor, truth: torch.Tensor, n_m: int | None = None) -> dict:
    """Bias and spread of gradients [B, P] against the truth [P] (see the module doc)."""
    reps = grads.shape[0]
    norm = float(truth.norm())
    g_bar = grads.mean(0)
    rel_error = float((g_bar - truth).norm()) / norm
    spread = float(grads.var(0).sum().sqrt()) / norm
    step_cos = torch.nn.functional.cosine_similarity(grads, truth.expand_as(grads), dim=1)
    out = {
        "cosine": float(torch.nn.functional.cosine_similarity(g_bar, truth, dim=0)),
        "rel_error": rel_error,
        # E||g_bar - g*||^2 = ||bias||^2 + tr(Cov) / reps: the bias with the draws' noise taken out
        "rel_bias_corrected": math.sqrt(max(0.0, rel_error**2 - spread**2 / reps)),
        "spread": spread,
        "bias_noise": spread / math.sqrt(reps),
        "step_cosine": float(step_cos.median()),
        "rmse_one_draw": float((grads - truth).pow(2).sum(1).mean().sqrt()) / norm,
        "true_norm": norm,
    }
    if n_m is not None:  # Gaussians: the L part alone (the probe measured that)
        t_L = truth[n_m:]
        if float(t_L.norm()) > 0:
            out["rel_error_L"] = float((g_bar[n_m:] - t_L).norm() / t_L.norm())
            out["spread_L"] = float(grads[:, n_m:].var(0).sum().sqrt() / t_L.norm())
    return out


def _seeds(seed: int, case_index: int, n_q: int, n_p: int) -> tuple[int, int]:
    base = (seed * 1_000_003 + case_index * 7_919) * 10_007
    # modulo torch's seed range (2**64): the same seeds as before wherever they fit, and any --seed works
    return (base + n_q) % 2**64, (base + 5_003 + n_q * 1_013 + n_p) % 2**64


def run_cell(case, case_index: int, variant: Variant, reps: int, clip: float, seed: int) -> dict:
    """One cell: ``reps`` draws (the same for every variant with this n_q and n_p), their gradients'
    statistics (:func:`gradient_stats`), the mean KL estimate and the seconds the gradients took."""
    eps_seed, prior_seed = _seeds(seed, case_index, variant.n_q, variant.n_p)
    eps = torch.randn(reps, variant.n_q, case.d, generator=torch.Generator().manual_seed(eps_seed),
                      dtype=torch.float64)
    prior = torch.randn(reps, variant.n_p, case.d, generator=torch.Generator().manual_seed(prior_seed),
                        dtype=torch.float64)
    t0 = time.perf_counter()
    grads, est = draw_gradients(case, eps, prior, estimator_fn(variant, clip, prior_seed))
    elapsed = time.perf_counter() - t0
    if not bool(torch.isfinite(grads).all()):
        raise FloatingPointError(f"non-finite gradient for {case.name}, d={case.d}, {variant.name}")
    row = {"case": case.name, "family": case.family, "scale": case.scale, "d": case.d, "variant": variant.name,
           "method": variant.method, **asdict(variant), "mean_kl_estimate": float(est.mean()), "seconds": elapsed}
    row.update(gradient_stats(grads, case.true_grad, case.n_m))
    return row


# ----------------------------------------------------------------------------------------------------
# The grid

SWEPT = ("plain", "kl", "ac-diag", "ac-full")  # the estimators whose best configuration gets the n sweep


def paper_variant(args) -> Variant:
    """The paper's setting: plain, median over all points, n_p = n_q."""
    return Variant("plain", "median", 1.0, args.base_lam, args.base_n, 1)


def first_pass_variants(args) -> list[Variant]:
    """Every variant at the base n_q (with --grid full: every variant)."""
    lams = sorted(set(args.lams) | {args.base_lam})
    ratios = sorted(set(args.prior_ratios) | {1})
    factors = sorted(set(args.factors) | {1.0})
    ns = sorted(set(args.ns) | {args.base_n})
    if args.grid == "full":
        out = [Variant("oracle", "-", 1.0, 0.0, n, 1) for n in ns]
        out += [Variant(*combo) for combo in itertools.product(
            [e for e in ESTIMATORS if e != "oracle"], args.rules, factors, lams, ns, ratios)]
        return out
    n0 = args.base_n
    out = [Variant("oracle", "-", 1.0, 0.0, n, 1) for n in ns]
    out += [Variant("plain", r, f, lam, n0, k) for r, f, lam, k in itertools.product(args.rules, factors, lams, ratios)]
    for est in ("ac-diag", "ac-full"):
        out += [Variant(est, r, 1.0, lam, n0, k) for r, lam, k in itertools.product(args.rules, lams, ratios)]
    out += [Variant("kl", "median", 1.0, lam, n0, k) for lam, k in itertools.product(lams, ratios)]
    out += [Variant("ac-full-shrink", "median", 1.0, lam, n0, 1) for lam in lams]
    out += [Variant("whitened", r, 1.0, args.base_lam, n0, 1) for r in args.rules]
    return list(dict.fromkeys(out))


def variant_of(row: dict) -> Variant:
    return Variant(row["estimator"], row["rule"], row["factor"], row["lam"], row["n_q"], row["prior_ratio"])


def best_variants(rows: list[dict], n_q: int) -> dict[str, Variant]:
    """Per estimator, the variant at this n_q with the highest median step cosine over its cells, to 2
    decimals (closer variants are not told apart by 40 draws); ties go to more good cells (rel. error <
    0.2 and spread < 1), then to the smaller worst rel. error."""
    best = {}
    for est in dict.fromkeys(r["estimator"] for r in rows if r["estimator"] != "oracle"):
        scores = {}
        for name in dict.fromkeys(r["variant"] for r in rows if r["estimator"] == est and r["n_q"] == n_q):
            cell = summarize([r for r in rows if r["variant"] == name])
            scores[variant_of(next(r for r in rows if r["variant"] == name))] = (
                round(cell["step_cosine"], 2), cell["good"], -cell["worst_rel_error"])
        if scores:
            best[est] = max(scores, key=scores.get)
    return best


def second_pass_variants(args, rows: list[dict]) -> list[Variant]:
    """The n sweep of the paper's setting and of each swept estimator's best (nothing with --grid full)."""
    if args.grid == "full":
        return []
    best = best_variants(rows, args.base_n)
    configs = [paper_variant(args)] + [best[e] for e in SWEPT if e in best]
    return list(dict.fromkeys(replace(c, n_q=n) for c in configs for n in args.ns))


# ----------------------------------------------------------------------------------------------------
# Tables and figures


def _median(rows, key):
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else float("nan")


def summarize(cell: list[dict]) -> dict:
    return {"cells": len(cell), "step_cosine": _median(cell, "step_cosine"), "cosine": _median(cell, "cosine"),
            "rel_error": _median(cell, "rel_error"), "spread": _median(cell, "spread"),
            "worst_rel_error": max(r["rel_error"] for r in cell),
            "good": sum(r["rel_error"] < 0.2 and r["spread"] < 1.0 for r in cell)}


def headline(rows: list[dict]) -> list[dict]:
    """One entry per variant, medians over all its cells, best median step cosine first."""
    out = [{"variant": name, **summarize([r for r in rows if r["variant"] == name])}
           for name in dict.fromkeys(r["variant"] for r in rows)]
    return sorted(out, key=lambda h: -h["step_cosine"])


def _fmt(h: dict) -> str:
    return (f"{h['step_cosine']:.3f} | {h['cosine']:.3f} | {h['rel_error']:.3g} | {h['spread']:.3g} | "
            f"{h['good']}/{h['cells']}")


def key_variants(rows: list[dict], args) -> dict[str, str]:
    """label -> variant name: the oracle, the paper's setting, and each estimator at the base setting and
    at its best, all at the base n_q."""
    n0, lam0 = args.base_n, args.base_lam
    names = {r["variant"] for r in rows}
    out = {"oracle (true ratio)": Variant("oracle", "-", 1.0, 0.0, n0, 1).name,
           "plain, paper (median, lam, n_p = n_q)": paper_variant(args).name}
    for est in ("ac-diag", "ac-full"):
        out[f"{est}, median, lam {lam0:g}"] = Variant(est, "median", 1.0, lam0, n0, 1).name
    out[f"kl, the library's default (lam {DEFAULT_LAM:g})"] = Variant("kl", "median", 1.0, DEFAULT_LAM, n0, 1).name
    out[f"ac-full, the library's default for n > d (lam {DEFAULT_LAM:g})"] = Variant(
        "ac-full", "median", 1.0, DEFAULT_LAM, n0, 1).name
    for est, v in best_variants(rows, n0).items():
        if est in SWEPT:
            out[f"best {est}: {v.method} lam={v.lam:g} n_p={v.n_p}"] = v.name
    return {label: name for label, name in out.items() if name in names}


def regimes(rows: list[dict]) -> dict[str, list[dict]]:
    """The cells by regime: Gaussians below the largest d, Gaussians at the largest d, the planar flow."""
    top = max((r["d"] for r in rows if r["family"] != "flow"), default=None)
    out = {f"Gaussians, d < {top}": [r for r in rows if r["family"] != "flow" and r["d"] < top],
           f"Gaussians, d = {top}": [r for r in rows if r["family"] != "flow" and r["d"] == top],
           "planar flow": [r for r in rows if r["family"] == "flow"]}
    return {k: v for k, v in out.items() if v}


def regime_table(rows: list[dict], keys: dict[str, str]) -> list[str]:
    """Markdown lines: per key variant and regime, median rel. error / median spread (good cells)."""
    parts = regimes(rows)
    lines = ["| | " + " | ".join(parts) + " |", "|---|" + "---|" * len(parts)]
    for label, name in keys.items():
        cells = []
        for part in parts.values():
            h = summarize([r for r in part if r["variant"] == name]) if any(
                r["variant"] == name for r in part) else None
            cells.append("-" if h is None else f"{h['rel_error']:.2g} / {h['spread']:.2g} ({h['good']}/{h['cells']})")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def markdown_tables(rows: list[dict], args) -> str:
    keys = key_variants(rows, args)
    lines = ["# Gradient accuracy of the KIVI KL estimate", "",
             "step cos.: cosine of one draw's gradient with the truth (median over draws; it counts bias and "
             "noise); cosine and rel. error: of the mean gradient over the draws (the bias); spread: std of one "
             "draw's gradient / true norm; good: cells with rel. error < 0.2 and spread < 1. Medians over the "
             "cells (case x d).", "",
             f"## Key variants (n_q = {args.base_n})", "",
             "| | variant | step cos. | cosine | rel. error | spread | good |", "|---|---|---|---|---|---|---|"]
    for label, name in keys.items():
        lines.append(f"| {label} | {name} | {_fmt(summarize([r for r in rows if r['variant'] == name]))} |")
    lines += ["", "## Key variants by regime: median rel. error / median spread (good cells)", ""]
    lines += regime_table(rows, keys)
    lines += ["", "## Per case: the key variants (medians over d)", "",
              "| case | variant | step cos. | cosine | rel. error | spread | good | rel. error per d |",
              "|---|---|---|---|---|---|---|---|"]
    cases = list(dict.fromkeys(r["case"] for r in rows))
    for case in cases:
        for label, name in keys.items():
            cell = sorted((r for r in rows if r["case"] == case and r["variant"] == name), key=lambda r: r["d"])
            if cell:
                per_d = ", ".join(f"{r['d']}: {r['rel_error']:.2g}" for r in cell)
                lines.append(f"| {case} | {label} | {_fmt(summarize(cell))} | {per_d} |")
    lines += ["", "## Per case: the best variant of each estimator (medians over d)", "",
              "| case | estimator | best variant | step cos. | cosine | rel. error | spread | good |",
              "|---|---|---|---|---|---|---|---|"]
    for case in cases:
        cell = [r for r in rows if r["case"] == case]
        for est, v in best_variants(cell, args.base_n).items():
            h = summarize([r for r in cell if r["variant"] == v.name])
            lines.append(f"| {case} | {est} | {v.name} | {_fmt(h)} |")
    lines += ["", "## All variants (medians over all cells)", "",
              "| variant | step cos. | cosine | rel. error | spread | good | worst rel. error |",
              "|---|---|---|---|---|---|---|"]
    for h in headline(rows):
        lines.append(f"| {h['variant']} | {_fmt(h)} | {h['worst_rel_error']:.3g} |")
    lines += ["", "## Per case and variant (medians over d)", "",
              "| case | variant | step cos. | rel. error | spread | rel. error per d |", "|---|---|---|---|---|---|"]
    for case in cases:
        for name in dict.fromkeys(r["variant"] for r in rows if r["case"] == case):
            cell = sorted((r for r in rows if r["case"] == case and r["variant"] == name), key=lambda r: r["d"])
            per_d = ", ".join(f"{r['d']}: {r['rel_error']:.2g}" for r in cell)
            lines.append(f"| {case} | {name} | {_median(cell, 'step_cosine'):.3f} | {_median(cell, 'rel_error'):.3g} "
                         f"| {_median(cell, 'spread'):.3g} | {per_d} |")
    return "\n".join(lines) + "\n"


COLORS = ("k", "tab:red", "tab:orange", "tab:blue", "tab:purple", "tab:green", "tab:olive", "tab:brown")


def plot_rel_error_vs_d(path, rows, keys: dict[str, str]) -> None:
    """Rel. error of the mean gradient vs. d, one panel per case with several d, one line per key variant."""
    plt = runs.matplotlib_pyplot()
    cases = [c for c in dict.fromkeys(r["case"] for r in rows) if len({r["d"] for r in rows if r["case"] == c}) > 1]
    if not cases:
        return
    cols = min(3, len(cases))
    nrows = math.ceil(len(cases) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 2.9 * nrows), squeeze=False)
    for ax, case in zip(axes.flat, cases):
        for k, (label, name) in enumerate(keys.items()):
            rs = sorted((r for r in rows if r["case"] == case and r["variant"] == name), key=lambda r: r["d"])
            ax.plot([r["d"] for r in rs], [r["rel_error"] for r in rs], marker="o", ms=3, lw=1.2,
                    color=COLORS[k % len(COLORS)], ls=":" if k == 0 else "-", label=label)
        ax.set(xscale="log", yscale="log", title=case, xlabel="d", ylabel="rel. error")
        ax.axhline(0.2, color="gray", lw=0.6, ls="--")
        ds = sorted({r["d"] for r in rows if r["case"] == case})
        ax.set_xticks(ds, [str(d) for d in ds])
        ax.minorticks_off()
    for ax in list(axes.flat)[len(cases):]:
        ax.set_visible(False)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=8)
    fig.suptitle("||mean estimated gradient - true|| / ||true|| (dashed: 0.2)", fontsize=10)
    runs.save_figure(fig, path, dpi=80, rect=(0, 0.12 / nrows * math.ceil(len(keys) / 4) + 0.01, 1, 0.97))


def plot_cosine_vs_scale(path, rows, keys: dict[str, str]) -> None:
    """Step cosine vs. q's scale, iso (solid) and corr (dashed), one panel per d."""
    plt = runs.matplotlib_pyplot()
    dims = sorted({r["d"] for r in rows if r["family"] in ("iso", "corr")})
    if not dims:
        return
    fig, axes = plt.subplots(1, len(dims), figsize=(3.8 * len(dims), 4.6), squeeze=False)
    for ax, d in zip(axes[0], dims):
        for k, (label, name) in enumerate(keys.items()):
            for family, ls in (("iso", "-"), ("corr", "--")):
                rs = sorted((r for r in rows if r["d"] == d and r["family"] == family and r["variant"] == name),
                            key=lambda r: r["scale"])
                ax.plot([r["scale"] for r in rs], [r["step_cosine"] for r in rs], marker="o", ms=3, lw=1.2, ls=ls,
                        color=COLORS[k % len(COLORS)], label=label if family == "iso" else None)
        ax.set(xscale="log", ylim=(-1.05, 1.05), title=f"d={d}", xlabel="scale s of q", ylabel="step cosine")
        ax.axhline(0.0, color="gray", lw=0.6)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=8)
    fig.suptitle("cosine of one draw's gradient with the true gradient (median over draws) vs. the scale of q;"
                 " solid: iso, dashed: corr", fontsize=10)
    runs.save_figure(fig, path, dpi=80, rect=(0, 0.045 * math.ceil(len(keys) / 2) + 0.02, 1, 0.95))


def plot_grid(path, rows, args) -> None:
    """Median step cosine over the cells at the base n_q: (rule x factor) by lam, per estimator and n_p / n_q."""
    plt = runs.matplotlib_pyplot()
    base = [r for r in rows if r["n_q"] == args.base_n and r["estimator"] in SWEPT]
    panels = [(e, k) for e in SWEPT for k in sorted(set(args.prior_ratios) | {1})
              if any(r["estimator"] == e and r["prior_ratio"] == k for r in base)]
    if not panels:
        return
    lams = sorted({r["lam"] for r in base})
    fig, axes = plt.subplots(1, len(panels), figsize=(3.0 * len(panels), 5.2), squeeze=False)
    for ax, (est, k) in zip(axes[0], panels):
        cell = [r for r in base if r["estimator"] == est and r["prior_ratio"] == k]
        labels = list(dict.fromkeys(f"{r['rule']} x{r['factor']:g}" for r in cell))
        grid = [[_median([r for r in cell if f"{r['rule']} x{r['factor']:g}" == lab and r["lam"] == lam],
                         "step_cosine") for lam in lams] for lab in labels]
        ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto")
        for i, j in itertools.product(range(len(labels)), range(len(lams))):
            if not math.isnan(grid[i][j]):
                ax.text(j, i, f"{grid[i][j]:.2f}", ha="center", va="center", fontsize=7,
                        color="k" if grid[i][j] > 0.6 else "w")
        ax.set_xticks(range(len(lams)), [f"{lam:g}" for lam in lams], fontsize=7)
        ax.set_yticks(range(len(labels)), labels, fontsize=7)
        ax.set(title=f"{est}, n_p = {k} n_q", xlabel="lam")
    fig.suptitle(f"median step cosine over all cells, n_q = {args.base_n} (1 = the true direction every draw)",
                 fontsize=10)
    runs.save_figure(fig, path, dpi=80)


def plot_n_sweep(path, rows, args) -> None:
    """Median rel. error and spread vs. n_q for the paper's setting, each swept estimator's best, the oracle."""
    plt = runs.matplotlib_pyplot()
    configs = {"oracle (true ratio)": Variant("oracle", "-", 1.0, 0.0, args.base_n, 1),
               "plain, paper": paper_variant(args)}
    configs.update({f"best {e}: {v.method} lam={v.lam:g} n_p={v.prior_ratio}n_q": v
                    for e, v in best_variants(rows, args.base_n).items() if e in SWEPT})
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), squeeze=False)
    for k, (label, v) in enumerate(configs.items()):
        pts = []
        for n in sorted(set(args.ns) | {args.base_n}):
            cell = [r for r in rows if r["variant"] == replace(v, n_q=n).name]
            if cell:
                pts.append((n, _median(cell, "rel_error"), _median(cell, "spread")))
        if pts:
            ns, err, spread = zip(*pts)
            for ax, ys in zip(axes[0], (err, spread)):
                ax.plot(ns, ys, marker="o", ms=3, color=COLORS[k % len(COLORS)], ls=":" if k == 0 else "-",
                        label=label)
    ns = sorted(set(args.ns) | {args.base_n})
    for ax, what in zip(axes[0], ("median rel. error", "median spread")):
        ax.set(xscale="log", yscale="log", xlabel="n_q", ylabel=what)
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.minorticks_off()
    axes[0][1].legend(fontsize=7)
    fig.suptitle("the n_q sweep, medians over all cells", fontsize=10)
    runs.save_figure(fig, path, dpi=80)


# ----------------------------------------------------------------------------------------------------
# Results file: every cell, compactly (one line per cell, 4 significant digits)

CELL_KEYS = ("cosine", "rel_error", "rel_bias_corrected", "spread", "step_cosine", "rmse_one_draw", "rel_error_L",
             "spread_L", "mean_kl_estimate", "seconds")


def _round(x):
    return float(f"{x:.4g}") if isinstance(x, float) and math.isfinite(x) else x


def write_results(path, header: dict, cases: list, rows: list[dict]) -> None:
    """``header`` plus ``cases`` (name, d, truth), ``variants`` and ``cells``: one list per cell, its fields
    named by ``cell_columns`` (case and variant as indices). Written atomically."""
    import json
    import os
    from pathlib import Path

    case_ids = {(c.name, c.d): i for i, c in enumerate(cases)}
    variant_ids = {name: i for i, name in enumerate(dict.fromkeys(r["variant"] for r in rows))}
    variants = []
    for name in variant_ids:
        r = next(r for r in rows if r["variant"] == name)
        variants.append({"name": name, **asdict(variant_of(r)), "n_p": variant_of(r).n_p})
    data = dict(header)
    data["cases"] = [{"name": c.name, "family": c.family, "scale": c.scale, "d": c.d, "true_kl": _round(c.true_kl),
                      "true_grad_norm": _round(float(c.true_grad.norm())),
                      "true_grad_rel_mc_se": _round(c.true_grad_se / float(c.true_grad.norm()))} for c in cases]
    data["variants"] = variants
    data["cell_columns"] = ["case", "variant", *CELL_KEYS]
    text = json.dumps(data, indent=1, sort_keys=True, default=float)
    cells = ",\n  ".join(json.dumps([case_ids[(r["case"], r["d"])], variant_ids[r["variant"]],
                                      *(_round(r.get(k)) for k in CELL_KEYS)]) for r in rows)
    text = text[:text.rindex("}")].rstrip() + f',\n "cells": [\n  {cells}\n ]\n}}\n'
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# ----------------------------------------------------------------------------------------------------


def run(args) -> int:
    apply_quick(args, QUICK)  # (begin applies it too: the same values) for the sample sizes checked below
    for option, n in (("--base-n", args.base_n), *(("--ns", n) for n in args.ns)):
        check_prior_samples(option, n, "kl")  # (n_p = n times a prior ratio, at least n)
    out = runs.begin(args, NAME, QUICK)
    t0 = time.time()
    cases = make_cases(args.cases, args.dims, args.condition, args.flow_truth_samples, args.seed)
    first = first_pass_variants(args)
    rows = []
    # the second pass depends on the first's best variants: the bar's total is an upper bound until then
    upper = 0 if args.grid == "full" else (1 + len(SWEPT)) * len(args.ns)
    with tqdm(total=len(cases) * (len(first) + upper), desc="gradient-accuracy cells",
              disable=args.no_progress) as bar:
        for i, case in enumerate(cases):
            for v in first:
                rows.append(run_cell(case, i, v, args.reps, args.clip, args.seed))
                bar.update()
        second = [v for v in second_pass_variants(args, rows) if v not in set(first)]
        bar.total = len(cases) * (len(first) + len(second))
        bar.refresh()
        for i, case in enumerate(cases):
            for v in second:
                rows.append(run_cell(case, i, v, args.reps, args.clip, args.seed))
                bar.update()
    elapsed = time.time() - t0

    config = {k: v for k, v in vars(args).items() if not k.startswith("_")}
    best = {e: v.name for e, v in best_variants(rows, args.base_n).items()}
    write_results(out / "results.json", {"config": config, "machine": runs.machine(), "elapsed_s": elapsed,
                                         "best_variants": best, "headline": headline(rows)}, cases, rows)
    (out / "table.md").write_text(markdown_tables(rows, args))
    keys = key_variants(rows, args)
    plot_rel_error_vs_d(out / "rel_error_vs_d.png", rows, keys)
    plot_cosine_vs_scale(out / "cosine_vs_scale.png", rows, keys)
    plot_grid(out / "grid.png", rows, args)
    plot_n_sweep(out / "n_sweep.png", rows, args)

    print(f"key variants at n_q = {args.base_n}, medians over all cells (step cos.: cosine of one draw's gradient "
          "with the truth)")
    print("| | step cos. | cosine | rel. error | spread | good cells |")
    print("|---|---|---|---|---|---|")
    for label, name in keys.items():
        print(f"| {label} | {_fmt(summarize([r for r in rows if r['variant'] == name]))} |")
    print(f"\n{plural(len(rows), 'cell')} in {elapsed:.0f} s; full table in {out}/table.md; "
          "figures rel_error_vs_d.png, cosine_vs_scale.png, grid.png, n_sweep.png")
    return 0
