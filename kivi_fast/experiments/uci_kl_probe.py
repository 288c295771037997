"""Why plain KIVI can fail on a UCI set: what the weight-KL estimate sees, and what its gradient does.

    python -m kivi_fast.cli uci-kl-probe --dataset yacht            # ~3 min on one core
    python -m kivi_fast.cli uci-kl-probe --dataset boston --epochs 300
    python -m kivi_fast.cli uci-kl-probe --quick                     # a smoke run in seconds

Two measurements on one split, with the paper's settings (n_p = n_q = M = 100, lam = 1e-3):

1. At initialization, per layer: the dimension d, the spread of the posterior samples (mean per-weight
   std), the median bandwidth the fit uses, the fraction of posterior samples where the fitted ratio
   p/q is <= 0 (clipped before the log), the KL estimate; and, over ``--reps`` draws, the norm of the
   gradient w.r.t. the posterior's parameters of the minibatch log-likelihood term (scaled by N / batch)
   and of the summed weight-KL estimates (both enter the ELBO with weight 1).
   Both for torch.nn.Linear's initialization of the generators and for Glorot's (the default).
2. Short trainings (same seed): KIVI with torch's initialization, the same with the weight KL switched
   off, KIVI with adaptive contrast, and KIVI with Glorot's initialization; logged every ``--every``
   epochs: test RMSE and LL, the posterior's spread and mean size. ``probe.json`` and ``probe.png`` go
   in the run folder.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from tqdm import tqdm

import kivi_fast

from ..nn import bnn
from . import datasets, runs
from .options import (UsageError, add_common, apply_quick, nonnegative_int, plural, positive_int, random_seed,
                      thread_count)
from .regression import build_model, evaluate, train_epoch

# name -> (method, weight of the weight KL in the ELBO, generator initialization)
VARIANTS = {"kivi, torch init": ("kivi", 1.0, "torch"), "no weight KL, torch init": ("kivi", 0.0, "torch"),
            "kivi-ac, torch init": ("kivi-ac", 1.0, "torch"), "kivi": ("kivi", 1.0, "glorot")}
QUICK = {"epochs": 2, "every": 1, "reps": 2}


def _spread(flat: torch.Tensor) -> tuple[float, float]:
    """(mean per-weight std, mean per-weight |mean|) of posterior samples [n, d]."""
    return float(flat.std(0).mean()), float(flat.mean(0).abs().mean())


def probe_init(model: bnn.RegressionBNN, data: datasets.Split, batch_size: int, reps: int) -> dict:
    n = len(data.y_train)
    params = list(model.posteriors.parameters())
    layers, g_lik, g_kl = [], [], []
    for rep in range(reps):
        flat = model.sample_weights(model.n_prior)
        x, y = data.x_train[:batch_size], data.y_train[:batch_size]
        y_hat = bnn.mlp_forward(x, model.weight_matrices(flat))
        log_lik = model.precision.expected_log_likelihood(y, y_hat).mean(0).sum() * (n / x.shape[0])
        kl_w = torch.stack(model.layer_kls(flat)).sum()
        for grads, target in ((g_lik, log_lik), (g_kl, kl_w)):
            gs = torch.autograd.grad(target, params, retain_graph=True, allow_unused=True)
            grads.append(float(torch.sqrt(sum((g * g).sum() for g in gs if g is not None))))
        if rep == 0:
            for w in flat:
                w = w.detach()
                prior = torch.randn(model.n_prior, w.shape[1], dtype=w.dtype)
                fit = kivi_fast.DensityRatio(model.lam).fit(prior, w)  # p / q: the reverse ratio trick
                ratio = fit.ratio(w)
                sd, mean_abs = _spread(w)
                layers.append({"d": w.shape[1], "q_sd": sd, "q_abs_mean": mean_abs, "bandwidth": float(fit.sigma),
                               "clipped_fraction": float((ratio <= 1e-8).double().mean()),
                               "kl_estimate": float(kivi_fast.kernel_kl(prior, w, model.lam))})
    return {"layers": layers, "grad_norm_log_lik": g_lik, "grad_norm_kl": g_kl}


def train_variant(args, data: datasets.Split, method: str, kl_scale: float, init: str) -> dict:
    torch.manual_seed(args.seed)
    model = build_model(args.dataset, data.x_train.shape[1], method, args.n_hidden, 1e-3, 100, init)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    n = len(data.y_train)
    log = {"epoch": [], "rmse": [], "test_ll": [], "q_sd": [], "q_abs_mean": [], "kl_weights": []}
    for epoch in tqdm(range(args.epochs), desc=f"{method}, KL x {kl_scale:g}, {init} init", leave=False,
                      disable=args.no_progress):
        terms = train_epoch(model, opt, data, 100, 100, kl_weight=kl_scale)
        if (epoch + 1) % args.every == 0 or epoch + 1 == args.epochs:
            ev = evaluate(model, data, 100, seed=1)
            with torch.no_grad():
                flat = model.sample_weights(100)
            spreads = [_spread(w) for w in flat]
            log["epoch"].append(epoch + 1)
            log["rmse"].append(ev["rmse"])
            log["test_ll"].append(ev["test_ll"])
            log["q_sd"].append([s[0] for s in spreads])
            log["q_abs_mean"].append([s[1] for s in spreads])
            log["kl_weights"].append(terms["kl_weights"] * n)  # the epoch's mean estimate, nats
    return log


def plot(result: dict, path: Path) -> None:
    plt = runs.matplotlib_pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    for name, log in result["training"].items():
        axes[0].plot(log["epoch"], log["rmse"], label=name)
        axes[1].plot(log["epoch"], [s[0] for s in log["q_sd"]], label=f"{name}, layer 1")
        axes[2].plot(log["epoch"], [s[0] for s in log["q_abs_mean"]], label=f"{name}, layer 1")
    axes[0].set(xlabel="epoch", ylabel="test RMSE", yscale="log", title=f"{result['dataset']}, split {result['split']}")
    axes[1].set(xlabel="epoch", ylabel="posterior spread (mean per-weight std)", yscale="log")
    axes[2].set(xlabel="epoch", ylabel="mean |posterior mean| per weight", yscale="log")
    for ax in axes:
        ax.legend(fontsize=7)
    runs.save_figure(fig, path, dpi=110)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset", default="yacht", choices=sorted(datasets.DATASETS), help="UCI data set")
    p.add_argument("--split", type=nonnegative_int, default=0, help="which standard split")
    p.add_argument("--epochs", type=positive_int, default=600, help="training epochs of each variant")
    p.add_argument("--every", type=positive_int, default=100, help="epochs between evaluations (and the last epoch)")
    p.add_argument("--reps", type=positive_int, default=5, help="draws for the gradient norms at initialization")
    p.add_argument("--n-hidden", type=positive_int, default=None, help="hidden units (default: the set's, 50 or 100)")
    p.add_argument("--seed", type=random_seed, default=0, help="random seed")
    p.add_argument("--threads", type=thread_count, default=1, help="torch CPU threads")
    p.add_argument("--data-dir", default=None,
                   help=f"folder holding the UCI sets' folders (default: ${datasets.ENV_VAR}, else the source "
                        "checkout's data/UCI_Datasets)")
    add_common(p, name="uci-kl-probe-<dataset>", quick="a smoke run in seconds: 2 epochs, 2 draws")


def run(args) -> int:
    apply_quick(args, QUICK)
    torch.set_num_threads(args.threads)
    args.n_hidden = args.n_hidden or datasets.DATASETS[args.dataset].n_hidden
    n_splits = datasets.n_splits(args.dataset, args.data_dir)
    if args.split >= n_splits:
        raise UsageError(f"argument --split: {args.dataset} has splits 0..{n_splits - 1}, got {args.split}")
    data = datasets.load_split(args.dataset, args.split, args.data_dir)
    run_dir = runs.run_folder(args.out, f"uci-kl-probe-{args.dataset}", args.run_dir)
    t0 = time.time()
    result = {"dataset": args.dataset, "split": args.split, "epochs": args.epochs, "init": {}, "training": {}}
    for init in ("torch", "glorot"):
        torch.manual_seed(args.seed)
        model = build_model(args.dataset, data.x_train.shape[1], "kivi", args.n_hidden, 1e-3, 100, init)
        result["init"][init] = probe_init(model, data, 100, args.reps)
    for name, (method, scale, init) in VARIANTS.items():
        result["training"][name] = train_variant(args, data, method, scale, init)
    result["seconds"] = time.time() - t0
    runs.write_json(run_dir / "probe.json", result)
    plot(result, run_dir / "probe.png")
    mean = lambda v: sum(v) / len(v)  # noqa: E731
    for name, init in result["init"].items():
        print(f"{args.dataset}, split {args.split}, at {name} initialization:")
        for i, layer in enumerate(init["layers"]):
            print(f"  layer {i + 1}: d {layer['d']}, posterior sd {layer['q_sd']:.3g}, bandwidth {layer['bandwidth']:.3g}, "
                  f"clipped ratios {100 * layer['clipped_fraction']:.0f}%, KL estimate {layer['kl_estimate']:.3g}")
        print(f"  gradient norm: log-likelihood {mean(init['grad_norm_log_lik']):.3g}, "
              f"weight KL {mean(init['grad_norm_kl']):.3g}")
    print(f"after {plural(args.epochs, 'epoch')}:")
    for name, log in result["training"].items():
        print(f"  {name:26s} RMSE {log['rmse'][-1]:.3f}  LL {log['test_ll'][-1]:.3f}  posterior sd "
              f"{', '.join(f'{s:.3g}' for s in log['q_sd'][-1])}  |mean| {', '.join(f'{s:.3g}' for s in log['q_abs_mean'][-1])}")
    print(f"results in {run_dir}")
    return 0
