"""How far float64 products let ours go: the ceiling on strong/ours, fast/ours and "% of roofline".

    python bench/bounds.py bench/results.json [run2.json ...] [--dtype float32] [--threads 1]

Ours keeps every product of the samples in float64 (the accuracy contract: bench/precision.py shows
that a float32 Gram is what takes the fast side outside 1e-3). However well ours is written, a call
then does at least these float64 multiply-adds, at most at the float64 GEMM rate measured in the same
run (with N = n_p + n_q, all times B):

    Gram, upper triangle       N (N + 1) / 2 d
    backward product W [q; p]  n_q N d                (forward+backward only)

plus the n x n part (Cholesky and solves) at the float32 rate and the bytes at the read bandwidth, as
bench/roofline.py charges them. The "float64 floor" is that time (the max of the compute and the
memory time); the "f32 backward" column lets the backward product run at the float32 rate (the one
float32 step that bench/precision.py finds inside the contract, the strong side's choice), the Gram
still in float64 (float32 inputs only). The rates are the best of five large GEMMs in the same run, so
a call can beat the floor by a few percent on this VM; it is a count, not a proof.

Per shape, from each run's own rates and medians (the median over the runs, with the range):
  - ours / floor: the floor time over ours, how close ours is to it (100%: at the floor);
  - max strong/ours, max fast/ours: that side's time over the floor, the best ratio float64 products
    allow against it as it ran; "f32 bwd": the same floor with the backward's product in float32;
  - max % roofline: the roofline time over the floor, the highest "ours % roofline" float64 products
    allow (the roofline charges the full Gram at the float32 rate).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from roofline import work  # noqa: E402


def floor_s(row: dict, rates: dict, backward_rate_key: str = "gemm_gflops_float64") -> float:
    """The float64-products floor of one benchmark row (seconds), see the module docstring."""
    b, n, d = row["B"], row["n"], row["d"]
    n_q = n_p = n
    total = n_q + n_p
    backward = row["pass"] == "fwd+bwd"
    gram = total * (total + 1) * d  # flops: 2 x the multiply-adds of the upper triangle
    product = 2.0 * n_q * total * d if backward else 0.0
    w = work(b, n_q, n_p, d, 4 if row["dtype"] == "float32" else 8, backward)
    compute = (b * gram / (rates["gemm_gflops_float64"] * 1e9) + b * product / (rates[backward_rate_key] * 1e9)
               + w["nxn_flops"] / (rates["gemm_gflops_float32"] * 1e9))
    return max(compute, w["bytes"] / (rates["read_gbs"] * 1e9))


def bounds(run: dict, dtype: str, threads: int) -> dict[tuple[str, str], dict]:
    """Per (shape, pass): ours / floor, the ratio ceilings and the roofline ceiling of one run."""
    if "roofline_rates" not in run:
        raise SystemExit("a run without roofline_rates: not written by this bench/run.py")
    out = {}
    for row in run["results"]:
        if row["dtype"] != dtype or row["threads"] != threads or row.get("ours_s") is None:
            continue
        rates = run["roofline_rates"][str(threads)]
        f64 = floor_s(row, rates)
        f32_bwd = floor_s(row, rates, "gemm_gflops_float32") if dtype == "float32" else float("nan")
        out[(row["shape"], row["pass"])] = {
            "ours_over_floor": f64 / row["ours_s"],
            "max_strong": row["strong_s"] / f64 if row.get("strong_s") else float("nan"),
            "max_fast": row["fast_s"] / f64 if row.get("fast_s") else float("nan"),
            "max_fast_f32_bwd": row["fast_s"] / f32_bwd if row.get("fast_s") else float("nan"),
            "max_roofline": row["roofline_s"] / f64,
            "strong_ratio": row.get("strong_ratio") or float("nan"),
            "fast_ratio": row.get("fast_ratio") or float("nan"),
            "roofline": row["roofline_frac"],
            "floor_ms": 1e3 * f64,
            "ours_ms": 1e3 * row["ours_s"],
        }
    return out


def spread(values: list[float], fmt: str) -> str:
    if len(values) == 1:
        return format(values[0], fmt)
    return f"{format(statistics.median(values), fmt)} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def read_run(path: str) -> dict:
    """A JSON file of bench/run.py --json, or SystemExit naming it (missing, unreadable, not such JSON)."""
    try:
        with open(path) as f:
            run = json.load(f)
    except (OSError, ValueError) as err:
        raise SystemExit(f"{path}: not a JSON file of bench/run.py --json ({err})") from None
    if not isinstance(run, dict) or not isinstance(run.get("results"), list):
        raise SystemExit(f"{path}: not a JSON file of bench/run.py --json (no results list)")
    return run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="JSON files written by bench/run.py --json")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    per_run = []
    for path in args.runs:
        per_run.append(bounds(read_run(path), args.dtype, args.threads))
    keys = [k for k in per_run[0] if all(k in r for r in per_run)]
    if not keys:
        raise SystemExit(f"no {args.dtype} rows at {args.threads} thread(s) common to all the runs given")
    print(f"{args.dtype}, {args.threads} thread(s), {len(per_run)} run(s): median (range)\n")
    print("| shape | pass | strong/ours | max strong/ours | fast/ours | max fast/ours | max, f32 bwd | ours ms | "
          "floor ms | ours / floor | ours % roofline | max % roofline |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for key in keys:
        cell = lambda name, fmt, scale=1.0: spread([scale * r[key][name] for r in per_run], fmt)  # noqa: E731
        print(f"| {key[0]} | {key[1]} | {cell('strong_ratio', '.2f')} | {cell('max_strong', '.2f')} | "
              f"{cell('fast_ratio', '.2f')} | {cell('max_fast', '.2f')} | {cell('max_fast_f32_bwd', '.2f')} | "
              f"{cell('ours_ms', '.3g')} | {cell('floor_ms', '.3g')} | {cell('ours_over_floor', '.0f', 100)}% | "
              f"{cell('roofline', '.0f', 100)}% | {cell('max_roofline', '.0f', 100)}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
