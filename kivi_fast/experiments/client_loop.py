"""``kivi-fast client-loop``: how often a user's training loop recovers a known posterior, over seeds.

The loop a user writes first: implicit posteriors (an MLP generator fed Gaussian noise) for Bayesian
linear regression, whose posterior is Gaussian in closed form, trained on the ELBO in float32 with Adam
at a *constant* learning rate. A training loop is chaotic, so one seed says little: each estimator
setting trains ``--seeds`` generators (one per seed: its initialization) at once, with one batched
estimator call a step on samples of shape [seeds, samples, d] (batch elements are independent, so these
are independent runs), and the study counts the seeds that end on target.

The model: x_i ~ N(0, I_d), w ~ N(0, I_d), y_i = w^T x_i + noise, noise ~ N(0, ``--noise``^2), i = 1..n
(``--n-data``; x and y fixed by ``--data-seed``). The posterior is N(mu, Sigma) with
Sigma = (I + X^T X / s^2)^{-1}, mu = Sigma X^T y / s^2 (:func:`blr_problem`).

Estimator settings (``--settings``):

* ``kl-paper``: ``kivi_fast.kernel_kl(prior samples, w, lam=1e-3)``, the paper's estimator and defaults;
* ``kl``: ``kivi_fast.kl(prior samples, w)``, the library's defaults (Gaussian contrast on both sides,
  full covariance here, lam = 1e-2): what a user with only prior samples calls;
* ``ac-paper``: ``kivi_fast.adaptive_contrast_kl(w, contrast="diagonal", lam=1e-3)``, Appendix D as the
  paper sets it;
* ``ac``: ``kivi_fast.adaptive_contrast_kl(w)``, the library's defaults (here full-covariance contrast,
  lam = 1e-2).

Target (the estimator-quality issue's, as in ``amortized``): the max over dimensions of
|mean_q - mu| / sqrt(Sigma_ii) below 0.2, and every variance ratio var_q / Sigma_ii in [0.7, 1.4], for
the final generator, measured on ``--eval-samples`` samples.

Outputs: ``results.json`` (config, the problem, every seed's metrics per setting), ``table.md`` and
``seeds.png`` (each seed's mean error against its worst variance ratio).
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from torch import nn
from tqdm.auto import tqdm

import kivi_fast

from . import runs
from .amortized import TARGET_MEAN_ERROR, TARGET_RATIOS, meets_target, worst_ratio  # the same target
from .options import add_common, check_prior_samples, int_at_least, plural, positive_float, positive_int, random_seed

NAME = "client-loop"
SETTINGS = ("kl-paper", "kl", "ac-paper", "ac")
QUICK = {"steps": 20, "seeds": 2, "eval_samples": 500}


def blr_problem(d: int, n: int, noise: float, seed: int):
    """(x [n, d], y [n], mu [d], Sigma [d, d]) of Bayesian linear regression with a N(0, I) prior, float64."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    w_true = torch.randn(d, generator=g, dtype=torch.float64)
    y = x @ w_true + noise * torch.randn(n, generator=g, dtype=torch.float64)
    sigma = torch.linalg.inv(torch.eye(d, dtype=torch.float64) + x.T @ x / noise**2)
    return x, y, sigma @ x.T @ y / noise**2, sigma


