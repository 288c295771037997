"""``kivi-fast blr``: 2-D Bayesian logistic regression, KIVI vs. factorized VI vs. HMC (the paper's App. F.1).

The setup follows the paper's Appendix "Toy Experiments":

* data: 200 inputs from U[-5, 5]^2, labels drawn from the model with weights drawn from the N(0, I) prior;
* truth: the unnormalized posterior on a grid, and HMC (Pyro's HMC kernel, 10 leapfrog steps, step size
  adapted by dual averaging from 0.001, 100 chains x 200 iterations, the first 100 of each discarded);
* factorized VI: N(mu, diag(sigma^2)), 100 samples per step, the KL term in closed form;
* KIVI: the paper's stochastic network (:func:`kivi_fast.nn.stochastic_net_2d`), 1000 samples per step,
  the KL term ``kivi_fast.adaptive_contrast_kl(q samples)`` (the library's default: full-covariance
  contrast, lam = 0.01), or with ``--contrast none`` the paper's ``kivi_fast.kernel_kl(prior samples,
  q samples, lam=0.1, clip=1e-8)``.

Both VI methods run 100 epochs with the paper's annealing lr = base * 100 / (100 + epoch - 1). The
paper does not say what an epoch is; here it is one pass over the 200 data points in minibatches of
``--batch-size`` (default 20, so 10 Adam steps per epoch and 1000 in all), the minibatch
log-likelihood scaled by N / batch so that each step is an unbiased estimate of the full ELBO.

The model (``make_data``, ``log_likelihood``, ``log_joint``, the grid posterior) is defined below:

    w ~ N(0, I_2),    y_i ~ Bernoulli(sigmoid(w^T x_i)),    x_i ~ U[-5, 5]^2,  i = 1..N (N = 200).

Its posterior is intractable but two-dimensional, so its unnormalized density can be drawn on a grid.
All log-densities take ``w`` of shape [..., 2] and return [...], so one call scores a whole batch of
posterior samples or a grid.

Outputs in the run folder: ``blr.png`` (the paper's five panels), ``metrics.json`` (agreement of each
VI posterior with HMC: mean and covariance errors and an RBF-kernel MMD, next to the same numbers for
two disjoint halves of the HMC samples, which is the noise floor), ``training.json`` (per-epoch ELBO).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

import kivi_fast
from kivi_fast.contrast import CONTRASTS

from ..contrast import standard_normal_log_prob
from ..nn import FactorizedGaussian, stochastic_net_2d
from . import runs
from .hmc import hmc_sample, split_r_hat
from .options import (SEED_LIMIT, UsageError, add_common, apply_quick, int_at_least, kivi_clip, kivi_lam,
                      nonnegative_int, plural, positive_float, positive_int, random_seed)
from .sample_metrics import mmd2_rbf, moment_gaps
from .training import check_loss_is_finite, estimator_refusal_as_run_error

NAME = "blr"


# ---- the model ----------------------------------------------------------------------------------

@dataclass
class LogisticData:
    """Inputs ``x`` [N, 2], labels ``y`` [N] in {0, 1}, and the weights ``w_true`` [2] that drew them."""

    x: torch.Tensor
    y: torch.Tensor
    w_true: torch.Tensor


def make_data(n: int = 200, half_width: float = 5.0, generator: torch.Generator | None = None,
              dtype=torch.float32) -> LogisticData:
    """Draw the training set the paper describes: x ~ U[-5, 5]^2, w_true ~ prior, y ~ the model."""
    x = (torch.rand(n, 2, generator=generator, dtype=dtype) * 2 - 1) * half_width
    w_true = torch.randn(2, generator=generator, dtype=dtype)
    y = torch.bernoulli(torch.sigmoid(x @ w_true), generator=generator)
    return LogisticData(x, y, w_true)


def log_likelihood(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """sum_i log Bernoulli(y_i; sigmoid(w^T x_i)) for each w: [..., 2] -> [...].

    Written with ``binary_cross_entropy_with_logits`` (= log(1 + e^{-|l|}) + ...) because the naive
    log(sigmoid(l)) underflows for the large logits that |x| up to 5 produces.
    """
    logits = w @ x.T  # [..., N]
    return -F.binary_cross_entropy_with_logits(logits, y.expand_as(logits), reduction="none").sum(-1)


log_prior = standard_normal_log_prob  # log N(w; 0, I) summed over the last dimension


def log_joint(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """log p(y | X, w) + log p(w): the unnormalized log-posterior, [..., 2] -> [...]."""
    return log_likelihood(w, x, y) + log_prior(w)


def posterior_on_grid(data: LogisticData, lo, hi, size: int = 200):
    """The normalized posterior density on a ``size`` x ``size`` grid over [lo, hi] (per axis).

    Returns (w1, w2, density), each [size, size], with w1 varying along the columns. The normalizer is
    the grid's Riemann sum, which is accurate as long as the grid covers the posterior's mass.
    """
    w1, w2 = torch.meshgrid(torch.linspace(lo[0], hi[0], size, dtype=torch.float64),
                            torch.linspace(lo[1], hi[1], size, dtype=torch.float64), indexing="xy")
    grid = torch.stack([w1, w2], dim=-1)
    logp = log_joint(grid, data.x.double(), data.y.double())
    density = torch.exp(logp - logp.max())
    cell = (w1[0, 1] - w1[0, 0]) * (w2[1, 0] - w2[0, 0])
    return w1, w2, density / (density.sum() * cell)


def posterior_moments_on_grid(data: LogisticData, centre, half_width, size: int = 400) -> dict:
    """Posterior mean [2] and covariance [2, 2] by quadrature on a grid (exact up to the grid).

    The grid spans ``centre`` +- ``half_width`` (per axis; make it several posterior standard
    deviations wide). It is an independent check of the HMC ground truth, which mixes slowly along
    the long axis of a correlated posterior.
    """
    centre, half = torch.as_tensor(centre, dtype=torch.float64), torch.as_tensor(half_width, dtype=torch.float64)
    w1, w2, density = posterior_on_grid(data, (centre - half).tolist(), (centre + half).tolist(), size)
    mass = density / density.sum()
    grid = torch.stack([w1, w2], -1).reshape(-1, 2)
    p = mass.reshape(-1)
    mean = (p[:, None] * grid).sum(0)
    diff = grid - mean
    cov = (p[:, None, None] * diff[:, :, None] * diff[:, None, :]).sum(0)
    return {"mean": mean, "cov": cov}


# ---- the experiment -----------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seed", type=random_seed, default=1, help="seed of the training, HMC and evaluation")
    parser.add_argument("--data-seed", type=random_seed, default=3,
                        help="seed of the data set (default 3: w_true = (-1.14, 0.94), a diagonal |w| ~ 1.5 that "
                             "gives the correlated posterior of the paper's figure; seed 1 draws |w_true| = 0.23 "
                             "and an almost round posterior)")
    parser.add_argument("--n-data", type=positive_int, default=200, help="data points")
    parser.add_argument("--epochs", type=positive_int, default=100, help="training epochs of both VI methods")
    parser.add_argument("--batch-size", type=positive_int, default=20, help="minibatch size; an epoch is one pass")
    parser.add_argument("--lr", type=positive_float, default=0.03, help="base Adam learning rate before annealing")
    parser.add_argument("--vi-samples", type=positive_int, default=100, help="factorized VI's samples per step")
    parser.add_argument("--kivi-samples", type=int_at_least(2), default=1000,
                        help="KIVI's q samples per step (and as many prior samples)")
    parser.add_argument("--contrast", choices=("none",) + CONTRASTS, default="auto",
                        help="KIVI's KL term: adaptive_contrast_kl with this contrast (auto, the library's "
                             "default, is full here), or none: the paper's estimator, kernel_kl against prior "
                             "samples (the paper's setting for this experiment)")
    parser.add_argument("--lam", type=kivi_lam, default=None,
                        help="KIVI's ridge coefficient lambda (default: 0.01, the library's, with adaptive "
                             "contrast; 0.1, the paper's, with --contrast none)")
    parser.add_argument("--clip", type=kivi_clip, default=1e-8, help="KIVI's lower clip of the density ratio")
    parser.add_argument("--kivi-seeds", type=positive_int, default=1,
                        help="train KIVI this many times (seeds --seed, --seed + 1, ...); the figure and the "
                             "KIVI row show the first, metrics.json's KIVI_over_seeds all of them")
    parser.add_argument("--hmc-chains", type=positive_int, default=100, help="HMC chains, from prior draws")
    parser.add_argument("--hmc-warmup", type=nonnegative_int, default=100, help="adaptation iterations, discarded")
    parser.add_argument("--hmc-samples", type=int_at_least(4), default=100, help="kept iterations per chain")
    parser.add_argument("--hmc-step-size", type=positive_float, default=1e-3, help="initial step size")
    parser.add_argument("--hmc-leapfrog", type=positive_int, default=10, help="leapfrog steps per iteration")
    parser.add_argument("--eval-samples", type=int_at_least(2), default=2000,
                        help="samples per method for the moments, the MMD and the figure (at most half the "
                             "HMC samples)")
    add_common(parser, name=NAME, quick="a seconds-long smoke run (3 epochs, 2 short HMC chains, few samples)")


QUICK = {"epochs": 3, "kivi_samples": 100, "vi_samples": 20, "hmc_chains": 2, "hmc_warmup": 20, "hmc_samples": 20,
         "eval_samples": 40}


def annealed_lr_factor(epoch: int) -> float:
    """The paper's schedule, lr = 100 / (100 + epoch - 1) for 1-based epochs, as a factor of the base."""
    return 100.0 / (100.0 + epoch - 1)


