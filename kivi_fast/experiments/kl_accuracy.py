"""``kivi-fast kl-accuracy``: how close is ``kivi_fast.kernel_kl`` to the true KL(q || N(0, I))? (a diagnostic)

The paper's "Accuracy of KL Estimation" compares the estimate with the ground truth for a normalizing
flow posterior. Here the comparison runs over a grid instead of a training run, with the prior p = N(0, I):

* q families with a known KL: N(0, I) itself (KL = 0), a shift N(mu, I) with |mu| = 1.5 (KL = 1.125
  in every d), narrow N(0, 0.5^2 I) and wide N(0, 2^2 I) (KL grows linearly with d), and a planar flow
  (:class:`kivi_fast.nn.PlanarFlow`, 4 tanh layers, exact density; true KL by Monte Carlo on 200k draws);
* d in {1, 2, 8, 32}, n = n_p = n_q in {50, 100, 200, 500}, lam in {1e-4, 1e-3, 1e-2, 1e-1};
* plain: ``kivi_fast.kernel_kl(prior, q, lam)`` (reverse ratio, median bandwidth, clip 1e-8), the
  paper's estimator; kl: ``kivi_fast.kl(prior, q, lam)``, the library's default (a Gaussian contrast of
  both sample sets; its clipped fraction is that of its posterior-side fit, as for ac-full); and adaptive
  contrast (App. D), ``kivi_fast.adaptive_contrast_kl(q, None, lam, contrast=...)``: ``ac-diag`` (q
  standardized per dimension, the paper's) and ``ac-full`` (q whitened by its sample covariance; the
  library's default ``contrast="auto"`` is this one wherever n > d, i.e. on this whole grid).

Each cell is repeated ``--reps`` times with fresh samples and reports bias (mean estimate - true),
standard deviation, RMSE and the fraction of q samples whose fitted reverse ratio p/q was at or below
the clip (``DensityRatio(lam).fit(prior, q).ratio(q) <= clip``, on the standardized or whitened
samples for adaptive contrast). Nothing here is tuned: the numbers are what the estimator gives.

The median bandwidth does not depend on lam, so it is computed once per sample set
(``kivi_fast.median_bandwidth`` of the pooled samples, exactly what ``bandwidth="median"`` computes)
and passed to every lam; for adaptive contrast the standard-normal contrast samples are regenerated
from the same seed so the bandwidth matches the samples the estimator uses.

Outputs: ``results.json`` (every cell), ``table.md`` (the full table), ``kl_accuracy.png``
(estimate vs. n per family, d and lam), ``clipped.png`` (clipped fraction).
"""

from __future__ import annotations

import argparse
import itertools
import math
import time

import torch
from tqdm.auto import tqdm

import kivi_fast

from ..contrast import GaussianFit, gaussian_contrast
from ..nn import PlanarFlow, gaussian_kl_to_standard_normal
from . import runs
from .options import (add_common, apply_quick, check_prior_samples, int_at_least, kivi_clip, kivi_lam, plural,
                      positive_int, random_seed)

