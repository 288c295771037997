"""Collect ``kivi-fast uci`` run folders into a results folder and one table beside the paper.

    python -m kivi_fast.cli uci-report runs/uci-*            # -> results/uci/<dataset>-<method>/, TABLE.md
    python -m kivi_fast.cli uci-report --merge runs/batch/*/split_*   # add uci-batch's splits to those

Run folders of the same data set, method and settings are pooled into one result (``uci-batch`` writes
one folder per split); ``--merge`` keeps the splits already exported there. Each run folder is copied
without its checkpoint and per-epoch histories (the test-metric curves every ``eval_every`` epochs stay,
with the training ELBO at those epochs), so the copies are small enough to commit; then every
``<dataset>-<method>/summary.json`` under the results folder goes into ``TABLE.md``: per dataset, our
methods (with the number of splits run) and the paper's Table 1 (KIVI, SVGD, Dropout) and appendix table
(Factorized, HMC), errors as standard errors over the splits, and the same side by side.
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
from pathlib import Path

from . import datasets, regression, runs
from .options import add_common, plural
from .regression import METHODS, PAPER_RESULTS, RESUME_KEYS, split_statistics

DATASET_ORDER = tuple(PAPER_RESULTS)
PAPER_METHODS = ("KIVI", "SVGD", "Dropout", "Factorized", "HMC")


def generator_init(summary: dict) -> str | None:
    """The posterior's initialization; summaries from before the setting existed used torch's."""
    if summary["method"] == "factorized":
        return None
    return summary.get("generator_init", "torch")


def is_uci_summary(summary: dict) -> bool:
    """Whether a summary.json is a uci run's or result's (other commands' name no data set, e.g. vae's and
    mnist's reports)."""
    return {"dataset", "method"} <= summary.keys()


def result_name(summary: dict) -> str:
    """<dataset>-<method>, with -torchinit for runs whose generators had torch's initialization."""
    suffix = "-torchinit" if generator_init(summary) == "torch" else ""
    return f"{summary['dataset']}-{summary['method']}{suffix}"


def _exported_splits(run_dir: Path) -> list[dict]:
    """A run folder's split results without the per-epoch histories: the test metrics every
    ``eval_every`` epochs stay, with the training ELBO at those epochs."""
    splits = []
    for path in sorted(run_dir.glob("split_*.json")):
        result = runs.read_json(path)
        history = result.pop("history", {})
        result["eval_history"] = {k: history.get(k, []) for k in ("eval_epoch", "rmse", "test_ll")}
        elbo_by_epoch = dict(zip(history.get("epoch", []), history.get("elbo", [])))
        result["eval_history"]["elbo"] = [elbo_by_epoch[e] for e in result["eval_history"]["eval_epoch"]
                                          if e in elbo_by_epoch]
        splits.append(result)
    return splits


def _settings(config: dict) -> dict:
    return {k: config.get(k) for k in RESUME_KEYS if k != "generator_init"}


def _plot(splits: list[dict], path: Path, title: str) -> None:
    """training.png from exported splits (curves at the evaluation epochs)."""
    results = []
    for s in splits:
        h = s["eval_history"]
        # exports from before the ELBO was kept at the evaluation epochs draw no ELBO curve
        has_elbo = len(h.get("elbo", [])) == len(h["eval_epoch"])
        results.append({"split": s["split"], "history": {
            "epoch": h["eval_epoch"] if has_elbo else [], "elbo": h["elbo"] if has_elbo else [],
            "eval_epoch": h["eval_epoch"], "rmse": h["rmse"], "test_ll": h["test_ll"]}})
    regression.plot_training(results, path, title)  # (looked up here: tests replace it)


def pool_runs(run_dirs: list[Path], results_root: Path, merge: bool = False) -> dict | None:
    """Pool run folders of one data set, method and setting into what ``write_result`` writes to
    ``results_root/<dataset>-<method>/``; checks everything, writes nothing. None if no folder has a
    finished split.

    Folders of single splits (as ``uci-batch`` writes them) become one result; with ``merge``, the splits
    already exported there are kept too. A split in several places is taken from the last; a warning
    says so if their numbers differ. The summary is recomputed from the pooled splits.
    """
    sources = [d for d in run_dirs if (d / "summary.json").exists() and any(d.glob("split_*.json"))]
    if not sources:
        return None
    summaries = [runs.read_json(d / "summary.json") for d in sources]
    configs = [runs.read_json(d / "config.json") for d in sources]
    names = {result_name(s) for s in summaries}
    if len(names) > 1 or any(_settings(c) != _settings(configs[0]) for c in configs):
        raise ValueError(f"run folders {[str(d) for d in sources]} hold different runs ({sorted(names)}); "
                         "export them separately")
    dest = results_root / names.pop()
    by_split: dict[int, tuple[str, dict]] = {}
    commands = {c for s in summaries for c in s.get("commands", [s.get("command")]) if c}
    profile = next((runs.read_json(d / "profile.json") for d in sources if (d / "profile.json").exists()), None)
    if merge and (dest / "splits.json").exists():
        old_summary = runs.read_json(dest / "summary.json")
        if _settings(runs.read_json(dest / "config.json")) != _settings(configs[0]):
            raise ValueError(f"{dest} holds a run with other settings than {sources[0]}; cannot merge")
        by_split = {s["split"]: (str(dest), s) for s in runs.read_json(dest / "splits.json", list)}
        commands |= {c for c in old_summary.get("commands", [old_summary.get("command")]) if c}
        profile = profile or old_summary.get("profile")
    first_source_splits = 0
    for d in sources:
        exported = _exported_splits(d)
        first_source_splits = first_source_splits or len(exported)
        for split in exported:
            old = by_split.get(split["split"])
            if old is not None and (old[1]["rmse"], old[1]["test_ll"]) != (split["rmse"], split["test_ll"]):
                print(f"warning: split {split['split']} is in {old[0]} and {d} with other numbers; "
                      f"taking {d}'s", file=sys.stderr)
            by_split[split["split"]] = (str(d), split)
    splits = [by_split[k][1] for k in sorted(by_split)]
    summary = {**summaries[0], **split_statistics(splits), "commands": sorted(commands), "profile": profile}
    summary.pop("command", None)  # one folder's; "commands" has them all
    single = len(sources) == 1 and len(by_split) == first_source_splits
    png = sources[0] / "training.png" if single and (sources[0] / "training.png").exists() else None
    return {"dest": dest, "splits": splits, "summary": summary, "config": {**configs[0], "splits": summary["splits"]},
            "training_png": png}


def write_result(pooled: dict, figures: bool = True) -> Path:
    """Write a pooled result into a fresh folder, then put it in place of the old one (a failure on the
    way leaves the old export as it was; no stale file of it survives). Without ``figures``, a result
    whose run folder has no training.png to copy gets none."""
    dest = pooled["dest"]
    tmp = dest.with_name(dest.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    summary = pooled["summary"]
    runs.write_json(tmp / "splits.json", pooled["splits"])
    runs.write_json(tmp / "summary.json", summary)
    runs.write_json(tmp / "config.json", pooled["config"])
    if summary.get("profile") is not None:
        runs.write_json(tmp / "profile.json", summary["profile"])
    if pooled["training_png"] is not None:
        shutil.copyfile(pooled["training_png"], tmp / "training.png")  # every epoch's ELBO
    elif figures:
        _plot(pooled["splits"], tmp / "training.png", f"{summary['dataset']}, {summary['method']}")
    if dest.exists():
        shutil.rmtree(dest)
    tmp.rename(dest)
    return dest


def export_runs(run_dirs: list[Path], results_root: Path, merge: bool = False) -> Path | None:
    """``pool_runs`` then ``write_result``: the run folders' result in ``results_root``."""
    pooled = pool_runs(run_dirs, results_root, merge)
    return write_result(pooled) if pooled is not None else None


def _cell(mean: float, err: float, digits: int) -> str:
    return f"{mean:.{digits}f} ± {err:.{digits}f}" if not math.isnan(err) else f"{mean:.{digits}f}"


def _timing_cells(summary: dict) -> tuple[str, str]:
    """s / epoch and the machines' cores, one entry per machine (timings differ between machines)."""
    by_machine = summary.get("seconds_per_epoch_by_machine") or {"not recorded": summary["seconds_per_epoch"]}
    secs = " / ".join(f"{v:.3f}" for v in by_machine.values())
    cores = " / ".join(label.split(" ", 1)[0] if label[0].isdigit() else label for label in by_machine)
    return secs, cores


def _summaries(results_root: Path) -> dict:
    """(dataset, method, torch_init) -> summary of every exported result."""
    summaries = {}
    for path in sorted(results_root.glob("*/summary.json")):
        s = runs.read_json(path)
        if not is_uci_summary(s):  # e.g. --results results: the vae and mnist reports' folders
            raise runs.RunError(f"{path} is not a uci-report result (it names no data set and method): is --results "
                                "the folder of uci results?")
        summaries[(s["dataset"], s["method"], generator_init(s) == "torch")] = s
    return summaries


def side_by_side(results_root: Path, metric: str) -> str:
    """Markdown: one row per data set, our three methods (Glorot init) beside the paper's five, for
    ``metric`` "rmse" or "test_ll"; a method with fewer than all splits shows how many it has."""
    summaries = _summaries(results_root)
    column = {"rmse": 0, "test_ll": 2}[metric]
    head = ["data set"] + [f"ours {m}" for m in METHODS] + [f"paper {m}" for m in PAPER_METHODS]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for dataset in DATASET_ORDER:
        ours = {m: summaries.get((dataset, m, False)) for m in METHODS}
        if not any(ours.values()):
            continue
        digits = 4 if dataset == "naval" and metric == "rmse" else 3
        cells = [dataset]
        for s in ours.values():
            if s is None:
                cells.append("-")
                continue
            complete = s["n_splits"] == datasets.DATASETS[dataset].n_splits
            note = "" if complete else f" ({plural(s['n_splits'], 'split')})"
            cells.append(_cell(s[metric]["mean"], s[metric]["se"], digits) + note)
        for method in PAPER_METHODS:
            v = PAPER_RESULTS[dataset].get(method)
            cells.append(_cell(v[column], v[column + 1], digits) if v else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def table(results_root: Path) -> str:
    """Markdown: one block of rows per dataset, ours first, then the paper's."""
    summaries = _summaries(results_root)
    lines = ["| dataset | method | splits | epochs | test RMSE | test LL | s / epoch | cores (per machine) |",
             "|---|---|---|---|---|---|---|---|"]
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
                         f"{_cell(s['test_ll']['mean'], s['test_ll']['se'], 3)} | " + " | ".join(_timing_cells(s)) + " |")
        for method in PAPER_METHODS:
            if method in PAPER_RESULTS[dataset]:
                rmse, rmse_err, ll, ll_err = PAPER_RESULTS[dataset][method]
                lines.append(f"| {dataset} | paper {method} | | | {_cell(rmse, rmse_err, digits)} | "
                             f"{_cell(ll, ll_err, 3)} | | |")
    return "\n".join(lines) + "\n"


def comparison_plot(results_root: Path, path: Path) -> None:
    """comparison.png: per data set, test RMSE and LL of ours (Glorot init) and the paper's methods,
    mean ± standard error, so that where we stand is seen at a glance. Nothing if there is no result."""
    summaries = _summaries(results_root)
    shown = [d for d in DATASET_ORDER if any((d, m, False) in summaries for m in METHODS)]
    if not shown:
        return
    plt = runs.matplotlib_pyplot()
    fig, axes = plt.subplots(2, len(shown), figsize=(2.6 * len(shown) + 1, 6.4), squeeze=False)
    entries = [(f"ours {m}", m) for m in METHODS] + [(f"paper {m}", m) for m in PAPER_METHODS]
    colors = plt.get_cmap("tab10")
    for col, dataset in enumerate(shown):
        for row, (metric, column) in enumerate((("rmse", 0), ("test_ll", 2))):
            ax = axes[row][col]
            for i, (label, m) in enumerate(entries):
                if label.startswith("ours"):
                    s = summaries.get((dataset, m, False))
                    if s is None:
                        continue
                    mean, err = s[metric]["mean"], s[metric]["se"]
                else:
                    v = PAPER_RESULTS[dataset].get(m)
                    if v is None:
                        continue
                    mean, err = v[column], v[column + 1]
                ax.errorbar([i], [mean], yerr=[0 if math.isnan(err) else err], fmt="o" if label.startswith("ours")
                            else "s", color=colors(i), capsize=3, label=label)
            ax.set_xticks([])
            n_all = datasets.DATASETS[dataset].n_splits
            partial = [f"{m} {summaries[(dataset, m, False)]['n_splits']}" for m in METHODS if (dataset, m, False)
                       in summaries and summaries[(dataset, m, False)]["n_splits"] < n_all]
            title = dataset + (f"\n(splits: {', '.join(partial)} of {n_all})" if partial else "")
            ax.set_title(title if row == 0 else "", fontsize=10)
            ax.set_ylabel({"rmse": "test RMSE (lower is better)", "test_ll": "test LL (higher is better)"}[metric]
                          if col == 0 else "")
    handles = [plt.Line2D([], [], color=colors(i), marker="o" if lab.startswith("ours") else "s", ls="")
               for i, (lab, _) in enumerate(entries)]
    fig.legend(handles, [lab for lab, _ in entries], loc="lower center", ncol=len(entries), fontsize=8)
    runs.save_figure(fig, path, dpi=100, rect=(0, 0.06, 1, 1))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dirs", nargs="*", help="run folders of `kivi-fast uci` to export (none: only the table)")
    p.add_argument("--results", default="results/uci", help="results folder")
    p.add_argument("--merge", action="store_true",
                   help="keep the splits already exported for the same data set, method and settings")
    add_common(p, out=False, quick="skip the figures (comparison.png, and training.png where a run folder has "
                                   "none to copy); the JSON files and TABLE.md as always",
               progress="accepted for the same options as every command (uci-report draws no progress bar)")


def run(args) -> int:
    root = Path(args.results)
    _summaries(root)  # a --results holding other results: stop before writing into it (or making it)
    if (root / "summary.json").exists():  # (vae-report's and mnist-report's folders hold one at the top)
        raise runs.RunError(f"{root / 'summary.json'}: --results holds another report's results; use the folder of "
                            "uci results")
    for run_dir in map(Path, args.run_dirs):  # a mistyped folder: named before anything is written
        if not run_dir.is_dir():
            raise runs.RunError(f"{run_dir}: no such folder")
    runs.make_folder(root, "--results")
    groups: dict[str, list[Path]] = {}
    for run_dir in map(Path, args.run_dirs):
        if not (run_dir / "summary.json").exists():
            print(f"{run_dir}: no finished split, skipped")
            continue
        summary = runs.read_json(run_dir / "summary.json")
        if not is_uci_summary(summary):  # e.g. results/vae in a glob: skipped, as other non-run folders are
            print(f"{run_dir}: not a kivi-fast uci run folder (its summary.json names no data set), skipped")
            continue
        groups.setdefault(result_name(summary), []).append(run_dir)
    if args.run_dirs and not groups:
        raise runs.RunError(f"none of the {len(args.run_dirs)} folders holds a finished uci split: nothing exported")
    pooled = {}
    for name, dirs in groups.items():  # check every group before writing any
        try:
            pooled[name] = pool_runs(dirs, root, merge=args.merge)
        except ValueError as err:
            print(f"{name}: {err}; nothing exported", file=sys.stderr)
            return 2
    for name, dirs in groups.items():
        where = dirs[0] if len(dirs) == 1 else f"{len(dirs)} run folders"
        print(f"{where}: " + (f"-> {write_result(pooled[name], figures=not args.quick)}" if pooled[name]
                              else "no finished split, skipped"))
    text = (table(root) + "\nTest RMSE, side by side (mean ± standard error over the splits; ours with Glorot's "
            "initialization):\n\n" + side_by_side(root, "rmse") + "\nTest log-likelihood, side by side:\n\n"
            + side_by_side(root, "test_ll"))
    (root / "TABLE.md").write_text(text)
    if not args.quick:
        comparison_plot(root, root / "comparison.png")
    print(text)
    return 0