def fit_vi(posterior, kl_term, data: LogisticData, *, epochs: int, batch_size: int,
           n_samples: int, lr: float, generator: torch.Generator, desc: str, progress: bool = True) -> list[dict]:
    """Maximize the ELBO E_q log p(y | X, w) - KL(q || prior) with Adam; returns per-epoch averages.

    ``kl_term(w)`` maps the step's reparameterized samples [n_samples, 2] to the KL estimate, so the
    same loop serves the closed-form Gaussian KL and KIVI's sample-based one.
    """
    opt = torch.optim.Adam(posterior.parameters(), lr=lr)
    n = data.y.shape[0]
    history = []
    for epoch in tqdm(range(1, epochs + 1), desc=desc, disable=not progress):
        for group in opt.param_groups:
            group["lr"] = lr * annealed_lr_factor(epoch)
        sums = {"elbo": 0.0, "kl": 0.0}
        batches = torch.randperm(n, generator=generator).split(batch_size)
        for step, idx in enumerate(batches):
            where, updated = f"epoch {epoch}, step {step + 1}", epoch > 1 or step > 0
            w = posterior.sample(n_samples, generator)
            expected_ll = log_likelihood(w, data.x[idx], data.y[idx]).mean() * (n / len(idx))
            with estimator_refusal_as_run_error(desc, where, updated):
                kl = kl_term(w)
            loss = kl - expected_ll
            value = loss.item()
            check_loss_is_finite(desc, value, where, updated)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sums["elbo"] -= value / len(batches)
            sums["kl"] += float(kl.detach()) / len(batches)
        history.append({"epoch": epoch, "lr": lr * annealed_lr_factor(epoch), **sums})
    return history