NAME = "kl-accuracy"
FAMILIES = ("N(0,I)", "shift |mu|=1.5", "narrow s=0.5", "wide s=2", "planar flow")
METHODS = ("plain", "kl", "ac-diag", "ac-full")
STYLES = ("-", "-.", "--", ":")  # the line style of each method in the figures
CONTRAST = {"ac-diag": "diagonal", "ac-full": "full"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seed", type=random_seed, default=0, help="random seed")
    parser.add_argument("--dims", type=positive_int, nargs="+", default=[1, 2, 8, 32], help="dimensions d")
    parser.add_argument("--ns", type=int_at_least(2), nargs="+", default=[50, 100, 200, 500],
                        help="sample sizes n = n_p = n_q")
    parser.add_argument("--lams", type=kivi_lam, nargs="+", default=[1e-4, 1e-3, 1e-2, 1e-1],
                        help="ridge coefficients lambda")
    parser.add_argument("--reps", type=positive_int, default=10, help="repetitions per cell (fresh samples)")
    parser.add_argument("--clip", type=kivi_clip, default=1e-8, help="lower clip of the density ratio")
    parser.add_argument("--flow-truth-samples", type=int_at_least(2), default=200_000,
                        help="Monte Carlo draws for the planar flow's true KL")
    add_common(parser, name=NAME, quick="a small grid that runs in seconds")


QUICK = {"dims": [1, 8], "ns": [50, 100], "lams": [1e-3, 1e-1], "reps": 3, "flow_truth_samples": 20_000}


class Family:
    """A q with a sampler and its true KL(q || N(0, I)) (and the Monte Carlo error of that truth)."""

    def __init__(self, name: str, d: int, truth_samples: int, seed: int):
        self.name, self.d = name, d
        self.flow = None
        zeros = torch.zeros(d, dtype=torch.float64)
        if name == "N(0,I)":
            self.mu, self.log_std = zeros, zeros
        elif name == "shift |mu|=1.5":
            self.mu, self.log_std = torch.full((d,), 1.5 / math.sqrt(d), dtype=torch.float64), zeros
        elif name == "narrow s=0.5":
            self.mu, self.log_std = zeros, torch.full((d,), math.log(0.5), dtype=torch.float64)
        elif name == "wide s=2":
            self.mu, self.log_std = zeros, torch.full((d,), math.log(2.0), dtype=torch.float64)
        elif name == "planar flow":
            self.flow = PlanarFlow.random(d, 4, generator=torch.Generator().manual_seed(1000 + d)).double()
        else:
            raise ValueError(name)
        if self.flow is None:
            self.true_kl, self.true_kl_se = float(gaussian_kl_to_standard_normal(self.mu, self.log_std)), 0.0
        else:
            self.true_kl, self.true_kl_se = self.flow.kl_to_standard_normal(
                truth_samples, torch.Generator().manual_seed(seed + 7))

    def sample(self, reps: int, n: int, generator: torch.Generator) -> torch.Tensor:
        """[reps, n, d] float64 samples."""
        if self.flow is not None:
            with torch.no_grad():
                return self.flow.sample(reps * n, generator).reshape(reps, n, self.d)
        eps = torch.randn(reps, n, self.d, generator=generator, dtype=torch.float64)
        return self.mu + eps * self.log_std.exp()


def _chunks(reps: int, n: int, d: int, budget_bytes: float = 2.0e8):
    """Split the repetitions so that a batched pairwise-difference tensor stays under the budget."""
    per_rep = (2 * n) ** 2 * d * 8
    size = max(1, min(reps, int(budget_bytes // per_rep)))
    return [range(i, min(i + size, reps)) for i in range(0, reps, size)]


def estimate_cell(family: Family, n: int, lams, reps: int, clip: float, seed: int) -> list[dict]:
    """All (method, lam) rows for one family, d and n: ``reps`` estimates each, batched over reps."""
    gen = torch.Generator().manual_seed(seed)
    d = family.d
    estimates = {(m, lam): [] for m in METHODS for lam in lams}
    clipped = {(m, lam): [] for m in METHODS for lam in lams}
    for chunk in _chunks(reps, n, d):
        b = len(chunk)
        q = family.sample(b, n, gen)
        prior = torch.randn(b, n, d, generator=gen, dtype=torch.float64)
        contrast_seed = int(torch.randint(0, 2**62, (1,), generator=gen))
        # The N(0, I) draws adaptive_contrast_kl and kl will make from a generator seeded with contrast_seed.
        eps = torch.randn(b, n, d, generator=torch.Generator().manual_seed(contrast_seed), dtype=torch.float64)
        pairs = {"plain": (prior, q)}
        for m, contrast in CONTRAST.items():  # both sides whitened as the library does (contrast.reference_draws)
            pairs[m] = (GaussianFit(eps, contrast).whiten(eps), gaussian_contrast(q, contrast)[0])
        pairs["kl"] = pairs["ac-full"]  # kl draws the same eps from the same seed and whitens q the same way
        sigmas = {m: kivi_fast.median_bandwidth(torch.cat([p_, q_], dim=1)) for m, (p_, q_) in pairs.items()}
        for lam in lams:
            estimates[("plain", lam)].append(kivi_fast.kernel_kl(prior, q, lam, clip=clip, bandwidth=sigmas["plain"]))
            estimates[("kl", lam)].append(kivi_fast.kl(prior, q, lam, clip=clip,
                                                       generator=torch.Generator().manual_seed(contrast_seed)))
            for m, contrast in CONTRAST.items():
                estimates[(m, lam)].append(kivi_fast.adaptive_contrast_kl(
                    q, None, lam, contrast=contrast, clip=clip, bandwidth=sigmas[m],
                    generator=torch.Generator().manual_seed(contrast_seed)))
            for m, (p_, q_) in pairs.items():
                ratio = kivi_fast.DensityRatio(lam, sigmas[m]).fit(p_, q_).ratio(q_)
                clipped[(m, lam)].append((ratio <= clip).double().mean(-1))
    rows = []
    for (m, lam), parts in estimates.items():
        est = torch.cat(parts)
        if not bool(torch.isfinite(est).all()):
            raise FloatingPointError(f"non-finite KL estimate for {family.name}, d={d}, n={n}, lam={lam}, {m}")
        bias = float(est.mean()) - family.true_kl
        std = float(est.std()) if est.numel() > 1 else 0.0
        rows.append({
            "family": family.name, "d": d, "n": n, "lam": lam, "method": m,
            "true_kl": family.true_kl, "true_kl_mc_se": family.true_kl_se,
            "mean_estimate": float(est.mean()), "bias": bias, "std": std,
            "rmse": math.sqrt(bias**2 + std**2 * (est.numel() - 1) / max(est.numel(), 1)),
            "clipped_fraction": float(torch.cat(clipped[(m, lam)]).mean()),
            "reps": int(est.numel()),
        })
    return rows


def markdown_table(rows: list[dict]) -> str:
    head = "| q | d | n | lam | method | true KL | mean est. | bias | std | clipped |\n|---|---|---|---|---|---|---|---|---|---|\n"
    body = "".join(
        f"| {r['family']} | {r['d']} | {r['n']} | {r['lam']:g} | {r['method']} | {r['true_kl']:.3f} | "
        f"{r['mean_estimate']:.3f} | {r['bias']:+.3f} | {r['std']:.3f} | {r['clipped_fraction']:.2f} |\n"
        for r in rows)
    return head + body


def summary_table(rows: list[dict], lam: float, n: int) -> str:
    """A compact view: one line per (q, d), bias +- std of each method at one lam and one n."""
    pick = {(r["family"], r["d"], r["method"]): r for r in rows if r["lam"] == lam and r["n"] == n}
    lines = [f"bias +- std at lam={lam:g}, n={n} (clipped fraction in brackets)",
             "| q | d | true KL | " + " | ".join(METHODS) + " |", "|---|---|---|" + "---|" * len(METHODS)]
    for fam, d in dict.fromkeys((k[0], k[1]) for k in pick):
        cells = []
        for m in METHODS:
            r = pick[(fam, d, m)]
            cells.append(f"{r['bias']:+.3f} +- {r['std']:.3f} [{r['clipped_fraction']:.2f}]")
        lines.append(f"| {fam} | {d} | {pick[(fam, d, METHODS[0])]['true_kl']:.3f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_estimates(path, rows, families, dims, lams) -> None:
    """Mean estimate +- std vs. n, one panel per (q, d); a line style per method (STYLES)."""
    plt = runs.matplotlib_pyplot()
    fig, axes = plt.subplots(len(families), len(dims), figsize=(3.3 * len(dims), 2.5 * len(families)),
                             squeeze=False)
    colors = plt.cm.viridis(torch.linspace(0, 0.9, len(lams)).numpy())
    for (i, fam), (j, d) in itertools.product(enumerate(families), enumerate(dims)):
        ax = axes[i][j]
        cell = [r for r in rows if r["family"] == fam and r["d"] == d]
        if not cell:
            ax.set_visible(False)
            continue
        for lam, color in zip(lams, colors):
            for m, style in zip(METHODS, STYLES):
                rs = sorted((r for r in cell if r["lam"] == lam and r["method"] == m), key=lambda r: r["n"])
                ax.errorbar([r["n"] for r in rs], [r["mean_estimate"] for r in rs], [r["std"] for r in rs],
                            color=color, ls=style, marker="o", ms=3, lw=1.2, capsize=2,
                            label=f"lam={lam:g}" if m == "plain" else None)
        ax.axhline(cell[0]["true_kl"], color="k", lw=1.5, label="true KL")
        ax.set_xscale("log")
        ns = sorted({r["n"] for r in cell})
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.minorticks_off()
        ax.set_title(f"{fam}, d={d}", fontsize=9)
        if i == len(families) - 1:
            ax.set_xlabel("n (= n_p = n_q)")
        if j == 0:
            ax.set_ylabel("KL estimate")
    axes[0][0].legend(fontsize=7)
    fig.suptitle("KIVI KL estimate vs. truth (black), mean +- std over repetitions\n"
                 "solid: plain, dash-dot: kl, dashed: ac-diag, dotted: ac-full", fontsize=10)
    runs.save_figure(fig, path, dpi=80)


def plot_clipped(path, rows, families, dims, lams) -> None:
    """Fraction of clipped reverse ratios (plain method) vs. lam, one line per d, a panel per q at largest n."""
    plt = runs.matplotlib_pyplot()
    n = max(r["n"] for r in rows)
    fig, axes = plt.subplots(1, len(families), figsize=(3.2 * len(families), 2.8), squeeze=False)
    for ax, fam in zip(axes[0], families):
        for d in dims:
            for m, style in zip(METHODS, STYLES):
                rs = sorted((r for r in rows if r["family"] == fam and r["d"] == d and r["n"] == n
                             and r["method"] == m), key=lambda r: r["lam"])
                ax.plot([r["lam"] for r in rs], [r["clipped_fraction"] for r in rs], ls=style, marker="o", ms=3,
                        label=f"d={d}" if m == "plain" else None)
        ax.set(xscale="log", ylim=(-0.03, 1.03), title=fam, xlabel="lam")
    axes[0][0].set_ylabel(f"clipped fraction (n={n})")
    axes[0][0].legend(fontsize=7)
    fig.suptitle("fraction of q samples whose fitted ratio p/q <= clip\n"
                 "(solid: plain, dash-dot: kl, dashed: ac-diag, dotted: ac-full)",
                 fontsize=10)
    runs.save_figure(fig, path, dpi=80)


def run(args) -> int:
    apply_quick(args, QUICK)  # (begin applies it too: the same values) for the sample sizes checked below
    for n in args.ns:
        check_prior_samples("--ns", n, "kl")
    out = runs.begin(args, NAME, QUICK)
    t0 = time.time()
    families = [Family(f, d, args.flow_truth_samples, args.seed) for d in args.dims for f in FAMILIES]
    rows = []
    cells = list(itertools.product(families, args.ns))
    for k, (fam, n) in enumerate(tqdm(cells, desc="KL accuracy cells", disable=args.no_progress)):
        rows.extend(estimate_cell(fam, n, args.lams, args.reps, args.clip, args.seed * 100_003 + k))
    elapsed = time.time() - t0
    config = {k: v for k, v in vars(args).items() if not k.startswith("_")}
    runs.write_json(out / "results.json", {"config": config, "backend": kivi_fast.backend(),
                                           "elapsed_s": elapsed, "rows": rows})
    (out / "table.md").write_text(markdown_table(rows))
    plot_estimates(out / "kl_accuracy.png", rows, FAMILIES, args.dims, args.lams)
    plot_clipped(out / "clipped.png", rows, FAMILIES, args.dims, args.lams)

    lam_mid = min(args.lams, key=lambda lam: abs(math.log(lam / 1e-3)))
    print(summary_table(rows, lam_mid, max(args.ns)))
    print()
    print(summary_table(rows, max(args.lams), max(args.ns)))
    print(f"\n{plural(len(rows), 'row')} in {elapsed:.0f} s; full table in {out}/table.md; "
          "figures kl_accuracy.png, clipped.png")
    return 0
