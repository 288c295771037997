"""The public estimator: ``kl``, ``DensityRatio`` and the kernel primitives.

Each function validates its arguments once (``_validate``), then runs the backend chosen in
``_backend`` (the compiled ops, or the pure-PyTorch reference when they are absent or
``KIVI_FAST_BACKEND=reference`` is set). Both give the same numbers; the tests hold them to it.
"""

from __future__ import annotations

import warnings

import torch

from . import _validate
from ._backend import impl
from .contrast import DEFAULT_LAM, check_kl_contrast, sample_contrast_kl
from .contrast import adaptive_contrast_kl as _adaptive_contrast_kl

__all__ = ["kl", "kernel_kl", "DensityRatio", "rbf_gram", "median_bandwidth", "adaptive_contrast_kl",
           "ClippingWarning"]


class ClippingWarning(UserWarning):
    """More than half of the fitted ratios at the posterior samples were clipped: the KL estimate is
    then mostly -log(clip), not a measurement of q."""


def _batched(x: torch.Tensor) -> torch.Tensor:
    return x if x.dim() == 3 else x.unsqueeze(0)


def _warn_if_mostly_clipped(clipped: torch.Tensor, clip: float) -> None:
    # Reading the fraction copies it to the host: done for CPU tensors only, where that is free. On
    # other devices it would stall the stream at every call, and under torch.compile it is a
    # data-dependent branch, so the check is skipped there.
    if not _validate.reads_values(clipped) or torch.compiler.is_compiling() or clipped.numel() == 0:
        return
    worst = clipped.item() if clipped.dim() == 0 else clipped.max().item()
    if worst > 0.5:
        # One text for every call: Python then shows the warning once per call site, not every step.
        warnings.warn(
            "kivi_fast.kernel_kl (also inside kl and adaptive_contrast_kl): more than half of the posterior "
            "samples' fitted ratios fell below clip and were clipped; the estimate is then dominated by "
            "-log(clip) and does not measure q. Lower lam, or pass a bandwidth that suits the samples' scale "
            "(kivi_fast.DensityRatio shows the fitted ratios).",
            ClippingWarning, stacklevel=_validate.user_stacklevel())


def kernel_kl(prior_z: torch.Tensor, q_z: torch.Tensor, lam: float = 1e-3, *, clip: float = 1e-8,
              bandwidth="median", reverse: bool = True) -> torch.Tensor:
    """The paper's estimator: KL(q || p) from samples with KIVI's kernel density-ratio fit (Shi et al.,
    2018), the compiled op. :func:`kl` with ``contrast="none", lam=1e-3``; :func:`kl`'s default builds on it.

    Args:
        prior_z: samples of the prior p, [n_p, d], or [B, n_p, d] for B independent estimates.
        q_z: samples of the posterior q, [n_q, d] or [B, n_q, d]; n_q may differ from n_p. Both sides
            need at least 2 samples (a ratio fitted to one sample estimates nothing).
        lam: ridge coefficient of the fit (the paper uses 1e-3), at least 1e-10: below that the fit,
            which cancels terms of size 1/lam, is no longer accurate in float64.
        clip: the fitted ratio is clipped below at ``clip``, in (0, 1), before the log. When more than
            half of the ratios are clipped a :class:`ClippingWarning` is issued (CPU tensors).
        bandwidth: ``"median"`` (the median Euclidean distance over all distinct pairs of the
            n_p + n_q points, per batch element), or a positive float, or a tensor of shape [] or [B].
        reverse: fit the reverse ratio p/q and return -mean log r(q_z) (the paper's reverse ratio
            trick, default); False fits q/p and returns mean log r(q_z) (the paper's ablation).

    Returns:
        A tensor of shape [] (or [B]) in the dtype of the inputs: float32 or float64; float16 and
        bfloat16 samples (e.g. under torch.autocast) are taken as float32 and give float32.

    Gradient: only w.r.t. ``q_z``, by the paper's Eq. (8): the fitted ratio (coefficients, centres,
    bandwidth) is held fixed and the gradient flows through the evaluation points. Points whose ratio
    was clipped get zero gradient. ``prior_z`` gets no gradient (a ``UserWarning`` says so when it
    requires one). torch.func's transforms (vmap, grad) raise NotImplementedError: pass batches.

    The fit and the evaluation run in float64 internally, because evaluating the fitted ratio cancels
    terms of size ~1/lam; float32 inputs give float32 results within 1e-3 of float64's.

    On a GPU nothing is read back to the host (a training step can be captured in a CUDA graph): NaN/Inf
    samples, a median distance or a bandwidth tensor below 1e-150 (0 included) or not finite, or a fit
    that fails give NaN for that batch element, where CPU tensors raise ValueError.
    """
    prior_z, q_z = _validate.entering("kernel_kl", prior_z, q_z)
    lam, clip, sigma = _validate.kl_arguments(prior_z, q_z, lam, clip, bandwidth)
    _validate.warn_if_ungraded("prior_z", prior_z, "kernel_kl")
    return _fixed_ratio_kl(prior_z, q_z, lam, clip, sigma, reverse)


