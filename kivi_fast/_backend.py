"""Finds and loads the compiled op library, or falls back to the pure-PyTorch reference.

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

ENV_VAR = "KIVI_FAST_BACKEND"
_LIB_STEM = "_kivi_fast_ops"
_state: dict = {}


def _library_path() -> str | None:
    spec = importlib.util.find_spec("kivi_fast")
    folders = list(spec.submodule_search_locations or []) if spec else []
    folders.append(os.path.dirname(__file__))
    for folder in folders:
        for pattern in (f"{_LIB_STEM}*.so", f"lib{_LIB_STEM}*.so", f"{_LIB_STEM}*.dylib", f"{_LIB_STEM}*.dll"):
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


def backend() -> str:
    """The implementation in use: ``"cpp"`` (compiled torch ops) or ``"reference"`` (pure PyTorch)."""
    if "name" not in _state:
        _state["name"] = _load()
    return _state["name"]
