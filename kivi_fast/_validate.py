"""Argument checks shared by both backends.

Most look at metadata only (rank, shapes, dtype, device, Python scalars), which costs nothing next to
the estimate. The few that read values (``check_finite``, a bandwidth tensor's range) run only where
reading them does not stall a device. Checks the kernels make as they read the data anyway (NaN/Inf
samples, a zero median distance) live in the backends.
"""

from __future__ import annotations

import math
import numbers
import os
import sys
import warnings

import torch
from torch.autograd import forward_ad

_FLOAT_DTYPES = (torch.float32, torch.float64)

# The smallest ridge coefficient both backends solve to float64's accuracy. The fit cancels terms of
# size 1/lam, so the error grows like 1/lam: against a 40-digit oracle of the same formula (n = 20 to
# 200, d = 3 and 8, q = p and shifted) every backend's float64 estimate is off by at most 2e-6
# (relative) at lam = 1e-10, by up to 5e-5 at 1e-12, 4e-3 at 1e-14 and 0.4 at 1e-16, where it changes
# sign (bench/lam_floor.py). python_tests/test_errors.py checks the floor against that oracle.
MIN_LAM = 1e-10

# The smallest bandwidth: its square is a normal float64 (below ~1e-154 it underflows to 0, and the
# kernel exp(-d^2 / (2 sigma^2)) turns to NaN at d = 0). csrc/kivi.h's kMinBandwidth is the same.
MIN_BANDWIDTH = 1e-150


def precision_of(*xs) -> float | None:
    """The coarsest dtype eps of the tensors among ``xs`` (None if none is a floating-point tensor): what
    the contrast's singularity check must allow for, taken before :func:`upcast_half`."""
    eps = [torch.finfo(x.dtype).eps for x in xs if isinstance(x, torch.Tensor) and x.is_floating_point()]
    return max(eps) if eps else None


def upcast_half(x):
    """float16/bfloat16 samples (a network's output under torch.autocast) as float32, exactly: the fit
    runs in float64 whatever the samples' dtype, and the gradient flows back in their own. Anything
    else is returned as it is, for the checks to judge."""
    return x.float() if isinstance(x, torch.Tensor) and x.dtype in (torch.float16, torch.bfloat16) else x


def entering(fn: str, *samples):
    """Every public function's first step: torch.func's transforms refused (:func:`check_no_transforms`),
    then its sample tensors with half precision taken as float32 (:func:`upcast_half`), returned in
    order (one alone as itself)."""
    check_no_transforms(fn)
    check_no_tangents(fn, samples)
    out = tuple(upcast_half(x) for x in samples)
    return out[0] if len(out) == 1 else out


def check_samples(name: str, x) -> None:
    """A sample tensor: [n, d] or [B, n, d], float32/float64."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape [n, d] or [B, n, d], got {type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must have dtype float32 or float64 (or float16/bfloat16, taken as float32), "
                        f"got {x.dtype}")
    if x.layout != torch.strided:
        raise ValueError(f"{name} must be a dense tensor, got layout {x.layout}")
    shape = x.shape
    if len(shape) not in (2, 3):
        raise ValueError(f"{name} must have shape [n, d] or [B, n, d], got shape {tuple(shape)}")
    if shape[-1] < 1:
        raise ValueError(f"{name} must have at least one dimension per sample (d >= 1), got shape {tuple(shape)}")
    if shape[-2] < 1:
        raise ValueError(f"{name} must hold at least one sample, got shape {tuple(shape)}")


def check_no_transforms(fn: str) -> None:
    """Refuse torch.func's transforms (vmap, grad, jacrev, ...) by name. The compiled ops' gradient is a
    C++ autograd formula, which those transforms cannot run, and the checks on CPU read values, which
    vmap cannot; without this the user gets torch's internal error about one or the other."""
    if not torch.compiler.is_compiling() and torch._C._are_functorch_transforms_active():
        raise NotImplementedError(
            f"kivi_fast.{fn} does not run under torch.func transforms (vmap, grad, jacrev, ...): pass "
            "batched samples [B, n, d] for B estimates in place of vmap, and take gradients with "
            "torch.autograd (loss.backward() or torch.autograd.grad)")


