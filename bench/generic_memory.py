"""Peak memory of ours on a GPU against the pure sides, measured on the CPU: a check of the memory
layout of what CUDA tensors run, without a GPU.

    .venv/bin/python bench/generic_memory.py                       # (1000, 32) ... (5000, 64), float32
    .venv/bin/python bench/generic_memory.py --shapes 2000x32 --dtype float64
    .venv/bin/python bench/generic_memory.py --shapes 1000x32 --launches   # and what a call launches

"ours on a GPU": the path a CUDA tensor of the shape takes (csrc/ops.cpp's choice: csrc/cuda/kl.cu's
kernels, or the generic path of csrc/generic.cpp with its CUDA kernels), run on CPU tensors through the
CPU emulation of the CUDA kernels (csrc/cuda_emulation/, an H100's multiprocessors and shared memory).
The host code is the GPU build's (kl.cu's, median.cu's and generic.cpp's), so it allocates the same
buffers through ATen as on a GPU. "ATen composition": the same with the generic path's CUDA kernels
switched off (``set_generic_kernels(False)``, the benches' A/B), where that path runs ("-" where kl.cu
takes the forward). The pure sides run on the CPU: their allocations are a GPU's but for their
median's selection buffers (a GPU's sort or kthvalue allocates its own). Each side runs one forward +
backward (after a warm-up call) under the profiler, and its peak is the largest sum of the bytes
allocated less those freed during the call. bench/gpu.py measures the same on a GPU
(torch.cuda.max_memory_allocated); where both ran they agreed (1.3 MB at 128 x (100, 8), 0.01 at
(100, 8) on an H200). The emulation runs each kernel's blocks one after another: (5000, 64) takes ~5
minutes.

--launches also prints, for ours' two columns, the kernels of csrc/cuda/ that one forward + backward
launches and the ATen calls it makes that run work on the device (a call counts when it or an op
inside it does more than make a view or an empty tensor; cuSOLVER's factorization is one call, several
kernels): what bounds the host's time a call where the GPU's work is small.
"""

from __future__ import annotations

import argparse
import collections
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import run as cpu_bench  # bench/run.py: inputs, the sides, the call
from alloc_peak import peak_bytes

from kivi_fast import _cuda_emulation


def gpu_kl(p, q):
    """ours' forward + backward as CUDA tensors take them, emulated (_cuda_emulation.kl), as a
    function of no arguments."""
    p, q = (t if t.dim() == 3 else t[None] for t in (p, q.detach()))
    grad_kl = torch.ones(p.shape[0], dtype=q.dtype)  # (autograd's: the KL's dtype)
    return lambda: _cuda_emulation.kl(p, q, True, grad_kl)


def aten_composition(p, q, measure):
    """measure(gpu_kl(p, q)) with the generic path's CUDA kernels switched off; None where kl.cu takes
    the forward."""
    if _cuda_emulation.kl_cu_takes(*(t if t.dim() == 3 else t[None] for t in (p, q))):
        return None
    with _cuda_emulation.switched("set_generic_kernels", False):
        return measure(gpu_kl(p, q))


# ATen ops that make views or empty tensors only: no work on the device
NO_DEVICE_WORK = {
    "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::view", "aten::view_as", "aten::_unsafe_view",
    "aten::reshape", "aten::_reshape_alias", "aten::as_strided", "aten::narrow", "aten::slice", "aten::select",
    "aten::unsqueeze", "aten::unsqueeze_", "aten::squeeze", "aten::squeeze_", "aten::expand", "aten::expand_as",
    "aten::t", "aten::transpose", "aten::permute", "aten::mT", "aten::mH", "aten::adjoint", "aten::diagonal",
    "aten::alias", "aten::detach", "aten::resize_", "aten::result_type", "aten::conj", "aten::resolve_conj",
    "aten::resolve_neg", "aten::unbind", "aten::split", "aten::chunk", "aten::contiguous", "aten::to",
    "aten::lift_fresh",
}


def calls(run, emu) -> tuple[collections.Counter, collections.Counter]:
    """(csrc/cuda/'s kernels, ATen calls with device work) of run(), by name (after a warm-up call)."""
    run()
    emu.take_launches()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    kernels = collections.Counter(emu.take_launches()[0])

    def works(e) -> bool:
        return e.name not in NO_DEVICE_WORK or any(works(c) for c in e.cpu_children)

    def outermost(e) -> bool:
        parent = e.cpu_parent
        while parent is not None:
            if parent.name.startswith("aten::"):
                return False
            parent = parent.cpu_parent
        return True

    aten = collections.Counter(e.name for e in prof.events()
                               if e.name.startswith("aten::") and outermost(e) and works(e))
    return kernels, aten


def peak_of(run) -> float:
    """Peak MB allocated by run() (after a warm-up call: lazy state, the pure sides' cached indices)."""
    run()
    return peak_bytes(run) / 2**20


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", type=cpu_bench.shapes_arg, default="1000x32,2000x32,100x50000,128x100x8,100x700,5000x64",
                    help="comma-separated NxD or BxNxD")
    ap.add_argument("--dtype", default="float32", choices=sorted(cpu_bench.DTYPES))
    ap.add_argument("--launches", action="store_true",
                    help="also print the kernels and ATen calls of ours' forward + backward")
    args = ap.parse_args(argv)
    if cpu_bench.kivi_fast.backend() != "cpp":
        print("bench/generic_memory.py: the compiled ops are not built", file=sys.stderr)
        return 2
    emu = _cuda_emulation.load()
    if emu is None:
        print("bench/generic_memory.py: this build has no CUDA emulation (CMake's KIVI_FAST_CUDA_EMULATION=OFF)",
              file=sys.stderr)
        return 2
    print(f"peak MB of one forward + backward, {args.dtype}, on the CPU (ours: the GPU's path, emulated)")
    print(f"{'shape':>14} {'ours on a GPU':>14} {'ATen composition':>17} {'strong':>9} {'fast':>9}")
    for shape in args.shapes:
        b, n, d, batched = cpu_bench.parse_shape(shape)
        p, q = cpu_bench.make_inputs(b, n, d, batched, cpu_bench.DTYPES[args.dtype])
        pure = {name: peak_of(lambda: cpu_bench.call(cpu_bench.IMPLS[name], p, q, True)) for name in ("strong", "fast")}
        ours = peak_of(gpu_kl(p, q))
        aten = aten_composition(p, q, peak_of)
        name = cpu_bench.shape_name(b, n, d, batched)
        print(f"{name:>14} {ours:14.2f} {'-' if aten is None else f'{aten:.2f}':>17} {pure['strong']:9.2f} "
              f"{pure['fast']:9.2f}", flush=True)
        if args.launches:
            for column, counted in (("ours on a GPU", calls(gpu_kl(p, q), emu)),
                                    ("ATen composition", aten_composition(p, q, lambda run: calls(run, emu)))):
                if counted is not None:
                    kernels, aten_calls = counted
                    print(f"{'':>14} {column}: {sum(kernels.values())} kernel launches {dict(kernels)}, "
                          f"{sum(aten_calls.values())} ATen calls {dict(aten_calls)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
