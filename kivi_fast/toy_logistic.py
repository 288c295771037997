"""The 2-D Bayesian logistic regression of the paper's Appendix F.1 (setup in Appendix "Toy Experiments").

    w ~ N(0, I_2),    y_i ~ Bernoulli(sigmoid(w^T x_i)),    x_i ~ U[-5, 5]^2,  i = 1..N (N = 200).

The posterior p(w | X, y) is intractable but two-dimensional, so its unnormalized density can be drawn
on a grid and compared with samples from VI, KIVI and HMC. All log-densities here take ``w`` of shape
[..., 2] and return [...], so one call scores a whole batch of posterior samples or a grid.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class LogisticData:
    """Inputs ``x`` [N, 2], labels ``y`` [N] in {0, 1}, and the weights ``w_true`` [2] that drew them."""

    x: torch.Tensor
    y: torch.Tensor
    w_true: torch.Tensor


def make_data(n: int = 200, half_width: float = 5.0, generator: torch.Generator | None = None,
              dtype=torch.float32) -> LogisticData:
    """Draw the training set the paper describes: x ~ U[-5, 5]^2, w_true ~ prior, y ~ the model."""
    x = (torch.rand(n, 2, generator=generator, dtype=dtype) * 2 - 1) * half_width
    w_true = torch.randn(2, generator=generator, dtype=dtype)
    y = torch.bernoulli(torch.sigmoid(x @ w_true), generator=generator)
    return LogisticData(x, y, w_true)


def log_likelihood(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """sum_i log Bernoulli(y_i; sigmoid(w^T x_i)) for each w: [..., 2] -> [...].

    Written with ``binary_cross_entropy_with_logits`` (= log(1 + e^{-|l|}) + ...) because the naive
    log(sigmoid(l)) underflows for the large logits that |x| up to 5 produces.
    """
    logits = w @ x.T  # [..., N]
    return -F.binary_cross_entropy_with_logits(logits, y.expand_as(logits), reduction="none").sum(-1)


def log_prior(w: torch.Tensor) -> torch.Tensor:
    """log N(w; 0, I) summed over the last dimension."""
    return -0.5 * w.pow(2).sum(-1) - 0.5 * w.shape[-1] * math.log(2 * math.pi)


def log_joint(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """log p(y | X, w) + log p(w): the unnormalized log-posterior, [..., 2] -> [...]."""
    return log_likelihood(w, x, y) + log_prior(w)


def posterior_on_grid(data: LogisticData, lo, hi, size: int = 200):
    """The normalized posterior density on a ``size`` x ``size`` grid over [lo, hi] (per axis).

    Returns (w1, w2, density), each [size, size], with w1 varying along the columns. The normalizer is
    the grid's Riemann sum, which is accurate as long as the grid covers the posterior's mass.
    """
    w1, w2 = torch.meshgrid(torch.linspace(lo[0], hi[0], size, dtype=torch.float64),
                            torch.linspace(lo[1], hi[1], size, dtype=torch.float64), indexing="xy")
    grid = torch.stack([w1, w2], dim=-1)
    logp = log_joint(grid, data.x.double(), data.y.double())
    density = torch.exp(logp - logp.max())
    cell = (w1[0, 1] - w1[0, 0]) * (w2[1, 0] - w2[0, 0])
    return w1, w2, density / (density.sum() * cell)


def posterior_moments_on_grid(data: LogisticData, centre, half_width, size: int = 400) -> dict:
    """Posterior mean [2] and covariance [2, 2] by quadrature on a grid (exact up to the grid).

    The grid spans ``centre`` +- ``half_width`` (per axis; make it several posterior standard
    deviations wide). It is an independent check of the HMC ground truth, which mixes slowly along
    the long axis of a correlated posterior.
    """
    centre, half = torch.as_tensor(centre, dtype=torch.float64), torch.as_tensor(half_width, dtype=torch.float64)
    w1, w2, density = posterior_on_grid(data, (centre - half).tolist(), (centre + half).tolist(), size)
    mass = density / density.sum()
    grid = torch.stack([w1, w2], -1).reshape(-1, 2)
    p = mass.reshape(-1)
    mean = (p[:, None] * grid).sum(0)
    diff = grid - mean
    cov = (p[:, None, None] * diff[:, :, None] * diff[:, None, :]).sum(0)
    return {"mean": mean, "cov": cov}