def kl_term(setting: str, w: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """KL(q || N(0, I)) per seed from the samples w [S, n, d], as ``setting`` estimates it."""
    if setting in ("kl-paper", "kl"):
        prior = torch.randn(w.shape, generator=generator, dtype=w.dtype)
        if setting == "kl-paper":
            return kivi_fast.kernel_kl(prior, w, 1e-3)
        return kivi_fast.kl(prior, w, generator=generator)
    if setting == "ac-paper":
        return kivi_fast.adaptive_contrast_kl(w, None, 1e-3, contrast="diagonal", generator=generator)
    if setting == "ac":
        return kivi_fast.adaptive_contrast_kl(w, generator=generator)
    raise ValueError(f"setting must be one of {SETTINGS}, got {setting!r}")


def train(setting: str, seeds, *, d: int = 4, n_data: int = 30, noise: float = 0.5, data_seed: int = 0,
          steps: int = 1500, lr: float = 3e-3, samples: int = 100, noise_dim: int = 8, hidden: int = 32,
          eval_samples: int = 20000, dtype=torch.float32, on_step=None) -> list[dict]:
    """Train one generator per seed at once; returns each one's mean error and variance ratios."""
    x, y, mu, sigma = blr_problem(d, n_data, noise, data_seed)
    xs, ys = x.to(dtype), y.to(dtype)
    generators = []
    for seed in seeds:
        torch.manual_seed(seed)
        generators.append(nn.Sequential(nn.Linear(noise_dim, hidden), nn.Tanh(), nn.Linear(hidden, d)).to(dtype))
    opt = torch.optim.Adam([p for g in generators for p in g.parameters()], lr=lr)
    rng = torch.Generator().manual_seed(10_000 + min(seeds))
    log_norm = math.log(noise) + 0.5 * math.log(2 * math.pi)
    for _ in range(steps):
        w = torch.stack([g(torch.randn(samples, noise_dim, generator=rng, dtype=dtype)) for g in generators])
        log_lik = (-0.5 * ((ys - w @ xs.T) / noise) ** 2 - log_norm).sum(-1)  # [S, samples]
        loss = (kl_term(setting, w, rng) - log_lik.mean(-1)).sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if on_step is not None:
            on_step()
    sd = sigma.diagonal().sqrt()
    out = []
    with torch.no_grad():
        for seed, g in zip(seeds, generators):
            w = g(torch.randn(eval_samples, noise_dim, generator=rng, dtype=dtype)).double()
            m = {"seed": seed, "mean_error": float(((w.mean(0) - mu).abs() / sd).max()),
                 "var_ratios": (w.var(0) / sigma.diagonal()).tolist()}
            m["meets_target"] = meets_target(m)
            out.append(m)
    return out


def markdown_table(results: dict, args) -> str:
    lines = [f"{plural(args.seeds, 'seed')} per setting, {args.steps} Adam steps at a constant lr {args.lr:g}, "
             f"{args.samples} samples, float32, d = {args.dim}. Target: mean error < {TARGET_MEAN_ERROR} posterior "
             f"std and every variance ratio in [{TARGET_RATIOS[0]}, {TARGET_RATIOS[1]}].", "",
             "| setting | on target | mean err. median | mean err. worst | worst var. ratio | var. ratios range |",
             "|---|---|---|---|---|---|"]
    for setting, rows in results.items():
        errors = sorted(r["mean_error"] for r in rows)
        ratios = [v for r in rows for v in r["var_ratios"]]
        lines.append(f"| {setting} | {sum(r['meets_target'] for r in rows)}/{len(rows)} | "
                     f"{errors[len(errors) // 2]:.3g} | {errors[-1]:.3g} | {worst_ratio(ratios):.3g} | "
                     f"{min(ratios):.3g}-{max(ratios):.3g} |")
    lines += ["", "Per seed:", "", "| setting | seed | mean err. | variance ratios | on target |", "|---|---|---|---|---|"]
    for setting, rows in results.items():
        for r in rows:
            lines.append(f"| {setting} | {r['seed']} | {r['mean_error']:.3g} | "
                         f"{', '.join(f'{v:.3g}' for v in r['var_ratios'])} | {'yes' if r['meets_target'] else 'no'} |")
    return "\n".join(lines) + "\n"


def plot(path, results: dict) -> None:
    plt = runs.matplotlib_pyplot()
    fig, ax = plt.subplots(figsize=(6, 4.2))
    for setting, rows in results.items():
        ax.scatter([r["mean_error"] for r in rows], [max(worst_ratio(r["var_ratios"]), 1e-3) for r in rows],
                   label=setting, alpha=0.7)
    ax.axvline(TARGET_MEAN_ERROR, color="0.5", ls="--", lw=0.8)
    for v in TARGET_RATIOS:
        ax.axhline(v, color="0.5", ls="--", lw=0.8)
    ax.set(xscale="log", yscale="log", xlabel="mean error (posterior stds)", ylabel="worst variance ratio",
           title="one dot per seed; the target is the dashed box")
    ax.legend()
    runs.save_figure(fig, path)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--settings", nargs="+", choices=SETTINGS, default=list(SETTINGS),
                        help="estimator settings to train with")
    parser.add_argument("--seeds", type=positive_int, default=16, help="generators (seeds) per setting")
    parser.add_argument("--seed", type=random_seed, default=0, help="first seed")
    parser.add_argument("--steps", type=positive_int, default=1500, help="Adam steps")
    parser.add_argument("--lr", type=positive_float, default=3e-3, help="Adam's learning rate, constant")
    parser.add_argument("--samples", type=int_at_least(2), default=100, help="posterior samples per step")
    parser.add_argument("--dim", type=positive_int, default=4, help="number of regression weights d")
    parser.add_argument("--n-data", type=positive_int, default=30, help="data points")
    parser.add_argument("--noise", type=positive_float, default=0.5, help="observation noise std")
    parser.add_argument("--data-seed", type=random_seed, default=0, help="seed of the data")
    parser.add_argument("--eval-samples", type=int_at_least(2), default=20000,
                        help="samples per generator for the final moments")
    add_common(parser, name=NAME, quick="a seconds-long smoke run (2 seeds, 20 steps)")


def run(args) -> int:
    if "kl" in args.settings:
        check_prior_samples("--samples", args.samples, "kl")
    out = runs.begin(args, NAME, QUICK)
    t0 = time.time()
    seeds = list(range(args.seed, args.seed + args.seeds))
    results = {}
    with tqdm(total=len(args.settings) * args.steps, desc="training steps", disable=args.no_progress) as bar:
        for setting in args.settings:
            bar.set_postfix_str(setting)
            results[setting] = train(setting, seeds, d=args.dim, n_data=args.n_data, noise=args.noise,
                                     data_seed=args.data_seed, steps=args.steps, lr=args.lr, samples=args.samples,
                                     eval_samples=args.eval_samples, on_step=bar.update)
    _, _, mu, sigma = blr_problem(args.dim, args.n_data, args.noise, args.data_seed)
    runs.write_json(out / "results.json", {
        "config": {k: v for k, v in vars(args).items() if not k.startswith("_")}, "machine": runs.machine(),
        "backend": kivi_fast.backend(), "posterior": {"mean": mu.tolist(), "cov": sigma.tolist()},
        "results": results, "elapsed_s": time.time() - t0})
    table = markdown_table(results, args)
    (out / "table.md").write_text(table)
    plot(out / "seeds.png", results)
    print(table.split("\n\nPer seed")[0])
    print(f"\n{time.time() - t0:.0f} s; files in {out}: results.json, table.md, seeds.png")
    return 0