def fit_kivi(net, args, data: LogisticData, gen: torch.Generator, desc: str) -> list[dict]:
    """Train the stochastic network ``net`` with KIVI's KL term as ``args`` set it."""
    def kivi_kl(w):
        if args.contrast != "none":
            return kivi_fast.adaptive_contrast_kl(w, None, args.lam, contrast=args.contrast, clip=args.clip,
                                                  generator=gen)
        prior = torch.randn(args.kivi_samples, 2, generator=gen, dtype=w.dtype)
        return kivi_fast.kernel_kl(prior, w, args.lam, clip=args.clip)

    return fit_vi(net, kivi_kl, data, epochs=args.epochs, batch_size=args.batch_size, n_samples=args.kivi_samples,
                  lr=args.lr, generator=gen, desc=desc, progress=not args.no_progress)


def agreement_with_hmc(samples: torch.Tensor, hmc: torch.Tensor) -> dict:
    """Moment errors and the RBF MMD^2 of ``samples`` against the HMC samples (same count)."""
    mmd2, sigma = mmd2_rbf(samples, hmc)
    return {**moment_gaps(samples, hmc), "mmd2": mmd2, "mmd_bandwidth": sigma}


def _window(*sample_sets: torch.Tensor, margin: float = 0.15):
    """A square plotting window (equal aspect) that holds the central 99% of every sample set."""
    pts = torch.cat([s.double() for s in sample_sets])
    lo = torch.quantile(pts, 0.005, dim=0)
    hi = torch.quantile(pts, 0.995, dim=0)
    centre, half = (lo + hi) / 2, float((hi - lo).max()) / 2 * (1 + margin)
    return (centre - half).tolist(), (centre + half).tolist()


