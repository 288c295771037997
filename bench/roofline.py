"""This machine's limits (GEMM GFLOP/s, memory read GB/s) and the roofline time of a KIVI KL call.

Roofline of one call on [B, n_q, d] posterior and [B, n_p, d] prior samples, N = n_p + n_q:

    GEMM flops (input dtype)    Gram 2 N^2 d  (+ backward 2 n_q N d for forward+backward)
    n x n flops (float32)       Cholesky n_q^3 / 3 + the two triangular solves 2 n_q^2
    bytes                       the inputs read once, N d elements (+ the gradient written once, n_q d)
    time = max(GEMM flops / GEMM rate(dtype) + n x n flops / GEMM rate(float32), bytes / bandwidth)

all times B, with the rates measured at the same thread count. It is a lower bound no implementation
can beat on this machine. The n x n part is charged at the float32 rate for both dtypes: the solve
must be float64-accurate (the evaluation cancels terms ~1/lam), but a float32 factor refined in
float64 gets there (ours does so above 256 rows).
"""

from __future__ import annotations

import time

import torch


def _best_time(fn, reps: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def gemm_gflops(dtype: torch.dtype, size: int = 2048, reps: int = 5) -> float:
    """Best-of-reps GFLOP/s of torch.mm on two [size, size] matrices (2 size^3 flops)."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=g, dtype=dtype)
    b = torch.randn(size, size, generator=g, dtype=dtype)
    out = torch.empty(size, size, dtype=dtype)
    t = _best_time(lambda: torch.mm(a, b, out=out), reps)
    return 2.0 * size**3 / t / 1e9


def read_bandwidth_gbs(nbytes: int = 1 << 30, reps: int = 5) -> float:
    """Best-of-reps GB/s (1e9 bytes/s) of torch.sum over a float32 tensor of ``nbytes`` bytes."""
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    t = _best_time(lambda: x.sum(), reps)
    return nbytes / t / 1e9


def machine_rates(threads: int, mem_bytes: int = 1 << 30) -> dict:
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return {
            "threads": threads,
            "gemm_gflops_float32": gemm_gflops(torch.float32),
            "gemm_gflops_float64": gemm_gflops(torch.float64),
            "read_gbs": read_bandwidth_gbs(mem_bytes),
        }
    finally:
        torch.set_num_threads(prev)


def work(b: int, n_q: int, n_p: int, d: int, elt_bytes: int, backward: bool) -> dict:
    """Flops and bytes a KIVI KL call must at least do (see the module docstring)."""
    n = n_q + n_p
    gemm = 2.0 * n * n * d + (2.0 * n_q * n * d if backward else 0.0)
    small = n_q**3 / 3.0 + 2.0 * n_q**2
    nbytes = (n * d + (n_q * d if backward else 0)) * elt_bytes
    return {"gemm_flops": b * gemm, "nxn_flops": b * small, "bytes": b * nbytes}


def roofline_s(w: dict, rates: dict, dtype: torch.dtype) -> float:
    key = "gemm_gflops_float32" if dtype == torch.float32 else "gemm_gflops_float64"
    compute = w["gemm_flops"] / (rates[key] * 1e9) + w["nxn_flops"] / (rates["gemm_gflops_float32"] * 1e9)
    memory = w["bytes"] / (rates["read_gbs"] * 1e9)
    return max(compute, memory)