def _fixed_ratio_kl(prior_z, q_z, lam: float, clip: float, sigma, reverse) -> torch.Tensor:
    """:func:`kernel_kl` on checked arguments (``kl(contrast="none")`` comes here, checked once)."""
    _validate.check_reverse(reverse)
    # without a gradient to come the op skips what only the backward needs
    grad_state = q_z.requires_grad and torch.is_grad_enabled()
    # unbatched samples go in as they are (the op takes them): no view nodes in the graph
    value, clipped = impl().kl(prior_z, q_z, lam, clip, sigma, reverse, grad_state)
    _warn_if_mostly_clipped(clipped, clip)
    return value


def kl(prior_z: torch.Tensor, q_z: torch.Tensor, lam: float = DEFAULT_LAM, *, contrast: str = "auto",
       clip: float = 1e-8, bandwidth="median", reverse: bool = True,
       generator: torch.Generator | None = None) -> torch.Tensor:
    """Estimate KL(q || p) from samples of both, differentiable w.r.t. ``q_z``.

    By default (``contrast="auto"``, lam = 1e-2) it contrasts each side with its fitted Gaussian
    (:func:`kivi_fast.contrast.sample_contrast_kl`): the Gaussian part of KL(q || p) is computed in
    closed form from the two samples' moments, and KIVI's kernel fit (:func:`kernel_kl`) estimates
    only the rest, between whitened samples and N(0, I) draws. ``contrast="none", lam=1e-3`` is the
    paper's estimator (:func:`kernel_kl`). Why: the gradient of the paper's estimator w.r.t. q's
    parameters is off by a median 1.3x its norm on Gaussian posteriors (no lam or bandwidth rule
    fixes it), and training loops with it end far from the posterior; with the contrast they recover
    it (results/diagnostics/README.md: grad-accuracy, client-loop, amortized).

    Args:
        prior_z, q_z: samples [n_p, d] and [n_q, d], or [B, n_p, d] and [B, n_q, d] for B independent
            estimates; at least 2 on each side, and with a contrast at least 4 prior samples (the
            inverse of a variance fitted to fewer has no finite mean: at q = p = N(0, I) in d = 10, 3
            prior samples read a median 28 nats under "auto", 4 read 2). ``contrast="full"`` asks for
            more than d a side: with n_p <= d the prior's shrunk covariance reads far off (d = 10:
            a median 19 nats with 4 prior samples, 2.3 with 8).
        lam: ridge coefficient of the kernel fits, at least 1e-10.
        contrast: "auto" ("full" when both sides have more than d samples, else "diagonal"; and
            "diagonal" for a side of a batch element whose samples lie on a subspace, where "full"
            is singular), "full" (full-covariance Gaussians; a singular covariance raises, on a GPU
            gives NaN), "diagonal" (per-dimension), or "none" (the paper's estimator).
            The full contrast estimates d (d + 1) / 2 covariances a side, so with n only a little above
            d its value is noisy: at q = p = N(0, I) in d = 20 (48 draws each) n = 25 reads up to 29
            nats off, n = 30 up to 10, n = 40 up to 5.5, n = 60 up to 1.6; "diagonal" within 1.4 at
            all of them. With n <= d + 4 prior samples the prior's covariance is shrunk toward its
            diagonal (its inverse has no finite variance there): within 4 nats at n = 21 to 24.
        clip, reverse: as in :func:`kernel_kl` (``reverse`` applies to the posterior's kernel term).
        bandwidth: "median" or a number or tensor, as in :func:`kernel_kl`; with a contrast it is in
            the units of the whitened samples.
        generator: a torch.Generator on q_z's device for the contrast's N(0, I) draws (n_p of them);
            with it the estimate is reproducible. Unused with ``contrast="none"``.

    Returns a tensor of shape [] (or [B]) in the dtype of the inputs (float16 and bfloat16: float32, as
    in :func:`kernel_kl`). The prior samples get no gradient
    (a ``UserWarning`` says so when they require one).
    The value reads high where q is much wider than p: the prior's kernel term then extrapolates
    beyond p's samples (kl-accuracy, n = 500: +0.85 nats for N(0, 4 I) in d = 8, whose KL is 6.5);
    :func:`adaptive_contrast_kl`, given p's density, has no such term.
    """
    sample_eps = _validate.precision_of(prior_z, q_z)  # (half samples: their own, not float32's)
    prior_z, q_z = _validate.entering("kl", prior_z, q_z)
    lam, clip, sigma = _validate.kl_arguments(prior_z, q_z, lam, clip, bandwidth)
    _validate.warn_if_ungraded("prior_z", prior_z, "kl")
    if check_kl_contrast(contrast) == "none":
        return _fixed_ratio_kl(prior_z, q_z, lam, clip, sigma, reverse)
    return sample_contrast_kl(prior_z, q_z, lam, contrast=contrast, clip=clip, bandwidth=bandwidth, reverse=reverse,
                              generator=generator, kernel_kl=kernel_kl, density_ratio=DensityRatio,
                              sample_eps=sample_eps)


