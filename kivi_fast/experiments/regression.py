"""The BNN-regression harness of the UCI experiments (the paper's Sec. 5.2.1), shared by the commands
``uci``, ``uci-batch``, ``uci-report``, ``uci-kl-probe`` and ``boston-posterior``: the paper's settings
and published numbers, the model per method, one training epoch, one split trained with checkpoints
(resumable with the same result), the test metrics and the statistics over splits.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from ..contrast import DEFAULT_LAM
from ..nn import FactorizedGaussian, MLPGenerator, bnn
from . import datasets, runs

METHODS = ("kivi", "kivi-ac", "kivi-contrast", "factorized")

# The paper's table of implicit posteriors (Appendix "Details of Experiments / Regression"): per data
# set and layer, (noise dim, hidden sizes..., output) with "N" the number of weights of that layer.
PAPER_POSTERIORS = {
    "boston": ((20, 30, "N"), (20, 30, "N")),
    "concrete": ((30, 50, "N"), (30, 50, "N")),
    "energy": ((100, 500, "N"), (50, 100, "N")),
    "kin8nm": ((100, 500, "N"), (50, 100, "N")),
    "naval": ((100, 500, "N"), (50, 100, "N")),
    "combined": ((100, 500, "N"), (100, 500, "N")),
    "protein": ((100, 500, "N"), (100, 500, "N")),
    "wine": ((20, 10, "N"), (5, 20, "N")),
    "yacht": ((100, 800, "N", "N"), (50, 200, 51, "N")),
    "year": ((100, 500, "N"), (100, 500, "N")),
}

# Published numbers (RMSE, its error, test LL, its error) as (mean, error); Table 1 gives SVGD, Dropout
# and KIVI; the appendix table ("Comparison with More Methods") Factorized, NF, KSD VI and HMC for
# five sets. The errors are those printed in the paper (standard errors over the splits for SVGD and
# Dropout, as in their papers).
PAPER_RESULTS = {
    "boston": {"SVGD": (2.957, 0.099, -2.504, 0.029), "Dropout": (2.97, 0.19, -2.46, 0.06),
               "KIVI": (2.798, 0.173, -2.527, 0.102), "Factorized": (3.42, 0.19, -2.66, 0.04),
               "HMC": (2.20, 0.05, -2.29, 0.01)},
    "concrete": {"SVGD": (5.324, 0.104, -3.082, 0.018), "Dropout": (5.23, 0.12, -3.04, 0.02),
                 "KIVI": (4.702, 0.116, -3.054, 0.043), "Factorized": (6.00, 0.10, -3.22, 0.06),
                 "HMC": (4.27, 0.13, -2.81, 0.02)},
    "energy": {"SVGD": (1.374, 0.045, -1.767, 0.024), "Dropout": (1.66, 0.04, -1.99, 0.02),
               "KIVI": (0.467, 0.015, -1.298, 0.005), "Factorized": (2.42, 0.06, -2.34, 0.02),
               "HMC": (0.47, 0.01, -1.43, 0.01)},
    "kin8nm": {"SVGD": (0.090, 0.001, 0.984, 0.008), "Dropout": (0.10, 0.00, 0.95, 0.01),
               "KIVI": (0.075, 0.001, 1.162, 0.008), "Factorized": (0.09, 0.00, 0.96, 0.01),
               "HMC": (0.07, 0.00, 1.22, 0.01)},
    "naval": {"SVGD": (0.004, 0.000, 4.089, 0.012), "Dropout": (0.01, 0.00, 3.80, 0.01),
              "KIVI": (0.001, 0.000, 5.501, 0.121), "Factorized": (0.01, 0.00, 4.00, 0.11),
              "HMC": (0.00, 0.00, 7.31, 0.00)},
    "combined": {"SVGD": (4.033, 0.033, -2.815, 0.008), "Dropout": (4.02, 0.04, -2.80, 0.01),
                 "KIVI": (3.976, 0.037, -2.794, 0.009)},
    "protein": {"SVGD": (4.606, 0.013, -2.947, 0.003), "Dropout": (4.36, 0.01, -2.89, 0.00),
                "KIVI": (4.255, 0.019, -2.868, 0.005)},
    "wine": {"SVGD": (0.609, 0.010, -0.925, 0.014), "Dropout": (0.62, 0.01, -0.93, 0.01),
             "KIVI": (0.629, 0.008, -0.958, 0.015)},
    "yacht": {"SVGD": (0.864, 0.052, -1.225, 0.042), "Dropout": (1.11, 0.09, -1.55, 0.03),
              "KIVI": (0.737, 0.068, -2.123, 0.010)},
    "year": {"SVGD": (8.684, math.nan, -3.580, math.nan), "Dropout": (8.849, math.nan, -3.588, math.nan),
             "KIVI": (8.950, math.nan, -3.615, math.nan)},
}



def paper_epochs(n_rows: int) -> int:
    """3000 epochs for the small sets (< 1000 data points), 500 for the others (Sec. 5.2.1)."""
    return 3000 if n_rows < 1000 else 500


def parse_splits(text: str | None, n: int | None = None) -> list[int]:
    """"0-19", "0,3,5", "2" or None (all n splits) -> sorted split numbers; ValueError if malformed or,
    when ``n`` is given, outside 0..n-1."""
    if not text:
        if n is None:
            raise ValueError("no splits given")
        return list(range(n))
    out: set[int] = set()
    for part in text.split(","):
        a, dash, b = part.strip().partition("-")
        try:
            lo, hi = int(a), int(b if dash else a)
        except ValueError:
            raise ValueError(f"splits must look like 0-19 or 0,3,5, got {text!r}") from None
        if lo < 0 or hi < lo:
            raise ValueError(f"splits must look like 0-19 or 0,3,5 (ascending ranges of numbers >= 0), got {text!r}")
        # checked before the range is expanded: 0-100000000000 must not fill the memory first
        if n is not None and hi >= n:
            raise ValueError(f"split {hi} is out of range 0..{n - 1}")
        if hi >= MAX_SPLITS:
            raise ValueError(f"split {hi} is out of range (no data set has more than {MAX_SPLITS} splits)")
        out.update(range(lo, hi + 1))
    return sorted(out)


MAX_SPLITS = 1000  # a bound on split numbers where the data set's count is not at hand


def default_lam(method: str) -> float:
    """The paper's lam = 1e-3 for its methods; the library's default for ``kivi-contrast``."""
    return DEFAULT_LAM if method == "kivi-contrast" else 1e-3


def build_model(dataset: str, n_features: int, method: str, n_hidden: int, lam: float | None, n_samples: int,
                generator_init: str = "glorot") -> bnn.RegressionBNN:
    """The BNN (D, hidden, 1) with the posterior of ``method`` for each of its two weight matrices
    (``lam`` None: :func:`default_lam`)."""
    lam = default_lam(method) if lam is None else lam
    layer_sizes = (n_features, n_hidden, 1)
    dims = [(n_in + 1) * n_out for n_in, n_out in zip(layer_sizes[:-1], layer_sizes[1:])]
    if method == "factorized":
        # near a point estimate: small random means, std 0.01
        posteriors = [FactorizedGaussian(d, std=1e-2, mean_init_std=0.1) for d in dims]
    else:
        posteriors = [MLPGenerator([d if s == "N" else s for s in sizes], init=generator_init)
                      for sizes, d in zip(PAPER_POSTERIORS[dataset], dims)]
    return bnn.RegressionBNN(layer_sizes, posteriors, kl_method=method, lam=lam, n_prior=n_samples)


def evaluate(model, data: datasets.Split, n_samples: int, seed: int) -> dict[str, float]:
    """Test RMSE and log-likelihoods (:func:`kivi_fast.nn.bnn.evaluate`) on the split's test set."""
    # own RNG stream, so that how often we evaluate never changes the training trajectory
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return bnn.evaluate(model, data.x_test, data.y_test_raw, float(data.y_scaler.mean),
                            float(data.y_scaler.std), n_samples)


