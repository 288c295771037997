"""Benchmark on a GPU: kivi_fast.kernel_kl against the two pure-PyTorch sides (bench/pure_torch.py), on CUDA.

    python bench/gpu.py                          # bench/run.py's shapes, float32 and float64
    python bench/gpu.py --shapes 128x100x8 --dtypes float32 --json bench/cuda_results.json
    python bench/gpu.py --shapes 128x100x8 --compiled   # and both pure sides and ours under torch.compile
                                         # (--compile-mode reduce-overhead: also in CUDA graphs), with
                                         # the like-for-like ratios <side>_compiled / ours_compiled
    python bench/gpu.py --shapes 10x314000 --graphed    # and each side's call captured in a CUDA graph
                                         # and replayed (as in a training step captured whole), with
                                         # the like-for-like ratios <side>_graphed / ours_graphed
    python bench/gpu.py --shapes 5000x64 --dtypes float32 --profile   # where ours spends its GPU time
                                         # (by kernel, the count of GPU operations, the host's share
                                         # of a call, by stage of kl.cu's forward kernel; batched
                                         # shapes: the floors of a call, bench/gpu.py's floors())

(Not named cuda.py: run as a script, bench/ comes first on sys.path, and torch's own ``import
cuda.bindings`` would find it.) CUDA tensors run kivi_fast's device-generic kernels (ATen calls,
csrc/generic.cpp), so this measures what those kernels and the C++ autograd formula give against the
pure-PyTorch sides on the same GPU. Each timing synchronizes the device; strong/ours and fast/ours are
median ratios of neighbouring calls, as in bench/run.py. Peak memory is torch.cuda.max_memory_allocated
over one forward+backward.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

import pure_torch  # bench/pure_torch.py: the pure sides (their capturable paths, for --graphed)
import run as cpu_bench  # bench/run.py: inputs, implementations, the agreement check's calls


# The device the benches run on: python_tests/test_gpu_benches.py runs them through on the CPU with
# torch.cuda's calls stood in, so that a lease's minutes are not spent on a script's own errors.
DEVICE = "cuda"


def synchronized_seconds(run) -> float:
    """Seconds of run(), the device synchronized before and after."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    run()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


capture = pure_torch.capture  # (a name of this module: the CPU's stand-ins replace it)


class Graphed:
    """A side's call (forward, or forward + backward) on one pair of inputs, captured in a CUDA graph:
    what a training step captured whole runs of it, without the host's work each call. It keeps the
    inputs, which the graph reads where they were at the capture."""

    def __init__(self, fn, p, q, backward: bool):
        self.inputs = (p, q)
        self.replay = capture(lambda: cpu_bench.call(fn, p, q, backward))


class CaptureFailed(RuntimeError):
    """A capture failed: torch may leave the process's current stream and its allocator in capture
    mode (torch.cuda.graph's exit ends the capture before it restores them), which would skew every
    later timing, so the bench stops there rather than go on."""


def graphed_for(impls: dict, p, q, backward: bool) -> dict:
    """{<side>_graphed: Graphed} of each side, captured on these inputs; CaptureFailed (with the cause:
    a host read, an op a capture refuses) where one fails."""
    out = {}
    for name, fn in impls.items():
        try:
            out[name + "_graphed"] = Graphed(fn, p, q, backward)
        except Exception as err:  # noqa: BLE001
            causes = [e for e in (err, err.__context__, err.__cause__) if e is not None]
            said = "; ".join(f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}" for e in causes)
            raise CaptureFailed(f"{name}_graphed: the capture failed ({said})") from err
    return out


def run_once(fn, p, q, backward: bool):
    return fn.replay() if isinstance(fn, Graphed) else cpu_bench.call(fn, p, q, backward)


def timed_call(fn, p, q, backward: bool) -> float:
    return synchronized_seconds(lambda: run_once(fn, p, q, backward))


