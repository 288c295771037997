"""Pure-PyTorch reference of the KIVI estimator: the test oracle and the fallback backend.

Short and obviously correct rather than fast: pairwise differences are materialized, the median is
``torch.quantile`` over the upper triangle, and the fixed-ratio gradient of the paper's Eq. (8) comes
from autograd through fit parameters that are ``detach()``ed. All arithmetic is float64; results are
cast back to the input dtype. The formulas (the paper's Eq. 6 and Appendix B):

    r(z) = sum_i alpha_i k(denom_i, z) + beta * sum_j k(numer_j, z)        (fits numer / denom)
    beta  = 1 / (lam n_numer)
    alpha = -1 / (lam n_denom n_numer) (K_dd / n_denom + lam I)^{-1} K_dn 1

The public functions validate their arguments like :mod:`kivi_fast.estimator` does; the underscored
float64 functions take batched, validated tensors and are what the reference backend runs.
"""

from __future__ import annotations

import math

import torch

from . import _validate
from .contrast import DEFAULT_LAM, check_kl_contrast, sample_contrast_kl
from .contrast import adaptive_contrast_kl as _adaptive_contrast_kl

__all__ = ["kl", "kernel_kl", "DensityRatio", "rbf_gram", "median_bandwidth", "adaptive_contrast_kl"]


