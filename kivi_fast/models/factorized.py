"""Explicit baseline posterior: factorized Gaussian N(mu, diag(sigma^2)), sigma = softplus(rho)."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn.functional import softplus


class FactorizedGaussian(nn.Module):
    """Mean-field Gaussian over ``dim`` weights, reparameterized; KL to N(0, I) in closed form.

    Initialized near a point estimate (small random means, small sigma = ``init_std``), the usual
    start of mean-field VI for BNNs, so that training does not begin from the prior's noise.
    """

    def __init__(self, dim: int, init_mean_std: float = 0.1, init_std: float = 1e-2):
        super().__init__()
        self.dim = int(dim)
        self.mean = nn.Parameter(torch.randn(self.dim) * init_mean_std)
        # softplus^{-1}(init_std) = log(exp(s) - 1)
        self.rho = nn.Parameter(torch.full((self.dim,), math.log(math.expm1(init_std))))

    @property
    def std(self) -> torch.Tensor:
        return softplus(self.rho)

    def sample(self, n: int) -> torch.Tensor:
        return self.mean + self.std * torch.randn(n, self.dim, dtype=self.mean.dtype, device=self.mean.device)

    def kl_to_standard_normal(self) -> torch.Tensor:
        """KL(N(mu, s^2) || N(0, 1)) summed over the weights: 0.5 sum(s^2 + mu^2 - 1 - 2 log s)."""
        s = self.std
        return 0.5 * (s.pow(2) + self.mean.pow(2) - 1 - 2 * s.log()).sum()
