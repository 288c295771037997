"""Pure-PyTorch reference of the KIVI estimator: the test oracle and the fallback backend.

Short and obviously correct rather than fast: pairwise differences are materialized, the median is
``torch.quantile`` over the upper triangle, and the fixed-ratio gradient of the paper's Eq. (8) comes
from autograd through fit parameters that are ``detach()``ed. All arithmetic is float64; results are
cast back to the input dtype. The formulas are the ones in ``ENGINEERING.md``:

    r(z) = sum_i alpha_i k(denom_i, z) + beta * sum_j k(numer_j, z)        (fits numer / denom)
    beta  = 1 / (lam n_numer)
    alpha = -1 / (lam n_denom n_numer) (K_dd / n_denom + lam I)^{-1} K_dn 1
"""

from __future__ import annotations

import torch

from . import _validate
from .contrast import adaptive_contrast_kl as _adaptive_contrast_kl

__all__ = ["kl", "DensityRatio", "rbf_gram", "median_bandwidth", "adaptive_contrast_kl"]


def _sqdist(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (x.unsqueeze(-2) - y.unsqueeze(-3)).pow(2).sum(-1)


def median_bandwidth(x: torch.Tensor) -> torch.Tensor:
    """Median Euclidean distance over the distinct pairs of rows of ``x`` ([n, d] -> [], [B, n, d] -> [B]).

    An even number of pairs gives the mean of the two middle distances (numpy's convention).
    """
    _validate.check_samples("x", x)
    if x.shape[-2] < 2:
        raise ValueError(f"x must hold at least 2 samples for a median distance, got shape {tuple(x.shape)}")
    _validate.check_finite("x", x)
    x64 = x.detach().double()
    n = x.shape[-2]
    rows, cols = torch.triu_indices(n, n, offset=1, device=x.device)
    dist = _sqdist(x64, x64)[..., rows, cols].sqrt()
    sigma = torch.quantile(dist, 0.5, dim=-1)
    if bool((sigma == 0).any()):
        raise ValueError(
            "the median pairwise distance of the samples is 0 (at least half of the pairs coincide); "
            "pass an explicit bandwidth=..."
        )
    return sigma.to(x.dtype)


def rbf_gram(x: torch.Tensor, y: torch.Tensor, sigma) -> torch.Tensor:
    """k(x_i, y_j) = exp(-||x_i - y_j||^2 / (2 sigma^2)) ([n, d], [m, d] -> [n, m]; batched too)."""
    _validate.check_pair("x", x, "y", y)
    batch = x.shape[0] if x.dim() == 3 else None
    s = _validate.bandwidth_tensor(sigma, batch, x)
    if s is None:
        raise ValueError("rbf_gram needs a numeric bandwidth sigma")
    s = s if batch is not None else s[0]
    _validate.check_finite("x", x)
    _validate.check_finite("y", y)
    return _gram64(x.double(), y.double(), s).to(x.dtype)


def _gram64(x: torch.Tensor, y: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    if sigma.dim() == 1:
        sigma = sigma[:, None, None]
    return torch.exp(-_sqdist(x, y) / (2 * sigma**2))


class DensityRatio:
    """Kernel fit of numer(z) / denom(z) from samples (uLSIF loss + RKHS penalty, closed form).

    After ``fit``: ``alpha`` (float64 weights on the denom samples, [n_denom] or [B, n_denom]),
    ``beta`` (the weight 1 / (lam n_numer) shared by all numer samples) and ``sigma`` (the bandwidth
    used, float64, [] or [B]). The fitted function is fixed: ``ratio`` and ``log_ratio`` are
    differentiable w.r.t. their argument only.
    """

    def __init__(self, lam: float = 1e-3, bandwidth="median"):
        self.lam = _validate.check_positive("lam", lam)
        self.bandwidth = bandwidth

    def fit(self, numer: torch.Tensor, denom: torch.Tensor) -> "DensityRatio":
        _validate.check_pair("numer", numer, "denom", denom)
        self.batched = numer.dim() == 3
        num = (numer if self.batched else numer[None]).detach()
        den = (denom if self.batched else denom[None]).detach()
        sigma = _validate.bandwidth_tensor(self.bandwidth, num.shape[0] if self.batched else None, num)
        self._alpha, self._sigma = self._fit(num, den, sigma)
        self.beta = 1.0 / (self.lam * num.shape[1])
        self._numer, self._denom = num, den
        return self

    @property
    def alpha(self) -> torch.Tensor:
        return self._alpha if self.batched else self._alpha[0]

    @property
    def sigma(self) -> torch.Tensor:
        return self._sigma if self.batched else self._sigma[0]

    def ratio(self, z: torch.Tensor) -> torch.Tensor:
        """The fitted ratio at ``z`` ([m, d] -> [m], [B, m, d] -> [B, m]); differentiable w.r.t. z."""
        if not hasattr(self, "_alpha"):
            raise RuntimeError("call fit(numer, denom) before evaluating the ratio")
        _validate.check_pair("z", z, "the fitted samples", self._denom if self.batched else self._denom[0])
        r = self._ratio(z if self.batched else z[None])
        return r if self.batched else r[0]

    def log_ratio(self, z: torch.Tensor, clip: float = 1e-8) -> torch.Tensor:
        """log max(r(z), clip); clipped points get zero gradient."""
        clip = _validate.check_positive("clip", clip)
        return torch.log(torch.clamp(self.ratio(z), min=clip))

    # The two computations a backend provides; inputs are batched [B, n, d].
    def _fit(self, num, den, sigma):
        _validate.check_finite("numer", num)
        _validate.check_finite("denom", den)
        num, den = num.double(), den.double()
        if sigma is None:
            sigma = median_bandwidth(torch.cat([den, num], dim=1)).double()
        n_num, n_den = num.shape[1], den.shape[1]
        system = _gram64(den, den, sigma) / n_den + self.lam * torch.eye(n_den, dtype=torch.float64, device=num.device)
        chol, info = torch.linalg.cholesky_ex(system)
        if bool((info != 0).any()):
            raise ValueError(f"K/n + lam I is not positive definite in float64 at lam={self.lam}; increase lam")
        rhs = _gram64(den, num, sigma).sum(-1, keepdim=True) / (self.lam * n_den * n_num)
        return -torch.cholesky_solve(rhs, chol)[..., 0], sigma

    def _ratio(self, z):
        z64 = z.double()
        r = (_gram64(z64, self._denom.double(), self._sigma) @ self._alpha[..., None])[..., 0]
        r = r + self.beta * _gram64(z64, self._numer.double(), self._sigma).sum(-1)
        return r.to(z.dtype)


def kl(prior_z: torch.Tensor, q_z: torch.Tensor, lam: float = 1e-3, *, clip: float = 1e-8,
       bandwidth="median", reverse: bool = True) -> torch.Tensor:
    """KL(q || p) from samples; see :func:`kivi_fast.kl` for the full contract."""
    _validate.check_pair("prior_z", prior_z, "q_z", q_z)
    _validate.check_finite("prior_z", prior_z)
    _validate.check_finite("q_z", q_z)
    clip = _validate.check_positive("clip", clip)
    if reverse:
        return -DensityRatio(lam, bandwidth).fit(prior_z, q_z).log_ratio(q_z, clip).mean(-1)
    return DensityRatio(lam, bandwidth).fit(q_z, prior_z).log_ratio(q_z, clip).mean(-1)


def adaptive_contrast_kl(q_z, log_prior=None, lam: float = 1e-3, **kwargs):
    """Adaptive-contrast KL on the reference backend; see :func:`kivi_fast.adaptive_contrast_kl`."""
    return _adaptive_contrast_kl(q_z, log_prior, lam, kl_fn=kl, **kwargs)
