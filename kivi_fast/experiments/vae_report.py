"""``kivi-fast vae-report RUN...``: collect finished ``vae`` runs (and their ``vae-ais``) into ``--results``.

Writes, per method, ``<method>/`` with the run's results.json, history.json, AIS JSON and PNGs (no
checkpoint); ``curves.png``, the train and test ELBO of every method on one figure (the paper's Fig. 4b);
``summary.json``, per method (named by :func:`run_label`): epochs, training images, final train and test
ELBO and their gap, the best test ELBO and its epoch, the AIS test log-likelihood with its settings (and
the IWAE check), the AIS log-likelihood of training images and the train - test gap (where ``vae-ais
--split train`` ran), time per epoch, the KL's share of a step, the device; and each method's AIS
difference to ``gaussian`` on the same images with its paired standard error; ``table.md``, the same
beside the paper's numbers.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from . import runs
from .options import add_common
from .vae import PAPER, plot_curves

FILES = ("results.json", "history.json", "ais.json", "ais_train.json", "config.json", "samples.png",
         "reconstructions.png",
         "curves.png")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="+", help="run folders of kivi-fast vae (one per method)")
    p.add_argument("--results", default="results/vae", help="folder to write")
    add_common(p, out=False, quick="skip the figure (curves.png)", progress="(no effect: nothing to wait for)")


def run_label(config: dict) -> str:
    """The method's name at the paper's settings (lam 1e-3, clip 1e-8, kivi-ac's diagonal contrast), else
    the name with what differs, e.g. "kivi-ac_auto_lam0.01" (also the run's folder under --results)."""
    label = config["method"]
    if label == "gaussian":
        return label
    if label == "kivi-ac" and config["contrast"] != "diagonal":
        label += f"_{config['contrast']}"
    if config["lam"] != 1e-3:
        label += f"_lam{config['lam']:g}"
    if config["clip"] != 1e-8:
        label += f"_clip{config['clip']:g}"
    return label


def load_run(folder: Path) -> dict:
    run = runs.load_finished_run(folder, "vae")
    result = run["results.json"]
    if not ({"final", "step_profile", "config", "epochs"} <= result.keys() and isinstance(result["config"], dict)
            and "method" in result["config"]):
        raise runs.RunError(f"{folder}/results.json is not a kivi-fast vae run's (it lacks the final ELBOs or the "
                            "settings)")
    for name in ("ais.json", "ais_train.json"):
        ais = run[name] = runs.read_json(folder / name) if (folder / name).exists() else None
        if ais is None:
            continue
        split = " --split train" if "train" in name else ""
        # an AIS of an earlier epoch than the run's end (the run continued after it) is not this run's
        if ais.get("epoch") != result["epochs"]:
            raise runs.RunError(f"{folder}/{name} is of epoch {ais.get('epoch')}, the run ended at epoch "
                                f"{result['epochs']}: rerun kivi-fast vae-ais{split} {folder}")
        # one image has no standard error (an older vae-ais wrote NaN), nor a paired difference to gaussian
        images = len(ais.get("per_image", ()))
        if images < 2:
            raise runs.RunError(f"{folder}/{name} holds {images} image(s): rerun kivi-fast vae-ais{split} {folder} "
                                "with --images 2 or more")
    return run


def summarize(run: dict) -> dict:
    result, history, ais = run["results.json"], run["history.json"], run["ais.json"]
    best = max(history, key=lambda h: h["test"]["elbo"])
    f = result["final"]
    out = {
        "epochs": result["epochs"], "train_images": result["train_images"],
        "final_train_elbo": f["train_elbo"], "final_test_elbo": f["test_elbo"],
        "final_gap": f["train_elbo"] - f["test_elbo"], "final_train_kl": f["train_kl"],
        "best_test_elbo": best["test"]["elbo"], "best_test_epoch": best["epoch"],
        "seconds_per_epoch": result["seconds_per_epoch"], "kl_share_of_step": result["step_profile"]["kl_share"],
        "step_seconds": result["step_profile"]["step_seconds"], "device": result.get("gpu", result["device"]),
        "machine": result["machine"], "config": result["config"],
    }
    if ais:
        out["ais"] = {k: ais[k] for k in ("ais_log_likelihood", "ais_standard_error", "acceptance", "settings",
                                          "epoch", "seconds", "device") if k in ais}
        for k in ("iwae_log_likelihood", "iwae_k", "ais_minus_iwae", "ais_minus_iwae_standard_error"):
            if k in ais:
                out["ais"][k] = ais[k]
    train = run["ais_train.json"]
    if train:
        out["ais_train"] = {k: train[k] for k in ("ais_log_likelihood", "ais_standard_error", "settings")}
        if ais:  # different images: independent errors
            out["ais_gap"] = {"train_minus_test": train["ais_log_likelihood"] - ais["ais_log_likelihood"],
                              "standard_error": math.hypot(train["ais_standard_error"], ais["ais_standard_error"])}
    return out


def paired(a: list[float], b: list[float]) -> dict:
    """The mean of a - b over the same images and its standard error; a RunError unless both have the same 2
    or more images (zip would drop the extra ones unsaid; one image has no standard error)."""
    if len(a) != len(b) or len(a) < 2:
        raise runs.RunError(f"a paired AIS difference needs the same 2 or more images of both runs, got {len(a)} "
                            f"and {len(b)}")
    d = [x - y for x, y in zip(a, b)]
    mean = sum(d) / len(d)
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (len(d) - 1))
    return {"difference": mean, "standard_error": sd / math.sqrt(len(d)), "images": len(d)}


def run(args) -> int:
    loaded = runs.collect_runs(args.runs, load_run, lambda r: run_label(r["results.json"]["config"]))
    out = Path(args.results)
    runs.make_folder(out, "--results")
    summary = {"paper_ais_test_ll": PAPER, "methods": {}}
    for method, (folder, r) in loaded.items():
        runs.copy_run_files(folder, out / method, FILES)
        summary["methods"][method] = summarize(r)
    base = loaded.get("gaussian", (None, {"ais.json": None}))[1]["ais.json"]
    for method, (_, r) in loaded.items():
        ais = r["ais.json"]
        if method != "gaussian" and ais and base and ais["settings"] == base["settings"]:
            summary["methods"][method]["ais_minus_gaussian"] = paired(ais["per_image"], base["per_image"])
    if not args.quick:
        plot_curves({m: r["history.json"] for m, (_, r) in loaded.items()}, out / "curves.png")
    runs.write_report(out, summary, markdown_table(summary))
    return 0


def markdown_table(summary: dict) -> str:
    rows = ["| method | epochs | train images | ELBO train | ELBO test | gap | best test ELBO (epoch) | "
            "AIS test LL | AIS - gaussian (paired) | AIS train - test | paper AIS (3000 epochs, 50k) | s/epoch | "
            "KL share |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for method, s in summary["methods"].items():
        ais = s.get("ais")
        ll = f"{ais['ais_log_likelihood']:.2f} ± {ais['ais_standard_error']:.2f}" if ais else "-"
        diff = s.get("ais_minus_gaussian")
        d = f"{diff['difference']:+.2f} ± {diff['standard_error']:.2f}" if diff else "-"
        gap = s.get("ais_gap")
        g = f"{gap['train_minus_test']:.2f} ± {gap['standard_error']:.2f}" if gap else "-"
        paper = summary["paper_ais_test_ll"].get(method)  # the paper's settings only
        rows.append(f"| {method} | {s['epochs']} | {s['train_images']} | {s['final_train_elbo']:.2f} | "
                    f"{s['final_test_elbo']:.2f} | {s['final_gap']:.2f} | {s['best_test_elbo']:.2f} "
                    f"({s['best_test_epoch']}) | {ll} | {d} | {g} | {paper if paper is not None else '-'} | "
                    f"{s['seconds_per_epoch']:.1f} | {100 * s['kl_share_of_step']:.0f}% |")
    return "\n".join(rows) + "\n"