def _sqdist(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (x.unsqueeze(-2) - y.unsqueeze(-3)).pow(2).sum(-1)


def _gram64(x: torch.Tensor, y: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    if sigma.dim() == 1:
        sigma = sigma[:, None, None]
    return torch.exp(-_sqdist(x, y) / (2 * sigma**2))


# the compiled ops' message (csrc/kivi.h, kNotFiniteMessage)
_NOT_FINITE = " contains NaN or Inf (or points so far apart that their squared distances overflow float64)"


def _check_distances(name: str, x: torch.Tensor, y: torch.Tensor | None = None, name_y: str | None = None) -> None:
    """Finite squared distances between the rows of (finite) samples x [..., n, d] and those of y (default
    x's own); else a ValueError naming the set that reaches farther out (``name``, or ``name_y`` for y's),
    as the compiled ops name the set far from the points' centre."""
    x64 = x.detach().double()
    y64 = x64 if y is None else y.detach().double()
    if x64.numel() == 0 or y64.numel() == 0:
        return
    x_far, y_far = float(x64.abs().amax()), float(y64.abs().amax())
    largest = max(x_far, y_far)
    if math.isfinite(4.0 * x64.shape[-1] * largest * largest):  # (a product, where ** would raise)
        return  # (no squared distance exceeds d (2 max |x|)^2)
    if not bool(torch.isfinite(_sqdist(x64, y64)).all()):
        raise ValueError((name_y if name_y is not None and y_far > x_far else name) + _NOT_FINITE)


def _check_spread(*named: tuple[str, torch.Tensor]) -> None:
    """Finite squared distances within each named set of (finite) samples [B, n, d], in turn."""
    for name, x in named:
        _check_distances(name, x)


def _check_evaluation(z: torch.Tensor, num: torch.Tensor, den: torch.Tensor) -> None:
    """The fitted ratio's points z [B, m, d]: finite, and at finite squared distances from its centres."""
    _validate.check_finite("z", z)
    _check_distances("z", z, torch.cat([den, num], dim=-2))


def _median64(x: torch.Tensor) -> torch.Tensor:
    """Median distance over the distinct pairs of rows, float64: [..., n, d] -> [...]."""
    x64 = x.detach().double()
    n = x.shape[-2]
    if x64.shape[:-2].numel() == 0:  # (quantile refuses an empty batch)
        return x64.new_empty(x64.shape[:-2])
    rows, cols = torch.triu_indices(n, n, offset=1, device=x.device)
    squared = _sqdist(x64, x64)[..., rows, cols]
    if not bool(torch.isfinite(squared).all()):
        raise ValueError("x" + _NOT_FINITE)
    sigma = torch.quantile(squared.sqrt(), 0.5, dim=-1)
    if bool((sigma == 0).any()):
        raise ValueError(
            "the median pairwise distance of the samples is 0 (at least half of the pairs coincide, or their "
            "squared distances underflow: rescale samples that small); pass an explicit bandwidth=..."
        )
    return sigma


def _fit64(num: torch.Tensor, den: torch.Tensor, lam: float, sigma: torch.Tensor | None):
    """(alpha [B, n_den], sigma [B]) of the fit of num / den; batched samples, sigma None: the median."""
    _validate.check_finite("numer", num)
    _validate.check_finite("denom", den)
    _check_spread(("denom", den), ("numer", num), ("denom", torch.cat([den, num], dim=1)))
    num, den = num.double(), den.double()
    if sigma is None:
        sigma = _median64(torch.cat([den, num], dim=1))
        if bool((sigma < _validate.MIN_BANDWIDTH).any()):
            raise ValueError("the median pairwise distance of the samples is below 1e-150, too small a bandwidth "
                             "(its square would underflow); rescale samples that small")
    n_num, n_den = num.shape[1], den.shape[1]
    system = _gram64(den, den, sigma) / n_den + lam * torch.eye(n_den, dtype=torch.float64, device=num.device)
    chol, info = torch.linalg.cholesky_ex(system)
    if bool((info != 0).any()):
        raise ValueError(f"K/n + lam I is not positive definite in float64 at lam={lam}; increase lam")
    rhs = _gram64(den, num, sigma).sum(-1, keepdim=True) / (lam * n_den * n_num)
    return -torch.cholesky_solve(rhs, chol)[..., 0], sigma


def _ratio64(z, num, den, alpha, beta: float, sigma) -> torch.Tensor:
    """The fitted ratio at z (batched), in z's dtype; differentiable w.r.t. z only."""
    z64 = z.double()
    r = (_gram64(z64, den.double(), sigma) @ alpha[..., None])[..., 0]
    r = r + beta * _gram64(z64, num.double(), sigma).sum(-1)
    return r.to(z.dtype)


def _kl_and_clipped(prior_z, q_z, lam: float, clip: float, sigma, reverse: bool):
    """(KL estimate [B], fraction of q_z's ratios clipped [B]) on batched, validated samples."""
    _validate.check_finite("prior_z", prior_z)
    _validate.check_finite("q_z", q_z)
    _check_spread(("q_z", q_z), ("prior_z", prior_z), ("q_z", torch.cat([q_z, prior_z], dim=1)))
    num, den = (prior_z, q_z) if reverse else (q_z, prior_z)
    alpha, sigma = _fit64(num.detach(), den.detach(), lam, sigma)
    r = _ratio64(q_z, num.detach(), den.detach(), alpha, 1.0 / (lam * num.shape[1]), sigma)
    log_r = torch.log(torch.clamp(r, min=clip)).mean(-1)
    clipped = (r.detach() <= clip).double().mean(-1)
    return (-log_r if reverse else log_r), clipped


def median_bandwidth(x: torch.Tensor) -> torch.Tensor:
    """Median Euclidean distance over the distinct pairs of rows of ``x`` ([n, d] -> [], [B, n, d] -> [B]).

    An even number of pairs gives the mean of the two middle distances (numpy's convention).
    """
    _validate.check_samples("x", x)
    _validate.check_min_samples("x", x, 2, "for a median distance")
    _validate.check_finite("x", x)
    return _median64(x).to(x.dtype)


def rbf_gram(x: torch.Tensor, y: torch.Tensor, sigma) -> torch.Tensor:
    """k(x_i, y_j) = exp(-||x_i - y_j||^2 / (2 sigma^2)) ([n, d], [m, d] -> [n, m]; batched too)."""
    _validate.check_pair("x", x, "y", y)
    batch = x.shape[0] if x.dim() == 3 else None
    s = _validate.bandwidth_tensor(sigma, batch, x)
    if s is None:
        raise ValueError("rbf_gram needs a numeric bandwidth sigma")
    _validate.check_finite("x", x)
    _validate.check_finite("y", y)
    _check_distances("x", x, y, "y")
    return _gram64(x.double(), y.double(), s if batch is not None else s[0]).to(x.dtype)


class DensityRatio:
    """Kernel fit of numer(z) / denom(z) from samples (the reference's; see kivi_fast.DensityRatio)."""

    def __init__(self, lam: float = 1e-3, bandwidth="median"):
        self.lam = _validate.check_lam(lam)
        self.bandwidth = bandwidth

    def fit(self, numer: torch.Tensor, denom: torch.Tensor) -> "DensityRatio":
        sigma = _validate.fit_arguments(numer, denom, self.bandwidth)
        self.batched = numer.dim() == 3
        num = (numer if self.batched else numer[None]).detach()
        den = (denom if self.batched else denom[None]).detach()
        self.alpha, self.sigma = _fit64(num, den, self.lam, sigma)
        if not self.batched:
            self.alpha, self.sigma = self.alpha[0], self.sigma[0]
        self.beta = 1.0 / (self.lam * num.shape[1])
        self._numer, self._denom = num, den
        return self

    def ratio(self, z: torch.Tensor) -> torch.Tensor:
        """The fitted ratio at ``z`` ([m, d] -> [m], [B, m, d] -> [B, m]); differentiable w.r.t. z."""
        if not hasattr(self, "alpha"):
            raise RuntimeError("call fit(numer, denom) before evaluating the ratio")
        _validate.check_pair("z", z, "the fitted samples", self._denom if self.batched else self._denom[0])
        b = (lambda t: t) if self.batched else (lambda t: t[None])
        _check_evaluation(b(z), self._numer, self._denom)
        r = _ratio64(b(z), self._numer, self._denom, b(self.alpha), self.beta, b(self.sigma))
        return r if self.batched else r[0]

    def log_ratio(self, z: torch.Tensor, clip: float = 1e-8) -> torch.Tensor:
        """log max(r(z), clip); clipped points get zero gradient."""
        clip = _validate.check_clip(clip)
        return torch.log(torch.clamp(self.ratio(z), min=clip))


def kernel_kl(prior_z: torch.Tensor, q_z: torch.Tensor, lam: float = 1e-3, *, clip: float = 1e-8,
              bandwidth="median", reverse: bool = True) -> torch.Tensor:
    """The paper's estimator from samples; see :func:`kivi_fast.kernel_kl` for the full contract."""
    lam, clip, sigma = _validate.kl_arguments(prior_z, q_z, lam, clip, bandwidth)
    _validate.check_reverse(reverse)
    batched = q_z.dim() == 3
    b = (lambda t: t) if batched else (lambda t: t[None])
    value, _ = _kl_and_clipped(b(prior_z), b(q_z), lam, clip, sigma, reverse)
    return value if batched else value[0]


def kl(prior_z: torch.Tensor, q_z: torch.Tensor, lam: float = DEFAULT_LAM, *, contrast: str = "auto",
       clip: float = 1e-8, bandwidth="median", reverse: bool = True, generator=None) -> torch.Tensor:
    """KL(q || p) from samples, by default with a Gaussian contrast; see :func:`kivi_fast.kl`."""
    if check_kl_contrast(contrast) == "none":
        return kernel_kl(prior_z, q_z, lam, clip=clip, bandwidth=bandwidth, reverse=reverse)
    lam, clip, _ = _validate.kl_arguments(prior_z, q_z, lam, clip, bandwidth)
    return sample_contrast_kl(prior_z, q_z, lam, contrast=contrast, clip=clip, bandwidth=bandwidth, reverse=reverse,
                              generator=generator, kernel_kl=kernel_kl, density_ratio=DensityRatio)


def adaptive_contrast_kl(q_z, log_prior=None, lam: float = DEFAULT_LAM, **kwargs):
    """Adaptive-contrast KL on the reference backend; see :func:`kivi_fast.adaptive_contrast_kl`."""
    return _adaptive_contrast_kl(q_z, log_prior, lam, kl_fn=kernel_kl, **kwargs)
