"""``kivi-fast uci``: BNN regression on the UCI benchmarks (the paper's Sec. 5.2.1, Table 1, and the
appendix table).

    python -m kivi_fast.cli uci --dataset boston --method kivi --splits 0-19
    python -m kivi_fast.cli uci --quick            # a smoke run in seconds (split 0, 10 epochs)

Protocol of the paper: one hidden layer of 50 ReLU units (100 for Protein), N(0, I) weight priors,
Gamma(6, 6) prior on the noise precision, n_p = n_q = M = 100, lam = 1e-3, batch 100, Adam with
learning rate 1e-3, 3000 epochs for sets under 1000 points and 500 for the others; implicit
posteriors are the MLP generators of the paper's table of implicit posteriors. Methods: ``kivi``
(the paper), ``kivi-ac`` (the same with the paper's adaptive contrast per layer), ``kivi-contrast``
(``kivi_fast.kl``'s defaults: Gaussian contrast of both sample sets, lam = 1e-2; not the paper's) and
``factorized`` (mean-field Gaussian VI with closed-form KL, in the same harness:
:mod:`kivi_fast.experiments.regression`).

The run folder holds ``config.json``, ``split_XX.json`` per finished split, ``summary.json`` (mean and
standard error over splits beside the paper's numbers), ``profile.json`` (where one epoch's time
goes), ``training.png`` and ``checkpoint.pt``; rerunning with the same ``--run-dir`` resumes where
it stopped, with the same result as an uninterrupted run.
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import time
from pathlib import Path

import torch

import kivi_fast

from ..nn import bnn
from ..nn.generator import INITS
from . import datasets, regression, runs
from .options import (UsageError, add_common, apply_quick, check_prior_samples, int_at_least, kivi_lam,
                      nonnegative_float, plural, positive_float, positive_int, random_seed, thread_count)

QUICK_EPOCHS = 10


def run_name(dataset: str, method: str) -> str:
    """The kind of run a uci run folder holds (runs.RUN_MARKER's text): one data set and method."""
    return f"uci-{dataset}-{method}"


def dataset_name(text: str) -> str:
    """An argparse type: a UCI data set this project can run (``year`` is refused with the reason)."""
    if text in datasets.UNAVAILABLE:
        raise argparse.ArgumentTypeError(f"{text!r}: {datasets.UNAVAILABLE[text]}")
    return text


def split_spec(text: str) -> str:
    """An argparse type: splits as "0-19", "0,3,5" or "2" (whether the data set has them is checked
    when it is known)."""
    try:
        regression.parse_splits(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


def profile_epoch(args, run_dir: Path) -> dict:
    """Where one epoch's time goes (split 0): a full training epoch against the same steps doing only
    the weight KL (sampling + KL + its backward) and only the likelihood (sampling + forward + backward).

    Both partial passes include sampling the weights (and its backward), so the two shares overlap and
    may add up to more than 1; ``kl_share`` is what the KL estimator costs beyond plain reparameterized VI
    at most, and 1 - likelihood_share at least.
    """
    data = datasets.load_split(args.dataset, 0, args.data_dir)
    n = len(data.y_train)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(12345)
        model = regression.build_model(args.dataset, data.x_train.shape[1], args.method, args.n_hidden, args.lam,
                                       args.samples, args.generator_init)
        opt = torch.optim.Adam(model.parameters(), lr=args.lr)
        warm = copy.deepcopy(model)  # warm-up (allocator, one-time dispatch) on a throw-away copy
        regression.train_epoch(warm, torch.optim.Adam(warm.parameters(), lr=args.lr), data, args.batch_size,
                               args.samples)
        t0 = time.perf_counter()
        regression.train_epoch(model, opt, data, args.batch_size, args.samples)
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
           "threads": torch.get_num_threads(), "backend": kivi_fast.backend(),
           "epoch_seconds": full, "kl_only_seconds": kl_time, "likelihood_only_seconds": lik_time,
           "kl_share": kl_time / full, "likelihood_share": lik_time / full}
    runs.write_json(run_dir / "profile.json", out)
    return out


def summarize(args, results: list[dict], profile: dict | None) -> dict:
    return {
        "dataset": args.dataset, "method": args.method, **regression.split_statistics(results),
        "epochs": args.epochs, "n_hidden": args.n_hidden, "samples": args.samples,
        "lam": args.lam, "batch_size": args.batch_size, "lr": args.lr, "seed": args.seed,
        "generator_init": args.generator_init,
        "eval_samples": args.eval_samples, "backend": kivi_fast.backend(), "threads": torch.get_num_threads(),
        "paper": {k: dict(zip(("rmse", "rmse_err", "test_ll", "test_ll_err"), v))
                  for k, v in regression.PAPER_RESULTS.get(args.dataset, {}).items()},
        "profile": profile, "command": args.command_line,
    }


def format_table(summary: dict) -> str:
    def cell(m, e, digits):
        return f"{m:.{digits}f} ± {e:.{digits}f}" if not math.isnan(e) else f"{m:.{digits}f} ± n/a"

    digits = 4 if summary["dataset"] == "naval" else 3
    name = f"ours ({summary['method']}, {plural(summary['n_splits'], 'split')})"
    rows = [(name, cell(summary["rmse"]["mean"], summary["rmse"]["se"], digits),
             cell(summary["test_ll"]["mean"], summary["test_ll"]["se"], 3))]
    for method, p in summary["paper"].items():
        rows.append((f"paper {method}", cell(p["rmse"], p["rmse_err"], digits), cell(p["test_ll"], p["test_ll_err"], 3)))
    width = max(len(r[0]) for r in rows) + 2
    lines = [f"{summary['dataset']}: {plural(summary['epochs'], 'epoch')}, {summary['seconds_per_epoch']:.3f} s/epoch",
             f"{'':<{width}}{'test RMSE':>18}{'test LL':>18}"]
    lines += [f"{r[0]:<{width}}{r[1]:>18}{r[2]:>18}" for r in rows]
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset", default="boston", type=dataset_name, choices=sorted(datasets.DATASETS),
                   help="UCI data set (year, the paper's tenth, is not available offline)")
    p.add_argument("--method", default="kivi", choices=regression.METHODS,
                   help="kivi: the paper's KIVI; kivi-ac: with the paper's adaptive contrast per layer; "
                        "kivi-contrast: kivi_fast.kl's defaults (Gaussian contrast, lam 1e-2); factorized: "
                        "mean-field Gaussian VI (closed-form KL)")
    p.add_argument("--splits", default=None, type=split_spec,
                   help='standard splits to run, e.g. "0-19" or "0,3,5" (default: all splits of the set)')
    p.add_argument("--epochs", type=positive_int, default=None,
                   help="training epochs per split (default: the paper's, 3000 under 1000 data points, else 500)")
    p.add_argument("--samples", type=int_at_least(2), default=100,
                   help="posterior and prior samples per step, n_p = n_q = M (paper: 100)")
    p.add_argument("--lam", type=kivi_lam, default=None,
                   help="KIVI's ridge coefficient lambda (default: the paper's 1e-3; 1e-2 for kivi-contrast)")
    p.add_argument("--batch-size", type=positive_int, default=100, help="minibatch size")
    p.add_argument("--lr", type=positive_float, default=1e-3, help="Adam learning rate")
    p.add_argument("--n-hidden", type=positive_int, default=None,
                   help="hidden units of the BNN (default: 50, 100 for protein)")
    p.add_argument("--eval-samples", type=positive_int, default=100, help="posterior samples for the test metrics")
    p.add_argument("--eval-every", type=positive_int, default=None,
                   help="epochs between test evaluations for the curves (default: a 30th of the epochs)")
    p.add_argument("--checkpoint-seconds", type=nonnegative_float, default=30.0,
                   help="seconds between checkpoints (0: after every epoch)")
    p.add_argument("--threads", type=thread_count, default=1, help="torch CPU threads (the machine is shared)")
    p.add_argument("--no-profile", action="store_true", help="skip the one-epoch profile (profile.json)")
    p.add_argument("--data-dir", default=None,
                   help=f"folder holding the UCI sets' folders (default: ${datasets.ENV_VAR}, else the source "
                        "checkout's data/UCI_Datasets)")
    p.add_argument("--seed", type=random_seed, default=0, help="random seed (split s uses seed * 1000 + s)")
    p.add_argument("--generator-init", default="glorot", choices=INITS,
                   help="initialization of the implicit posteriors (MLPGenerator): Glorot-uniform (TensorFlow's, "
                        "the paper's code base) or torch.nn.Linear's")
    add_common(p, name="uci-<dataset>-<method>",
               quick=f"a smoke run in seconds: at most {QUICK_EPOCHS} epochs, split 0 unless --splits, no profile")