def plot_figure(path, data, grid, vi: FactorizedGaussian, samples: dict, window, kivi_title="(e) KIVI") -> None:
    """The paper's Fig. (App. F.1): data, true posterior, factorized VI, HMC, KIVI, side by side."""
    plt = runs.matplotlib_pyplot()
    w1, w2, density = (t.numpy() for t in grid)
    fig, axes = plt.subplots(1, 5, figsize=(17, 3.7))
    lo, hi = window

    ax = axes[0]
    x, y = data.x.numpy(), data.y.numpy()
    ax.scatter(x[y == 1, 0], x[y == 1, 1], s=9, c="tab:red", label="y = 1")
    ax.scatter(x[y == 0, 0], x[y == 0, 1], s=9, c="tab:blue", label="y = 0")
    wt = data.w_true.double()
    t = torch.linspace(-5, 5, 2, dtype=torch.float64)
    if abs(float(wt[1])) > 1e-9:  # the true decision boundary w^T x = 0
        ax.plot(t, -wt[0] / wt[1] * t, "k--", lw=1, label="w_true boundary")
    ax.set(xlim=(-5.3, 5.3), ylim=(-5.3, 5.3), title="(a) training data", xlabel="x1", ylabel="x2")
    ax.legend(fontsize=7, loc="lower left")

    ax = axes[1]
    ax.contourf(w1, w2, density, levels=12, cmap="viridis")
    ax.set_title("(b) true posterior")

    vi_density = vi.log_prob(torch.stack([grid[0], grid[1]], -1).float()).exp().detach().numpy()
    axes[2].contour(w1, w2, vi_density, levels=6, cmap="autumn", linewidths=1.2)
    panels = [(axes[2], "factorized VI", "(c) VI (factorized)"), (axes[3], "HMC", "(d) HMC"),
              (axes[4], "KIVI", kivi_title)]
    for ax, key, title in panels:
        ax.contour(w1, w2, density, levels=6, colors="0.6", linewidths=0.8)
        s = samples[key].numpy()
        ax.scatter(s[:, 0], s[:, 1], s=2, alpha=0.35, c="tab:blue", rasterized=True)
        ax.set_title(title)
    for ax in axes[1:]:
        ax.set(xlim=(lo[0], hi[0]), ylim=(lo[1], hi[1]), xlabel="w1", ylabel="w2")
        ax.set_aspect("equal")
    axes[0].set_aspect("equal")
    fig.suptitle("2-D Bayesian logistic regression (gray: true posterior contours; dots: samples)", fontsize=10)
    runs.save_figure(fig, path, dpi=90)