def check_no_tangents(fn: str, samples) -> None:
    """Refuse forward-mode AD (torch.autograd.forward_ad's dual tensors). The compiled ops have no
    forward-mode formula, so their outputs would carry no tangent, and kl's and adaptive_contrast_kl's
    would carry only their Gaussian parts': a wrong directional derivative, silently."""
    if torch.compiler.is_compiling():
        return
    for x in samples:
        if isinstance(x, torch.Tensor) and forward_ad.unpack_dual(x).tangent is not None:
            raise NotImplementedError(
                f"kivi_fast.{fn} does not take forward-mode AD (dual tensors of torch.autograd.forward_ad): "
                "its gradient is Eq. 8's, in reverse mode; take it with loss.backward() or torch.autograd.grad")


_API_DIR = os.path.dirname(os.path.abspath(__file__))


def user_stacklevel() -> int:
    """warnings.warn's stacklevel (for its caller) that names the first frame outside the estimator's own
    modules (kivi_fast/*.py; nn/ and experiments/ call them as users do): however deep in kl or
    adaptive_contrast_kl a warning is raised, it points at the line that called them, and Python shows
    it once per such line."""
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.dirname(os.path.abspath(frame.f_code.co_filename)) == _API_DIR:
        frame, level = frame.f_back, level + 1
    return level


def warn_if_ungraded(name: str, x: torch.Tensor, fn: str) -> None:
    """Warn where a tensor asks for a gradient that the estimator does not give it (the fitted ratio is
    held fixed, the paper's Eq. 8), so that, e.g., a learned prior's sampler does not silently train
    on nothing. Python shows it once per call site."""
    if x.requires_grad and torch.is_grad_enabled() and not torch.compiler.is_compiling():
        warnings.warn(
            f"kivi_fast.{fn}: {name} requires grad but gets no gradient (the estimator's gradient flows "
            f"through q_z only, the fitted ratio held fixed: the paper's Eq. 8); pass {name}.detach() "
            "to silence this", UserWarning, stacklevel=user_stacklevel())


def check_pair(name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor) -> None:
    """Two sample sets that are compared with each other: same rank, d, batch, dtype and device."""
    check_samples(name_a, a)
    check_samples(name_b, b)
    if a.dim() != b.dim():
        raise ValueError(
            f"{name_a} and {name_b} must both be unbatched [n, d] or both batched [B, n, d], "
            f"got shapes {tuple(a.shape)} and {tuple(b.shape)}"
        )
    if a.shape[-1] != b.shape[-1]:
        raise ValueError(
            f"{name_a} and {name_b} must have the same sample dimension d, got {a.shape[-1]} and {b.shape[-1]}"
        )
    if a.dim() == 3 and a.shape[0] != b.shape[0]:
        raise ValueError(f"{name_a} and {name_b} must have the same batch size, got {a.shape[0]} and {b.shape[0]}")
    if a.dtype != b.dtype:
        raise TypeError(f"{name_a} and {name_b} must have the same dtype, got {a.dtype} and {b.dtype}")
    if a.device != b.device:
        raise ValueError(f"{name_a} and {name_b} must be on the same device, got {a.device} and {b.device}")


def reads_values(x: torch.Tensor) -> bool:
    """Whether the value checks of the Python code may read ``x`` back to the host: on the CPU, where
    that is free. On a GPU a read would stall every call and break CUDA-graph capture, so a bad value
    gives NaN for its batch element instead (csrc/generic.cpp's reads_back is the compiled ops' rule).
    The one place for the choice, so that tests can run the device's branches on CPU tensors."""
    return x.is_cpu


def check_finite(name: str, x: torch.Tensor) -> None:
    """NaN/Inf check where no compiled op reads the data first (the reference backend, the contrast's
    CPU fits); the compiled ops check while they read it."""
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name} contains NaN or Inf")


def check_positive(name: str, value) -> float:
    """A positive, finite Python number (lam, clip)."""
    if type(value) is float and 0.0 < value < math.inf:  # the common case, without the checks below
        return value
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.device.type == "meta":
            raise TypeError(f"{name} must be a positive number, got a tensor of shape {tuple(value.shape)} on "
                            f"{value.device}")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a positive number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value) or value <= 0.0:
        raise ValueError(f"{name} must be positive and finite, got {value}")
    return value


def check_lam(value) -> float:
    """The ridge coefficient: a number >= MIN_LAM (below it the fit is not accurate in float64)."""
    value = check_positive("lam", value)
    if value < MIN_LAM:
        raise ValueError(f"lam must be at least {MIN_LAM:g}, got {value:g}: below it the kernel fit is not "
                         "accurate in float64 (it cancels terms of size 1/lam); increase lam")
    return value


