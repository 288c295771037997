"""Peak memory of the device-generic kernels against the pure sides, measured on the CPU: a check of the
memory layout of what CUDA tensors run where csrc/cuda/kl.cu does not apply, without a GPU.

    .venv/bin/python bench/generic_memory.py                       # (1000, 32) ... (5000, 64), float32
    .venv/bin/python bench/generic_memory.py --shapes 2000x32 --dtype float64

csrc/generic.cpp is forced on CPU tensors (the ``generic`` implementation of the tests). Each side runs
one forward + backward (after a warm-up call) under the profiler, and its peak is the largest sum of the
bytes allocated less those freed during the call. The allocations are a GPU's (the same ATen calls, the
same sizes) except in the median of many pairs: on a GPU csrc/cuda/kl.cu's pair_sqdist writes the
packed pairs from the samples in one kernel and csrc/cuda/median.cu reads them in place (a few KB per
batch element), while on the CPU the generic path packs them in chunks and its median copies them; so
ours is reported without the allocations made inside ``kivi_fast::pack_pairs`` and
``kivi_fast::median_of_pairs`` (the pairs themselves are counted). The pure sides' medians allocate the
same on both. bench/gpu.py measures the same on a GPU (torch.cuda.max_memory_allocated).
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import run as cpu_bench  # bench/run.py: inputs, the sides, the call

CPU_ONLY = ("kivi_fast::pack_pairs", "kivi_fast::median_of_pairs")


def peak_mb(fn, p, q, skip: tuple[str, ...] = ()) -> float:
    """Peak MB allocated by one forward + backward; allocations inside ops named in ``skip`` left out."""
    cpu_bench.call(fn, p, q, True)  # warm-up: lazy state, the pure sides' cached indices
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        cpu_bench.call(fn, p, q, True)
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
    torch.ops.kivi_fast_testing.set_force_generic(True)
    print(f"peak MB of one forward + backward, {args.dtype}, on the CPU (ours: generic kernels, "
          f"without the CPU's packing and median buffers)")
    print(f"{'shape':>14} {'ours':>9} {'strong':>9} {'fast':>9}")
    for shape in args.shapes.split(","):
        b, n, d, batched = cpu_bench.parse_shape(shape)
        p, q = cpu_bench.make_inputs(b, n, d, batched, cpu_bench.DTYPES[args.dtype])
        row = {name: peak_mb(fn, p, q, CPU_ONLY if name == "ours" else ()) for name, fn in cpu_bench.IMPLS.items()}
        print(f"{cpu_bench.shape_name(b, n, d, batched):>14} {row['ours']:9.1f} {row['strong']:9.1f} "
              f"{row['fast']:9.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