def run(args, callback=None) -> int:
    if args.dataset in datasets.UNAVAILABLE:  # for callers that bypass the argparse type
        raise UsageError(datasets.UNAVAILABLE[args.dataset])
    torch.set_num_threads(args.threads)
    n_rows = len(datasets.load_arrays(args.dataset, args.data_dir)[1])
    args.epochs = args.epochs if args.epochs is not None else regression.paper_epochs(n_rows)
    apply_quick(args, {"epochs": QUICK_EPOCHS, "splits": args.splits or "0", "no_profile": True})
    args.n_hidden = args.n_hidden or datasets.DATASETS[args.dataset].n_hidden
    if args.lam is None:
        args.lam = regression.default_lam(args.method)
    args.eval_every = args.eval_every or max(1, args.epochs // 30)
    if args.method == "factorized":
        args.generator_init = None  # no generator
    if args.method == "kivi-contrast":
        check_prior_samples("--samples", args.samples, "kivi-contrast")
    args.command_line = getattr(args, "command_line", None) or " ".join(["python -m kivi_fast.cli uci"] + sys.argv[2:])
    try:
        splits = regression.parse_splits(args.splits, datasets.n_splits(args.dataset, args.data_dir))
    except ValueError as err:
        raise UsageError(f"argument --splits: {err} ({args.dataset} has "
                         f"{plural(datasets.n_splits(args.dataset, args.data_dir), 'split')})") from None

    run_dir = runs.run_folder(args.out, run_name(args.dataset, args.method), args.run_dir)
    config = {k: getattr(args, k) for k in regression.RESUME_KEYS}
    old = runs.read_json(run_dir / "config.json") if (run_dir / "config.json").exists() else None
    if old is not None and regression.resume_config(old) != config:
        said = ", ".join(f"{k} {a!r} there, {b!r} here" for k, (a, b) in
                         runs.config_differences(regression.resume_config(old), config).items())
        raise UsageError(f"--run-dir: {run_dir} holds a run with other settings ({said}); use another --run-dir")
    runs.write_json(run_dir / "config.json", {**config, "splits": splits, "data_dir": str(args.data_dir or "")})
    print(f"run folder: {run_dir}", file=sys.stderr)

    profile = runs.read_json(run_dir / "profile.json") if (run_dir / "profile.json").exists() else None
    if profile is None and not args.no_profile:
        profile = profile_epoch(args, run_dir)
        print(f"profile of one epoch: {profile['epoch_seconds']:.3f} s, weight KL {100 * profile['kl_share']:.0f}%, "
              f"likelihood {100 * profile['likelihood_share']:.0f}%", file=sys.stderr)

    results = []
    title = f"{args.dataset}, {args.method}"
    for split in splits:
        path = run_dir / f"split_{split:02d}.json"
        if path.exists():
            results.append(runs.read_json(path))
            continue
        result = regression.train_split(args, split, run_dir, callback)
        runs.write_json(path, result)
        results.append(result)
        print(f"split {split}: rmse {result['rmse']:.3f}  test ll {result['test_ll']:.3f}  "
              f"({result['seconds_per_epoch']:.3f} s/epoch)", file=sys.stderr)
        runs.write_json(run_dir / "summary.json", summarize(args, results, profile))
        regression.plot_training(results, run_dir / "training.png", title)

    summary = summarize(args, results, profile)
    runs.write_json(run_dir / "summary.json", summary)
    regression.plot_training(results, run_dir / "training.png", title)
    print(format_table(summary))
    return 0
