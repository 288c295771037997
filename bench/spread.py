"""The spread of strong/ours, fast/ours and ours' roofline fraction over several runs of bench/run.py.

    python bench/spread.py bench/results.json run2.json run3.json [--dtype float32]

This VM is shared and its speed drifts by tens of percent from minute to minute, so one run's ratio
can sit well above or below another's; bench/README.md reports the minimum / median / maximum over the
runs, printed here as a markdown table, with ours' own time (median over the runs' medians).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bounds import read_run  # noqa: E402


def _spread(values, fmt):
    if not values:
        return "-"
    return " / ".join(format(x, fmt) for x in (min(values), statistics.median(values), max(values)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="JSON files written by bench/run.py --json")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args(argv)
    cells: dict[tuple, list[dict]] = {}
    loads = []
    for path in args.runs:
        run = read_run(path)
        loads.append((run.get("load_average", [[None], [None]]), run.get("idle_fraction_before")))
        for row in run["results"]:
            if row["dtype"] == args.dtype and row.get("ours_s") is not None:
                cells.setdefault((row["shape"], row["threads"], row["pass"]), []).append(row)
    print(f"{len(args.runs)} runs, {args.dtype}; per run, the CPUs idle just before it and the 1-minute load "
          "average at its start and end: "
          + ", ".join(("?" if idle is None else f"{100 * idle:.0f}% idle") + f", {a[0]:.2f} -> {b[0]:.2f}"
                      for (a, b), idle in loads))
    print()
    print("| shape | thr | pass | runs | ours ms (median) | strong/ours min / median / max | "
          "fast/ours min / median / max | ours % roofline min / median / max |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for (shape, threads, pass_), rows in cells.items():
        ours = statistics.median(r["ours_s"] for r in rows) * 1e3
        strong = [r["strong_ratio"] for r in rows if r.get("strong_ratio") is not None]
        fast = [r["fast_ratio"] for r in rows if r.get("fast_ratio") is not None]
        fracs = [100 * r["roofline_frac"] for r in rows if r.get("roofline_frac") is not None]
        print(f"| {shape} | {threads} | {pass_} | {len(rows)} | {ours:.3g} | {_spread(strong, '.2f')} | "
              f"{_spread(fast, '.2f')} | {_spread(fracs, '.0f')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