def run(args) -> int:
    apply_quick(args, QUICK)  # (begin applies it too: the same values) for --hmc-chains in the check below
    if args.seed + args.hmc_chains > SEED_LIMIT:  # HMC chain c seeds numpy (through Pyro) with seed + c
        raise UsageError(f"--seed {args.seed} with --hmc-chains {args.hmc_chains}: HMC seeds its chains with "
                         f"--seed + chain, which must stay below {SEED_LIMIT}")
    out = runs.begin(args, NAME, QUICK)
    torch.manual_seed(args.seed)
    data = make_data(args.n_data, generator=torch.Generator().manual_seed(args.data_seed))
    gen = torch.Generator().manual_seed(args.seed)
    timings = {}

    t0 = time.time()
    init = torch.randn(args.hmc_chains, 2, generator=gen)  # chains start from prior draws
    hmc = hmc_sample(lambda w: log_joint(w, data.x, data.y), init, warmup=args.hmc_warmup,
                     num_samples=args.hmc_samples, step_size=args.hmc_step_size,
                     num_steps=args.hmc_leapfrog, seed=args.seed, progress=not args.no_progress)
    timings["hmc_s"] = time.time() - t0
    hmc_all = hmc.samples.reshape(-1, 2)

    t0 = time.time()
    vi = FactorizedGaussian(2, std_param="exp")  # starts at the prior N(0, I)
    vi_history = fit_vi(vi, lambda w: vi.kl_to_standard_normal(), data, epochs=args.epochs,
                        batch_size=args.batch_size, n_samples=args.vi_samples, lr=args.lr, generator=gen,
                        desc="factorized VI", progress=not args.no_progress)
    timings["vi_s"] = time.time() - t0

    if args.lam is None:
        args.lam = 0.1 if args.contrast == "none" else kivi_fast.contrast.DEFAULT_LAM
    # Score each posterior on as many samples as the HMC reference holds (at most eval_samples).
    m = min(args.eval_samples, hmc_all.shape[0] // 2)
    perm = torch.randperm(hmc_all.shape[0], generator=gen)
    hmc_ref, hmc_other = hmc_all[perm[:m]], hmc_all[perm[m:2 * m]]
    with torch.no_grad():
        samples = {"factorized VI": vi.sample(m, gen), "HMC": hmc_ref}

    # Each KIVI run has its own seed for its initialization and its noise: a run does not depend on
    # what ran before it, so "--seed 5" reproduces the fifth run of "--seed 1 --kivi-seeds 5".
    t0 = time.time()
    over_seeds = []
    for seed in range(args.seed, args.seed + args.kivi_seeds):
        torch.manual_seed(seed)
        seed_gen = torch.Generator().manual_seed(seed)
        net = stochastic_net_2d()
        history = fit_kivi(net, args, data, seed_gen, desc="KIVI" if seed == args.seed else f"KIVI, seed {seed}")
        with torch.no_grad():
            kivi_samples = net.sample(m, seed_gen)
        over_seeds.append(agreement_with_hmc(kivi_samples, hmc_ref))
        if seed == args.seed:
            kivi_history, samples["KIVI"] = history, kivi_samples
    timings["kivi_s"] = time.time() - t0
    metrics = {
        "KIVI": over_seeds[0],
        "factorized VI": agreement_with_hmc(samples["factorized VI"], hmc_ref),
        "HMC half vs. other half (noise floor)": agreement_with_hmc(hmc_other, hmc_ref),
    }
    grid_window = _window(hmc_all, samples["KIVI"], samples["factorized VI"])
    grid = posterior_on_grid(data, *grid_window, size=200)
    hmc_all_moments = moment_gaps(hmc_all, hmc_all)
    # Quadrature on a grid 8 HMC standard deviations wide: the exact moments, to check HMC itself.
    exact = posterior_moments_on_grid(data, hmc_all.double().mean(0), 8 * hmc_all.double().std(0))
    hmc_vs_exact = {"mean_error": float((torch.tensor(hmc_all_moments["mean"]) - exact["mean"]).norm()),
                    "cov_rel_error": float((torch.tensor(hmc_all_moments["cov"]) - exact["cov"]).norm()
                                           / exact["cov"].norm())}
    report = {
        "config": {k: v for k, v in vars(args).items() if not k.startswith("_")},
        "backend": kivi_fast.backend(),
        "data": {"w_true": data.w_true.tolist(), "n": args.n_data, "positives": int(data.y.sum())},
        "hmc": {"mean": hmc_all_moments["mean"], "cov": hmc_all_moments["cov"],
                "split_r_hat": split_r_hat(hmc.samples).tolist() if hmc.samples.shape[1] >= 4 else None,
                "step_size_median": float(torch.tensor(hmc.step_sizes).median()),
                "accept_rate_mean": float(torch.tensor(hmc.accept_rates).mean()),
                "n_samples": int(hmc_all.shape[0]),
                "vs_grid_quadrature": hmc_vs_exact},
        "grid_quadrature": {"mean": exact["mean"].tolist(), "cov": exact["cov"].tolist()},
        "eval_samples": m,
        "agreement_with_hmc": metrics,
        "KIVI_over_seeds": {"seeds": list(range(args.seed, args.seed + args.kivi_seeds)),
                            "cov_rel_error": [r["cov_rel_error"] for r in over_seeds],
                            "mean_error": [r["mean_error"] for r in over_seeds],
                            "mmd2": [r["mmd2"] for r in over_seeds]},
        "final_elbo": {"factorized VI": vi_history[-1]["elbo"], "KIVI": kivi_history[-1]["elbo"]},
        "timings": timings,
    }
    runs.write_json(out / "metrics.json", report)
    runs.write_json(out / "training.json", {"factorized VI": vi_history, "KIVI": kivi_history})
    contrast = f", {args.contrast} contrast" if args.contrast != "none" else ""
    kivi_title = f"(e) KIVI (lam={args.lam:g}{contrast})"
    plot_figure(out / "blr.png", data, grid, vi, samples, grid_window, kivi_title)

    print(f"blr: w_true = {[round(v, 3) for v in data.w_true.tolist()]}, HMC: {plural(hmc_all.shape[0], 'sample')}, "
          f"split R-hat {report['hmc']['split_r_hat']}, accept {report['hmc']['accept_rate_mean']:.2f}; "
          f"HMC vs. grid quadrature: |mean err| {hmc_vs_exact['mean_error']:.4f}, "
          f"rel cov err {hmc_vs_exact['cov_rel_error']:.3f}")
    print(f"{'vs. HMC':<38}{'|mean err|':>11}{'|cov err|_F':>13}{'rel cov err':>13}{'MMD^2':>11}")
    for name, r in metrics.items():
        print(f"{name:<38}{r['mean_error']:>11.4f}{r['cov_error']:>13.5f}{r['cov_rel_error']:>13.3f}"
              f"{r['mmd2']:>11.5f}")
    if args.kivi_seeds > 1:
        errs = sorted(r["cov_rel_error"] for r in over_seeds)
        print(f"KIVI over {args.kivi_seeds} seeds: rel cov err median {statistics.median(errs):.3f}, "
              f"range {errs[0]:.3f}-{errs[-1]:.3f}")
    print(f"final ELBO: VI {vi_history[-1]['elbo']:.2f}, KIVI {kivi_history[-1]['elbo']:.2f}; "
          f"times (s): " + ", ".join(f"{k} {v:.0f}" for k, v in timings.items()))
    print(f"wrote {out}/blr.png, metrics.json, training.json")
    return 0