def time_sides(impls: dict, pure: tuple, p, q, backward: bool, target_s: float, like: tuple = ()) -> dict:
    """Median seconds of each of impls, called in turn round after round; <name>_ratio for each of pure:
    the median of its rounds' ratios to ours, and <a>_vs_<b> for each pair (a, b) of like the same."""
    for fn in impls.values():  # warm-up: cuBLAS/cuSOLVER handles, the caching allocator
        for _ in range(3):
            timed_call(fn, p, q, backward)
    times = {name: [] for name in impls}
    start = time.perf_counter()
    while len(times["ours"]) < 10 or time.perf_counter() - start < len(impls) * target_s:
        for name, fn in impls.items():
            times[name].append(timed_call(fn, p, q, backward))
        if len(times["ours"]) >= 2000:
            break
    out = {name: statistics.median(ts) for name, ts in times.items()}
    for name in pure:
        out[name + "_ratio"] = statistics.median(a / b for a, b in zip(times[name], times["ours"]))
    for a_name, b_name in like:
        out[f"{a_name}_vs_{b_name}"] = statistics.median(a / b for a, b in zip(times[a_name], times[b_name]))
    return out


def peak_mb(fn, p, q) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    cpu_bench.call(fn, p, q, True)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def profile_table(run, rows: int) -> str:
    """torch.profiler's table of what run() launches (synchronized before and after), by GPU time, then
    the count of the GPU's operations (kernels, copies, fills) and their summed time."""
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if DEVICE == "cuda" else [])
    with torch.profiler.profile(activities=acts) as prof:
        run()
        torch.cuda.synchronize()
    on_gpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy_ms = sum(e.time_range.elapsed_us() for e in on_gpu) / 1e3
    return (prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows)
            + f"\n  {len(on_gpu)} GPU operations, {busy_ms:.3f} ms of GPU time")


def host_share(fn, p, q, calls: int = 50) -> str:
    """Forward + backward of fn: the host's time to enqueue a call (from an idle GPU until the call
    returns, before the GPU has finished) against the synchronized call's. Where the two are close the
    call is bound by the host (Python, the dispatcher, the launches), not by the GPU."""
    for _ in range(5):
        cpu_bench.call(fn, p, q, True)
    enqueue, wall = [], []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        cpu_bench.call(fn, p, q, True)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        enqueue.append(t1 - t0)
        wall.append(time.perf_counter() - t0)
    return (f"  host: {statistics.median(enqueue) * 1e3:.3f} ms to enqueue a "
            f"{statistics.median(wall) * 1e3:.3f} ms call")


def kernel_profile(fn, p, q, rows: int = 15) -> str:
    """torch.profiler's table of one forward + backward (after a warm-up call), by GPU time."""
    cpu_bench.call(fn, p, q, True)
    return profile_table(lambda: cpu_bench.call(fn, p, q, True), rows)


STAGES = ("distances", "median", "system", "solve", "evaluation")


def forward_stages(fn, p, q) -> str | None:
    """Block 0 of kl.cu's forward kernel: the clock cycles of each stage in one call (after a warm-up),
    from the kernel's own clock64() reads (torch.ops.kivi_fast_testing.set_forward_stage_clocks); None
    where no such kernel ran."""
    clocks = torch.zeros(6, dtype=torch.int64, device=p.device)
    cpu_bench.call(fn, p, q, False)
    torch.ops.kivi_fast_testing.set_forward_stage_clocks(clocks)
    try:
        cpu_bench.call(fn, p, q, False)
        torch.cuda.synchronize()
    finally:
        torch.ops.kivi_fast_testing.set_forward_stage_clocks(None)
    c = clocks.tolist()
    if c[-1] == 0:
        return None
    total = c[-1] - c[0]
    parts = [f"{name} {c[i + 1] - c[i]} ({100 * (c[i + 1] - c[i]) / total:.0f}%)" for i, name in enumerate(STAGES)]
    return f"  kl_forward_kernel, block 0: {total} cycles: " + ", ".join(parts)


def with_switches(settings: dict, fn):
    """fn with the CUDA kernels' testing switches (torch.ops.kivi_fast_testing.<switch>) set as in
    settings ({switch: flag}), each restored after."""
    setters = {name: getattr(torch.ops.kivi_fast_testing, name) for name in settings}

    def run(*args):
        old = {name: setters[name](flag) for name, flag in settings.items()}
        try:
            return fn(*args)
        finally:
            for name, flag in old.items():
                setters[name](flag)
    return run