def train_epoch(model, opt, data: datasets.Split, batch_size: int, n_samples: int,
                kl_weight: float = 1.0) -> dict[str, float]:
    """One pass over a random permutation of the training set; returns the mean ELBO terms per point.

    ``kl_weight`` multiplies the weight KL in the loss (1: the ELBO; diagnostics switch it off)."""
    n = len(data.y_train)
    perm = torch.randperm(n)
    sums = {}
    n_batches = 0
    for start in range(0, n, batch_size):
        idx = perm[start:start + batch_size]
        model.check_batch(data.x_train[idx], data.y_train[idx], n)  # (its errors are not the KL's, below)
        try:
            terms = model.elbo(data.x_train[idx], data.y_train[idx], n, n_samples)
        except ValueError as err:  # the estimator refusing its samples: said once, not as a traceback
            raise runs.RunError(f"the weight KL failed: {err} (if training diverged, try a smaller learning "
                                "rate)") from err
        opt.zero_grad(set_to_none=True)
        loss = terms["log_lik"] - kl_weight * terms["kl_weights"] - terms["kl_precision"]  # = elbo at weight 1
        (-loss / n).backward()  # per data point, so lr means the same for every set
        opt.step()
        for k, v in terms.items():
            sums[k] = sums.get(k, 0.0) + float(v.detach()) / n
        n_batches += 1
    return {k: v / n_batches for k, v in sums.items()}


