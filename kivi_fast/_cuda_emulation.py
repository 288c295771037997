"""The CPU emulation of the CUDA kernels (csrc/cuda_emulation/, built beside the ops as the library
``_kivi_fast_cuda_emulation``, ops ``torch.ops.kivi_fast_cuda_emulation``): what a machine without a GPU
can run of the CUDA path, for python_tests/test_cuda_emulation.py and bench/generic_memory.py. Not part
of the API.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from . import _backend


@functools.lru_cache(maxsize=None)
def load():
    """The emulation's ops, or None where the build left it out (CMake's KIVI_FAST_CUDA_EMULATION=OFF)."""
    path = _backend._library_path("_kivi_fast_cuda_emulation")
    if path is None:
        return None
    torch.ops.load_library(path)
    return torch.ops.kivi_fast_cuda_emulation


def _emulation():
    emu = load()
    if emu is None:
        raise RuntimeError("kivi_fast was built without its CUDA emulation (KIVI_FAST_CUDA_EMULATION=OFF)")
    return emu


@contextlib.contextmanager
def switched(setter: str, flag: bool):
    """One of the emulation's testing switches (its ops set_two_blocks_per_sm, set_paired_elimination,
    set_gathered_selection, set_generic_kernels, set_gemm_kernel_values, set_tile_subblocks,
    set_balanced_tile_ranges, set_paired_weight_dims, set_weight_kernel, set_product_tile_distances,
    set_gemm_pair_distances) set
    to flag inside the block, its old value restored after."""
    set_flag = getattr(_emulation(), setter)
    old = set_flag(flag)
    try:
        yield
    finally:
        set_flag(old)


def kl_cu_takes(p, q) -> bool:
    """Whether csrc/cuda/kl.cu's forward takes these samples ([B, n, d]) on the emulated device."""
    b, n_q, d = q.shape
    return _emulation().handles_kl(p.shape[1] + n_q, d, b)


def kl(p, q, reverse, grad_kl, sigma=None, lam=1e-3, clip=1e-8):
    """The kl op's outputs (KL in q's dtype, grad state, bandwidth, clipped fraction) and its backward,
    the gradient of sum_b grad_kl[b] KL_b w.r.t. q, on CPU tensors ([B, n, d]) as CUDA tensors of these
    shapes take them: as csrc/ops.cpp picks, csrc/cuda/kl.cu's kernels where they handle the shape, else
    the generic path (csrc/generic.cpp) with its CUDA kernels; the backward likewise."""
    emu = _emulation()
    b, n_q, d = q.shape
    forward = emu.kl if kl_cu_takes(p, q) else emu.generic_kl
    value, *rest = forward(p, q, lam, clip, sigma, reverse, True)
    out = (value.to(q.dtype), *rest)
    backward = emu.kl_grad if emu.handles_kl_grad(p.shape[1] + n_q, n_q, d, b) else emu.generic_kl_grad
    return out, backward(grad_kl, out[1], q, p, reverse)
