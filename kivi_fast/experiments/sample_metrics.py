"""Distances between two sample sets, to score a variational posterior against HMC ground truth."""

from __future__ import annotations

import torch


def moments(samples: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample mean [d] and covariance [d, d] (float64) of ``samples`` [n, d]."""
    s = samples.double()
    return s.mean(0), torch.atleast_2d(torch.cov(s.T))


def moment_gaps(samples: torch.Tensor, reference) -> dict:
    """How far the first two moments of ``samples`` [n, d] are from the reference moments.

    ``reference`` is either samples [m, d] or a pair (mean [d], cov [d, d]) of known moments.
    mean_error: ||mean - mean_ref||_2; cov_error: ||C - C_ref||_F; cov_rel_error: the latter over
    ||C_ref||_F, so it reads as a fraction; also the moments themselves, as lists, for the record.
    """
    mean_s, cov_s = moments(samples)
    if isinstance(reference, torch.Tensor):
        mean_r, cov_r = moments(reference)
    else:
        mean_r, cov_r = (torch.as_tensor(t, dtype=torch.float64) for t in reference)
    return {
        "mean": mean_s.tolist(),
        "cov": cov_s.tolist(),
        "mean_error": float((mean_s - mean_r).norm()),
        "cov_error": float((cov_s - cov_r).norm()),
        "cov_rel_error": float((cov_s - cov_r).norm() / cov_r.norm()),
    }


def mmd2_rbf(x: torch.Tensor, y: torch.Tensor, sigma: float | None = None) -> tuple[float, float]:
    """Unbiased squared MMD between samples x [n, d] and y [m, d] with an RBF kernel.

    ``sigma`` defaults to the median distance over the pooled samples (the same heuristic KIVI uses),
    so the score is scale-free. Returns (mmd2, sigma). The unbiased estimate can be slightly negative
    when the two sets come from the same distribution.
    """
    x, y = x.double(), y.double()
    if sigma is None:
        from ..estimator import median_bandwidth

        sigma = float(median_bandwidth(torch.cat([x, y])))

    def gram(a, b):
        return torch.exp(-torch.cdist(a, b).pow(2) / (2 * sigma**2))

    n, m = x.shape[0], y.shape[0]
    kxx, kyy, kxy = gram(x, x), gram(y, y), gram(x, y)
    mmd2 = ((kxx.sum() - kxx.diagonal().sum()) / (n * (n - 1))
            + (kyy.sum() - kyy.diagonal().sum()) / (m * (m - 1)) - 2 * kxy.mean())
    return float(mmd2), sigma
