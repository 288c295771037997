"""Explicit baseline posterior: the factorized (mean-field) Gaussian N(mean, diag(std^2))."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn.functional import softplus

from .._random import standard_normal
from ._checks import finite_float, positive_float, positive_int, trailing

STD_PARAMETERIZATIONS = ("softplus", "exp")
LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def gaussian_kl_to_standard_normal(mean: torch.Tensor, log_std: torch.Tensor,
                                   variance: torch.Tensor | None = None) -> torch.Tensor:
    """KL(N(mean, diag(sigma^2)) || N(0, I)) = 0.5 sum(mean^2 + sigma^2 - 1 - 2 log sigma) over the last
    dim; ``variance`` (sigma^2) may be passed where it is at hand, else it is exp(2 log_std)."""
    variance = (2 * log_std).exp() if variance is None else variance
    return 0.5 * (mean.pow(2) + variance - 1 - 2 * log_std).sum(-1)


class FactorizedGaussian(nn.Module):
    """Mean-field Gaussian over ``dim`` weights, reparameterized; KL to N(0, I) in closed form.

    It starts at N(``mean``, ``std``^2), plus N(0, ``mean_init_std``^2) noise on the means when that
    is > 0 (drawn from torch's global generator; the UCI harness starts near a point estimate with
    small random means and std 0.01, the usual start of mean-field VI for BNNs).

    ``std_param`` says how the trainable ``rho`` gives the std: "softplus" (default, std =
    softplus(rho)) or "exp" (std = exp(rho), i.e. rho is log std). The two give other optimization
    paths; each experiment keeps the one its results were made with.
    """

    def __init__(self, dim: int, mean: float = 0.0, std: float = 1.0, *, mean_init_std: float = 0.0,
                 std_param: str = "softplus"):
        super().__init__()
        if std_param not in STD_PARAMETERIZATIONS:
            raise ValueError(f"std_param must be one of {STD_PARAMETERIZATIONS}, got {std_param!r}")
        std = positive_float("std", std)
        f32 = torch.finfo(torch.float32)
        if not f32.tiny <= std <= f32.max:  # (1e-50 was stored as 0; 1e40 overflowed unnamed)
            raise ValueError(f"std must lie within float32's normal range [{f32.tiny:.3g}, {f32.max:.3g}], got {std}")
        self.dim, self.std_param = positive_int("dim", dim), std_param
        init_mean = torch.full((self.dim,), finite_float("mean", mean))
        if finite_float("mean_init_std", mean_init_std, least=0.0):
            init_mean = init_mean + torch.randn(self.dim) * mean_init_std
        self.mean = nn.Parameter(init_mean)
        # the inverse of the std's map: softplus^-1(s) = log(exp(s) - 1) = s + log(1 - exp(-s)) (which
        # does not overflow for s above ~709), or log s
        rho = std + math.log(-math.expm1(-std)) if std_param == "softplus" else math.log(std)
        self.rho = nn.Parameter(torch.full((self.dim,), rho))

    @property
    def std(self) -> torch.Tensor:
        return softplus(self.rho) if self.std_param == "softplus" else self.rho.exp()

    @property
    def log_std(self) -> torch.Tensor:
        return self.std.log() if self.std_param == "softplus" else self.rho

    def sample(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """[n, dim] reparameterized samples."""
        eps = standard_normal((positive_int("n", n), self.dim), generator, dtype=self.mean.dtype,
                              device=self.mean.device)
        return self.mean + self.std * eps

    def log_prob(self, w: torch.Tensor) -> torch.Tensor:
        """log q(w), [..., dim] -> [...]."""
        trailing("w", w, (self.dim,))
        z = (w - self.mean) / self.std
        return (-0.5 * z.pow(2) - self.log_std - LOG_SQRT_2PI).sum(-1)

    def entropy(self) -> torch.Tensor:
        """H[q] = sum(1/2 + log sqrt(2 pi) + log std)."""
        return (0.5 + LOG_SQRT_2PI + self.log_std).sum(-1)

    def kl_to_standard_normal(self) -> torch.Tensor:
        """KL(q || N(0, I)) in closed form."""
        variance = self.std.pow(2) if self.std_param == "softplus" else None
        return gaussian_kl_to_standard_normal(self.mean, self.log_std, variance)
