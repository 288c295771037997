"""Peak memory of the GPU paths against the pure sides, measured on the CPU: a check of the memory
layout of what CUDA tensors run, without a GPU.

    .venv/bin/python bench/generic_memory.py                       # (1000, 32) ... (5000, 64), float32
    .venv/bin/python bench/generic_memory.py --shapes 2000x32 --dtype float64

"ours, ATen kernels": csrc/generic.cpp, forced on CPU tensors (the ``generic`` implementation of the
tests), what CUDA tensors run where csrc/cuda/kl.cu does not apply. "ours, CUDA kernels": kl.cu's
forward and backward through their CPU emulation (csrc/cuda_emulation/, an H100's multiprocessors
and shared memory), whose host code makes the same allocations as on a GPU, for the shapes those
kernels take ("-" elsewhere). Each side runs one forward + backward (after a warm-up call) under the
profiler, and its peak is the largest sum of the bytes allocated less those freed during the call.
The ATen kernels' allocations are a GPU's (the same ATen calls, the same sizes) except in the median
of many pairs: on a GPU csrc/cuda/kl.cu's pair_sqdist writes the packed pairs from the samples in one
kernel and csrc/cuda/median.cu reads them in place (a few KB per batch element), while on the CPU the
generic path packs them in chunks and its median copies them; so ours is reported without the
allocations made inside ``kivi_fast::pack_pairs`` and ``kivi_fast::median_of_pairs`` (the pairs
themselves are counted). The pure sides' medians allocate the same on both. bench/gpu.py measures the
same on a GPU (torch.cuda.max_memory_allocated); where both ran they agreed (the CUDA kernels: 1.3 MB
at 128 x (100, 8), 0.01 at (100, 8) on an H200).
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import run as cpu_bench  # bench/run.py: inputs, the sides, the call

CPU_ONLY = ("kivi_fast::pack_pairs", "kivi_fast::median_of_pairs")


def emulated_cuda_kernels():
    """(handles(p, q), kl(p, q)): whether kl.cu takes these samples on an H100, and ours' forward +
    backward on CUDA tensors by the emulated kernels: the op's forward, its KL cast to the samples'
    dtype, and the backward (as csrc/ops.cpp and csrc/autograd.cpp call them); (never, None) in a build
    without the emulation (CMake's KIVI_FAST_CUDA_EMULATION=OFF)."""
    path = cpu_bench.kivi_fast._backend._library_path("_kivi_fast_cuda_emulation")
    if path is None:
        print("bench/generic_memory.py: no CUDA emulation in this build: the CUDA kernels' column is left out",
              file=sys.stderr)
        return (lambda p, q: False), None
    torch.ops.load_library(path)
    emu = torch.ops.kivi_fast_cuda_emulation  # (its device: an H100's attributes, as loaded)

    def batched(t):
        return t if t.dim() == 3 else t[None]

    def handles(p, q):
        p, q = batched(p), batched(q)
        return emu.handles_kl(p.shape[1] + q.shape[1], q.shape[2], q.shape[0])

    def kl(p, q):
        p, q = batched(p), batched(q.detach())
        value, state, _, _ = emu.kl(p, q, 1e-3, 1e-8, None, True, True)
        value = value.to(q.dtype)
        return value, emu.kl_grad(torch.ones_like(value, dtype=torch.float64), state, q, p, True)
    return handles, kl


def peak_mb(fn, p, q, skip: tuple[str, ...] = ()) -> float:
    """Peak MB allocated by one forward + backward; allocations inside ops named in ``skip`` left out."""
    return peak_of(lambda: cpu_bench.call(fn, p, q, True), skip)


def peak_of(run, skip: tuple[str, ...] = ()) -> float:
    """Peak MB allocated by run() (after a warm-up call: lazy state, the pure sides' cached indices)."""
    run()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events = prof.profiler.kineto_results.events()
    spans = [(e.start_ns(), e.start_ns() + e.duration_ns()) for e in events if e.name() in skip]
    memory = sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns())
    now = top = 0
    for e in memory:
        if any(a <= e.start_ns() <= b for a, b in spans):
            continue
        now += e.nbytes()
        top = max(top, now)
    if not memory:
        raise RuntimeError("the profiler recorded no allocations")
    return top / 2**20


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="1000x32,2000x32,100x50000,128x100x8,5000x64",
                    help="comma-separated NxD or BxNxD")
    ap.add_argument("--dtype", default="float32", choices=sorted(cpu_bench.DTYPES))
    args = ap.parse_args(argv)
    if cpu_bench.kivi_fast.backend() != "cpp":
        print("bench/generic_memory.py: the compiled ops are not built", file=sys.stderr)
        return 2
    handles, cuda_kl = emulated_cuda_kernels()
    torch.ops.kivi_fast_testing.set_force_generic(True)
    print(f"peak MB of one forward + backward, {args.dtype}, on the CPU (ours, ATen kernels: without the "
          f"CPU's packing and median buffers; ours, CUDA kernels: emulated, where they apply)")
    print(f"{'shape':>14} {'ours, ATen kernels':>19} {'ours, CUDA kernels':>19} {'strong':>9} {'fast':>9}")
    for shape in args.shapes.split(","):
        b, n, d, batched = cpu_bench.parse_shape(shape)
        p, q = cpu_bench.make_inputs(b, n, d, batched, cpu_bench.DTYPES[args.dtype])
        row = {name: peak_mb(fn, p, q, CPU_ONLY if name == "ours" else ()) for name, fn in cpu_bench.IMPLS.items()}
        cuda = f"{peak_of(lambda: cuda_kl(p, q)):19.2f}" if handles(p, q) else f"{'-':>19}"
        print(f"{cpu_bench.shape_name(b, n, d, batched):>14} {row['ours']:19.1f} {cuda} {row['strong']:9.1f} "
              f"{row['fast']:9.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
