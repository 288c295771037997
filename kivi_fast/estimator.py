"""The public estimator: ``kl``, ``DensityRatio`` and the kernel primitives, on the compiled ops.

Each function validates its arguments once (``_validate``), then runs the compiled ops
(``torch.ops.kivi_fast``) or, when they are absent or ``KIVI_FAST_BACKEND=reference`` is set, the
pure-PyTorch reference. Both give the same numbers; the tests hold them to it.
"""

from __future__ import annotations

import torch

from . import _validate, reference
from ._backend import backend
from .contrast import adaptive_contrast_kl as _adaptive_contrast_kl

__all__ = ["kl", "DensityRatio", "rbf_gram", "median_bandwidth", "adaptive_contrast_kl"]


def _ops():
    return torch.ops.kivi_fast


def _batched(x: torch.Tensor) -> torch.Tensor:
    return x if x.dim() == 3 else x.unsqueeze(0)


def kl(prior_z: torch.Tensor, q_z: torch.Tensor, lam: float = 1e-3, *, clip: float = 1e-8,
       bandwidth="median", reverse: bool = True) -> torch.Tensor:
    """Estimate KL(q || p) from samples with the kernel density-ratio fit of KIVI (Shi et al., 2018).

    Args:
        prior_z: samples of the prior p, [n_p, d], or [B, n_p, d] for B independent estimates.
        q_z: samples of the posterior q, [n_q, d] or [B, n_q, d]; n_q may differ from n_p.
        lam: ridge coefficient lambda > 0 of the fit (the paper uses 1e-3).
        clip: the fitted ratio is clipped below at ``clip`` > 0 before the log.
        bandwidth: ``"median"`` (the median Euclidean distance over all distinct pairs of the
            n_p + n_q points, per batch element), or a positive float, or a tensor of shape [] or [B].
        reverse: fit the reverse ratio p/q and return -mean log r(q_z) (the paper's reverse ratio
            trick, default); False fits q/p and returns mean log r(q_z) (the paper's ablation).

    Returns:
        A tensor of shape [] (or [B]) in the dtype of the inputs.

    Gradient: only w.r.t. ``q_z``, by the paper's Eq. (8): the fitted ratio (coefficients, centres,
    bandwidth) is held fixed and the gradient flows through the evaluation points. Points whose ratio
    was clipped get zero gradient. ``prior_z`` gets no gradient.

    The fit and the evaluation run in float64 internally, because evaluating the fitted ratio cancels
    terms of size ~1/lam; float32 inputs give float32 results accurate to float32. (On CPU, kernel
    systems above 256 rows are factored in float32 and the solve refined in float64 to float64's
    backward error.)
    """
    if backend() == "reference":
        return reference.kl(prior_z, q_z, lam, clip=clip, bandwidth=bandwidth, reverse=reverse)
    _validate.check_pair("prior_z", prior_z, "q_z", q_z)
    lam = _validate.check_positive("lam", lam)
    clip = _validate.check_positive("clip", clip)
    if not isinstance(reverse, bool):
        raise TypeError(f"reverse must be a bool, got {type(reverse).__name__}")
    batch = q_z.shape[0] if q_z.dim() == 3 else None
    sigma = _validate.bandwidth_tensor(bandwidth, batch, q_z)
    # without a gradient to come the op skips what only the backward needs
    grad_state = q_z.requires_grad and torch.is_grad_enabled()
    # unbatched samples go in as they are (the op takes them): no view nodes in the graph
    return _ops().kl(prior_z, q_z, lam, clip, sigma, reverse, grad_state)[0]


class DensityRatio(reference.DensityRatio):
    """Kernel density-ratio fit r(z) ~ numer(z) / denom(z) (kscore style: fit, then evaluate).

    >>> dr = DensityRatio(lam=1e-3).fit(numer_samples, denom_samples)
    >>> dr.ratio(z), dr.log_ratio(z, clip=1e-8), dr.alpha, dr.beta, dr.sigma

    The fitted function is r(z) = sum_i alpha_i k(denom_i, z) + beta sum_j k(numer_j, z) with an RBF
    kernel of bandwidth ``sigma``; it is the same fit that :func:`kl` uses.
    """

    def _fit(self, num, den, sigma):
        if backend() == "reference":
            return super()._fit(num, den, sigma)
        return _ops().fit(num, den, self.lam, sigma)

    def _ratio(self, z):
        if backend() == "reference":
            return super()._ratio(z)
        return _ops().ratio(z, self._numer, self._denom, self._alpha, self.beta, self._sigma)[0]


def median_bandwidth(x: torch.Tensor) -> torch.Tensor:
    """Median Euclidean distance over the distinct pairs of rows of ``x`` ([n, d] -> [], [B, n, d] -> [B]).

    An even number of pairs gives the mean of the two middle distances (numpy's convention). Raises
    ValueError when the median is 0 (at least half of the pairs coincide). No gradient.
    """
    if backend() == "reference":
        return reference.median_bandwidth(x)
    _validate.check_samples("x", x)
    if x.shape[-2] < 2:
        raise ValueError(f"x must hold at least 2 samples for a median distance, got shape {tuple(x.shape)}")
    sigma = _ops().median_bandwidth(_batched(x)).to(x.dtype)
    return sigma if x.dim() == 3 else sigma[0]


def rbf_gram(x: torch.Tensor, y: torch.Tensor, sigma) -> torch.Tensor:
    """RBF Gram matrix exp(-||x_i - y_j||^2 / (2 sigma^2)): [n, d], [m, d] -> [n, m] (batched too).

    ``sigma`` is a positive float or a tensor of shape [] or [B]. No gradient.
    """
    if backend() == "reference":
        return reference.rbf_gram(x, y, sigma)
    _validate.check_pair("x", x, "y", y)
    batch = x.shape[0] if x.dim() == 3 else None
    s = _validate.bandwidth_tensor(sigma, batch, x)
    if s is None:
        raise ValueError("rbf_gram needs a numeric bandwidth sigma")
    gram = _ops().rbf_gram(_batched(x), _batched(y), s)
    return gram if batch is not None else gram[0]


def adaptive_contrast_kl(q_z, log_prior=None, lam: float = 1e-3, **kwargs) -> torch.Tensor:
    """KL(q || p) with adaptive contrast (the paper's Appendix D), for any prior with a log-density.

    KL(q || p) = KIVI(N(0, I) samples, (z - m) / s) + E_q[log N(z; m, s^2) - log p(z)], with m, s the
    per-dimension mean and standard deviation of ``q_z`` (per batch element), which keep their gradient.
    ``log_prior`` maps [..., n, d] to [..., n]; None means N(0, I). Keyword arguments: ``n_prior``,
    ``clip``, ``bandwidth``, ``reverse``, ``generator`` (see :func:`kivi_fast.contrast.adaptive_contrast_kl`).
    """
    return _adaptive_contrast_kl(q_z, log_prior, lam, kl_fn=kl, **kwargs)
