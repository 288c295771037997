"""The nn modules' argument checks, on metadata only (types, shapes; no values), so that they cost
nothing in a training step, stay traceable by torch.compile and read nothing back from a GPU.

Without them torch would truncate a size (``int(2.7)``), or broadcast a sample of the wrong trailing
shape into a plausible result of the right shape (a [B, 1] target against [S, B] predictions scores
sample s against target s).
"""

from __future__ import annotations

import math
import numbers
from typing import Sequence

import torch


def integer(name: str, value, what: str = "an int") -> int:
    """``value`` as an int: an integer, not a bool (True would pass as 1) or a float (2.7 as 2)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be {what}, got {value!r}")
    return int(value)


def positive_int(name: str, value) -> int:
    """``value`` as an int >= 1 (:func:`integer`). A symbolic size (a shape under torch.compile's dynamic
    shapes) is taken as it is."""
    if isinstance(value, torch.SymInt):
        return value
    value = integer(name, value, "a positive int")
    if value < 1:
        raise ValueError(f"{name} must be a positive int, got {value}")
    return int(value)


def positive_ints(name: str, values: Sequence) -> list[int]:
    """Each entry of the sequence ``values`` by :func:`positive_int`, named ``name[i]``."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(f"{name} must be a sequence of positive ints, got {values!r}")
    return [positive_int(f"{name}[{i}]", v) for i, v in enumerate(values)]


def positive_float(name: str, value) -> float:
    """``value`` as a finite float > 0."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a positive number, got {value!r}")
    value = float(value)
    if not 0 < value < float("inf"):
        raise ValueError(f"{name} must be positive and finite, got {value}")
    return value


def finite_float(name: str, value, least: float = -float("inf")) -> float:
    """``value`` as a finite float, at least ``least`` (NaN or inf here gave NaN samples, and a string or a
    bool was taken as a number)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if not (math.isfinite(value) and value >= least):
        raise ValueError(f"{name} must be finite{'' if least == -float('inf') else f' and at least {least:g}'}, "
                         f"got {value}")
    return value


def trailing(name: str, x, shape: Sequence[int]) -> None:
    """``x`` a floating-point tensor [..., *shape]."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")
    k = len(shape)
    if x.dim() < k or tuple(x.shape[x.dim() - k:]) != tuple(shape):
        want = ", ".join(["...", *map(str, shape)])
        raise ValueError(f"{name} must have shape [{want}], got {list(x.shape)}")


def exact(name: str, x, shape: Sequence[int], floating: bool = True) -> None:
    """``x`` a tensor of exactly ``shape`` (floating-point unless ``floating`` is False)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(x).__name__}")
    if floating and not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(x.shape)}")


def samples(name: str, value) -> int:
    """A sample count the KL estimators take: an int >= 2."""
    value = positive_int(name, value)
    if not isinstance(value, torch.SymInt) and value < 2:
        raise ValueError(f"{name} must be at least 2 (the kernel estimators need two samples), got {value}")
    return value


def kl_options(lam, clip=None, contrast=None) -> tuple:
    """The estimator's options a module passes to kivi_fast's KL at every step, checked once when it is
    built (else a bad one would fail at the first step, named as the estimator's own argument)."""
    from .. import _validate
    from ..contrast import check_contrast

    lam = _validate.check_lam(lam)
    clip = None if clip is None else _validate.check_clip(clip)
    return lam, clip, None if contrast is None else check_contrast(contrast)


def batch(x, width: int, n_data: int | None = None, least: int = 1) -> None:
    """A minibatch of inputs x [B, width] with B >= ``least``, from a data set of ``n_data`` >= B points."""
    trailing("x", x, (width,))
    if x.dim() != 2 or x.shape[0] < least:
        rows = f" with B >= {least}" if least else ""
        raise ValueError(f"x must have shape [B, {width}]{rows}, got {list(x.shape)}")
    if n_data is not None and positive_int("n_data", n_data) < x.shape[0]:
        raise ValueError(f"n_data (the data set's size) must be at least the batch's {x.shape[0]}, got {n_data}")