# what a checkpoint of train_split holds: tensors (state dicts, torch's RNG state) and plain values;
# also "settings" (the RESUME_KEYS it was trained with), which checkpoints written before it lack
CHECKPOINT_KEYS = ("split", "epoch", "model", "optimizer", "rng", "history", "elapsed")


def train_split(args, split: int, run_dir: Path, callback=None) -> dict:
    """Train and evaluate one split, checkpointing to ``run_dir/checkpoint.pt``; resumes from it.

    ``args`` holds the settings of ``kivi-fast uci`` (dataset, method, epochs, ...; ``no_progress``
    hides the bar). ``callback(epoch)``, called after each epoch (after any checkpoint), may raise to
    interrupt.
    """
    data = datasets.load_split(args.dataset, split, args.data_dir)
    torch.manual_seed(args.seed * 1000 + split)
    model = build_model(args.dataset, data.x_train.shape[1], args.method, args.n_hidden, args.lam, args.samples,
                        args.generator_init)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    history: dict[str, list] = {"epoch": [], "elbo": [], "log_lik": [], "kl_weights": [], "kl_precision": [],
                                "eval_epoch": [], "rmse": [], "test_ll": []}
    start_epoch, elapsed = 0, 0.0
    ckpt_path = run_dir / "checkpoint.pt"
    ckpt = runs.load_checkpoint(ckpt_path, CHECKPOINT_KEYS)
    # the checkpoint carries the settings it was trained with: a run folder without config.json
    # (boston-posterior's, or one copied by hand) must not resume another run's model as this one's
    settings = {k: getattr(args, k, None) for k in RESUME_KEYS}
    if ckpt is not None and ckpt["split"] == split:
        _check_resumable(ckpt_path, ckpt, settings)
        try:
            model.load_state_dict(ckpt["model"])
            opt.load_state_dict(ckpt["optimizer"])
        except (RuntimeError, ValueError, KeyError) as err:  # another model's parameters
            raise runs.CheckpointError(f"{ckpt_path} holds another model than this run's ({args.dataset}, "
                                       f"{args.method}): {runs.state_dict_mismatch(err)}; remove it, or use "
                                       "another --run-dir") from None
        torch.set_rng_state(ckpt["rng"])
        history, start_epoch, elapsed = ckpt["history"], ckpt["epoch"], ckpt["elapsed"]

    def save(epoch):
        runs.save_checkpoint(ckpt_path, {"split": split, "epoch": epoch, "model": model.state_dict(),
                                         "optimizer": opt.state_dict(), "rng": torch.get_rng_state(),
                                         "history": history, "elapsed": elapsed, "settings": settings})

    last_save = time.time()
    bar = tqdm(range(start_epoch, args.epochs), initial=start_epoch, total=args.epochs, desc=f"split {split}",
               mininterval=2.0, dynamic_ncols=True, file=sys.stderr, disable=getattr(args, "no_progress", False))
    for epoch in bar:
        t0 = time.perf_counter()
        terms = train_epoch(model, opt, data, args.batch_size, args.samples)
        elapsed += time.perf_counter() - t0
        if not math.isfinite(terms["elbo"]):  # diverged: end with one line, keeping the last good checkpoint
            raise runs.RunError(f"split {split}: the training ELBO became {terms['elbo']} at epoch {epoch + 1} "
                                f"(try a smaller learning rate); {runs.last_checkpoint(run_dir)}")
        history["epoch"].append(epoch + 1)
        for k, v in terms.items():
            history[k].append(v)
        if (epoch + 1) % args.eval_every == 0 or epoch + 1 == args.epochs:
            metrics = evaluate(model, data, args.eval_samples, seed=epoch)
            history["eval_epoch"].append(epoch + 1)
            history["rmse"].append(metrics["rmse"])
            history["test_ll"].append(metrics["test_ll"])
        bar.set_postfix({"train ELBO/point": f"{terms['elbo']:.3f}",
                         "test RMSE": f"{history['rmse'][-1]:.3f}" if history["rmse"] else "-"}, refresh=False)
        if time.time() - last_save >= args.checkpoint_seconds or epoch + 1 == args.epochs:
            save(epoch + 1)
            last_save = time.time()
        if callback is not None:
            callback(epoch + 1)
    bar.close()

    final = evaluate(model, data, args.eval_samples, seed=10**6 + split)
    alpha, beta = float(model.precision.alpha.detach()), float(model.precision.beta.detach())
    epochs_run = max(args.epochs, 1)
    return {
        "split": split, **final,
        "elbo_per_point": history["elbo"][-1] if history["elbo"] else math.nan,
        "noise_alpha": alpha, "noise_beta": beta,
        # noise std in original units with the posterior mean precision alpha / beta
        "noise_std": math.sqrt(beta / alpha) * float(data.y_scaler.std),
        "epochs": args.epochs, "train_seconds": elapsed, "seconds_per_epoch": elapsed / epochs_run,
        "machine": runs.machine(), "history": history,
    }


