"""The one place where the backend is chosen: the compiled ops, or the pure-PyTorch reference.

``impl()`` returns the backend in use as an object with five primitives (``kl``, ``fit``, ``ratio``,
``median_bandwidth``, ``rbf_gram``) on validated, batched arguments ([B, n, d]; ``kl`` also takes an
unbatched pair); the public API in ``estimator.py`` validates once and calls it.

The library is a plain shared object that registers ``torch.ops.kivi_fast.*`` with TORCH_LIBRARY; it
is found through ``importlib`` because scikit-build-core's editable install does not place it beside
this file. Set ``KIVI_FAST_BACKEND=reference`` to force the reference even when the library exists.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import warnings

import torch

from . import reference
from ._validate import check_finite as _validate_finite

ENV_VAR = "KIVI_FAST_BACKEND"
_LIB_STEM = "_kivi_fast_ops"
_state: dict = {}


def constant_under_compile(fn):
    """torch.compiler.assume_constant_result(fn) without its import of torch._dynamo (1.1 s, most of
    what importing kivi_fast would cost beyond torch): the decorator only sets this mark, which dynamo
    reads when it traces a call (python_tests/test_backend.py checks that the two agree)."""
    fn._dynamo_marked_constant = True
    return fn


def _library_path(stem: str = _LIB_STEM) -> str | None:
    """The compiled library ``stem`` (the ops, or the tests' CUDA emulation), or None if not built."""
    spec = importlib.util.find_spec("kivi_fast")
    folders = list(spec.submodule_search_locations or []) if spec else []
    folders.append(os.path.dirname(__file__))
    for folder in folders:
        for pattern in (f"{stem}*.so", f"lib{stem}*.so", f"{stem}*.dylib", f"{stem}*.dll"):
            hits = sorted(glob.glob(os.path.join(folder, pattern)))
            if hits:
                return hits[0]
    return None


def _load() -> str:
    choice = os.environ.get(ENV_VAR, "").strip().lower()
    if choice not in ("", "cpp", "reference"):
        raise ValueError(f'{ENV_VAR} must be "cpp" or "reference", got {choice!r}')
    if choice == "reference":
        return "reference"
    path = _library_path()
    if path is None:
        if choice == "cpp":
            raise ImportError(f"{ENV_VAR}=cpp but the compiled library {_LIB_STEM} was not found; "
                              "build it with `pip install --no-build-isolation -e .`")
        warnings.warn("kivi_fast: compiled ops not found, using the pure-PyTorch reference "
                      "(build with `pip install --no-build-isolation -e .`)", stacklevel=3)
        return "reference"
    torch.ops.load_library(path)
    from . import _ops  # noqa: F401  (registers the fake kernels)

    return "cpp"


# Under torch.compile the first call may come while dynamo traces the caller: the library's loading
# (file globbing, dlopen) cannot be traced, so dynamo runs this eagerly and takes its result as a constant.
@constant_under_compile
def backend() -> str:
    """The implementation in use: ``"cpp"`` (compiled torch ops) or ``"reference"`` (pure PyTorch)."""
    if "name" not in _state:
        _state["name"] = _load()
    return _state["name"]


class CompiledOps:
    """The compiled torch ops (``torch.ops.kivi_fast``, csrc/): CPU kernels, CUDA kernels for the kl op
    where they apply, device-generic ATen kernels elsewhere."""

    @staticmethod
    def kl(prior_z, q_z, lam, clip, sigma, reverse, grad_state):
        value, _state, _sigma, clipped = torch.ops.kivi_fast.kl(prior_z, q_z, lam, clip, sigma, reverse, grad_state)
        return value, clipped

    @staticmethod
    def fit(numer, denom, lam, sigma):
        return torch.ops.kivi_fast.fit(numer, denom, lam, sigma)

    @staticmethod
    def ratio(z, numer, denom, alpha, beta, sigma):
        # without a gradient to come the op leaves out the state the backward reads
        grad_state = z.requires_grad and torch.is_grad_enabled()
        return torch.ops.kivi_fast.ratio(z, numer, denom, alpha, beta, sigma, grad_state)[0]

    @staticmethod
    def median_bandwidth(x):
        return torch.ops.kivi_fast.median_bandwidth(x)

    @staticmethod
    def rbf_gram(x, y, sigma):
        return torch.ops.kivi_fast.rbf_gram(x, y, sigma)


def _refuse_meta(*tensors) -> None:
    """Refuse tensors on 'meta': the reference reads values (its checks, the median's quantile), so a
    shapes-only run (the compiled ops' fake kernels) has nothing to read."""
    if any(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in tensors):
        raise NotImplementedError(
            "kivi_fast's pure-PyTorch reference reads the samples' values and cannot run on 'meta' tensors; "
            "the compiled ops propagate shapes on 'meta' (build them with `pip install --no-build-isolation -e .`)")


class ReferenceOps:
    """The pure-PyTorch reference (kivi_fast/reference.py), on the same batched arguments."""

    @staticmethod
    def kl(prior_z, q_z, lam, clip, sigma, reverse, grad_state):
        _refuse_meta(prior_z, q_z)
        unbatched = q_z.dim() == 2
        if unbatched:
            prior_z, q_z = prior_z[None], q_z[None]
        value, clipped = reference._kl_and_clipped(prior_z, q_z, lam, clip, sigma, reverse)
        return (value[0], clipped[0]) if unbatched else (value, clipped)

    @staticmethod
    def fit(numer, denom, lam, sigma):
        _refuse_meta(numer, denom)
        return reference._fit64(numer, denom, lam, sigma)

    @staticmethod
    def ratio(z, numer, denom, alpha, beta, sigma):
        _refuse_meta(z, numer, denom)
        reference._check_evaluation(z, numer, denom)
        return reference._ratio64(z, numer, denom, alpha, beta, sigma)

    @staticmethod
    def median_bandwidth(x):
        _refuse_meta(x)
        _validate_finite("x", x)
        return reference._median64(x)

    @staticmethod
    def rbf_gram(x, y, sigma):
        _refuse_meta(x, y)
        _validate_finite("x", x)
        _validate_finite("y", y)
        reference._check_distances("x", x, y, "y")
        return reference._gram64(x.double(), y.double(), sigma).to(x.dtype)


_IMPLS = {"cpp": CompiledOps, "reference": ReferenceOps}


def impl():
    """The backend in use (CompiledOps or ReferenceOps)."""
    return _IMPLS[backend()]
