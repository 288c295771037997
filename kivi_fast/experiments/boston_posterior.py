"""``kivi-fast boston-posterior``: parallel coordinates of the Boston BNN posteriors (the paper's
"Visualization of Inferred Posteriors").

A BNN with one hidden layer of 50 units is trained on one Boston housing split with the UCI harness
(:func:`kivi_fast.experiments.regression.train_split`, the paper's settings: lam = 1e-3, 100 samples, batch 100,
Adam 1e-3, 3000 epochs), once with KIVI (the paper's implicit MLP posteriors) and once with factorized
Gaussian VI. Then 100 samples of the second-layer weights W_1 (51 = 50 weights + bias) are drawn from
each posterior and drawn as polylines over the 51 dimensions, the dimensions sorted by their posterior
mean (hidden units are exchangeable, so only the sorted picture is comparable). The signal-to-noise
ratio |mu| / sigma per weight (from the same samples) shows over-pruning: weights whose posterior sits
on the prior's zero with a large spread carry no signal. The paper's HMC panel is not reproduced (no
BNN HMC in this project).

Outputs: ``boston_posterior.png``, ``posterior_stats.json`` (per-dimension mean, std, |mu|/sigma and
the test metrics of each model); each method's training run (checkpoint, history) is kept in a
subfolder, and rerunning with the same ``--run-dir`` resumes or reuses it.
"""

from __future__ import annotations

import argparse
import math
from types import SimpleNamespace

import torch

from ..nn.generator import INITS
from . import datasets, regression, runs
from .options import (UsageError, add_common, apply_quick, int_at_least, kivi_lam, nonnegative_int, plural,
                      positive_int, random_seed)

