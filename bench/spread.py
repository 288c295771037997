"""The spread of pure/ours and of the roofline fraction over several runs of bench/run.py.

    python bench/spread.py bench/results.json run2.json run3.json [--dtype float32]

This VM's speed drifts by tens of percent from minute to minute, so one run's ratio can sit well
above or below another's; bench/README.md reports the minimum / median / maximum over the runs of
one session, printed here as its markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="JSON files written by bench/run.py --json")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args(argv)
    cells: dict[tuple, list[dict]] = {}
    for path in args.runs:
        with open(path) as f:
            for row in json.load(f)["results"]:
                if row["dtype"] == args.dtype and row.get("ratio") is not None:
                    cells.setdefault((row["shape"], row["threads"], row["pass"]), []).append(row)
    print("| shape | thr | pass | runs | pure/ours min / median / max | ours % roofline min / median / max |")
    print("|---|---|---|---:|---:|---:|")
    for (shape, threads, pass_), rows in cells.items():
        ratios = [r["ratio"] for r in rows]
        fracs = [100 * r["roofline_frac"] for r in rows if r.get("roofline_frac") is not None]
        spread = lambda v, f: " / ".join(format(x, f) for x in (min(v), statistics.median(v), max(v)))  # noqa: E731
        print(f"| {shape} | {threads} | {pass_} | {len(rows)} | {spread(ratios, '.2f')} | "
              f"{spread(fracs, '.0f') if fracs else '-'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
