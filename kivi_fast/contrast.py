"""Adaptive contrast (the paper's Appendix D, after AVB): KIVI against a Gaussian r fitted to q.

    KL(q || p) = KL(q_hat || N(0, I)) + E_q[log r(z) - log p(z)],

with r = N(m, S) fitted to the q samples by maximum likelihood and q_hat the law of the samples
mapped by r's whitening, z -> C^{-1} (z - m) with S = C C^T. Only the first term needs the
density-ratio estimator, and it compares two distributions of zero mean and unit covariance, where
the kernel fit is most accurate. m and C keep their gradient. Two choices of r:

- ``contrast="diagonal"`` (the paper's): S = diag(s^2), per-dimension standardization.
- ``contrast="full"``: S the full sample covariance, shrunk toward its diagonal when n <= d (where it
  is singular) by the Schaefer & Strimmer (2005) intensity. For a Gaussian q the whitened samples do
  not depend on q's parameters, so the kernel term carries no gradient and the analytic term gives
  the exact one; for other q the kernel term carries only the non-Gaussian rest. In the
  ``grad-accuracy`` study (results/diagnostics/README.md) its gradient on Gaussians with n_q > d
  equals the true ratio's, where per-dimension contrast misses correlations.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch

from . import _validate

CONTRASTS = ("diagonal", "full")


def standard_normal_log_prob(z: torch.Tensor) -> torch.Tensor:
    """log N(z; 0, I) summed over the last dimension."""
    return -0.5 * z.pow(2).sum(-1) - 0.5 * z.shape[-1] * math.log(2 * math.pi)


def shrinkage_intensity(x: torch.Tensor) -> torch.Tensor:
    """Schaefer & Strimmer (2005) shrinkage intensity of the sample correlation toward the identity
    (their target D: the covariance toward its diagonal), [..., n, d] -> [...] in [0, 1]:

        lam* = sum_{i != j} Var(r_ij) / sum_{i != j} r_ij^2,

    with r_ij the sample correlations and Var(r_ij) = n / (n - 1)^3 sum_k (w_kij - w_bar_ij)^2,
    w_kij = y_ki y_kj, y the standardized samples. No gradient."""
    x = x.detach()
    n = x.shape[-2]
    y = x - x.mean(-2, keepdim=True)
    y = y / y.std(-2, keepdim=True).clamp_min(torch.finfo(x.dtype).tiny)
    mt = y.transpose(-1, -2)
    w_bar = mt @ y / n                                   # mean_k w_kij
    w_sq = (mt * mt) @ (y * y)                           # sum_k w_kij^2
    var_r = n / (n - 1) ** 3 * (w_sq - n * w_bar.pow(2))
    r = w_bar * n / (n - 1)
    off = ~torch.eye(x.shape[-1], dtype=torch.bool, device=x.device)
    num = (var_r * off).sum((-2, -1))
    den = (r.pow(2) * off).sum((-2, -1))
    return (num / den.clamp_min(torch.finfo(x.dtype).tiny)).clamp(0.0, 1.0)


def whitening(q_z: torch.Tensor, shrink: str = "auto") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample mean [..., 1, d], Cholesky factor C [..., d, d] of the maximum-likelihood sample
    covariance, and the shrinkage intensity used [...]. ``shrink``: "auto" shrinks toward the diagonal
    (:func:`shrinkage_intensity`) only when n <= d, where the covariance is singular; "always";
    "never". Mean and C keep their gradient w.r.t. q_z; the intensity is held fixed."""
    n, d = q_z.shape[-2], q_z.shape[-1]
    mean = q_z.mean(-2, keepdim=True)
    xc = q_z - mean
    cov = xc.transpose(-1, -2) @ xc / n
    if shrink == "always" or (shrink == "auto" and n <= d):
        rho = shrinkage_intensity(q_z)
    else:
        rho = torch.zeros(q_z.shape[:-2], dtype=q_z.dtype, device=q_z.device)
    r = rho[..., None, None]
    cov = (1 - r) * cov + r * torch.diag_embed(cov.diagonal(dim1=-2, dim2=-1))
    chol, info = torch.linalg.cholesky_ex(cov)
    if bool((info != 0).any()):
        raise ValueError("q_z's sample covariance is singular (samples on a lower-dimensional subspace); "
                         'use contrast="diagonal" or more samples')
    return mean, chol, rho


def whiten(x: torch.Tensor, mean: torch.Tensor, chol: torch.Tensor) -> torch.Tensor:
    """C^{-1} (x - mean) per row: [..., n, d]."""
    return torch.linalg.solve_triangular(chol, (x - mean).transpose(-1, -2), upper=False).transpose(-1, -2)


def gaussian_contrast(q_z: torch.Tensor, contrast: str = "diagonal", shrink: str = "auto"
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(z_hat, log r(q_z)): the samples mapped by the whitening of the Gaussian r fitted to them, and
    r's log-density at them ([..., n]). Both keep their gradient w.r.t. q_z. ``shrink``: see
    :func:`whitening` (full contrast only)."""
    if contrast == "diagonal":
        mean = q_z.mean(-2, keepdim=True)
        std = q_z.std(-2, correction=0, keepdim=True)  # divides by n: the maximum-likelihood fit
        if bool((std == 0).any()):
            raise ValueError("q_z has a dimension in which all samples are equal (zero standard deviation)")
        z_hat = (q_z - mean) / std
        return z_hat, standard_normal_log_prob(z_hat) - std.log().sum(-1)
    if contrast == "full":
        mean, chol, _ = whitening(q_z, shrink)
        z_hat = whiten(q_z, mean, chol)
        return z_hat, standard_normal_log_prob(z_hat) - chol.diagonal(dim1=-2, dim2=-1).log().sum(-1, keepdim=True)
    raise ValueError(f'contrast must be one of {", ".join(map(repr, CONTRASTS))}, got {contrast!r}')


def adaptive_contrast_kl(
    q_z: torch.Tensor,
    log_prior: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    lam: float = 1e-3,
    *,
    contrast: str = "diagonal",
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
    contrast: "diagonal" (per-dimension Gaussian, the paper's) or "full" (full-covariance Gaussian).
    n_prior: number of N(0, I) samples contrasted with the whitened q samples (default n).
    """
    _validate.check_samples("q_z", q_z)
    n = q_z.shape[-2]
    if n < 2:
        raise ValueError(f"q_z must hold at least 2 samples to standardize them, got shape {tuple(q_z.shape)}")
    if n_prior is not None and (isinstance(n_prior, bool) or not isinstance(n_prior, int) or n_prior < 2):
        raise ValueError(f"n_prior must be an integer >= 2 (the number of N(0, I) samples), got {n_prior!r}")
    z_hat, log_contrast = gaussian_contrast(q_z, contrast)

    shape = list(q_z.shape)
    shape[-2] = n if n_prior is None else n_prior
    eps = torch.randn(shape, dtype=q_z.dtype, device=q_z.device, generator=generator)
    kl_whitened = kl_fn(eps, z_hat, lam, clip=clip, bandwidth=bandwidth, reverse=reverse)

    log_p = standard_normal_log_prob(q_z) if log_prior is None else log_prior(q_z)
    if log_p.shape != log_contrast.shape:
        raise ValueError(
            f"log_prior must map samples of shape {tuple(q_z.shape)} to shape {tuple(log_contrast.shape)}, "
            f"got {tuple(log_p.shape)}"
        )
    return kl_whitened + (log_contrast - log_p).mean(-1)
