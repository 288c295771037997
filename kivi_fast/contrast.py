"""Gaussian contrast around KIVI's kernel estimator: the defaults of ``kl`` and ``adaptive_contrast_kl``.

Adaptive contrast (the paper's Appendix D, after AVB), for a prior with a log-density:

    KL(q || p) = KL(q_hat || N(0, I)) + E_q[log r(z) - log p(z)],

with r = N(m, S) fitted to the q samples by maximum likelihood and q_hat the law of the samples
mapped by r's whitening, z -> C^{-1} (z - m) with S = C C^T. Only the first term needs the
density-ratio estimator, and it compares two distributions of zero mean and unit covariance, where
the kernel fit is most accurate. m and C keep their gradient. For a prior known only by samples,
:func:`sample_contrast_kl` fits a Gaussian to each side and adds a second kernel term for what the
prior's Gaussian misses. The choices of r:

- ``contrast="diagonal"`` (the paper's): S = diag(s^2), per-dimension standardization.
- ``contrast="full"``: S the full sample covariance, shrunk toward its diagonal when n <= d (where it
  is singular) by the Schaefer & Strimmer (2005) intensity. For a Gaussian q the whitened samples do
  not depend on q's parameters, so the kernel term carries no gradient and the analytic term gives
  the exact one; for other q the kernel term carries only the non-Gaussian rest. Per-dimension
  contrast leaves correlations to the kernel term, which cannot carry them.
- ``contrast="auto"`` (the default): "full" when n > d, else "diagonal". With n <= d the shrunk full
  covariance measured no better than the diagonal one and costs O(d^2) memory, which a BNN layer of
  10^5-10^6 weights cannot hold. A batch element whose samples lie on a subspace (an implicit
  posterior with fewer noise dimensions than d), where "full" is singular, takes its diagonal.

The default lam is 1e-2, not the paper's 1e-3, and the values are corrected for the biases of
fitting and whitening with sample moments (the N(0, I) draws are whitened too; the plug-in
log-determinant and precision are corrected to their expectations). Why, with the measurements:
results/diagnostics/README.md (grad-accuracy, amortized, client-loop, kl-accuracy, blr).
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import Callable, Optional

import torch

from . import _validate
from ._backend import constant_under_compile
from ._random import standard_normal

CONTRASTS = ("auto", "diagonal", "full")
DEFAULT_LAM = 1e-2  # adaptive contrast's default ridge coefficient; see the module docstring
MIN_PRIOR_SAMPLES = 4  # kl's prior samples under a contrast; see sample_contrast_kl


def standard_normal_log_prob(z: torch.Tensor) -> torch.Tensor:
    """log N(z; 0, I) summed over the last dimension."""
    return -0.5 * z.pow(2).sum(-1) - 0.5 * z.shape[-1] * math.log(2 * math.pi)


def shrinkage_intensity(x: torch.Tensor) -> torch.Tensor:
    """Schaefer & Strimmer (2005) shrinkage intensity of the sample correlation toward the identity
    (their target D: the covariance toward its diagonal), [..., n, d] -> [...] in [0, 1]:

        lam* = sum_{i != j} Var(r_ij) / sum_{i != j} r_ij^2,

    with r_ij the sample correlations and Var(r_ij) = n / (n - 1)^3 sum_k (w_kij - w_bar_ij)^2,
    w_kij = y_ki y_kj, y the standardized samples. No gradient. Two samples give 1: their correlations
    are +-1 whatever the law's, and the formula's variance of them 0 (an intensity of 0, which left the
    covariance singular). (And an empty batch, where std warns of zero degrees of freedom.)"""
    x = x.detach()
    n = x.shape[-2]
    if n == 2 or x.numel() == 0:
        return torch.ones(x.shape[:-2], dtype=x.dtype, device=x.device)
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


def diagonal_moments(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(std, mean) [..., 1, d] of samples [..., n, d] by maximum likelihood (dividing by n). An empty batch
    gives empty ones without std_mean's warning of zero degrees of freedom."""
    if x.numel() == 0:
        empty = x.sum(-2, keepdim=True)
        return empty, empty
    return torch.std_mean(x, -2, correction=0, keepdim=True)


def shrinks(shrink: str, n: int, d: int) -> bool:
    """Whether :func:`whitening` shrinks the covariance of n samples in d dimensions."""
    return shrink == "always" or (shrink == "auto" and n <= d)