def with_switch(switch: str, flag: bool, fn):
    return with_switches({switch: flag}, fn)


def switch_ab(p, q, switch: str, target_s: float) -> str:
    """Ours (forward + backward) with a testing switch on and off, timed alternately:
    set_two_blocks_per_sm (batches of more than one wave: two forward blocks per SM, or one),
    set_paired_elimination (the forward's elimination two columns a step, or one),
    set_gathered_selection (the medians, kl.cu's forward's and median.cu's: the last few keys
    gathered and ranked, or a pass for every digit),
    set_generic_kernels (many points: the generic path's CUDA kernels, or ATen's composition of the
    same steps),
    set_gemm_kernel_values (off by default; the generic path's kernel values from a GEMM of the points
    and one pass, or from differences in tiles),
    set_tile_subblocks (the tiled distances, pair_tile_kernel's and kernel_block's: only the 16 x 16
    sub-blocks that hold a needed pair, or all 16 of a tile),
    set_balanced_tile_ranges (pair_tile_kernel with few tile pairs: each pair's
    dimensions in ranges by its cost, or the same ranges for all),
    set_paired_weight_dims (the weight state's backward: two dimensions a thread, or one),
    set_weight_kernel (the weight state's backward: grad_from_weights_kernel, or the generic path's
    GEMM of the weights and the samples, converted to float64 in chunks),
    set_product_tile_distances (off by default; the tiled distances, pair_tile_kernel's and
    kernel_block's, from the points' norms and products, the GEMM's form, or from their differences),
    set_gemm_pair_distances (off by default; the many-dimension path's distances where d >= N from
    cuBLAS's float64 GEMM of the centred points, or from the pair kernels)."""
    ours = cpu_bench.IMPLS["ours"]
    t = time_sides({"ours": with_switch(switch, True, ours), "off": with_switch(switch, False, ours)}, ("off",),
                   p, q, True, target_s)
    return f"  {switch}: on {t['ours'] * 1e3:.3f} ms, off {t['off'] * 1e3:.3f} ms: off/on {t['off_ratio']:.2f}"


def median_ms(run, calls: int = 50) -> float:
    """Median ms of synchronized calls of run(), after 5 warm-up calls."""
    for _ in range(5):
        run()
    return statistics.median(synchronized_seconds(run) for _ in range(calls)) * 1e3


def floors(p, q) -> str:
    """What bounds a batched call of ours from below: the same call on a tiny problem, 1 x (3, 2) (the
    host's work and the launches), torch's own floor for such a call (autograd through ``q * 2`` on the
    same tiny input: Python, the engine and four launches, none of them ours), the forward op alone,
    and the GPU's own batched Cholesky (torch.linalg.cholesky_ex) of B float64 systems of the shape's
    size, the factorization that our forward kernel does inside each block among its other stages."""
    ours = cpu_bench.IMPLS["ours"]
    b, n = p.shape[0], p.shape[1]
    tiny_p, tiny_q = p[:1, :3, :2].contiguous(), q[:1, :3, :2].contiguous()
    a = torch.randn(b, n, n, dtype=torch.float64, device=p.device)
    spd = a @ a.mT / n + torch.eye(n, dtype=torch.float64, device=p.device)
    parts = {
        "ours fwd+bwd at 1 x (3, 2)": median_ms(lambda: cpu_bench.call(ours, tiny_p, tiny_q, True)),
        "torch's fwd+bwd of q * 2 there": median_ms(lambda: cpu_bench.call(lambda _, x: x * 2, tiny_p, tiny_q, True)),
        "ours forward op alone": median_ms(lambda: torch.ops.kivi_fast.kl(p, q, 1e-3, 1e-8, None, False, False)),
        f"torch.linalg.cholesky_ex of {b} x ({n}, {n}) float64": median_ms(lambda: torch.linalg.cholesky_ex(spd)),
    }
    return "  floors: " + ", ".join(f"{k} {v:.3f} ms" for k, v in parts.items())