class DensityRatio:
    """Kernel density-ratio fit r(z) ~ numer(z) / denom(z) (kscore style: fit, then evaluate).

    >>> dr = DensityRatio(lam=1e-3).fit(numer_samples, denom_samples)
    >>> dr.ratio(z), dr.log_ratio(z, clip=1e-8), dr.alpha, dr.beta, dr.sigma

    The fitted function is r(z) = sum_i alpha_i k(denom_i, z) + beta sum_j k(numer_j, z) with an RBF
    kernel of bandwidth ``sigma``; it is the same fit that :func:`kl` uses. After ``fit``: ``alpha``
    (float64, [n_denom] or [B, n_denom]), ``beta`` = 1 / (lam n_numer) and ``sigma`` (float64, [] or
    [B]). ``ratio`` and ``log_ratio`` are differentiable w.r.t. their argument only. The fit keeps
    ``numer`` and ``denom`` as given (detached, not copied: r's centres): changing them in place
    afterwards changes the ratio, so refit after updating them.
    """

    def __init__(self, lam: float = 1e-3, bandwidth="median"):
        self.lam = _validate.check_lam(lam)
        self.bandwidth = bandwidth

    def fit(self, numer: torch.Tensor, denom: torch.Tensor) -> "DensityRatio":
        numer, denom = _validate.entering("DensityRatio.fit", numer, denom)
        sigma = _validate.fit_arguments(numer, denom, self.bandwidth)
        num, den = _batched(numer).detach(), _batched(denom).detach()
        alpha, fitted_sigma = impl().fit(num, den, self.lam, sigma)  # (a failed refit keeps the last fit)
        self.batched, self._alpha, self._sigma = numer.dim() == 3, alpha, fitted_sigma
        self._beta = 1.0 / (self.lam * num.shape[1])
        self._numer, self._denom = num, den
        return self

    def _fitted(self, what: str) -> None:
        if not hasattr(self, "_alpha"):
            raise RuntimeError(f"call fit(numer, denom) before {what}")

    @property
    def alpha(self) -> torch.Tensor:
        self._fitted("reading alpha")
        return self._alpha if self.batched else self._alpha[0]

    @property
    def beta(self) -> float:
        self._fitted("reading beta")
        return self._beta

    @property
    def sigma(self) -> torch.Tensor:
        self._fitted("reading sigma")
        return self._sigma if self.batched else self._sigma[0]

    def ratio(self, z: torch.Tensor) -> torch.Tensor:
        """The fitted ratio at ``z`` ([m, d] -> [m], [B, m, d] -> [B, m]); differentiable w.r.t. z."""
        self._fitted("evaluating the ratio")
        z = _validate.entering("DensityRatio.ratio", z)
        _validate.check_pair("z", z, "the fitted samples", self._denom if self.batched else self._denom[0])
        r = impl().ratio(_batched(z), self._numer, self._denom, self._alpha, self._beta, self._sigma)
        return r if self.batched else r[0]

    def log_ratio(self, z: torch.Tensor, clip: float = 1e-8) -> torch.Tensor:
        """log max(r(z), clip); clipped points get zero gradient."""
        clip = _validate.check_clip(clip)
        return torch.log(torch.clamp(self.ratio(z), min=clip))


