"""Adaptive contrast (the paper's Appendix D, after AVB): KIVI against a Gaussian fitted to q.

    KL(q || p) = KL(q_hat || N(0, I)) + E_q[log N(z; m, s^2) - log p(z)],

with m, s the per-dimension mean and standard deviation of the q samples and q_hat the law of
(z - m) / s. Only the first term needs the density-ratio estimator, and it compares two distributions
with zero mean and unit variance, where the kernel fit is most accurate. m and s keep their gradient.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch

from . import _validate


def standard_normal_log_prob(z: torch.Tensor) -> torch.Tensor:
    """log N(z; 0, I) summed over the last dimension."""
    return -0.5 * z.pow(2).sum(-1) - 0.5 * z.shape[-1] * math.log(2 * math.pi)


def adaptive_contrast_kl(
    q_z: torch.Tensor,
    log_prior: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    lam: float = 1e-3,
    *,
    n_prior: Optional[int] = None,
    clip: float = 1e-8,
    bandwidth="median",
    reverse: bool = True,
    generator: Optional[torch.Generator] = None,
    kl_fn: Callable[..., torch.Tensor],
) -> torch.Tensor:
    """KL(q || p) with adaptive contrast; ``kl_fn`` is the KIVI estimator to use for the first term.

    q_z: [n, d] or [B, n, d] samples of q (B independent posteriors, e.g. one per data point).
    log_prior: callable mapping [..., n, d] to [..., n], the prior's log-density; None means N(0, I).
    n_prior: number of N(0, I) samples contrasted with the standardized q samples (default n).
    The standard deviation s divides by n (not n - 1), matching the Gaussian fitted by maximum likelihood.
    """
    _validate.check_samples("q_z", q_z)
    n = q_z.shape[-2]
    if n < 2:
        raise ValueError(f"q_z must hold at least 2 samples to standardize them, got shape {tuple(q_z.shape)}")
    mean = q_z.mean(-2, keepdim=True)
    std = q_z.std(-2, correction=0, keepdim=True)
    if bool((std == 0).any()):
        raise ValueError("q_z has a dimension in which all samples are equal (zero standard deviation)")
    z_hat = (q_z - mean) / std

    if n_prior is not None and (isinstance(n_prior, bool) or not isinstance(n_prior, int) or n_prior < 2):
        raise ValueError(f"n_prior must be an integer >= 2 (the number of N(0, I) samples), got {n_prior!r}")
    shape = list(q_z.shape)
    shape[-2] = n if n_prior is None else n_prior
    eps = torch.randn(shape, dtype=q_z.dtype, device=q_z.device, generator=generator)
    kl_standardized = kl_fn(eps, z_hat, lam, clip=clip, bandwidth=bandwidth, reverse=reverse)

    log_contrast = standard_normal_log_prob(z_hat) - std.log().sum(-1)
    log_p = standard_normal_log_prob(q_z) if log_prior is None else log_prior(q_z)
    if log_p.shape != log_contrast.shape:
        raise ValueError(
            f"log_prior must map samples of shape {tuple(q_z.shape)} to shape {tuple(log_contrast.shape)}, "
            f"got {tuple(log_p.shape)}"
        )
    return kl_standardized + (log_contrast - log_p).mean(-1)
