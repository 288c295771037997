"""The closed form of the paper (Eq. 6 / Appendix B) minimizes the regularized uLSIF objective.

Oracle: numpy/scipy in float64, independent of the package: the kernel from scipy's cdist, the full
first-order system of the objective over all N = n_den + n_num coefficients solved directly.
"""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from scipy.spatial.distance import cdist

import kivi_fast


def objective(coef, kernel, n_den, lam):
    """1/(2 n_den) sum_denom r^2 - 1/n_num sum_numer r + lam/2 ||r||_H^2, r = sum_c coef_c k(c, .)."""
    n_num = kernel.shape[0] - n_den
    r = kernel @ coef
    return 0.5 * np.sum(r[:n_den] ** 2) / n_den - np.sum(r[n_den:]) / n_num + 0.5 * lam * coef @ kernel @ coef


def direct_solution(numer, denom, lam, sigma):
    pts = np.concatenate([denom, numer])
    kernel = np.exp(-cdist(pts, pts, "sqeuclidean") / (2 * sigma**2))
    n_den, n_num = len(denom), len(numer)
    k_d, k_n = kernel[:n_den], kernel[n_den:]
    # Gradient of the objective set to zero: (K_d^T K_d / n_den + lam K) c = K_n^T 1 / n_num.
    hessian = k_d.T @ k_d / n_den + lam * kernel
    rhs = k_n.sum(0) / n_num
    return np.linalg.solve(hessian, rhs), kernel, hessian, rhs


@given(
    n_num=st.integers(2, 12),
    n_den=st.integers(2, 12),
    d=st.integers(1, 5),
    lam=st.floats(1e-2, 1.0),
    scale=st.floats(0.3, 3.0),
    seed=st.integers(0, 2**16),
)
def test_coefficients_solve_the_first_order_system(impl, n_num, n_den, d, lam, scale, seed):
    rng = np.random.default_rng(seed)
    numer = rng.normal(size=(n_num, d)) * scale
    denom = rng.normal(size=(n_den, d)) * scale + 0.5
    fit = kivi_fast.DensityRatio(lam=lam).fit(torch.from_numpy(numer), torch.from_numpy(denom))
    sigma = float(fit.sigma)
    pts = np.concatenate([denom, numer])
    assert sigma == pytest.approx(np.median(cdist(pts, pts)[np.triu_indices(len(pts), 1)]), rel=1e-12)

    expected, kernel, hessian, rhs = direct_solution(numer, denom, lam, sigma)
    ours = np.concatenate([fit.alpha.numpy(), np.full(n_num, fit.beta)])
    # Our coefficients satisfy the first-order conditions to rounding (a backward-error check that
    # does not depend on the conditioning of the system) ...
    residual = np.abs(hessian @ ours - rhs).max()
    assert residual <= 1e-11 * (np.abs(hessian).max() * np.abs(ours).max() + np.abs(rhs).max())
    # ... and agree with the direct solve as far as the system's condition number lets it be accurate.
    tol = max(1e-8, 1e-15 * np.linalg.cond(hessian)) * np.abs(expected).max()
    np.testing.assert_allclose(ours, expected, rtol=0, atol=tol)
    np.testing.assert_allclose(kernel @ ours, kernel @ expected, rtol=0, atol=tol)
    np.testing.assert_allclose(fit.beta, 1 / (lam * n_num), rtol=1e-14)


@given(seed=st.integers(0, 2**16), lam=st.floats(1e-3, 1.0), step=st.floats(1e-4, 1e-1))
def test_no_perturbation_lowers_the_objective(impl, seed, lam, step):
    rng = np.random.default_rng(seed)
    numer = rng.normal(size=(9, 3))
    denom = rng.normal(size=(11, 3)) * 1.5
    fit = kivi_fast.DensityRatio(lam=lam).fit(torch.from_numpy(numer), torch.from_numpy(denom))
    pts = np.concatenate([denom, numer])
    kernel = np.exp(-cdist(pts, pts, "sqeuclidean") / (2 * float(fit.sigma) ** 2))
    coef = np.concatenate([fit.alpha.numpy(), np.full(len(numer), fit.beta)])
    best = objective(coef, kernel, len(denom), lam)
    scale = np.abs(coef).max()
    for _ in range(50):
        delta = rng.normal(size=coef.shape) * step * scale
        assert objective(coef + delta, kernel, len(denom), lam) >= best - 1e-9 * abs(best)


def test_reverse_ratio_is_the_fit_of_p_over_q(impl):
    """kl(reverse=True) = -mean log r_{p/q}(q_z); reverse=False = mean log r_{q/p}(q_z)."""
    g = torch.Generator().manual_seed(3)
    p = torch.randn(60, 2, generator=g, dtype=torch.float64)
    q = torch.randn(50, 2, generator=g, dtype=torch.float64) * 0.7 + 0.4
    r_pq = kivi_fast.DensityRatio(lam=1e-3).fit(p, q).ratio(q)
    r_qp = kivi_fast.DensityRatio(lam=1e-3).fit(q, p).ratio(q)
    torch.testing.assert_close(kivi_fast.kernel_kl(p, q), -torch.log(r_pq.clamp_min(1e-8)).mean(), rtol=1e-10, atol=0)
    torch.testing.assert_close(kivi_fast.kernel_kl(p, q, reverse=False), torch.log(r_qp.clamp_min(1e-8)).mean(),
                               rtol=1e-10, atol=0)