NAME = "boston-posterior"
METHODS = {"factorized": "factorized VI", "kivi": "KIVI"}
QUICK = {"epochs": 2, "samples": 20}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seed", type=random_seed, default=0, help="random seed (as kivi-fast uci's)")
    parser.add_argument("--split", type=nonnegative_int, default=0, help="which of the 20 standard Boston splits")
    parser.add_argument("--epochs", type=positive_int, default=3000, help="training epochs (paper: 3000 for Boston)")
    parser.add_argument("--samples", type=int_at_least(2), default=100, help="n_p = n_q = M during training")
    parser.add_argument("--lam", type=kivi_lam, default=1e-3, help="KIVI's ridge coefficient lambda")
    parser.add_argument("--generator-init", default="glorot", choices=INITS,
                        help="initialization of KIVI's implicit posterior (see kivi-fast uci)")
    parser.add_argument("--plot-samples", type=int_at_least(2), default=100, help="posterior samples of W_1 drawn")
    parser.add_argument("--data-dir", default=None,
                        help=f"folder holding the UCI sets' folders (default: ${datasets.ENV_VAR}, else the source "
                             "checkout's data/UCI_Datasets)")
    add_common(parser, name=NAME, quick="a seconds-long smoke run (2 epochs, 20 samples)")


def _trainer_args(args, method: str) -> SimpleNamespace:
    """The settings :func:`regression.train_split` reads, with the paper's values for Boston."""
    return SimpleNamespace(dataset="boston", method=method, epochs=args.epochs, samples=args.samples,
                           lam=args.lam, generator_init=args.generator_init, batch_size=100, lr=1e-3, n_hidden=50,
                           eval_samples=100,
                           eval_every=max(1, args.epochs // 30), checkpoint_seconds=30.0, seed=args.seed,
                           data_dir=args.data_dir, no_progress=args.no_progress)


def second_layer_samples(run_dir, targs, n_features: int, n: int, seed: int) -> torch.Tensor:
    """Rebuild the trained BNN from its checkpoint and draw ``n`` samples of W_1, [n, 51]."""
    model = regression.build_model("boston", n_features, targs.method, targs.n_hidden, targs.lam, targs.samples,
                            targs.generator_init)
    model.load_state_dict(runs.load_checkpoint(run_dir / "checkpoint.pt", regression.CHECKPOINT_KEYS)["model"])
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return model.posteriors[1].sample(n)


def weight_stats(w: torch.Tensor) -> dict:
    """Per-dimension mean, std and |mu| / sigma of samples [n, d], the dimensions sorted by mean."""
    mean, std = w.mean(0), w.std(0)
    order = torch.argsort(mean)
    snr = mean.abs() / std
    return {"order": order.tolist(), "mean": mean[order].tolist(), "std": std[order].tolist(),
            "snr": snr[order].tolist(), "median_snr": float(snr.median()),
            "fraction_snr_below_1": float((snr < 1).double().mean())}


def plot(path, samples: dict, stats: dict) -> None:
    plt = runs.matplotlib_pyplot()
    fig, axes = plt.subplots(len(samples) + 1, 1, figsize=(12, 3.0 * (len(samples) + 1)))
    for ax, (name, w) in zip(axes, samples.items()):
        sorted_w = w[:, stats[name]["order"]].numpy()
        dims = range(sorted_w.shape[1])
        for row in sorted_w:
            ax.plot(dims, row, color="tab:blue", alpha=0.12, lw=0.8)
        ax.plot(dims, sorted_w.mean(0), color="k", lw=1.2, label="posterior mean")
        ax.set(title=f"{name}: {sorted_w.shape[0]} samples of W_1 (dimensions sorted by mean)",
               xlabel="dimension of W_1 (sorted)", ylabel="weight value", xlim=(0, sorted_w.shape[1] - 1))
        ax.legend(fontsize=8, loc="upper left")
    ax = axes[-1]
    for name in samples:
        snr = sorted(stats[name]["snr"], reverse=True)
        ax.plot(range(len(snr)), snr, marker="o", ms=3, label=f"{name} (median {stats[name]['median_snr']:.2f})")
    ax.axhline(1.0, color="0.5", ls="--", lw=1)
    ax.set(yscale="log", title="signal-to-noise ratio |mu| / sigma of each W_1 weight (sorted)",
           xlabel="rank", ylabel="|mu| / sigma")
    ax.legend(fontsize=8)
    runs.save_figure(fig, path, dpi=80)


def run(args) -> int:
    apply_quick(args, QUICK)
    torch.set_num_threads(1)
    n_splits = datasets.n_splits("boston", args.data_dir)
    if args.split >= n_splits:
        raise UsageError(f"argument --split: boston has splits 0..{n_splits - 1}, got {args.split}")
    n_features = datasets.load_split("boston", args.split, args.data_dir).x_train.shape[1]
    out = runs.run_folder(args.out, NAME, args.run_dir)
    samples, stats, metrics = {}, {}, {}
    for method, label in METHODS.items():
        targs = _trainer_args(args, method)
        sub = out / method
        sub.mkdir(exist_ok=True)
        result = regression.train_split(targs, args.split, sub)
        metrics[label] = {k: result[k] for k in ("rmse", "test_ll", "elbo_per_point", "train_seconds")}
        samples[label] = second_layer_samples(sub, targs, n_features, args.plot_samples, args.seed + 1)
        stats[label] = weight_stats(samples[label])
    runs.write_json(out / "posterior_stats.json", {
        "config": {k: v for k, v in vars(args).items() if not k.startswith("_")},
        "test_metrics": metrics, "w1": stats})
    plot(out / "boston_posterior.png", samples, stats)

    print(f"Boston split {args.split}, {plural(args.epochs, 'epoch')}; W_1 posterior from "
          f"{plural(args.plot_samples, 'sample')}:")
    print(f"{'':<16}{'test RMSE':>10}{'test LL':>10}{'median |mu|/sigma':>20}{'share < 1':>11}")
    for label in METHODS.values():
        m, s = metrics[label], stats[label]
        print(f"{label:<16}{m['rmse']:>10.3f}{m['test_ll']:>10.3f}{s['median_snr']:>20.2f}"
              f"{s['fraction_snr_below_1']:>11.2f}")
    print(f"wrote {out}/boston_posterior.png, posterior_stats.json")
    return 0 if all(math.isfinite(m["rmse"]) for m in metrics.values()) else 1
