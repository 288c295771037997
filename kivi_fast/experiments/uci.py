"""BNN regression on the UCI benchmarks (the paper's Sec. 5.2.1, Table 1, and the appendix table).

    python -m kivi_fast.cli uci --dataset boston --method kivi --splits 0-19

Protocol of the paper: one hidden layer of 50 ReLU units (100 for Protein), N(0, I) weight priors,
Gamma(6, 6) prior on the noise precision, n_p = n_q = M = 100, lam = 1e-3, batch 100, Adam with
learning rate 1e-3, 3000 epochs for sets under 1000 points and 500 for the others; implicit
posteriors are the MLP generators of the paper's table of implicit posteriors. Methods: ``kivi``
(the paper), ``kivi-ac`` (the same with adaptive contrast per layer) and ``factorized`` (mean-field
Gaussian VI with closed-form KL, in the same harness).

The run folder holds ``config.json``, ``split_XX.json`` per finished split, ``summary.json`` (mean and
standard error over splits beside the paper's numbers), ``profile.json`` (where one epoch's time
goes), ``training.png`` and ``checkpoint.pt``; rerunning with the same ``--run-dir`` resumes where
it stopped, with the same result as an uninterrupted run.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from .. import bnn
from ..data import uci as uci_data
from ..models import FactorizedGaussian, MLPGenerator
from ..models.mlp_generator import INITS
from . import runs

METHODS = ("kivi", "kivi-ac", "factorized")

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


def parse_splits(text: str | None, n: int) -> list[int]:
    """"0-19", "0,3,5", "2" or None (all n splits) -> sorted split numbers."""
    if not text:
        return list(range(n))
    out: set[int] = set()
    for part in text.split(","):
        a, _, b = part.strip().partition("-")
        out.update(range(int(a), int(b or a) + 1))
    bad = [s for s in out if not 0 <= s < n]
    if bad:
        raise ValueError(f"splits {sorted(bad)} out of range 0..{n - 1}")
    return sorted(out)


def build_model(dataset: str, n_features: int, method: str, n_hidden: int, lam: float, n_samples: int,
                generator_init: str = "glorot"):
    """The BNN (D, hidden, 1) with the posterior of ``method`` for each of its two weight matrices."""
    layer_sizes = (n_features, n_hidden, 1)
    dims = [(n_in + 1) * n_out for n_in, n_out in zip(layer_sizes[:-1], layer_sizes[1:])]
    if method == "factorized":
        posteriors = [FactorizedGaussian(d) for d in dims]
    else:
        posteriors = [MLPGenerator([d if s == "N" else s for s in sizes], init=generator_init)
                      for sizes, d in zip(PAPER_POSTERIORS[dataset], dims)]
    return bnn.RegressionBNN(layer_sizes, posteriors, kl_method=method, lam=lam, n_prior=n_samples)


def _evaluate(model, data: uci_data.Split, n_samples: int, seed: int) -> dict[str, float]:
    # own RNG stream, so that how often we evaluate never changes the training trajectory
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return bnn.evaluate(model, data.x_test, data.y_test_raw, float(data.y_scaler.mean),
                            float(data.y_scaler.std), n_samples)


def _train_epoch(model, opt, data: uci_data.Split, batch_size: int, n_samples: int,
                 kl_weight: float = 1.0) -> dict[str, float]:
    """One pass over a random permutation of the training set; returns the mean ELBO terms per point.

    ``kl_weight`` multiplies the weight KL in the loss (1: the ELBO; diagnostics switch it off)."""
    n = len(data.y_train)
    perm = torch.randperm(n)
    sums = {}
    n_batches = 0
    for start in range(0, n, batch_size):
        idx = perm[start:start + batch_size]
        terms = model.elbo(data.x_train[idx], data.y_train[idx], n, n_samples)
        opt.zero_grad(set_to_none=True)
        loss = terms["log_lik"] - kl_weight * terms["kl_weights"] - terms["kl_precision"]  # = elbo at weight 1
        (-loss / n).backward()  # per data point, so lr means the same for every set
        opt.step()
        for k, v in terms.items():
            sums[k] = sums.get(k, 0.0) + float(v.detach()) / n
        n_batches += 1
    return {k: v / n_batches for k, v in sums.items()}


def train_split(args, split: int, run_dir: Path, callback=None) -> dict:
    """Train and evaluate one split, checkpointing to ``run_dir/checkpoint.pt``; resumes from it.

    ``callback(epoch)``, called after each epoch (after any checkpoint), may raise to interrupt.
    """
    data = uci_data.load_split(args.dataset, split, args.data_dir)
    torch.manual_seed(args.seed * 1000 + split)
    model = build_model(args.dataset, data.x_train.shape[1], args.method, args.n_hidden, args.lam, args.samples,
                        args.generator_init)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    history: dict[str, list] = {"epoch": [], "elbo": [], "log_lik": [], "kl_weights": [], "kl_precision": [],
                                "eval_epoch": [], "rmse": [], "test_ll": []}
    start_epoch, elapsed = 0, 0.0
    ckpt_path = run_dir / "checkpoint.pt"
    ckpt = runs.load_checkpoint(ckpt_path)
    if ckpt is not None and ckpt["split"] == split:
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        torch.set_rng_state(ckpt["rng"])
        history, start_epoch, elapsed = ckpt["history"], ckpt["epoch"], ckpt["elapsed"]

    def save(epoch):
        runs.save_checkpoint(ckpt_path, {"split": split, "epoch": epoch, "model": model.state_dict(),
                                         "optimizer": opt.state_dict(), "rng": torch.get_rng_state(),
                                         "history": history, "elapsed": elapsed})

    last_save = time.time()
    bar = tqdm(range(start_epoch, args.epochs), initial=start_epoch, total=args.epochs, desc=f"split {split}",
               mininterval=2.0, dynamic_ncols=True, file=sys.stderr)
    for epoch in bar:
        t0 = time.perf_counter()
        terms = _train_epoch(model, opt, data, args.batch_size, args.samples)
        elapsed += time.perf_counter() - t0
        history["epoch"].append(epoch + 1)
        for k, v in terms.items():
            history[k].append(v)
        if (epoch + 1) % args.eval_every == 0 or epoch + 1 == args.epochs:
            metrics = _evaluate(model, data, args.eval_samples, seed=epoch)
            history["eval_epoch"].append(epoch + 1)
            history["rmse"].append(metrics["rmse"])
            history["test_ll"].append(metrics["test_ll"])
        bar.set_postfix(elbo=f"{terms['elbo']:.3f}", rmse=f"{history['rmse'][-1]:.3f}" if history["rmse"] else "-",
                        refresh=False)
        if time.time() - last_save >= args.checkpoint_seconds or epoch + 1 == args.epochs:
            save(epoch + 1)
            last_save = time.time()
        if callback is not None:
            callback(epoch + 1)
    bar.close()

    final = _evaluate(model, data, args.eval_samples, seed=10**6 + split)
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


def profile_epoch(args, run_dir: Path) -> dict:
    """Where one epoch's time goes (split 0): a full training epoch against the same steps doing only
    the weight KL (sampling + KL + its backward) and only the likelihood (sampling + forward + backward).

    Both partial passes include sampling the weights (and its backward), so the two shares overlap and
    may add up to more than 1; ``kl_share`` is what the KL estimator costs beyond plain reparameterized VI
    at most, and 1 - likelihood_share at least.
    """
    data = uci_data.load_split(args.dataset, 0, args.data_dir)
    n = len(data.y_train)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(12345)
        model = build_model(args.dataset, data.x_train.shape[1], args.method, args.n_hidden, args.lam, args.samples,
                            args.generator_init)
        opt = torch.optim.Adam(model.parameters(), lr=args.lr)
        warm = copy.deepcopy(model)  # warm-up (allocator, one-time dispatch) on a throw-away copy
        _train_epoch(warm, torch.optim.Adam(warm.parameters(), lr=args.lr), data, args.batch_size, args.samples)
        t0 = time.perf_counter()
        _train_epoch(model, opt, data, args.batch_size, args.samples)
        full = time.perf_counter() - t0

        def timed(part):
            t = time.perf_counter()
            for start in range(0, n, args.batch_size):
                xb, yb = data.x_train[start:start + args.batch_size], data.y_train[start:start + args.batch_size]
                flat = model.sample_weights(args.samples)
                if part == "kl":
                    loss = torch.stack(model.layer_kls(flat)).sum()
                else:
                    y_hat = bnn.mlp_forward(xb, model.weight_matrices(flat))
                    loss = -model.precision.expected_log_likelihood(yb, y_hat).mean()
                model.zero_grad(set_to_none=True)
                loss.backward()
            return time.perf_counter() - t

        kl_time, lik_time = timed("kl"), timed("likelihood")
    out = {"dataset": args.dataset, "method": args.method, "batches": math.ceil(n / args.batch_size),
           "threads": torch.get_num_threads(), "backend": _backend_name(),
           "epoch_seconds": full, "kl_only_seconds": kl_time, "likelihood_only_seconds": lik_time,
           "kl_share": kl_time / full, "likelihood_share": lik_time / full}
    runs.write_json(run_dir / "profile.json", out)
    return out


def _read_json(path: Path):
    return json.loads(Path(path).read_text())


def _backend_name() -> str:
    import kivi_fast

    return kivi_fast.backend()


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


def summarize(args, results: list[dict], profile: dict | None) -> dict:
    return {
        "dataset": args.dataset, "method": args.method, **split_statistics(results),
        "epochs": args.epochs, "n_hidden": args.n_hidden, "samples": args.samples,
        "lam": args.lam, "batch_size": args.batch_size, "lr": args.lr, "seed": args.seed,
        "generator_init": args.generator_init,
        "eval_samples": args.eval_samples, "backend": _backend_name(), "threads": torch.get_num_threads(),
        "paper": {k: dict(zip(("rmse", "rmse_err", "test_ll", "test_ll_err"), v))
                  for k, v in PAPER_RESULTS.get(args.dataset, {}).items()},
        "profile": profile, "command": args.command_line,
    }


def format_table(summary: dict) -> str:
    def cell(m, e, digits):
        return f"{m:.{digits}f} ± {e:.{digits}f}" if not math.isnan(e) else f"{m:.{digits}f} ± n/a"

    digits = 4 if summary["dataset"] == "naval" else 3
    name = f"ours ({summary['method']}, {summary['n_splits']} splits)"
    rows = [(name, cell(summary["rmse"]["mean"], summary["rmse"]["se"], digits),
             cell(summary["test_ll"]["mean"], summary["test_ll"]["se"], 3))]
    for method, p in summary["paper"].items():
        rows.append((f"paper {method}", cell(p["rmse"], p["rmse_err"], digits), cell(p["test_ll"], p["test_ll_err"], 3)))
    width = max(len(r[0]) for r in rows) + 2
    lines = [f"{summary['dataset']}: {summary['epochs']} epochs, {summary['seconds_per_epoch']:.3f} s/epoch",
             f"{'':<{width}}{'test RMSE':>18}{'test LL':>18}"]
    lines += [f"{r[0]:<{width}}{r[1]:>18}{r[2]:>18}" for r in rows]
    return "\n".join(lines)


def plot(results: list[dict], path: Path, title: str) -> None:
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


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset", default="boston", choices=sorted(list(uci_data.DATASETS) + list(uci_data.UNAVAILABLE)))
    p.add_argument("--method", default="kivi", choices=METHODS)
    p.add_argument("--splits", default=None, help='e.g. "0-19" or "0,3,5" (default: all splits of the set)')
    p.add_argument("--epochs", type=int, default=None, help="default: the paper's (3000 under 1000 points, else 500)")
    p.add_argument("--samples", type=int, default=100, help="n_p = n_q = M (paper: 100)")
    p.add_argument("--lam", type=float, default=1e-3)
    p.add_argument("--batch-size", type=int, default=100)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--n-hidden", type=int, default=None, help="default: 50, 100 for protein")
    p.add_argument("--eval-samples", type=int, default=100, help="posterior samples for the test metrics")
    p.add_argument("--eval-every", type=int, default=None, help="epochs between test evaluations for the curves")
    p.add_argument("--checkpoint-seconds", type=float, default=30.0)
    p.add_argument("--threads", type=int, default=1, help="torch threads (the machine is shared)")
    p.add_argument("--no-profile", action="store_true", help="skip the one-epoch profile")
    p.add_argument("--data-dir", default=None, help=f"UCI_Datasets folder (default {uci_data.DEFAULT_DATA_DIR})")
    p.add_argument("--out", default="runs")
    p.add_argument("--run-dir", default=None, help="run folder to use (and resume from)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--generator-init", default="glorot", choices=INITS,
                   help="initialization of the implicit posteriors (MLPGenerator): glorot (default) or torch")


# settings that must match for a run folder to be resumed
_RESUME_KEYS = ("dataset", "method", "epochs", "samples", "lam", "batch_size", "lr", "n_hidden", "seed",
                "eval_samples", "eval_every", "generator_init")



def _old_config(old: dict) -> dict:
    """The resume keys of a run folder's config; folders from before --generator-init used torch's."""
    config = {k: old.get(k) for k in _RESUME_KEYS}
    if "generator_init" not in old and old.get("method") != "factorized":
        config["generator_init"] = "torch"
    return config


def run(args, callback=None) -> int:
    if args.dataset in uci_data.UNAVAILABLE:
        print(uci_data.UNAVAILABLE[args.dataset], file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    n_rows = len(uci_data.load_arrays(args.dataset, args.data_dir)[1])
    args.epochs = args.epochs if args.epochs is not None else paper_epochs(n_rows)
    args.n_hidden = args.n_hidden or uci_data.DATASETS[args.dataset].n_hidden
    args.eval_every = args.eval_every or max(1, args.epochs // 30)
    if args.method == "factorized":
        args.generator_init = None  # no generator
    args.command_line = getattr(args, "command_line", None) or " ".join(["python -m kivi_fast.cli uci"] + sys.argv[2:])
    splits = parse_splits(args.splits, uci_data.n_splits(args.dataset, args.data_dir))

    run_dir = runs.run_folder(args.out, f"uci-{args.dataset}-{args.method}", args.run_dir)
    config = {k: getattr(args, k) for k in _RESUME_KEYS}
    old = _read_json(run_dir / "config.json") if (run_dir / "config.json").exists() else None
    if old is not None and _old_config(old) != config:
        print(f"{run_dir} holds a run with other settings ({old}); use another --run-dir", file=sys.stderr)
        return 2
    runs.write_json(run_dir / "config.json", {**config, "splits": splits, "data_dir": str(args.data_dir or "")})
    print(f"run folder: {run_dir}", file=sys.stderr)

    profile = _read_json(run_dir / "profile.json") if (run_dir / "profile.json").exists() else None
    if profile is None and not args.no_profile:
        profile = profile_epoch(args, run_dir)
        print(f"profile of one epoch: {profile['epoch_seconds']:.3f} s, weight KL {100 * profile['kl_share']:.0f}%, "
              f"likelihood {100 * profile['likelihood_share']:.0f}%", file=sys.stderr)

    results = []
    for split in splits:
        path = run_dir / f"split_{split:02d}.json"
        if path.exists():
            results.append(_read_json(path))
            continue
        result = train_split(args, split, run_dir, callback)
        runs.write_json(path, result)
        results.append(result)
        print(f"split {split}: rmse {result['rmse']:.3f}  test ll {result['test_ll']:.3f}  "
              f"({result['seconds_per_epoch']:.3f} s/epoch)", file=sys.stderr)
        summary = summarize(args, results, profile)
        runs.write_json(run_dir / "summary.json", summary)
        plot(results, run_dir / "training.png", f"{args.dataset}, {args.method}")

    summary = summarize(args, results, profile)
    runs.write_json(run_dir / "summary.json", summary)
    plot(results, run_dir / "training.png", f"{args.dataset}, {args.method}")
    print(format_table(summary))
    return 0
