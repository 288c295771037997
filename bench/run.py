"""Benchmark: kivi_fast.kernel_kl ("ours") against two pure-PyTorch KIVI KLs (bench/pure_torch.py).

"strong" is the fastest pure PyTorch that meets kivi_fast's accuracy contract (float32 results within
1e-3 of float64, bench/precision.py), "fast" the fastest in float32, which misses it on some inputs.

    python bench/run.py                      # the full table (~7 min on 2 quiet cores)
    python bench/run.py --quick              # a fast subset
    python bench/run.py --markdown --json bench/results.json
    python bench/run.py --shapes 100x8,128x100x8 --dtypes float32 --threads 1
    python bench/run.py --dtypes float32 --threads 1 --no-memory --compiled   # and both sides compiled

Shapes are n x d (n_p = n_q = n) or B x n x d. For each shape, dtype and thread count it times the
forward and the forward+backward (gradient w.r.t. q_z) of the three implementations, called in turn
(ours, strong, fast, ours, ...): warm-up, then the median of an adaptive number of repetitions (about
--target-s seconds each), and each pure side's ratio to ours as the median over repetitions of the
ratio of neighbouring calls. Peak memory comes from a fresh subprocess per (implementation, shape,
dtype): the RSS high-water mark of one forward+backward minus the RSS after imports and input
creation, for the first call (one-time allocations included: BLAS buffers, our per-thread scratch)
and for the next one (what every later step of a loop costs). The roofline (bench/roofline.py) uses
this machine's GEMM GFLOP/s and memory read GB/s measured in the same run. See bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
import warnings

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
try:
    import kivi_fast  # noqa: F401
except ImportError:  # not installed: run from the checkout
    sys.path.insert(0, ROOT)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import kivi_fast
    from kivi_fast import reference
sys.path.insert(0, HERE)
import pure_torch  # noqa: E402
import roofline  # noqa: E402

# The shapes, plus 100x51: the second layer of the UCI Boston BNN (51 x 1 weights).
DEFAULT_SHAPES = "10x314000,100x700,100x51,100x8,128x100x8,1000x32,2000x32,100x50000"
QUICK_SHAPES = "100x8,128x100x8,100x700,1000x32"
DTYPES = {"float32": torch.float32, "float64": torch.float64}
LAM = 1e-3


def parse_shape(s: str) -> tuple[int, int, int, bool]:
    """'n x d' -> (1, n, d, False); 'B x n x d' -> (B, n, d, True); a ValueError for anything else."""
    try:
        parts = [int(v) for v in s.lower().split("x")]
    except ValueError:
        parts = []
    if len(parts) in (2, 3) and min(parts) > 0:
        return (1, *parts, False) if len(parts) == 2 else (*parts, True)
    raise ValueError(f"a shape is NxD or BxNxD, of positive whole numbers; got {s!r}")


def shape_arg(text: str) -> str:
    """An argparse type: one shape (parse_shape's), checked."""
    try:
        parse_shape(text.strip())
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text.strip()


def shapes_arg(text: str) -> list[str]:
    """An argparse type: comma-separated shapes (parse_shape's), checked."""
    shapes = [shape_arg(s) for s in text.split(",") if s.strip()]
    if not shapes:
        raise argparse.ArgumentTypeError("expected comma-separated NxD or BxNxD shapes, got none")
    return shapes


def dtypes_arg(text: str) -> list[str]:
    """An argparse type: comma-separated names of DTYPES."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in names if s not in DTYPES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"expected comma-separated dtypes of {', '.join(DTYPES)}; got {text!r}")
    return names


def shape_name(b: int, n: int, d: int, batched: bool) -> str:
    return f"{b}x({n}, {d})" if batched else f"({n}, {d})"


def make_inputs(b, n, d, batched, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    lead = (b,) if batched else ()
    p = torch.randn(*lead, n, d, generator=g, dtype=torch.float64).to(dtype)
    q = (0.8 * torch.randn(*lead, n, d, generator=g, dtype=torch.float64) + 0.3).to(dtype)
    return p, q


def ours_kl(p, q):
    return kivi_fast.kernel_kl(p, q, LAM)


def strong_kl(p, q):
    return pure_torch.kl(p, q, LAM, side="strong")


def fast_kl(p, q):
    return pure_torch.kl(p, q, LAM, side="fast")


IMPLS = {"ours": ours_kl, "strong": strong_kl, "fast": fast_kl}
PURE = ("strong", "fast")


def compiled_sides(sides, mode: str | None = None) -> dict:
    """Each pure side under torch.compile (``mode``: torch.compile's), as "<side>_compiled": one graph a
    call (fullgraph: a break raises rather than timing a split graph), a graph per shape, dtype, pass
    and thread count (the recompile limit raised so that no cell falls back to eager unseen)."""
    torch._dynamo.config.recompile_limit = 4096
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\._inductor")  # inductor's own deprecations
    return {name + "_compiled": torch.compile(IMPLS[name], dynamic=False, mode=mode, fullgraph=True) for name in sides}


def compiled_for(compiled: dict, p, q, backward: bool) -> dict:
    """The compiled sides that compile and run for these inputs, each called three times (its compile
    and warm-up, outside any timing: with mode="reduce-overhead" the CUDA graph is recorded on a later
    call than the first, and an op that a capture refuses fails there); a side that fails is left out
    of the cell, and said so."""
    ok = {}
    for name, fn in compiled.items():
        try:
            for _ in range(3):
                call(fn, p, q, backward)
        except Exception as err:  # noqa: BLE001
            print(f"  {name} left out: {type(err).__name__}: {str(err).strip().splitlines()[-1][:160]}")
            continue
        ok[name] = fn
    return ok


def call(fn, p, q, backward: bool):
    if backward:
        q = q.detach().requires_grad_(True)
        out = fn(p, q)
        (g,) = torch.autograd.grad(out.sum(), q)
        return out, g
    return fn(p, q), None


def reference_bytes(b, n, d) -> float:
    """The reference backend materializes [B, N, N, d] float64 differences (twice, for pow)."""
    return 2.0 * b * (2 * n) ** 2 * d * 8


def ours_runnable(b, n, d, max_ref_gb: float) -> bool:
    return kivi_fast.backend() != "reference" or reference_bytes(b, n, d) <= max_ref_gb * 1e9


# ---------------------------------------------------------------------------------------------------
# Self-check: both implementations agree with the oracle on small shapes (value and gradient).

def self_check(check_ours: bool, compiled: dict | None = None) -> None:
    """Each side against kivi_fast.reference.kernel_kl, value and gradient (relative, 2-norm for the gradient):
    float64 to 1e-8; float32 to 1e-3 (the contract) for ours and strong, to 1e-2 for fast, which is not
    held to the contract (bench/precision.py counts its misses). The compiled sides (compiled_sides) on
    the float32 cases whose graphs differ most from eager (batched; above 256 rows; tall)."""
    cases = [(1, 30, 5, False), (3, 12, 4, True), (1, 20, 300, False), (1, 100, 8, False), (1, 300, 6, False),
             (1, 10, 9000, False)]  # (300, 6): above 256 rows and the sampled median; (10, 9000): tall
    for dtype in (torch.float64, torch.float32):
        for b, n, d, batched in cases:
            p, q = make_inputs(b, n, d, batched, dtype, seed=1)
            want, want_g = call(lambda p_, q_: reference.kernel_kl(p_, q_, LAM), p, q, True)
            sides = dict(IMPLS)
            if compiled and dtype == torch.float32 and (batched or n > 256 or d >= pure_torch._TALL_D):
                sides.update(compiled)
            for name, fn in sides.items():
                if name == "ours" and not check_ours:
                    continue
                rtol = 1e-8 if dtype == torch.float64 else (1e-2 if name.startswith("fast") else 1e-3)
                got, got_g = call(fn, p, q, True)
                what = f"{name} vs kivi_fast.reference.kernel_kl on {shape_name(b, n, d, batched)} {dtype}"
                assert got.dtype == dtype and got_g.dtype == dtype, what + ": dtype"
                err = ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()
                gerr = ((got_g.double() - want_g.double()).norm() / want_g.double().norm()).item()
                assert err <= rtol, f"{what}: value relative error {err:.3g} > {rtol}"
                assert gerr <= rtol, f"{what}: gradient relative error {gerr:.3g} > {rtol}"


# ---------------------------------------------------------------------------------------------------
# Timing.

def time_calls(fns: dict, p, q, backward: bool, target_s: float, min_reps: int = 5, max_reps: int = 2000,
               pure=PURE):
    """(median, minimum wall time in s, repetitions) of each fn, after warm-up, and under "<name>_ratio"
    for each pure side the median over repetitions of its time over ours in the same repetition.

    The implementations are called in turn, call by call, so that a change of load on a shared machine
    hits all alike; the ratio of neighbouring calls is what such a change disturbs least (this VM's
    speed drifts by tens of percent between minutes). Repetitions go on until ~target_s per
    implementation have elapsed.
    """
    first = {}
    for name, fn in fns.items():
        t0 = time.perf_counter()
        call(fn, p, q, backward)
        first[name] = time.perf_counter() - t0
        if first[name] < target_s / 4:  # a second warm-up when it is cheap
            call(fn, p, q, backward)
    if max(first.values(), default=0.0) > target_s:
        min_reps = 3
    times = {name: [] for name in fns}
    start = time.perf_counter()
    while True:
        for name, fn in fns.items():
            t0 = time.perf_counter()
            call(fn, p, q, backward)
            times[name].append(time.perf_counter() - t0)
        reps = len(next(iter(times.values()), []))
        if reps >= max_reps or (reps >= min_reps and time.perf_counter() - start >= target_s * len(fns)):
            break
    out = {name: (statistics.median(ts), min(ts), len(ts)) for name, ts in times.items()}
    for name in pure:
        if name in times and "ours" in times:
            out[name + "_ratio"] = statistics.median(a / b for a, b in zip(times[name], times["ours"]))
    return out


# ---------------------------------------------------------------------------------------------------
# Peak memory, in a fresh subprocess.

def _proc_status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def _mem_child(impl: str, shape: str, dtype: str) -> None:
    torch.set_num_threads(1)
    b, n, d, batched = parse_shape(shape)
    fn = IMPLS[impl]
    # Initialize lazy state (library, thread pools, BLAS buffers) on a tiny problem first.
    tp, tq = make_inputs(2, 6, 3, True, DTYPES[dtype], seed=2)
    call(fn, tp, tq, True)
    call(fn, tp[0], tq[0], True)
    p, q = make_inputs(b, n, d, batched, DTYPES[dtype])
    deltas, reset = [], True
    for _ in range(2):  # the first call, then the next one (what each step of a training loop sees)
        base = _proc_status_kb("VmRSS")
        try:  # reset the high-water mark to the current RSS (Linux >= 4.0)
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            reset = False
        call(fn, p, q, True)
        deltas.append((_proc_status_kb("VmHWM") - base) / 1024.0)
    print(json.dumps({"peak_delta_mb": deltas[0], "next_call_peak_delta_mb": deltas[1], "hwm_reset": reset}))


def peak_memory_mb(impl: str, shape: str, dtype: str) -> tuple[float, float] | None:
    """(first call, next call) peak RSS increase in MB, or None if the subprocess failed."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--_mem", impl, shape, dtype],
                          capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0:
        print(f"  peak memory of {impl} {shape} {dtype} failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
        return None
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return out["peak_delta_mb"], out["next_call_peak_delta_mb"]


# ---------------------------------------------------------------------------------------------------
# Machine description.

def idle_fraction(seconds: float = 2.0) -> float | None:
    """The fraction of all CPUs' time spent idle over ``seconds`` (/proc/stat): what other jobs leave
    free just before the run (the load average also counts this benchmark's own previous runs)."""
    def snap():
        with open("/proc/stat") as f:
            vals = [int(v) for v in f.readline().split()[1:]]
        return vals[3] + vals[4], sum(vals)  # idle + iowait, total
    try:
        i0, t0 = snap()
        time.sleep(seconds)
        i1, t1 = snap()
    except OSError:
        return None
    return (i1 - i0) / max(t1 - t0, 1)


def machine_info() -> dict:
    model, cores_per_socket, sockets = platform.processor() or "?", None, set()
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, val = line.partition(":")
                key, val = key.strip(), val.strip()
                if key == "model name":
                    model = val
                elif key == "cpu cores":
                    cores_per_socket = int(val)
                elif key == "physical id":
                    sockets.add(val)
                elif key == "flags" and not flags:
                    flags = val
    except OSError:
        pass
    blas = re.findall(r"(?:BLAS|LAPACK)_INFO=\w+", torch.__config__.show())
    return {
        "cpu": model,
        "logical_cpus": os.cpu_count(),
        "physical_cores": cores_per_socket * max(len(sockets), 1) if cores_per_socket else None,
        "avx512": "avx512f" in flags.split(),
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "blas": "; ".join(blas),
        "mkl": torch.backends.mkl.is_available(),
        "python": platform.python_version(),
        "kivi_fast_backend": kivi_fast.backend(),
    }


# ---------------------------------------------------------------------------------------------------
# Table.

def _fmt_ms(s):
    return "-" if s is None else (f"{s * 1e3:.3g}" if s * 1e3 < 100 else f"{s * 1e3:.0f}")


def _fmt(v, spec):
    return "-" if v is None else format(v, spec)


def table(rows: list[dict], markdown: bool) -> str:
    head = ["shape", "dtype", "thr", "pass", "ours ms", "strong ms", "fast ms", "strong/ours", "fast/ours",
            "roofline ms", "ours % roofline", "MB ours / strong / fast"]

    def mb(r):  # first call / next call of each side
        cells = [r.get(f"{k}_mb") for k in IMPLS]
        if all(c is None for c in cells):
            return "-"
        return " / ".join("-" if c is None else f"{c[0]:.1f} ({c[1]:.1f})" for c in cells)

    body = []
    for r in rows:
        body.append([r["shape"], r["dtype"], str(r["threads"]), r["pass"], _fmt_ms(r["ours_s"]),
                     _fmt_ms(r["strong_s"]), _fmt_ms(r["fast_s"]), _fmt(r["strong_ratio"], ".2f"),
                     _fmt(r["fast_ratio"], ".2f"), _fmt_ms(r["roofline_s"]),
                     _fmt(None if r["roofline_frac"] is None else 100 * r["roofline_frac"], ".1f"), mb(r)])
    return _render(head, body, markdown)


def _render(head: list[str], body: list[list[str]], markdown: bool, names: int = 4) -> str:
    """A table as markdown or as aligned text; its first ``names`` columns name the cell (left-aligned)."""
    if markdown:
        lines = ["| " + " | ".join(head) + " |",
                 "|" + "|".join("---" if i < names else "---:" for i in range(len(head))) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in body]
        return "\n".join(lines)
    widths = [max(len(h), *(len(row[i]) for row in body)) if body else len(h) for i, h in enumerate(head)]
    fmt = lambda row: "  ".join(c.ljust(w) if i < names else c.rjust(w)  # noqa: E731
                                for i, (c, w) in enumerate(zip(row, widths)))
    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(row) for row in body])


