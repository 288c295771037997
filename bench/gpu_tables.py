"""The GPU section's tables (bench/README.md, "GPU") from the JSON of one ``scripts/gpu_check.sh`` run.

    python bench/gpu_tables.py runs/gpu_check          # the folder gpu_check.sh wrote (OUT_DIR)
    python bench/gpu_tables.py bench --markdown        # the committed JSON

For each float32 shape, forward + backward: each side at its strongest, eager, compiled or captured in
a CUDA graph, ours included, and each pure side's ratio to ours so. A shape that the compiled phase
timed (``cuda_compiled.json``) takes all its numbers from that run, where ours, the eager sides, the
compiled ones and the graphed ones were timed in turn in one process; the others come from the bench
phase (``cuda_results.json``), eager only. Ratios are the benches' own (medians of each round's
ratio) where both sides' best ran the same way, else the ratio of the two medians; "eager" is each
eager pure side over ours eager, and "compiled" each compiled pure side over ours compiled the same
way ("-" where one was left out). Peak MB is of
ours and the eager sides, from the bench phase where it timed the shape, else from the compiled
phase's run (a compiled or graphed side's would leave out the graphs' memory pool). Then the training steps (``train_steps.json``), when that file is there. The
float64 rows (``cuda_results64.json``) and the forward-alone rows are left to the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import run as cpu_bench  # bench/run.py: the tables' rendering

SIDES = ("strong", "fast")


def load(folder: str, name: str) -> dict | None:
    path = os.path.join(folder, name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def rows_by_shape(data: dict | None) -> dict:
    """{shape: row} of a bench JSON's float32 forward + backward rows."""
    if data is None:
        return {}
    return {r["shape"]: r for r in data["rows"] if r["dtype"] == "float32" and r["pass"] == "fwd+bwd"}


def strongest(row: dict, side: str) -> tuple[str, float]:
    """(how, seconds) of a side at its strongest in one row: eager, compiled or graphed."""
    options = [("eager", row[side + "_s"])]
    for way in ("compiled", "graphed"):
        if row.get(f"{side}_{way}_s") is not None:
            options.append((way, row[f"{side}_{way}_s"]))
    return min(options, key=lambda o: o[1])


def best_ratio(row: dict, side: str) -> float:
    """A pure side at its strongest over ours at its strongest: the bench's own ratio where both ran
    the same way, else the ratio of their medians."""
    (way, t), (ours_way, ours_t) = strongest(row, side), strongest(row, "ours")
    if way == ours_way:
        return row[f"{side}_ratio"] if way == "eager" else row[f"{side}_{way}_vs_ours_{way}"]
    return t / ours_t


def like_for_like(row: dict, way: str) -> str:
    """Each pure side run `way` (eager, compiled) over ours run the same way, "-" where one is missing."""
    if way == "eager":
        likes = [row.get(f"{s}_ratio") for s in SIDES]
    else:
        likes = [row.get(f"{s}_{way}_vs_ours_{way}") for s in SIDES]
    return "-" if all(v is None for v in likes) else " / ".join(cpu_bench._fmt(v, ".2f") for v in likes)


def at_best(row: dict, side: str) -> str:
    way, t = strongest(row, side)
    return cpu_bench._fmt_ms(t) + ("" if way == "eager" else f" ({way})")


def bench_table(bench: dict, compiled: dict, markdown: bool) -> str:
    head = ["shape", "dtype", "pass", "timed in", "ours at its best", "strong at its best", "fast at its best",
            "strong/ours", "fast/ours", "eager", "compiled", "peak MB ours / strong / fast"]
    body = []
    for shape, row in {**bench, **compiled}.items():
        peaks = bench.get(shape, row)
        mb = " / ".join(cpu_bench._fmt(peaks.get(k + "_mb"), ".1f") for k in ("ours",) + SIDES)
        body.append([shape, "float32", "fwd+bwd", "compiled phase" if shape in compiled else "bench phase"]
                    + [at_best(row, s) for s in ("ours",) + SIDES]
                    + [f"{best_ratio(row, s):.2f}" for s in SIDES]
                    + [like_for_like(row, "eager"), like_for_like(row, "compiled"), mb])
    return cpu_bench._render(head, body, markdown)


def steps_table(steps: dict, markdown: bool) -> str:
    head = ["step", "CUDA kernels ms", "KL ms (share)", "ATen kernels ms", "KL ms (share)", "eager ms",
            "CUDA graph ms", "graph + TF32 ms", "KL graphed alone ms (share)"]
    body = []
    for r in steps["rows"]:
        cells = ["-"] * 8
        if "cuda" in r:
            for i, k in enumerate(("cuda", "generic")):
                cells[2 * i] = cpu_bench._fmt_ms(r[k]["step_seconds"])
                cells[2 * i + 1] = f"{cpu_bench._fmt_ms(r[k]['kl_seconds'])} ({100 * r[k]['kl_share']:.0f}%)"
        if "eager" in r:
            cells[4:7] = [cpu_bench._fmt_ms(r.get(k)) for k in ("eager", "graph", "graph_tf32")]
        if "kl_graph" in r:
            cells[7] = f"{cpu_bench._fmt_ms(r['kl_graph'])} ({100 * r['kl_graph_share']:.0f}%)"
        body.append([r["case"]] + cells)
    return cpu_bench._render(head, body, markdown, names=1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", help="where gpu_check.sh wrote its JSON (its OUT_DIR), or bench/")
    ap.add_argument("--markdown", action="store_true", help="markdown tables")
    args = ap.parse_args(argv)
    bench, compiled = load(args.folder, "cuda_results.json"), load(args.folder, "cuda_compiled.json")
    steps = load(args.folder, "train_steps.json")
    if bench is None and compiled is None:
        print(f"bench/gpu_tables.py: no cuda_results.json or cuda_compiled.json in {args.folder}", file=sys.stderr)
        return 2
    devices = [d["device"] for d in (bench, compiled, steps) if d is not None]
    if any(d.get("gpu") != devices[0].get("gpu") for d in devices):  # (a lease's calls may get other GPUs)
        print(f"bench/gpu_tables.py: the files come from different GPUs: {[d.get('gpu') for d in devices]}",
              file=sys.stderr)
        return 2
    print(" ".join(f"{k}={v}" for k, v in devices[0].items()) + "\n")
    print(bench_table(rows_by_shape(bench), rows_by_shape(compiled), args.markdown))
    if steps is not None:
        print("\n" + steps_table(steps, args.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