# A pivot of the covariance's Cholesky factor (a dimension's standard deviation given the earlier ones)
# within rounding is rounding, not spread: samples on a subspace factor with such pivots instead of
# failing, and whitening by them multiplies the rounding into values of order 1. Two roundings bound
# it: the samples' own, their dtype's eps times the dimension's largest magnitude (over 900 draws of
# samples on a line the largest such pivot was 0.35 of it in float32, 1.6 in float64), and the
# covariance's, whose relative rounding eps of the variances leaves a pivot of ~sqrt(eps) times the
# std, growing with d (rank 255 in d = 256: 2.1e-5 of the std, 1.4 sqrt(d eps)). Margins of 8 and 64:
# float32 samples at 1e5 standard deviations from the origin still have 16 rounding steps per std.
SAMPLE_ROUNDINGS, COVARIANCE_ROUNDINGS = 8.0, 64.0


def whitening(q_z: torch.Tensor, shrink: str = "auto", name: str = "q_z", sample_eps: Optional[float] = None,
              fallback: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample mean [..., 1, d], Cholesky factor C [..., d, d] of the maximum-likelihood sample
    covariance, and the shrinkage intensity used [...]. ``shrink``: "auto" shrinks toward the diagonal
    (:func:`shrinkage_intensity`) only when n <= d, where the covariance is singular; "always";
    "never". Mean and C keep their gradient w.r.t. q_z; the intensity is held fixed. ``sample_eps``:
    the relative precision of the samples as the caller got them (float32's for float32 samples
    converted to float64; default q_z's dtype's), which sets what counts as singular
    (SAMPLE_ROUNDINGS). A singular covariance raises on the CPU (NaN elsewhere), unless ``fallback``
    (``contrast="auto"``'s): then that batch element takes its diagonal, an intensity of 1."""
    n, d = q_z.shape[-2], q_z.shape[-1]
    mean = q_z.mean(-2, keepdim=True)
    xc = q_z - mean
    cov = xc.transpose(-1, -2) @ xc / n
    if shrinks(shrink, n, d):
        rho = shrinkage_intensity(q_z)
    else:
        rho = torch.zeros(q_z.shape[:-2], dtype=q_z.dtype, device=q_z.device)
    r = rho[..., None, None]
    cov = (1 - r) * cov + r * torch.diag_embed(cov.diagonal(dim1=-2, dim2=-1))
    if _validate.reads_values(q_z):  # (else NaN, as below)
        _validate.check_finite(name, q_z)
    in_range = variances_in_range(cov.detach().diagonal(dim1=-2, dim2=-1), name)
    chol, info = torch.linalg.cholesky_ex(cov)
    ok = info == 0
    if not shrinks(shrink, n, d):  # (a shrunk covariance is nonsingular by construction)
        eps = torch.finfo(q_z.dtype).eps
        samples = SAMPLE_ROUNDINGS * (eps if sample_eps is None else sample_eps) * q_z.detach().abs().amax(-2)
        covariance = COVARIANCE_ROUNDINGS * math.sqrt(d * eps) * cov.detach().diagonal(dim1=-2, dim2=-1).sqrt()
        rounding = torch.maximum(samples, covariance)
        ok = ok & (chol.detach().diagonal(dim1=-2, dim2=-1) > rounding).all(-1)
        # Samples on a subspace (a generator with fewer noise dimensions than d) under "auto": the
        # diagonal covariance for them, factored anew for the whole batch (a failed factor's backward
        # would put NaN into the element's gradient even where its value is not selected). On the CPU
        # only when an element needs it; elsewhere always, as knowing would read ok back.
        if fallback and (not _validate.reads_values(q_z) or not bool(ok.all())):
            cov = torch.where(ok[..., None, None], cov, torch.diag_embed(cov.diagonal(dim1=-2, dim2=-1)))
            rho = torch.where(ok, rho, 1.0)
            chol, info = torch.linalg.cholesky_ex(cov)
            ok = info == 0
    # The checks of values here raise on the CPU only: on a GPU reading them back would stall every
    # call (and break CUDA-graph capture), so a bad fit gives NaN for its batch element instead.
    if not _validate.reads_values(chol):
        chol = torch.where((ok & in_range)[..., None, None], chol, math.nan)
    elif not bool(ok.all()):
        if fallback:  # (a diagonal that does not factor)
            raise ValueError(f"{name} has a dimension in which all samples are equal (zero standard deviation)")
        raise ValueError(f"{name}'s sample covariance is singular (samples on a lower-dimensional subspace); "
                         'use contrast="diagonal" (or "auto") or more samples')
    return mean, chol, rho


def variances_in_range(var: torch.Tensor, name: str) -> torch.Tensor:
    """Whether each batch element's sample variances [..., d] are 0 (judged by the singularity checks) or
    between MIN_BANDWIDTH^2 and float64's largest: a variance that overflows made the factorization fail
    as if the samples lay on a subspace, and one below 1e-300 (a standard deviation below 1e-150, as
    for the kernels' bandwidth) a finite value with a NaN gradient. Raises on the CPU, naming the
    cause; elsewhere the caller makes the elements out of range NaN (see whitening)."""
    in_range = (var.isfinite() & ((var == 0) | (var >= _validate.MIN_BANDWIDTH**2))).all(-1)
    if _validate.reads_values(var) and not bool(in_range.all()):
        if not bool(var.isfinite().all()):  # (with finite samples: a sum of squares overflowed, or inf - inf)
            raise variance_overflow(name)
        raise ValueError(f"{name} has a standard deviation below {_validate.MIN_BANDWIDTH:g} in some dimension: "
                         "samples that small ask to be rescaled")
    return in_range


def whiten(x: torch.Tensor, mean: torch.Tensor, chol: torch.Tensor) -> torch.Tensor:
    """C^{-1} (x - mean) per row: [..., n, d]."""
    return torch.linalg.solve_triangular(chol, (x - mean).transpose(-1, -2), upper=False).transpose(-1, -2)


def variance_overflow(name: str) -> ValueError:
    """The error for finite samples whose variance overflows float64 (both contrasts' checks)."""
    return ValueError(f"{name}'s samples are so far apart that their variance overflows float64: rescale them")


def check_std(std: torch.Tensor, name: str) -> None:
    """A zero standard deviation, a NaN one (NaN/Inf samples) or an infinite one (an overflowing
    variance) raises on the CPU (elsewhere it gives NaN: see whitening)."""
    if not _validate.reads_values(std):
        return
    if bool((std == 0).any()):
        raise ValueError(f"{name} has a dimension in which all samples are equal (zero standard deviation)")
    if bool(std.isnan().any()):
        raise ValueError(f"{name} contains NaN or Inf")
    if bool(std.isinf().any()):
        raise variance_overflow(name)


def check_kl_contrast(contrast: str) -> str:
    """``kivi_fast.kl``'s contrast argument, checked: one of CONTRASTS, or "none" (the paper's estimator)."""
    if contrast != "none" and contrast not in CONTRASTS:
        raise ValueError(f'contrast must be one of {", ".join(map(repr, (*CONTRASTS, "none")))}, got {contrast!r}')
    return contrast


def check_contrast(contrast: str) -> str:
    """A Gaussian contrast's name, checked: one of CONTRASTS."""
    if contrast not in CONTRASTS:
        raise ValueError(f'contrast must be one of {", ".join(map(repr, CONTRASTS))}, got {contrast!r}')
    return contrast


def resolve_contrast(contrast: str, n: int, d: int) -> str:
    """The contrast that ``contrast`` names for n samples in d dimensions: "auto" is "full" when n > d."""
    check_contrast(contrast)
    if contrast == "auto":
        return "full" if n > d else "diagonal"
    return contrast


_CUDA_STANDARDIZE: dict = {}


@constant_under_compile  # torch.compile asks it when tracing, and does not trace it
def _has_cuda_standardize() -> bool:
    """Whether the compiled library has the contrast's CUDA kernels (csrc/cuda/contrast.cu)."""
    if "built" not in _CUDA_STANDARDIZE:
        from . import _backend

        _CUDA_STANDARDIZE["built"] = _backend.backend() == "cpp" and torch._C._dispatch_has_kernel_for_dispatch_key(
            "kivi_fast::standardize", "CUDA")
    return _CUDA_STANDARDIZE["built"]


def _standardize_ops(x: torch.Tensor):
    """The ops that standardize x in one launch each way (``standardize``, ``standardize_grad``):
    torch.ops.kivi_fast for a CUDA tensor where the library has their kernels; None (ATen's composition
    here) otherwise. (The CPU emulation's tests put its ops here.)"""
    return torch.ops.kivi_fast if x.is_cuda and x.numel() and _has_cuda_standardize() else None


def standardize(x: torch.Tensor, name: str = "x", to_standard_normal: bool = False, bias: float = 0.0
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:class:`_DiagonalContrast`'s forward without a gradient: (z, s, t) in float64 whatever x's
    dtype, s [..., 1, d] the maximum-likelihood standard deviations. A zero s raises on the CPU
    (:func:`check_std`; elsewhere z is NaN and t Inf)."""
    return _standardize(_standardize_ops(x), x, name, to_standard_normal, bias)


def _standardize(ops, x, name, to_standard_normal, bias):
    if ops is not None:
        *batch, n, d = x.shape
        z, std, t = ops.standardize(x.reshape(-1, n, d), to_standard_normal, bias)
        return z.view(x.shape), std.view(*batch, 1, d), t.view(batch)
    x = x.double()
    std, mean = diagonal_moments(x)
    check_std(std, name)
    z = (x - mean) / std
    if to_standard_normal:
        t = (0.5 * torch.addcmul(std.square(), mean, mean) - std.log()).sum((-2, -1)) + (bias - 0.5 * x.shape[-1])
    else:
        t = -std.log().sum((-2, -1))
    return z, std, t


class _DifferentiableOnce(torch.autograd.Function):
    """``grad`` (a backward's result under create_graph=True) as is, with a derivative that raises as the
    ops' own backwards do (csrc/autograd.cpp). Its node takes ``anchor`` (a tensor of the graph that led
    to the gradient), so that the path from the gradient back to the samples passes through it: torch's
    once_differentiable hangs its error off a detached copy instead, which torch.autograd.grad(...,
    inputs=samples) prunes, and a second derivative then came out partial (the log prior's term only),
    silently."""

    @staticmethod
    def forward(ctx, grad, anchor):
        return grad.clone()

    @staticmethod
    def backward(ctx, _):
        raise NotImplementedError(
            "kivi_fast: second derivatives of the KIVI estimators are not supported (their gradient is the "
            "paper's Eq. 8, the fitted ratio held fixed, here through the contrast's standardization)")


class _DiagonalContrast(torch.autograd.Function):
    """The diagonal contrast of samples x [..., n, d] in one autograd node, with r = N(m, diag(s^2)) the
    maximum-likelihood fit: (z, t) with z = (x - m) / s and

    - t = -sum_d log s_d (``to_standard_normal`` False): E_x[log r(x)] + d (1 + log 2 pi) / 2, since
      the whitened samples' mean square is exactly 1 in each dimension;
    - t = sum_d (s_d^2 + m_d^2) / 2 - log s_d - 1 / 2 = KL(r || N(0, I)) = E_x[log r(x) - log N(x; 0, I)]
      (``to_standard_normal`` True), since mean_x x_d^2 = s_d^2 + m_d^2 exactly: adaptive contrast's
      Gaussian part for an N(0, I) prior from r's moments, with no pass over the samples for log N;
      plus ``bias``, a constant (the plug-in log-determinant's correction, GaussianFit.log_det_bias).

    z and t are float64, the gradient in x's dtype. The gradient in closed form (batch normalization's;
    -z / (n s) from the log-determinant, and x / n from the N(0, I) term). On CUDA each way is one
    launch (:func:`standardize`, csrc/cuda/contrast.cu); elsewhere ATen's composition here, 11 and 10
    device ops, where autograd through it takes more than twice as many. At the VAE's shapes such small
    ops are most of the KL's (python_tests/test_kl_contrast.py counts them)."""

    @staticmethod
    def forward(ctx, x, name, to_standard_normal=False, bias=0.0):
        ctx.ops = _standardize_ops(x)  # the backward takes the same way
        z, std, t = _standardize(ctx.ops, x, name, to_standard_normal, bias)
        # x itself only for the N(0, I) term's gradient (else a float64 copy would be kept alive)
        ctx.save_for_backward(z, std, x if to_standard_normal else None)
        ctx.to_standard_normal, ctx.dtype = to_standard_normal, x.dtype
        return z, t

    @staticmethod
    def backward(ctx, grad_z, grad_t):
        z, std, x = ctx.saved_tensors
        with torch.no_grad():
            grad = _DiagonalContrast._grad(ctx, grad_z, grad_t, z, std, x)
        if torch.is_grad_enabled():  # create_graph=True: the gradient is differentiable once
            grad = _DifferentiableOnce.apply(grad, z)
        return grad, None, None, None

    @staticmethod
    def _grad(ctx, grad_z, grad_t, z, std, x):
        if ctx.ops is not None:
            *batch, n, d = z.shape
            # (without x the kernel reads none of it, and z stands in for it; the gradient is then float64)
            grad = ctx.ops.standardize_grad(None if grad_z is None else grad_z.reshape(-1, n, d),
                                            None if grad_t is None else grad_t.reshape(-1), z.view(-1, n, d),
                                            std.view(-1, 1, d), (z if x is None else x).reshape(-1, n, d),
                                            ctx.to_standard_normal)
            return grad.view(z.shape).to(ctx.dtype)
        n = z.shape[-2]
        # d/dx_k of sum_j g_j z_j = (g_k - mean_j g_j - z_k mean_j g_j z_j) / s; of -sum log s: -z_k / (n s);
        # of sum (s^2 + m^2) / 2: (s z_k + m) / n = x_k / n
        t_scale = torch.zeros_like(std) if grad_t is None else grad_t[..., None, None] / n
        if grad_z is None:
            out = -z * t_scale / std
        else:
            scale = t_scale + (grad_z * z).mean(-2, keepdim=True)
            out = torch.addcmul(grad_z - grad_z.mean(-2, keepdim=True), z, scale, value=-1.0) / std
        if ctx.to_standard_normal and grad_t is not None:
            out = torch.addcmul(out, x.double(), t_scale)
        return out.to(ctx.dtype)


class GaussianFit:
    """The maximum-likelihood Gaussian N(mean, S) of samples [..., n, d], S = diag(std^2) or C C^T;
    its parameters keep their gradient w.r.t. the samples."""

    def __init__(self, x: torch.Tensor, contrast: str, shrink: str = "auto", name: str = "q_z",
                 sample_eps: Optional[float] = None, fallback: bool = False):
        self.diagonal = contrast == "diagonal"
        self.n, self.d = x.shape[-2], x.shape[-1]
        self.shrunk = not self.diagonal and shrinks(shrink, self.n, self.d)
        # batch elements whose singular covariance fell back to its diagonal (whitening's fallback),
        # [...] bool, or None where none can: they are diagonal fits, with the diagonal's corrections
        self.fell_back = None
        if self.diagonal:
            self.std, self.mean = diagonal_moments(x)
            check_std(self.std, name)
        else:
            self.mean, self.chol, rho = whitening(x, shrink, name, sample_eps, fallback)
            if fallback and not self.shrunk:
                self.fell_back = rho == 1.0

    def whiten(self, x: torch.Tensor) -> torch.Tensor:
        """S^{-1/2} (x - mean) per row: the map under which the fitted Gaussian is N(0, I)."""
        return (x - self.mean) / self.std if self.diagonal else whiten(x, self.mean, self.chol)

    def log_det_scale(self) -> torch.Tensor:
        """log |det S^{1/2}|, [..., 1]: the whitening map's log-Jacobian, negated."""
        scale = self.std[..., 0, :] if self.diagonal else self.chol.diagonal(dim1=-2, dim2=-1)
        return scale.log().sum(-1, keepdim=True)

    def precision_factor(self) -> float | torch.Tensor:
        """c with E[c S_hat^{-1}] = S^{-1} for n Gaussian samples (inverse-Wishart mean): the plug-in
        precision is too large by n / (n - d - 2) (full) or n / (n - 3) (diagonal); 1 where that is
        undefined, or the covariance shrunk (the formula is for the plug-in one). Per batch element
        ([...]) where elements can have fallen back to their diagonal."""
        def factor(k: int) -> float:  # k = 3 for a diagonal fit, d + 2 for a full one
            return (self.n - k) / self.n if self.n > k and not self.shrunk else 1.0

        own = factor(3 if self.diagonal else self.d + 2)
        return own if self.fell_back is None else _per_element(self.fell_back, factor(3), own)

    def log_det_bias(self) -> float | torch.Tensor:
        """E[log |det S_hat^{1/2}|] - log |det S^{1/2}| for n Gaussian samples: the plug-in covariance
        is too small in log-determinant (n S_hat ~ Wishart(n - 1, S)), so a KL that uses it reads high
        by ~d (d + 1) / (4 n) nats (full) or ~d / (2 n) (diagonal). A constant: the gradient is
        unchanged. 0 where the formula does not hold (a shrunk covariance, n <= d). Per batch element
        ([...]) where elements can have fallen back to their diagonal."""
        if not self.diagonal and (self.shrunk or self.n <= self.d):
            return 0.0
        if self.fell_back is None:
            return _log_det_bias(self.n, self.d, self.diagonal)
        return _per_element(self.fell_back, _log_det_bias(self.n, self.d, True), _log_det_bias(self.n, self.d, False))


def _rows(x: float | torch.Tensor) -> float | torch.Tensor:
    """A per-element value [...] as [..., 1], to broadcast over the element's rows; a float as it is."""
    return x[..., None] if isinstance(x, torch.Tensor) else x


def _per_element(where: torch.Tensor, then: float, otherwise: float) -> torch.Tensor:
    """[...] float64: ``then`` where ``where``, else ``otherwise`` (a Python float per case), exactly."""
    return torch.full(where.shape, otherwise, dtype=torch.float64, device=where.device).masked_fill(where, then)


@functools.lru_cache(maxsize=64)
def _log_det_bias(n: int, d: int, diagonal: bool) -> float:
    """:meth:`GaussianFit.log_det_bias`'s value, cached: a training loop asks for the same (n, d) every step."""
    if diagonal:
        return 0.5 * d * (torch.special.digamma(torch.tensor((n - 1) / 2, dtype=torch.float64)).item()
                          + math.log(2 / n))
    half = torch.tensor([(n - i) / 2 for i in range(1, d + 1)], dtype=torch.float64)
    return 0.5 * (torch.special.digamma(half).sum().item() + d * math.log(2 / n))


def gaussian_contrast(q_z: torch.Tensor, contrast: str = "auto", shrink: str = "auto",
                      sample_eps: Optional[float] = None, fallback: Optional[bool] = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(z_hat, E_q[log r]): the samples mapped by the whitening of the Gaussian r fitted to them, and the
    mean of r's log-density at them ([...]), its log-determinant corrected for the plug-in bias
    (:meth:`GaussianFit.log_det_bias`), so that it estimates E_q[log r] without that bias. Both keep
    their gradient w.r.t. q_z. ``shrink``, ``sample_eps``, ``fallback``: see :func:`whitening` (full
    contrast only; ``fallback`` defaults to whether ``contrast`` is "auto"). The fit is by maximum
    likelihood, so the whitened samples' mean square is exactly d (a diagonal fit's too), unless the
    covariance was shrunk: then it is summed."""
    n, d = q_z.shape[-2], q_z.shape[-1]
    fallback = contrast == "auto" if fallback is None else fallback
    contrast = resolve_contrast(contrast, n, d)
    if contrast == "diagonal":
        z_hat, neg_log_det = _DiagonalContrast.apply(q_z, "q_z")
        mean_square, bias = float(d), _log_det_bias(n, d, True)
    else:
        fit = GaussianFit(q_z, contrast, shrink, sample_eps=sample_eps, fallback=fallback)
        z_hat, neg_log_det = fit.whiten(q_z), -fit.log_det_scale()[..., 0]
        mean_square = z_hat.pow(2).sum(-1).mean(-1) if fit.shrunk else float(d)
        bias = fit.log_det_bias()
    return z_hat, -0.5 * mean_square - 0.5 * d * math.log(2 * math.pi) + neg_log_det + bias


def reference_draws(shape, contrast: str, device, generator: Optional[torch.Generator]) -> torch.Tensor:
    """N(0, I) draws [..., n, d] in float64, whitened by their own fitted Gaussian like the samples
    they are compared with: both sets then have exactly zero mean and unit covariance (or variances),
    and the kernel fit does not mistake the whitening for a difference between the laws."""
    if generator is not None:
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
        try:
            on = generator.device
        except RuntimeError:  # (torch raises for a generator of a device that draws nothing, 'meta')
            on = "a device that cannot draw"
        if not isinstance(on, torch.device) or on.type != torch.device(device).type:
            raise ValueError(f"generator must be on q_z's device ({device}), got a generator on {on}")
    return whiten_reference(standard_normal(shape, generator, dtype=torch.float64, device=device), contrast)


def whiten_reference(eps: torch.Tensor, contrast: str, name: str = "the N(0, I) draws") -> torch.Tensor:
    """N(0, I) draws whitened by their own fitted Gaussian (see :func:`reference_draws`), in float64;
    ``name`` is theirs in error messages (the caller's ``reference_z``)."""
    if contrast == "diagonal":
        return standardize(eps, name)[0]
    sample_eps = torch.finfo(eps.dtype).eps
    eps = eps.double()
    return GaussianFit(eps, contrast, name=name, sample_eps=sample_eps).whiten(eps)


def sample_contrast_kl(prior_z: torch.Tensor, q_z: torch.Tensor, lam: float, *, contrast: str, clip: float,
                       bandwidth, reverse: bool, generator: Optional[torch.Generator],
                       kernel_kl: Callable[..., torch.Tensor], density_ratio,
                       sample_eps: Optional[float] = None) -> torch.Tensor:
    """KL(q || p) from samples of both, with a Gaussian contrast on each side (``kivi_fast.kl``'s default):

        KL(q || p) = KL(q_hat || N(0, I)) + E_q[log r_q(z) - log r_p(z)] - E_q[log (p_hat / N(0, I))(T_p z)],

    with r_q, r_p the Gaussians fitted to the q and p samples, T_p the whitening of r_p and p_hat the
    law of the whitened prior samples. The first and last terms are KIVI fits between whitened
    samples and N(0, I) samples (``kernel_kl``, and ``density_ratio`` evaluated at q's points), the
    middle one is analytic. For a Gaussian q the first term carries no gradient and for a Gaussian
    p the last is zero up to noise, so the Gaussian part of the gradient is exact; the kernel fits
    only see what is not Gaussian. The prior samples get no gradient. ``sample_eps``: the samples'
    precision as the user gave them (float16's for float16 samples taken as float32; default the
    dtype's), which sets what counts as a singular covariance (:func:`whitening`)."""
    # The prior's fitted precision enters log r_p, and the inverse of a variance fitted to 3 or fewer
    # samples has no finite mean: at q = p = N(0, I) in d = 10 the estimate read a median 28 nats with 3
    # prior samples and 360 with 2, against 2 with 4 (5 without the contrast)
    _validate.check_min_samples("prior_z", prior_z, MIN_PRIOR_SAMPLES,
                                "for a Gaussian contrast (the inverse of a variance fitted to fewer has no finite "
                                'mean); with fewer pass contrast="none"')
    n, d = min(prior_z.shape[-2], q_z.shape[-2]), q_z.shape[-1]
    # "auto": a side whose covariance is singular (samples on a subspace) is whitened by its diagonal
    fallback = contrast == "auto"
    contrast = resolve_contrast(contrast, n, d)
    # float64 throughout, as the kernel fits: the Gaussian terms cancel large parts of each other
    dtype, q64, p64 = q_z.dtype, q_z.double(), prior_z.detach().double()
    sample_eps = torch.finfo(dtype).eps if sample_eps is None else sample_eps
    q_hat, log_r_q = gaussian_contrast(q64, contrast, sample_eps=sample_eps, fallback=fallback)
    # The prior's precision enters log r_p, and a sample covariance's inverse has a finite mean only for
    # n_p > d + 2 and a finite variance for n_p > d + 4: just above d samples the plug-in precision read
    # q's quadratic form thousands of nats too high (q = p = N(0, I), d = 20, n = 21: ~2000), and at
    # n = d + 3, d + 4 up to 60 off. There the covariance is shrunk, as for n <= d (within 4 nats).
    fit_p = GaussianFit(p64, contrast, "always" if p64.shape[-2] <= d + 4 else "auto", name="prior_z",
                        sample_eps=sample_eps, fallback=fallback)  # (prior_z has q_z's dtype: checked)
    q_in_p = fit_p.whiten(q64)
    eps = reference_draws(p64.shape, contrast, q_z.device, generator)
    kernel_q = kernel_kl(eps, q_hat, lam, clip=clip, bandwidth=bandwidth, reverse=reverse)
    # E_q[log r_p] with r_p's true moments, estimated without the plug-in biases of S_hat's inverse,
    # of its log-determinant and of m_hat (whose error adds d / n_p to the quadratic form)
    quad = _rows(fit_p.precision_factor()) * q_in_p.pow(2).sum(-1) - d / fit_p.n
    log_r_p = -0.5 * quad - 0.5 * d * math.log(2 * math.pi) - fit_p.log_det_scale() + _rows(fit_p.log_det_bias())
    prior_rest = density_ratio(lam, bandwidth).fit(fit_p.whiten(p64), eps).log_ratio(q_in_p, clip)
    return (kernel_q + log_r_q - (log_r_p + prior_rest).mean(-1)).to(dtype)


def adaptive_contrast_kl(
    q_z: torch.Tensor,
    log_prior: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    lam: float = DEFAULT_LAM,
    *,
    contrast: str = "auto",
    n_prior: Optional[int] = None,
    clip: float = 1e-8,
    bandwidth="median",
    reverse: bool = True,
    generator: Optional[torch.Generator] = None,
    reference_z: Optional[torch.Tensor] = None,
    kl_fn: Callable[..., torch.Tensor],
    sample_eps: Optional[float] = None,
) -> torch.Tensor:
    """KL(q || p) with adaptive contrast; ``kl_fn`` is the KIVI estimator to use for the first term.

    q_z: [n, d] or [B, n, d] samples of q (B independent posteriors, e.g. one per data point).
    log_prior: callable mapping [..., n, d] to [..., n], the prior's log-density; None means N(0, I).
    lam: the ridge coefficient of the kernel term (default 1e-2; the paper's is 1e-3).
    contrast: "auto" (default: "full" when n > d, else "diagonal"; "diagonal" for a batch element
        whose samples lie on a subspace), "diagonal" (per-dimension Gaussian, the paper's) or "full"
        (full-covariance Gaussian).
    n_prior: number of N(0, I) samples contrasted with the whitened q samples (default n).
    reference_z: those N(0, I) samples [..., n_prior, d], drawn by the caller (e.g. one stream of draws
        shared by several processes); default: drawn here with ``generator``. Whitened like the q samples.
    sample_eps: as in :func:`sample_contrast_kl`.
    """
    _validate.check_samples("q_z", q_z)
    if log_prior is not None and not callable(log_prior):
        raise TypeError("log_prior must be a callable mapping samples [..., n, d] to log-densities [..., n] "
                        f"(or None for N(0, I)), got {type(log_prior).__name__}")
    n = q_z.shape[-2]
    if n < 2:
        raise ValueError(f"q_z must hold at least 2 samples to standardize them, got shape {tuple(q_z.shape)}")
    if n_prior is not None:
        if isinstance(n_prior, bool) or not isinstance(n_prior, numbers.Integral) or n_prior < 2:
            raise ValueError(f"n_prior must be an integer >= 2 (the number of N(0, I) samples), got {n_prior!r}")
        n_prior = int(n_prior)
    # float64 throughout, as the kernel fit; the N(0, I) draws do not depend on q_z's dtype
    d = q_z.shape[-1]
    resolved = resolve_contrast(contrast, n, d)
    closed_form = log_prior is None and resolved == "diagonal"
    if closed_form:  # E_q[log r - log N(0, I)] from r's moments, in the contrast's own node (float64)
        z_hat, gaussian_part = _DiagonalContrast.apply(q_z, "q_z", True, _log_det_bias(n, d, True))
    else:
        q64 = q_z.double()
        z_hat, gaussian_part = gaussian_contrast(q64, contrast, sample_eps=sample_eps or torch.finfo(q_z.dtype).eps)

    if reference_z is None:
        shape = list(q_z.shape)
        shape[-2] = n if n_prior is None else n_prior
        eps = reference_draws(shape, resolved, q_z.device, generator)
    else:
        if n_prior is not None or generator is not None:
            raise ValueError("pass either reference_z or n_prior/generator, not both")
        _validate.check_pair("reference_z", reference_z, "q_z", q_z)
        _validate.check_min_samples("reference_z", reference_z, 2, "(N(0, I) draws to whiten)")
        eps = whiten_reference(reference_z.detach(), resolved, "reference_z")
    kl_whitened = kl_fn(eps, z_hat, lam, clip=clip, bandwidth=bandwidth, reverse=reverse)

    if not closed_form:
        log_p = standard_normal_log_prob(q64) if log_prior is None else log_prior(q_z)
        if not isinstance(log_p, torch.Tensor) or not log_p.is_floating_point() or log_p.device != q_z.device:
            got = f"{log_p.dtype} on {log_p.device}" if isinstance(log_p, torch.Tensor) else type(log_p).__name__
            raise TypeError(f"log_prior must return a floating-point tensor on q_z's device ({q_z.device}), got {got}")
        if log_p.shape != q_z.shape[:-1]:
            raise ValueError(
                f"log_prior must map samples of shape {tuple(q_z.shape)} to shape {tuple(q_z.shape[:-1])}, "
                f"got {tuple(log_p.shape)}"
            )
        # (checked on the CPU only, as the other values: on a GPU a NaN gives the estimate NaN)
        if _validate.reads_values(log_p) and not torch.compiler.is_compiling() and \
                not bool(torch.isfinite(log_p.detach()).all()):
            raise ValueError("log_prior returned NaN or Inf at some of q_z's samples (a density of 0 there, or "
                             "a prior's parameters that are not finite)")
        gaussian_part = gaussian_part - log_p.double().mean(-1)
    return (kl_whitened + gaussian_part).to(q_z.dtype)
