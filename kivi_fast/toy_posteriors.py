"""Variational posteriors for the 2-D toy studies: the paper's stochastic network and a factorized Gaussian.

Both are ``torch.nn.Module``s whose ``sample(n)`` returns reparameterized samples [n, 2], so the same
training loop serves KIVI (which needs only samples) and factorized VI (which also has a density).
"""

from __future__ import annotations

import math

import torch
from torch import nn


class StochasticNet2D(nn.Module):
    """The implicit posterior of the paper's Appendix "Toy Experiments" (2-D Bayesian logistic regression).

        eps ~ N(0, I_noise) -> FC(hidden) + activation -> FC(hidden), linear -> h
        z = h + xi,  xi ~ N(0, diag(exp(2 log_std)))      (the second noise, trainable variances)
        w = Linear(activation(FC(hidden)(z)))             (2-D output)

    The paper does not name the activation of the other layers; ReLU is used, as in its BNN
    posteriors. Injecting noise twice makes the samples' law a continuous mixture, which lets q bend
    along a correlated posterior while keeping a density (that KIVI never needs).
    """

    def __init__(self, noise_dim: int = 2, hidden: int = 20, out_dim: int = 2, init_log_std: float = 0.0,
                 activation: type[nn.Module] = nn.ReLU):
        super().__init__()
        self.noise_dim = noise_dim
        self.to_h = nn.Sequential(nn.Linear(noise_dim, hidden), activation(), nn.Linear(hidden, hidden))
        self.log_std = nn.Parameter(torch.full((hidden,), float(init_log_std)))
        self.to_w = nn.Sequential(nn.Linear(hidden, hidden), activation(), nn.Linear(hidden, out_dim))

    def sample(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        p = self.log_std
        eps = torch.randn(n, self.noise_dim, generator=generator, dtype=p.dtype, device=p.device)
        h = self.to_h(eps)
        xi = torch.randn(h.shape, generator=generator, dtype=p.dtype, device=p.device)
        return self.to_w(h + xi * self.log_std.exp())


class FactorizedGaussian(nn.Module):
    """q(w) = N(mu, diag(sigma^2)) with sigma = exp(log_std): the mean-field baseline."""

    def __init__(self, dim: int = 2, init_log_std: float = 0.0):
        super().__init__()
        self.mu = nn.Parameter(torch.zeros(dim))
        self.log_std = nn.Parameter(torch.full((dim,), float(init_log_std)))

    def sample(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        eps = torch.randn(n, self.mu.shape[0], generator=generator, dtype=self.mu.dtype, device=self.mu.device)
        return self.mu + eps * self.log_std.exp()

    def log_prob(self, w: torch.Tensor) -> torch.Tensor:
        """log q(w), [..., dim] -> [...]."""
        z = (w - self.mu) / self.log_std.exp()
        return (-0.5 * z.pow(2) - self.log_std - 0.5 * math.log(2 * math.pi)).sum(-1)

    def kl_to_standard_normal(self) -> torch.Tensor:
        """KL(q || N(0, I)) in closed form."""
        return gaussian_kl_to_standard_normal(self.mu, self.log_std)


def gaussian_kl_to_standard_normal(mu: torch.Tensor, log_std: torch.Tensor) -> torch.Tensor:
    """KL(N(mu, diag(exp(2 log_std))) || N(0, I)) = 0.5 sum(mu^2 + sigma^2 - 1 - 2 log sigma) over the last dim."""
    return 0.5 * (mu.pow(2) + (2 * log_std).exp() - 1 - 2 * log_std).sum(-1)