# settings that must match for a run folder to be resumed (and for run folders to be pooled)
RESUME_KEYS = ("dataset", "method", "epochs", "samples", "lam", "batch_size", "lr", "n_hidden", "seed",
               "eval_samples", "eval_every", "generator_init")


def _check_resumable(path: Path, ckpt: dict, settings: dict) -> None:
    """Refuse a checkpoint trained with other settings (or for more epochs than asked). Checkpoints
    written before they carried their settings are trusted: the run folder's config.json vouches."""
    old = ckpt.get("settings")
    if isinstance(old, dict):
        differ = runs.config_differences(old, settings)
        if differ:
            said = ", ".join(f"{k} {a!r} there, {b!r} here" for k, (a, b) in differ.items())
            raise runs.CheckpointError(f"{path} was trained with other settings ({said}); remove it, or use "
                                       "another --run-dir")
    if ckpt["epoch"] > settings["epochs"]:
        raise runs.CheckpointError(f"{path} has trained {ckpt['epoch']} epochs, more than --epochs "
                                   f"{settings['epochs']}; remove it, or use another --run-dir")


def resume_config(old: dict) -> dict:
    """The resume keys of a run folder's config; folders from before --generator-init used torch's."""
    config = {k: old.get(k) for k in RESUME_KEYS}
    if "generator_init" not in old and old.get("method") != "factorized":
        config["generator_init"] = "torch"
    return config


def mean_se(values) -> tuple[float, float]:
    """Mean and standard error (sample std with n - 1, over sqrt n); the error is nan for one value."""
    v = np.asarray(values, dtype=float)
    se = float(v.std(ddof=1) / math.sqrt(len(v))) if len(v) > 1 else math.nan
    return float(v.mean()), se


def split_statistics(results: list[dict]) -> dict:
    """The summary's numbers over the splits run: mean and standard error of the test metrics, timings."""
    rmse, ll, ll_plugin = (mean_se([r[k] for r in results]) for k in ("rmse", "test_ll", "test_ll_plugin"))
    secs = [r["seconds_per_epoch"] for r in results]
    by_machine: dict[str, list[float]] = {}
    for r in results:
        by_machine.setdefault(machine_label(r.get("machine")), []).append(r["seconds_per_epoch"])
    return {
        "splits": [r["split"] for r in results], "n_splits": len(results),
        "rmse": {"mean": rmse[0], "se": rmse[1]},
        "test_ll": {"mean": ll[0], "se": ll[1],
                    "how": "log-mean-exp over posterior weight samples, precision integrated under "
                           "q(lambda) (Student-t), original units"},
        "test_ll_plugin": {"mean": ll_plugin[0], "se": ll_plugin[1],
                           "how": "as test_ll with the posterior mean precision alpha / beta"},
        "seconds_per_epoch": float(np.mean(secs)) if secs else math.nan,
        "seconds_per_split": float(np.mean([r["train_seconds"] for r in results])) if results else math.nan,
        # timings are only comparable on one machine: which ran the splits, and the time on each
        "machines": sorted(by_machine),
        "seconds_per_epoch_by_machine": {m: float(np.mean(v)) for m, v in sorted(by_machine.items())},
    }


def machine_label(machine: dict | None) -> str:
    if machine is None:
        return "not recorded"  # results from before splits recorded it
    return f"{machine['cores']} cores ({machine['cpu']}), torch {machine['torch']}"


def plot_training(results: list[dict], path: Path, title: str) -> None:
    """training.png: the training ELBO, test RMSE and test LL against epochs, one line per split."""
    plt = runs.matplotlib_pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    for r in results:
        h = r["history"]
        axes[0].plot(h["epoch"], h["elbo"], lw=0.8, label=f"split {r['split']}")
        axes[1].plot(h["eval_epoch"], h["rmse"], lw=0.8)
        axes[2].plot(h["eval_epoch"], h["test_ll"], lw=0.8)
    axes[0].set(xlabel="epoch", ylabel="training ELBO per data point", title=title)
    axes[1].set(xlabel="epoch", ylabel="test RMSE")
    axes[2].set(xlabel="epoch", ylabel="test log-likelihood")
    if len(results) <= 10:
        axes[0].legend(fontsize=7)
    lo = [np.percentile(r["history"]["elbo"], 5) for r in results if r["history"]["elbo"]]
    if lo:
        axes[0].set_ylim(bottom=min(lo))  # the first epochs' ELBO would squash the rest
    runs.save_figure(fig, path, dpi=110)