def check_clip(value) -> float:
    """The lower clip of the fitted ratio, in (0, 1): a clip >= 1 would cut ratios that are valid."""
    value = check_positive("clip", value)
    if value >= 1.0:
        raise ValueError(f"clip must lie in (0, 1), got {value:g}")
    return value


def check_reverse(reverse) -> None:
    """The kernel fit's direction: a Python bool (an op's schema takes nothing else)."""
    if not isinstance(reverse, bool):
        kind = type(reverse)
        raise TypeError(f"reverse must be a Python bool (True or False), got "
                        f"{kind.__module__ + '.' if kind.__module__ != 'builtins' else ''}{kind.__name__}")


def check_min_samples(name: str, x: torch.Tensor, least: int, why: str) -> None:
    """At least ``least`` samples (rows) in ``x``; ``why`` ends the message."""
    if x.shape[-2] < least:
        raise ValueError(f"{name} must hold at least {least} samples {why}, got shape {tuple(x.shape)}")


def kl_arguments(prior_z, q_z, lam, clip, bandwidth) -> tuple[float, float, torch.Tensor | None]:
    """The checks of a KL estimate, for both backends' ``kl``: (lam, clip, bandwidth tensor or None)."""
    check_pair("prior_z", prior_z, "q_z", q_z)
    check_min_samples("prior_z", prior_z, 2, "to fit a density ratio")
    check_min_samples("q_z", q_z, 2, "to fit a density ratio")
    lam, clip = check_lam(lam), check_clip(clip)
    return lam, clip, bandwidth_tensor(bandwidth, q_z.shape[0] if q_z.dim() == 3 else None, q_z)


def fit_arguments(numer, denom, bandwidth) -> torch.Tensor | None:
    """The checks of a density-ratio fit, for both backends' ``DensityRatio.fit``: the bandwidth tensor."""
    check_pair("numer", numer, "denom", denom)
    check_min_samples("numer", numer, 2, "to fit a density ratio")
    check_min_samples("denom", denom, 2, "to fit a density ratio")
    return bandwidth_tensor(bandwidth, numer.shape[0] if numer.dim() == 3 else None, numer)


def bandwidth_tensor(bandwidth, batch: int | None, like: torch.Tensor) -> torch.Tensor | None:
    """None for the median heuristic; otherwise a float64 tensor of shape [B] (batched) or [1].

    The batch size is None for unbatched inputs. A scalar bandwidth is broadcast over the batch.
    """
    if isinstance(bandwidth, str):
        if bandwidth != "median":
            raise ValueError(f'bandwidth must be "median", a positive float or a tensor, got {bandwidth!r}')
        return None
    rows = 1 if batch is None else batch
    if isinstance(bandwidth, torch.Tensor):
        if bandwidth.is_complex() or not bandwidth.is_floating_point():
            raise TypeError(f"bandwidth must be a floating-point tensor, got {bandwidth.dtype}")
        if bandwidth.dim() > 1 or bandwidth.numel() not in (1, rows):
            raise ValueError(
                f"bandwidth must be a scalar or have shape [B] = [{rows}], got shape {tuple(bandwidth.shape)}"
            )
        if bandwidth.device.type == "meta" and like.device.type != "meta":
            raise ValueError(f"bandwidth must hold values: a tensor on the samples' device ({like.device}) "
                             "or the CPU, got one on 'meta'")
        sigma = bandwidth.detach().to(device=like.device, dtype=torch.float64).reshape(-1)
        # Checked where reading the values is free (CPU, eagerly; the compiled ops check them again); on
        # a GPU the read would stall every call, and a bandwidth below MIN_BANDWIDTH or not finite gives
        # NaN for its batch element instead.
        if reads_values(sigma) and not torch.compiler.is_compiling() and \
                not bool((torch.isfinite(sigma) & (sigma >= MIN_BANDWIDTH)).all()):
            raise ValueError(f"bandwidth must be finite and at least {MIN_BANDWIDTH:g}, got {bandwidth}")
        return sigma.expand(rows).contiguous()
    value = check_positive("bandwidth", bandwidth)
    if value < MIN_BANDWIDTH:
        raise ValueError(f"bandwidth must be at least {MIN_BANDWIDTH:g} (its square a normal float64), got {value:g}")
    return torch.full((rows,), value, dtype=torch.float64, device=like.device)