def median_bandwidth(x: torch.Tensor) -> torch.Tensor:
    """Median Euclidean distance over the distinct pairs of rows of ``x`` ([n, d] -> [], [B, n, d] -> [B]).

    An even number of pairs gives the mean of the two middle distances (numpy's convention). Raises
    ValueError when the median is 0 (at least half of the pairs coincide; on a GPU: NaN). No gradient.
    """
    x = _validate.entering("median_bandwidth", x)
    _validate.check_samples("x", x)
    _validate.check_min_samples("x", x, 2, "for a median distance")
    sigma = impl().median_bandwidth(_batched(x.detach())).to(x.dtype)  # (no gradient: none is recorded)
    return sigma if x.dim() == 3 else sigma[0]


def rbf_gram(x: torch.Tensor, y: torch.Tensor, sigma) -> torch.Tensor:
    """RBF Gram matrix exp(-||x_i - y_j||^2 / (2 sigma^2)): [n, d], [m, d] -> [n, m] (batched too).

    ``sigma`` is a positive float or a tensor of shape [] or [B]. No gradient.
    """
    x, y = _validate.entering("rbf_gram", x, y)
    _validate.check_pair("x", x, "y", y)
    batch = x.shape[0] if x.dim() == 3 else None
    s = _validate.bandwidth_tensor(sigma, batch, x)
    if s is None:
        raise ValueError("rbf_gram needs a numeric bandwidth sigma")
    gram = impl().rbf_gram(_batched(x.detach()), _batched(y.detach()), s)  # (no gradient: none is recorded)
    return gram if batch is not None else gram[0]


def adaptive_contrast_kl(q_z, log_prior=None, lam: float = DEFAULT_LAM, **kwargs) -> torch.Tensor:
    """KL(q || p) with adaptive contrast (the paper's Appendix D), for any prior with a log-density:
    the call to use when training a posterior against a known prior.

    KL(q || p) = KIVI(N(0, I) samples, whitened q_z) + E_q[log r(z) - log p(z)], with r the Gaussian
    fitted to ``q_z`` (per batch element), whose moments keep their gradient. By default
    (``contrast="auto"``, lam = 1e-2) r has a full covariance when n > d, for which the gradient on a
    Gaussian q equals the true ratio's, and a diagonal one otherwise (and for a batch element whose
    samples lie on a subspace); ``contrast="diagonal",
    lam=1e-3`` is the paper's form. The defaults come from the grad-accuracy and amortized studies
    (results/diagnostics/README.md). ``log_prior`` maps [..., n, d] to [..., n]; None means N(0, I).
    Keyword arguments: ``contrast``, ``n_prior``, ``clip``, ``bandwidth``, ``reverse``, ``generator``,
    ``reference_z``
    (see :func:`kivi_fast.contrast.adaptive_contrast_kl`).
    """
    sample_eps = _validate.precision_of(q_z)
    q_z = _validate.entering("adaptive_contrast_kl", q_z)
    if "reference_z" in kwargs:
        kwargs["reference_z"] = _validate.upcast_half(kwargs["reference_z"])
    return _adaptive_contrast_kl(q_z, log_prior, lam, kl_fn=kernel_kl, sample_eps=sample_eps, **kwargs)