def device_info(script: str) -> dict | None:
    """The GPU, torch and CUDA versions and kivi_fast's backend, printed; None (said so) without a GPU."""
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print(f"{script}: torch sees no CUDA device", file=sys.stderr)
        return None
    info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "kivi_fast_backend": cpu_bench.kivi_fast.backend()}
    print(" ".join(f"{k}={v}" for k, v in info.items()))
    return info


def save_json(path: str | None, info: dict, rows: list) -> None:
    if path:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump({"device": info, "rows": rows}, f, indent=1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", type=cpu_bench.shapes_arg, default=cpu_bench.DEFAULT_SHAPES,
                    help="comma-separated NxD or BxNxD")
    ap.add_argument("--dtypes", type=cpu_bench.dtypes_arg, default="float32,float64",
                    help="comma-separated float32, float64")
    ap.add_argument("--target-s", type=float, default=0.5, help="seconds per implementation and timing")
    ap.add_argument("--json", metavar="PATH", help="save the device and the results as JSON")
    ap.add_argument("--compiled", action="store_true", help="also the pure sides under torch.compile")
    ap.add_argument("--compile-mode", default=None, choices=["default", "reduce-overhead", "max-autotune-no-cudagraphs"],
                    help="torch.compile's mode for --compiled (default: torch's default; with CUDA graphs the "
                         "compiled sides' peak MB misses the graphs' memory pool)")
    ap.add_argument("--graphed", action="store_true",
                    help="also each side (ours and the eager pure sides) captured in a CUDA graph and replayed")
    ap.add_argument("--passes", default="fwd,fwd+bwd", help="comma-separated: fwd (forward alone), fwd+bwd")
    ap.add_argument("--profile", action="store_true",
                    help="instead of timing: the GPU time of each kernel in one forward + backward of ours")
    args = ap.parse_args(argv)
    passes = {"fwd": False, "fwd+bwd": True}
    if not args.passes or any(k not in passes for k in args.passes.split(",")):
        ap.error(f"--passes: comma-separated names of {sorted(passes)}, got {args.passes!r}")
    backwards = [passes[k] for k in args.passes.split(",")]
    info = device_info("bench/gpu.py")
    if info is None:
        return 2
    dev = torch.device(DEVICE)
    if args.profile:
        for shape in args.shapes:
            b, n, d, batched = cpu_bench.parse_shape(shape)
            for dtype_name in args.dtypes:
                p, q = (t.to(dev) for t in cpu_bench.make_inputs(b, n, d, batched, cpu_bench.DTYPES[dtype_name]))
                print(f"{cpu_bench.shape_name(b, n, d, batched)} {dtype_name}: ours, forward + backward")
                ours = cpu_bench.IMPLS["ours"]
                print(kernel_profile(ours, p, q))
                print(host_share(ours, p, q))
                stages = forward_stages(ours, p, q)
                print(stages or "  (no kl.cu forward kernel ran)")
                if stages is not None:  # the elimination one column a step; the median without its gather
                    print(forward_stages(with_switch("set_paired_elimination", False, ours), p, q)
                          + " (one column a step)")
                    print(switch_ab(p, q, "set_paired_elimination", args.target_s))
                    print(forward_stages(with_switch("set_gathered_selection", False, ours), p, q)
                          + " (the median a pass for every digit)")
                    print(switch_ab(p, q, "set_gathered_selection", args.target_s))
                if batched:
                    print(floors(p, q))
                if batched and b > torch.cuda.get_device_properties(dev).multi_processor_count:
                    print(switch_ab(p, q, "set_two_blocks_per_sm", args.target_s))
                # the tiled distances: more than 64 points, outside the fused kernel's small regime
                if 2 * n > 64 and not (2 * n <= 512 and 2 * n * d <= 6144):
                    print(switch_ab(p, q, "set_tile_subblocks", args.target_s))
                    if 2 * n <= 512:  # few tile pairs (up to 8 tiles): pair_tile_kernel's ranges by cost
                        print(switch_ab(p, q, "set_balanced_tile_ranges", args.target_s))
                    print(switch_ab(p, q, "set_product_tile_distances", args.target_s))
                if 2 * n <= 256 and 2 * n * d > 6144 and d >= 2 * n:  # the pair distances by cuBLAS
                    print(switch_ab(p, q, "set_gemm_pair_distances", args.target_s))
                if d + 1 >= 2 * n and n * 2 * n <= 2**16:  # the weight state's backward kernel
                    print(switch_ab(p, q, "set_paired_weight_dims", args.target_s))
                    print(switch_ab(p, q, "set_weight_kernel", args.target_s))
                if not batched and 2 * n > 512:  # the generic path: its CUDA kernels or ATen's launches
                    print(switch_ab(p, q, "set_generic_kernels", args.target_s))
                    print(switch_ab(p, q, "set_gemm_kernel_values", args.target_s))
                    if n * (2 * n - 1) >= 2**16:  # median.cu's median of the pairs, with its gather or not
                        print(switch_ab(p, q, "set_gathered_selection", args.target_s))
        return 0
    impls, pure = dict(cpu_bench.IMPLS), tuple(cpu_bench.PURE)
    compiled = cpu_bench.compiled_sides(cpu_bench.PURE, mode=args.compile_mode) if args.compiled else {}
    if args.compiled:  # ours under the same compile too (with reduce-overhead, CUDA graphs): like for like
        # (not fullgraph: a break, which would cost ours time, is timed rather than leaving ours out)
        compiled["ours_compiled"] = torch.compile(cpu_bench.IMPLS["ours"], dynamic=False, mode=args.compile_mode)
    rows = []
    for shape in args.shapes:
        b, n, d, batched = cpu_bench.parse_shape(shape)
        for dtype_name in args.dtypes:
            p, q = (t.to(dev) for t in cpu_bench.make_inputs(b, n, d, batched, cpu_bench.DTYPES[dtype_name]))
            for backward in backwards:
                run_compiled = cpu_bench.compiled_for(compiled, p, q, backward)  # (failures left out, and said so)
                run_impls = run_graphed = None  # (the last cell's graphs and their memory freed first)
                try:
                    run_graphed = graphed_for(impls, p, q, backward) if args.graphed else {}
                except CaptureFailed as err:
                    print(f"bench/gpu.py: {err}; stopped here (the rows before are saved)", flush=True)
                    return 3
                run_impls = {**impls, **run_compiled, **run_graphed}
                run_pure = pure + tuple(run_compiled) + tuple(run_graphed)
                like = ()
                for mine, others in (("ours_compiled", run_compiled), ("ours_graphed", run_graphed)):
                    if mine in others:  # each pure side against ours run the same way
                        like += tuple((k, mine) for k in others if k != mine)
                t = time_sides(run_impls, run_pure, p, q, backward, args.target_s, like)
                row = {"shape": cpu_bench.shape_name(b, n, d, batched), "dtype": dtype_name,
                       "pass": "fwd+bwd" if backward else "fwd"}
                for name in run_impls:
                    row[name + "_s"] = t[name]
                    if backward and not isinstance(run_impls[name], Graphed):  # (a replay allocates nothing)
                        row[name + "_mb"] = peak_mb(run_impls[name], p, q)
                for name in run_pure:
                    row[name + "_ratio"] = t[name + "_ratio"]
                for a_name, b_name in like:
                    row[f"{a_name}_vs_{b_name}"] = t[f"{a_name}_vs_{b_name}"]
                rows.append(row)
                save_json(args.json, info, rows)  # after each row: a run cut off keeps what it timed
                print(f"{row['shape']:>14} {dtype_name:8} {row['pass']:8} "
                      + "  ".join(f"{k} {t[k] * 1e3:8.3f} ms" for k in run_impls)
                      + "  " + "  ".join(f"{k}/ours {t[k + '_ratio']:5.2f}" for k in run_pure)
                      + "".join(f"  {a}/{b} {t[f'{a}_vs_{b}']:5.2f}" for a, b in like)
                      + ("  peak MB " + " / ".join(f"{row[k + '_mb']:.1f}" for k in run_impls if k + "_mb" in row)
                         if backward else ""),
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
