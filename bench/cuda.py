"""Benchmark on a GPU: kivi_fast.kl against the pure-PyTorch KL (bench/pure_torch.py), both on CUDA.

    python bench/cuda.py                          # bench/run.py's shapes, float32 and float64
    python bench/cuda.py --shapes 128x100x8 --dtypes float32 --json bench/cuda_results.json

CUDA tensors run kivi_fast's device-generic kernels (ATen calls, csrc/generic.cpp), so this measures
what those kernels and the C++ autograd formula give against the same algorithm written in Python,
on the same GPU. Each timing synchronizes the device; pure/ours is the median ratio of neighbouring
calls, as in bench/run.py. Peak memory is torch.cuda.max_memory_allocated over one forward+backward.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

import run as cpu_bench  # bench/run.py: inputs, implementations, the agreement check's calls


def timed_call(fn, p, q, backward: bool) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    cpu_bench.call(fn, p, q, backward)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def time_pair(p, q, backward: bool, target_s: float) -> dict:
    impls = cpu_bench.IMPLS
    for fn in impls.values():  # warm-up: cuBLAS/cuSOLVER handles, the caching allocator
        for _ in range(3):
            timed_call(fn, p, q, backward)
    times = {name: [] for name in impls}
    start = time.perf_counter()
    while len(times["ours"]) < 10 or time.perf_counter() - start < 2 * target_s:
        for name, fn in impls.items():
            times[name].append(timed_call(fn, p, q, backward))
        if len(times["ours"]) >= 2000:
            break
    out = {name: statistics.median(ts) for name, ts in times.items()}
    out["ratio"] = statistics.median(a / b for a, b in zip(times["pure"], times["ours"]))
    return out


def peak_mb(fn, p, q) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    cpu_bench.call(fn, p, q, True)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=cpu_bench.DEFAULT_SHAPES, help="comma-separated NxD or BxNxD")
    ap.add_argument("--dtypes", default="float32,float64")
    ap.add_argument("--target-s", type=float, default=0.5, help="seconds per implementation and timing")
    ap.add_argument("--json", metavar="PATH", help="save the device and the results as JSON")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/cuda.py: torch sees no CUDA device", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "kivi_fast_backend": cpu_bench.kivi_fast.backend()}
    print(" ".join(f"{k}={v}" for k, v in info.items()))
    rows = []
    for shape in args.shapes.split(","):
        b, n, d, batched = cpu_bench.parse_shape(shape)
        for dtype_name in args.dtypes.split(","):
            p, q = (t.to(dev) for t in cpu_bench.make_inputs(b, n, d, batched, cpu_bench.DTYPES[dtype_name]))
            for backward in (False, True):
                t = time_pair(p, q, backward, args.target_s)
                row = {"shape": cpu_bench.shape_name(b, n, d, batched), "dtype": dtype_name,
                       "pass": "fwd+bwd" if backward else "fwd", "pure_s": t["pure"], "ours_s": t["ours"],
                       "ratio": t["ratio"]}
                if backward:
                    row["pure_mb"] = peak_mb(cpu_bench.pure_kl, p, q)
                    row["ours_mb"] = peak_mb(cpu_bench.ours_kl, p, q)
                rows.append(row)
                print(f"{row['shape']:>14} {dtype_name:8} {row['pass']:8} pure {t['pure'] * 1e3:8.3f} ms  "
                      f"ours {t['ours'] * 1e3:8.3f} ms  pure/ours {t['ratio']:5.2f}"
                      + (f"  peak MB pure {row['pure_mb']:.1f} ours {row['ours_mb']:.1f}" if backward else ""),
                      flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": info, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
