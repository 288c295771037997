"""``kivi-fast mnist-report RUN...``: collect finished ``mnist`` runs into ``--results``.

Writes, per run, ``<method>-<L>/`` (the label names any setting that is not the paper's, see
:func:`run_label`) with the run's results.json, history.json, config.json and curves.png (no checkpoint);
``curves.png``, the training lower bound of the KIVI and PC runs (the paper's Fig. 3, right) and the test
error through training of those and of each L's BBB baseline; ``summary.json``, per run: epochs,
training images, test and validation error with their binomial standard errors, the test error at the
best validation epoch, the final lower bound and its KL (the method's estimate; BBB's exact), time per
epoch and per step, the KL's share of a step, peak memory, the device; per L, each KIVI and PC run's
test error minus that of the Bayes-by-Backprop run with the lowest validation error at the same L and
budget; and the paper's table.
``table.md``: the same beside the paper's numbers.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from . import runs
from .mnist import BBB_INIT_STD, CONFIG_KEYS, plot_history
from .training import ADDED_SETTINGS
from .options import add_common

FILES = ("results.json", "history.json", "config.json", "curves.png")
# The paper's Fig. 3 table, test error in percent by L (None: not reported). "Scale mixture" changes the
# prior and "dropconnect" ensembles 5 networks: the paper marks both as not directly comparable.
PAPER_TABLE = {
    "kivi": {400: 1.29, 800: 1.22, 1200: 1.27},
    "bbb": {400: 1.82, 800: 1.99, 1200: 2.04},
    "bbb, scale mixture prior": {400: 1.36, 800: 1.34, 1200: 1.32},
    "sgd": {800: 1.6},
    "dropout": {800: 1.3},
    "dropconnect (5 networks)": {800: 1.2},
}
# settings of the paper's protocol that name a run when they differ (the budget is reported, not named)
PAPER_SETTINGS = {"batch": 100, "samples": 10, "n_p": 10, "lam": 1e-3, "clip": 1e-8, "lr": 1e-3}
ONLY_FOR = {"n_p": "kivi", "lam": "kivi", "clip": "kivi", "bbb_init_std": "bbb"}  # settings one method uses
DEFAULT_SETTINGS = {**PAPER_SETTINGS, "bbb_init_std": BBB_INIT_STD}  # (the paper gives no BBB initialization)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="+", help="run folders of kivi-fast mnist (one per method and L)")
    p.add_argument("--results", default="results/mnist", help="folder to write")
    add_common(p, out=False, quick="skip the figure (curves.png)", progress="(no effect: nothing to wait for)")


def run_label(config: dict) -> str:
    """``<method>-<L>``, then each setting that differs from the paper's (or, where it gives none, the
    default), e.g. "kivi-400_lam0.01"."""
    config = {**ADDED_SETTINGS, **config}
    label = f"{config['method']}-{config['hidden']}"
    if config.get("mmnn_hidden") is not None and config["method"] != "bbb":
        label += f"_N{config['mmnn_hidden']}"
    for key, default in DEFAULT_SETTINGS.items():
        if config[key] != default and ONLY_FOR.get(key, config["method"]) == config["method"]:
            label += f"_{key.replace('_', '')}{config[key]:g}"
    return label


def load_run(folder: Path) -> dict:
    run = runs.load_finished_run(folder, "mnist")
    # a setting added later (ADDED_SETTINGS) was, in an older run, the value it holds there
    missing = [k for k in CONFIG_KEYS if k not in {**ADDED_SETTINGS, **run["results.json"].get("config", {})}]
    if missing:
        raise runs.RunError(f"{folder}/results.json lacks the settings {', '.join(missing)}: not a kivi-fast "
                            "mnist run of this version")
    return run


def binomial_se(error: float, n: int) -> float:
    return math.sqrt(error * (1 - error) / n)


def summarize(run: dict) -> dict:
    r, history = run["results.json"], run["history.json"]
    n = r["config"]["eval_images"]
    profile = r["step_profile"]
    return {
        "method": r["method"], "hidden": r["hidden"], "epochs": r["epochs"],
        "train_images": r["config"]["train_images"], "steps": r["epochs"] * (r["config"]["train_images"]
                                                                            // r["config"]["batch"]),
        "test_error": r["test_error"], "test_error_se": binomial_se(r["test_error"], n),
        "valid_error": r["valid_error"], "valid_error_se": binomial_se(r["valid_error"], n),
        "eval_images": n, "best_valid": r["best_valid"], "final_lower_bound": r["final_lower_bound"],
        "final_kl_per_image": history[-1]["kl"],
        "final_kl_total": history[-1]["kl"] * r["config"]["train_images"],  # nats, all layers
        "seconds_per_epoch": r["seconds_per_epoch"],
        "step_seconds": profile["step_seconds"], "kl_share_of_step": profile["kl_share"],
        "peak_memory_gib": r["peak_memory_gib"], "processes": r["processes"],
        "device": r.get("gpu", r["device"]), "machine": r["machine"], "config": r["config"],
    }


def comparisons(summaries: dict) -> dict:
    """Per L, each KIVI or PC run's final test error minus that of Bayes-by-Backprop at the same L and
    budget (of several such BBB runs, e.g. a learning-rate sweep, the one with the lowest final validation
    error), with the standard error of independent binomial errors (the same test images: conservative)."""
    out = {}
    for label, s in summaries.items():
        same = [(b["valid_error"], k) for k, b in summaries.items() if b["method"] == "bbb"
                and b["hidden"] == s["hidden"] and b["steps"] == s["steps"] and b["train_images"] == s["train_images"]]
        if not same or s["method"] == "bbb":
            continue
        base_label = min(same)[1]
        base = summaries[base_label]
        out[label] = {"bbb_run": base_label, "minus_bbb": s["test_error"] - base["test_error"],
                      "standard_error": math.hypot(s["test_error_se"], base["test_error_se"])}
    return out


def run(args) -> int:
    loaded = runs.collect_runs(args.runs, load_run, lambda r: run_label(r["results.json"]["config"]))
    out = Path(args.results)
    runs.make_folder(out, "--results")
    order = sorted(loaded, key=lambda k: (loaded[k][1]["results.json"]["hidden"], k))
    summary = {"paper_test_error_percent": PAPER_TABLE, "runs": {}}
    for label in order:
        folder, r = loaded[label]
        runs.copy_run_files(folder, out / label, FILES)
        summary["runs"][label] = summarize(r)
    summary["test_error_minus_bbb"] = comparisons(summary["runs"])
    if not args.quick:
        plot_runs(loaded, summary, order, out / "curves.png")
    runs.write_report(out, summary, markdown_table(summary))
    return 0


def plot_runs(loaded: dict, summary: dict, order: list, path: Path) -> None:
    """KIVI, PC and each L's BBB baseline (the sweep's other runs are in the table): colour by method,
    line style by L. The bound panel has KIVI and PC only (the paper's Fig. 3, right): BBB's exact KL
    puts its bound off that scale."""
    baselines = {c["bbb_run"] for c in summary["test_error_minus_bbb"].values()}
    shown = [k for k in order if summary["runs"][k]["method"] != "bbb" or k in baselines] or order
    widths = sorted({summary["runs"][k]["hidden"] for k in shown})
    colors = {"kivi": "C0", "pc": "C1", "bbb": "C2"}
    styles = {k: {"color": colors[summary["runs"][k]["method"]],
                  "linestyle": ("-", "--", ":", "-.")[widths.index(summary["runs"][k]["hidden"]) % 4]}
              for k in shown}
    implicit = {k for k in shown if summary["runs"][k]["method"] != "bbb"}
    plot_history({k: loaded[k][1]["history.json"] for k in shown}, path, implicit or None, styles)


def markdown_table(summary: dict) -> str:
    rows = ["| L | run | steps (epochs x images) | test error % | minus best BBB (points) | valid error % | "
            "test at best valid (epoch) | lower bound / image | KL (nats, total) | paper test error % | s/epoch | "
            "s/step | KL share | peak memory GiB |",
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for label, s in summary["runs"].items():
        diff = summary["test_error_minus_bbb"].get(label)
        d = f"{100 * diff['minus_bbb']:+.2f} ± {100 * diff['standard_error']:.2f}" if diff else "-"
        paper = PAPER_TABLE.get(s["method"], {}).get(s["hidden"]) if label == f"{s['method']}-{s['hidden']}" \
            else None  # the paper's number only beside the paper's settings
        best = s["best_valid"]
        rows.append(f"| {s['hidden']} | {label} | {s['steps']} ({s['epochs']} x {s['train_images']}) | "
                    f"{100 * s['test_error']:.2f} ± {100 * s['test_error_se']:.2f} | {d} | "
                    f"{100 * s['valid_error']:.2f} | {100 * best['test_error']:.2f} ({best['epoch']}) | "
                    f"{s['final_lower_bound']:.3f} | {s['final_kl_total']:.4g} | "
                    f"{paper if paper is not None else '-'} | "
                    f"{s['seconds_per_epoch']:.0f} | {s['step_seconds']:.2f} | {100 * s['kl_share_of_step']:.0f}% | "
                    f"{s['peak_memory_gib']:.2f} |")
    return "\n".join(rows) + "\n"
