"""Collect ``kivi-fast uci`` run folders into a results folder and one table beside the paper.

    python -m kivi_fast.cli uci-report runs/uci-*            # -> results/uci/<dataset>-<method>/, TABLE.md

Each run folder is copied without its checkpoint and per-epoch histories (the test-metric curves every
``eval_every`` epochs stay), so the copies are small enough to commit; then every
``<dataset>-<method>/summary.json`` under the results folder goes into ``TABLE.md``: per dataset, our
methods (with the number of splits run) and the paper's Table 1 (KIVI, SVGD, Dropout) and appendix table
(Factorized, HMC), errors as standard errors over the splits.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path

from . import runs
from .uci import METHODS, PAPER_RESULTS

DATASET_ORDER = tuple(PAPER_RESULTS)
PAPER_METHODS = ("KIVI", "SVGD", "Dropout", "Factorized", "HMC")


def generator_init(summary: dict) -> str | None:
    """The posterior's initialization; summaries from before the setting existed used torch's."""
    if summary["method"] == "factorized":
        return None
    return summary.get("generator_init", "torch")


def result_name(summary: dict) -> str:
    """<dataset>-<method>, with -torchinit for runs whose generators had torch's initialization."""
    suffix = "-torchinit" if generator_init(summary) == "torch" else ""
    return f"{summary['dataset']}-{summary['method']}{suffix}"


def export_run(run_dir: Path, results_root: Path) -> Path | None:
    """Copy one run folder's results to ``results_root/<dataset>-<method>/``; None if it has no split yet."""
    split_files = sorted(run_dir.glob("split_*.json"))
    if not split_files or not (run_dir / "summary.json").exists():
        return None
    summary = json.loads((run_dir / "summary.json").read_text())
    dest = results_root / result_name(summary)
    if dest.exists():
        shutil.rmtree(dest)  # no stale file of an earlier export survives
    dest.mkdir(parents=True)
    splits = []
    for path in split_files:
        result = json.loads(path.read_text())
        history = result.pop("history", {})
        result["eval_history"] = {k: history.get(k, []) for k in ("eval_epoch", "rmse", "test_ll")}
        splits.append(result)
    runs.write_json(dest / "splits.json", splits)
    for name in ("summary.json", "config.json", "profile.json", "training.png"):
        if (run_dir / name).exists():
            shutil.copyfile(run_dir / name, dest / name)
    return dest


def _cell(mean: float, err: float, digits: int) -> str:
    return f"{mean:.{digits}f} ± {err:.{digits}f}" if not math.isnan(err) else f"{mean:.{digits}f}"


def table(results_root: Path) -> str:
    """Markdown: one block of rows per dataset, ours first, then the paper's."""
    summaries = {}
    for path in sorted(results_root.glob("*/summary.json")):
        s = json.loads(path.read_text())
        summaries[(s["dataset"], s["method"], generator_init(s) == "torch")] = s
    lines = ["| dataset | method | splits | epochs | test RMSE | test LL | s / epoch |",
             "|---|---|---|---|---|---|---|"]
    for dataset in DATASET_ORDER:
        ours = [summaries[(dataset, m, torch_init)] for m in METHODS for torch_init in (False, True)
                if (dataset, m, torch_init) in summaries]
        if not ours:
            continue
        digits = 4 if dataset == "naval" else 3
        for s in ours:
            label = s["method"] + (" (torch init)" if generator_init(s) == "torch" else "")
            lines.append(f"| {dataset} | **ours: {label}** | {s['n_splits']} | {s['epochs']} | "
                         f"{_cell(s['rmse']['mean'], s['rmse']['se'], digits)} | "
                         f"{_cell(s['test_ll']['mean'], s['test_ll']['se'], 3)} | {s['seconds_per_epoch']:.3f} |")
        for method in PAPER_METHODS:
            if method in PAPER_RESULTS[dataset]:
                rmse, rmse_err, ll, ll_err = PAPER_RESULTS[dataset][method]
                lines.append(f"| {dataset} | paper {method} | | | {_cell(rmse, rmse_err, digits)} | "
                             f"{_cell(ll, ll_err, 3)} | |")
    return "\n".join(lines) + "\n"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dirs", nargs="*", help="run folders of `kivi-fast uci` to export (none: only the table)")
    p.add_argument("--results", default="results/uci", help="results folder (default results/uci)")


def run(args) -> int:
    root = Path(args.results)
    root.mkdir(parents=True, exist_ok=True)
    for run_dir in map(Path, args.run_dirs):
        dest = export_run(run_dir, root)
        print(f"{run_dir}: " + (f"-> {dest}" if dest else "no finished split, skipped"))
    text = table(root)
    (root / "TABLE.md").write_text(text)
    print(text)
    return 0