def compiled_table(rows: list[dict], names: list[str], markdown: bool) -> str:
    """Each compiled side's median ms and x/ours, beside its eager self's."""
    head = ["shape", "dtype", "thr", "pass"] + [h for k in names for h in (f"{k} ms", f"{k}/ours", f"eager/{k}")]
    body = []
    for r in rows:
        cells = []
        for k in names:
            eager, mine = r[k.removesuffix("_compiled") + "_s"], r[k + "_s"]  # (None: not run, or left out)
            cells += [_fmt_ms(mine), _fmt(r[k + "_ratio"], ".2f"),
                      _fmt(None if eager is None or mine is None else eager / mine, ".2f")]
        body.append([r["shape"], r["dtype"], str(r["threads"]), r["pass"]] + cells)
    return _render(head, body, markdown)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", type=shapes_arg, default=None,
                    help=f"comma-separated NxD or BxNxD (default {DEFAULT_SHAPES})")
    ap.add_argument("--dtypes", type=dtypes_arg, default="float32,float64", help="comma-separated float32, float64")
    ap.add_argument("--threads", default=None, help="comma-separated thread counts (default 1,2 capped at the CPUs)")
    ap.add_argument("--quick", action="store_true", help=f"shapes {QUICK_SHAPES}, shorter timing, smaller probes")
    ap.add_argument("--target-s", type=float, default=None, help="seconds per timing (default 1.0, --quick 0.3)")
    ap.add_argument("--markdown", action="store_true", help="print the table as markdown")
    ap.add_argument("--json", metavar="PATH", help="save machine, rates and results as JSON")
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    ap.add_argument("--no-check", action="store_true", help="skip the start-up agreement check")
    ap.add_argument("--max-ref-gb", type=float, default=3.0,
                    help="on the reference backend, skip 'ours' where it would materialize more than this")
    ap.add_argument("--sides", default="strong,fast", help="pure sides to time beside ours (default strong,fast)")
    ap.add_argument("--compiled", action="store_true",
                    help="also time each side under torch.compile (not its memory): the compiled table after the main one")
    ap.add_argument("--_mem", nargs=3, metavar=("IMPL", "SHAPE", "DTYPE"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args._mem:
        _mem_child(*args._mem)
        return 0

    shapes = args.shapes or shapes_arg(QUICK_SHAPES if args.quick else DEFAULT_SHAPES)
    dtypes = args.dtypes
    ncpu = os.cpu_count() or 1
    threads = [int(t) for t in args.threads.split(",")] if args.threads else sorted({1, min(2, ncpu)})
    target_s = args.target_s if args.target_s is not None else (0.3 if args.quick else 1.0)

    info = machine_info()
    idle0 = idle_fraction()
    load0 = os.getloadavg()
    print(f"kivi_fast backend (ours): {info['kivi_fast_backend']}")
    print(f"machine: {info['cpu']}, {info['logical_cpus']} logical CPUs, torch {info['torch']}, "
          f"ISA {info['cpu_capability']}, load average {load0[0]:.2f}, CPUs idle over the last 2 s: "
          + ("?" if idle0 is None else f"{100 * idle0:.0f}%"))
    if info["kivi_fast_backend"] == "reference":
        print("WARNING: the compiled ops are not built; 'ours' is the pure-PyTorch reference (kivi_fast/reference.py)")

    sides = [x.strip() for x in args.sides.split(",") if x.strip()]
    unknown = set(sides) - set(PURE)
    if unknown:
        ap.error(f"--sides: unknown {sorted(unknown)}; known: {', '.join(PURE)}")
    compiled = compiled_sides(sides) if args.compiled else {}

    if not args.no_check:
        t0 = time.perf_counter()
        self_check(check_ours=True, compiled=compiled)
        print(f"self-check passed: {', '.join([*IMPLS, *compiled])} agree with kivi_fast.reference.kernel_kl (value and "
              f"gradient; float64 1e-8, float32 1e-3 (fast 1e-2) relative) [{time.perf_counter() - t0:.1f} s]")

    rates = {}
    for t in threads:
        rates[t] = roofline.machine_rates(t, mem_bytes=(256 << 20) if args.quick else (1 << 30))
        r = rates[t]
        print(f"machine limits at {t} thread(s): GEMM float32 {r['gemm_gflops_float32']:.1f} GFLOP/s, "
              f"float64 {r['gemm_gflops_float64']:.1f} GFLOP/s, memory read {r['read_gbs']:.1f} GB/s")

    # The roofline uses, per thread count t, the best rate seen at any count <= t (t threads can do at
    # least what fewer do; on a shared machine a depressed measurement would flatter the fraction).
    roof_rates = {}
    for t in threads:
        lower = [rates[u] for u in threads if u <= t]
        roof_rates[t] = {k: max(r[k] for r in lower) for k in rates[t] if k != "threads"}

    mem = {}
    if not args.no_memory:
        t0 = time.perf_counter()
        for shape in shapes:
            b, n, d, _ = parse_shape(shape)
            for dt in dtypes:
                for name in ["ours"] + sides:
                    if name != "ours" or ours_runnable(b, n, d, args.max_ref_gb):
                        mem[(name, shape, dt)] = peak_memory_mb(name, shape, dt)
        print(f"peak memory measured in {len(mem)} subprocesses [{time.perf_counter() - t0:.1f} s]")

    rows = []
    t_start = time.perf_counter()
    prev_threads = torch.get_num_threads()
    for shape in shapes:
        b, n, d, batched = parse_shape(shape)
        name = shape_name(b, n, d, batched)
        for dt in dtypes:
            dtype = DTYPES[dt]
            p, q = make_inputs(b, n, d, batched, dtype)
            run_ours = ours_runnable(b, n, d, args.max_ref_gb)
            for t in threads:
                torch.set_num_threads(t)
                for backward in (False, True):
                    fns = {k: IMPLS[k] for k in ["ours"] + sides if k != "ours" or run_ours}
                    fns.update(compiled_for(compiled, p, q, backward))
                    res = time_calls(fns, p, q, backward, target_s, pure=PURE + tuple(compiled))
                    w = roofline.work(b, n, n, d, p.element_size(), backward)
                    roof = roofline.roofline_s(w, roof_rates[t], dtype)
                    row = {
                        "shape": name, "B": b, "n": n, "d": d, "batched": batched, "dtype": dt, "threads": t,
                        "pass": "fwd+bwd" if backward else "fwd", "load_average_1min": os.getloadavg()[0],
                    }
                    for k in [*IMPLS, *compiled]:
                        med, best, reps = res.get(k, (None, None, 0))
                        row[f"{k}_s"], row[f"{k}_min_s"], row[f"{k}_reps"] = med, best, reps
                        row[f"{k}_mb"] = mem.get((k, shape, dt))  # (compiled sides: not measured)
                    for k in PURE + tuple(compiled):
                        row[f"{k}_ratio"] = res.get(f"{k}_ratio")
                        row[f"{k}_ratio_of_medians"] = (None if row["ours_s"] is None or row[f"{k}_s"] is None
                                                        else row[f"{k}_s"] / row["ours_s"])
                        row[f"{k}_roofline_frac"] = None if row[f"{k}_s"] is None else roof / row[f"{k}_s"]
                    row["roofline_s"] = roof
                    row["roofline_frac"] = None if row["ours_s"] is None else roof / row["ours_s"]
                    row.update(w)
                    rows.append(row)
                    print(f"  {name:>16} {dt} {t} thr {row['pass']:>7}: "
                          + ", ".join(f"{k} {_fmt_ms(row[k + '_s'])} ms" for k in [*IMPLS, *compiled]
                                      if row[k + "_s"] is not None)
                          + ("" if run_ours else " (ours skipped: reference backend too big)"), flush=True)
    torch.set_num_threads(prev_threads)
    load1 = os.getloadavg()
    print(f"timings took {time.perf_counter() - t_start:.1f} s; load average {load0[0]:.2f} -> {load1[0]:.2f}")
    print()
    print(table(rows, args.markdown))
    print()
    if compiled:
        print(compiled_table(rows, list(compiled), args.markdown))
        print()
    # busy: other jobs held more than a quarter of the CPUs just before the run (the load average
    # would also count this benchmark's own previous run; during a run the benchmark itself keeps the
    # 1-minute average near 1-2). The load average at each row is in the JSON.
    busy = idle0 is not None and idle0 < 0.75
    if busy or info["kivi_fast_backend"] != "cpp":
        print("PRELIMINARY: " + "; ".join(
            ([f"the machine was busy ({100 * (1 - idle0):.0f}% of the CPUs taken by other jobs before the run; "
              f"load average {load0[0]:.2f} -> {load1[0]:.2f} on {ncpu} CPUs)"] if busy else [])
            + (["'ours' ran on the reference backend, not the compiled ops"] if info["kivi_fast_backend"] != "cpp" else [])))
    print(f"ours = kivi_fast.kernel_kl on the {info['kivi_fast_backend']} backend; strong, fast = bench/pure_torch.py's "
          "sides (strong meets the 1e-3 contract, fast is float32 throughout); ms = median wall time; "
          "x/ours = median over repetitions of the ratio of neighbouring calls (> 1: ours is faster); "
          "MB = peak RSS increase of one forward+backward (1 thread), the first call in a fresh process "
          "(the next call); roofline = max(flops / GEMM rate, bytes / bandwidth) at the same thread count")

    if args.json:
        out = {"machine": info, "rates": {str(t): r for t, r in rates.items()},
               "roofline_rates": {str(t): r for t, r in roof_rates.items()}, "load_average": [load0, load1],
               "idle_fraction_before": idle0,
               "target_s": target_s, "lam": LAM, "preliminary": bool(busy or info["kivi_fast_backend"] != "cpp"),
               "argv": sys.argv[1:],
               "results": rows,
               "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"saved {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
