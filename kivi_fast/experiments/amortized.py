"""``kivi-fast amortized``: amortized inference with an exact answer (a diagnostic of the VAE's setting).

The VAE's setting in miniature: a linear-Gaussian decoder, held fixed, z ~ N(0, I_d), x = W z + b + noise,
noise ~ N(0, s^2 I_D) (d = 4, D = 12; W, b from ``--model-seed``, entries of W N(0, ``--w-scale``^2), of
b N(0, 1)). Its posterior is Gaussian in closed form (:func:`exact_posterior`):
Sigma = (I + W^T W / s^2)^{-1}, the same for every x, and mu(x) = Sigma W^T (x - b) / s^2.

Encoders, trained on the ELBO E_q[log p(x | z)] - KL(q(z | x) || N(0, I)) with Adam at a constant
``--lr``, ``--steps`` steps, each on ``--batch`` x drawn fresh from the model, ``--samples`` samples of z per
x (the reconstruction term a Monte Carlo mean over them):

* ``plain``, ``kl``, ``ac-diag``, ``ac-full``: an implicit encoder, an MLP (two hidden layers of
  ``--hidden`` tanh units) fed [x, eps], eps ~ N(0, I_d), giving one z per eps. The KL of the whole
  minibatch is ONE batched call on q_z of shape [batch, samples, d]: against as many N(0, I) samples,
  ``kivi_fast.kernel_kl`` (plain, the paper's estimator) or ``kivi_fast.kl`` (its default Gaussian
  contrast of both sample sets); or ``kivi_fast.adaptive_contrast_kl`` (the prior's density known)
  with ``contrast="diagonal"`` / ``"full"``; each at every ``--lams``.
* ``gaussian``: the baseline, an MLP giving the mean and a Cholesky factor (softplus diagonal) of a
  full-covariance Gaussian, with the KL in closed form (:func:`gaussian_kl`).

Evaluation on ``--eval-points`` held-out x (fixed by ``--model-seed``), ``--eval-samples`` encoder samples
each, against p(z | x) = N(mu(x), Sigma):

* mean error: max over dimensions of |mean_q - mu(x)|_i / sqrt(Sigma_ii), averaged over x;
* variance ratios: var_q,i / Sigma_ii per dimension, averaged over x;
* Gaussian KL: KL(N(mean_q, cov_q) || p(z | x)), averaged over x (the moments' error in one number).

The target (the estimator-quality issue's): mean error < 0.2 and every variance ratio in [0.7, 1.4], on
every seed. Each (method, lam) runs ``--seeds`` seeds (seed k: the encoder's initialization, the data and
the samples); the decoder is the same for all.

Outputs: ``results.json`` (config, the model, every run's metrics; rewritten after each run, and a rerun
with the same ``--run-dir`` and settings skips the runs it holds), ``table.md`` and ``variance_ratios.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch
from torch import nn
from tqdm.auto import tqdm

import kivi_fast

from . import runs
from .grad_accuracy import gaussian_kl
from .options import (add_common, apply_quick, check_prior_samples, int_at_least, kivi_clip, kivi_lam,
                      positive_float, positive_int, random_seed)
from .training import check_loss_is_finite, estimator_refusal_as_run_error

NAME = "amortized"
METHODS = ("plain", "kl", "ac-diag", "ac-full", "gaussian")
LATENT, OBSERVED = 4, 12
TARGET_MEAN_ERROR = 0.2
TARGET_RATIOS = (0.7, 1.4)
CONTRAST = {"ac-diag": "diagonal", "ac-full": "full"}
QUICK = {"steps": 30, "seeds": 1, "lams": [1e-2], "eval_points": 16, "eval_samples": 200, "batch": 16,
         "samples": 40}
# settings that change the numbers: a run folder's results are reused only when all of them match
SETTINGS = ("model_seed", "w_scale", "noise_std", "steps", "batch", "samples", "lr", "hidden", "clip",
            "eval_points", "eval_samples", "seed")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--methods", choices=METHODS, nargs="+", default=list(METHODS), help="encoders to train")
    parser.add_argument("--lams", type=kivi_lam, nargs="+", default=[1e-3, 1e-2],
                        help="KIVI's ridge coefficients (plain, kl, ac-diag, ac-full)")
    parser.add_argument("--seeds", type=positive_int, default=4, help="number of seeds per method and lam")
    parser.add_argument("--seed", type=random_seed, default=0, help="first seed")
    parser.add_argument("--steps", type=positive_int, default=2000, help="Adam steps per run")
    parser.add_argument("--batch", type=positive_int, default=64, help="data points per minibatch")
    parser.add_argument("--samples", type=int_at_least(2), default=100, help="samples of z per data point")
    parser.add_argument("--lr", type=positive_float, default=1e-3, help="Adam's learning rate (constant)")
    parser.add_argument("--hidden", type=positive_int, default=64, help="units in each of the 2 hidden layers")
    parser.add_argument("--clip", type=kivi_clip, default=1e-8, help="lower clip of the density ratio")
    parser.add_argument("--model-seed", type=random_seed, default=0,
                        help="seed of the decoder (W, b) and of the held-out x")
    parser.add_argument("--w-scale", type=positive_float, default=0.5, help="std of the entries of W")
    parser.add_argument("--noise-std", type=positive_float, default=0.5, help="observation noise s")
    parser.add_argument("--eval-points", type=positive_int, default=256, help="held-out x")
    parser.add_argument("--eval-samples", type=int_at_least(2), default=2000, help="encoder samples per held-out x")
    add_common(parser, name=NAME, quick="a few steps of every method on 1 seed (seconds)")


# ----------------------------------------------------------------------------------------------------
# The model and its exact posterior


class LinearGaussian:
    """z ~ N(0, I_d), x = W z + b + s * noise, noise ~ N(0, I_D); W [D, d], b [D]."""

    def __init__(self, W: torch.Tensor, b: torch.Tensor, s: float):
        self.W, self.b, self.s = W, b, s

    @classmethod
    def from_seed(cls, seed: int, w_scale: float, s: float, d: int = LATENT, D: int = OBSERVED) -> "LinearGaussian":
        gen = torch.Generator().manual_seed(seed)
        return cls(w_scale * torch.randn(D, d, generator=gen), torch.randn(D, generator=gen), s)

    def sample(self, n: int, generator: torch.Generator) -> torch.Tensor:
        d, D = self.W.shape[1], self.W.shape[0]
        z = torch.randn(n, d, generator=generator)
        return z @ self.W.T + self.b + self.s * torch.randn(n, D, generator=generator)

    def log_likelihood(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """log p(x | z) up to its constant, for x [B, D] and z [B, n, d] -> [B, n]."""
        resid = x.unsqueeze(-2) - z @ self.W.T - self.b
        return -0.5 * resid.pow(2).sum(-1) / self.s ** 2


def exact_posterior(W: torch.Tensor, b: torch.Tensor, s: float, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """p(z | x) = N(mu(x), Sigma) of the linear-Gaussian model: Sigma = (I + W^T W / s^2)^{-1},
    mu(x) = Sigma W^T (x - b) / s^2. Returns mu [N, d] (x [N, D]) and Sigma [d, d], in float64."""
    W, b, x = W.double(), b.double(), x.double()
    precision = torch.eye(W.shape[1], dtype=torch.float64) + W.T @ W / s ** 2
    chol = torch.linalg.cholesky(precision)
    sigma = torch.cholesky_inverse(chol)
    mu = (x - b) @ W @ sigma / s ** 2  # Sigma is symmetric
    return mu, 0.5 * (sigma + sigma.T)


# ----------------------------------------------------------------------------------------------------
# Encoders


def _mlp(n_in: int, hidden: int, n_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(n_in, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                         nn.Linear(hidden, n_out))


class ImplicitEncoder(nn.Module):
    """q(z | x): z = f([x, eps]), eps ~ N(0, I_d), f an MLP."""

    def __init__(self, hidden: int, d: int = LATENT, D: int = OBSERVED):
        super().__init__()
        self.d, self.net = d, _mlp(D + d, hidden, d)

    def forward(self, x: torch.Tensor, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """n samples of z per x: [B, D] -> [B, n, d]."""
        eps = torch.randn(x.shape[0], n, self.d, generator=generator)
        return self.net(torch.cat([x.unsqueeze(-2).expand(-1, n, -1), eps], -1))


class GaussianEncoder(nn.Module):
    """q(z | x) = N(m(x), L(x) L(x)^T), L lower triangular with a softplus diagonal."""

    def __init__(self, hidden: int, d: int = LATENT, D: int = OBSERVED):
        super().__init__()
        self.d = d
        self.rows, self.cols = torch.tril_indices(d, d)
        self.net = _mlp(D, hidden, d + len(self.rows))

    def moments(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.net(x)
        m, flat = out[:, :self.d], out[:, self.d:]
        L = torch.zeros(x.shape[0], self.d, self.d, dtype=out.dtype)
        L[:, self.rows, self.cols] = flat
        diag = torch.nn.functional.softplus(L.diagonal(dim1=-2, dim2=-1)) + 1e-5
        return m, torch.tril(L, -1) + torch.diag_embed(diag)

    def forward(self, x: torch.Tensor, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        m, L = self.moments(x)
        eps = torch.randn(x.shape[0], n, self.d, generator=generator)
        return m.unsqueeze(-2) + eps @ L.transpose(-1, -2)


# ----------------------------------------------------------------------------------------------------
# Training and evaluation


def kl_term(method: str, encoder, x, z, lam: float, clip: float, gen: torch.Generator) -> torch.Tensor:
    """The KL(q(z | x) || N(0, I)) of each x in the minibatch, [B]: one batched call for the KIVI methods."""
    if method == "gaussian":
        return gaussian_kl(*encoder.moments(x))
    if method in ("plain", "kl"):
        prior = torch.randn(z.shape, generator=gen)
        if method == "plain":
            return kivi_fast.kernel_kl(prior, z, lam, clip=clip)
        return kivi_fast.kl(prior, z, lam, clip=clip, generator=gen)
    return kivi_fast.adaptive_contrast_kl(z, None, lam, contrast=CONTRAST[method], clip=clip, generator=gen)


def train(model: LinearGaussian, method: str, lam: float, seed: int, args, on_step=None) -> tuple[nn.Module, float]:
    """Train one encoder; returns it and its last step's loss (the negative ELBO per x, up to a constant)."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    encoder = (GaussianEncoder if method == "gaussian" else ImplicitEncoder)(args.hidden)
    opt = torch.optim.Adam(encoder.parameters(), lr=args.lr)
    loss = torch.tensor(float("nan"))
    what = f"{label(method, lam)}, seed {seed}"
    for step in range(args.steps):
        where, updated = f"step {step + 1}", step > 0
        x = model.sample(args.batch, gen)
        z = encoder(x, args.samples, gen)
        recon = model.log_likelihood(x, z).mean(-1)
        with estimator_refusal_as_run_error(what, where, updated):
            loss = (kl_term(method, encoder, x, z, lam, args.clip, gen) - recon).mean()
        check_loss_is_finite(what, loss.item(), where, updated)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if on_step is not None:
            on_step()
    return encoder, float(loss.detach())


def gaussian_kl_between(m_q, cov_q, m_p, cov_p) -> torch.Tensor:
    """KL(N(m_q, cov_q) || N(m_p, cov_p)) per row: m [N, d], cov [N, d, d] or [d, d]."""
    cov_p = cov_p.expand_as(cov_q)
    chol_p = torch.linalg.cholesky(cov_p)
    d = m_q.shape[-1]
    trace = torch.cholesky_solve(cov_q, chol_p).diagonal(dim1=-2, dim2=-1).sum(-1)
    diff = (m_p - m_q).unsqueeze(-1)
    maha = (diff * torch.cholesky_solve(diff, chol_p)).sum((-2, -1))
    logdet_p = 2 * chol_p.diagonal(dim1=-2, dim2=-1).log().sum(-1)
    logdet_q = torch.linalg.slogdet(cov_q)[1]
    return 0.5 * (trace + maha - d + logdet_p - logdet_q)


@torch.no_grad()
def evaluate(encoder: nn.Module, x: torch.Tensor, mu: torch.Tensor, sigma: torch.Tensor, n: int,
             seed: int) -> dict:
    """The encoder's moments at each held-out x against p(z | x) = N(mu, Sigma) (see the module's doc)."""
    gen = torch.Generator().manual_seed(seed)
    mean_q, cov_q = [], []
    for chunk in x.split(32):
        z = encoder(chunk, n, gen).double()
        m = z.mean(1)
        c = z - m.unsqueeze(1)
        mean_q.append(m)
        cov_q.append(c.transpose(1, 2) @ c / (n - 1))
    mean_q, cov_q = torch.cat(mean_q), torch.cat(cov_q)
    sd = sigma.diagonal().sqrt()
    mean_error = ((mean_q - mu).abs() / sd).amax(-1).mean()
    ratios = (cov_q.diagonal(dim1=-2, dim2=-1) / sigma.diagonal()).mean(0)
    jitter = 1e-10 * torch.eye(cov_q.shape[-1], dtype=cov_q.dtype)
    gkl = gaussian_kl_between(mean_q, cov_q + jitter, mu, sigma)
    return {"mean_error": float(mean_error), "var_ratios": [float(r) for r in ratios],
            "gaussian_kl": float(gkl.mean()), "gaussian_kl_median": float(gkl.median())}


def meets_target(m: dict) -> bool:
    lo, hi = TARGET_RATIOS
    return (math.isfinite(m["mean_error"]) and m["mean_error"] < TARGET_MEAN_ERROR
            and all(lo <= r <= hi for r in m["var_ratios"]))


def worst_ratio(ratios) -> float:
    """The variance ratio furthest from 1 (in log scale)."""
    return max(ratios, key=lambda v: abs(math.log(v)) if v > 0 else math.inf)


def configs(args) -> list[tuple[str, float | None]]:
    return [(m, None) if m == "gaussian" else (m, lam) for m in args.methods
            for lam in ([None] if m == "gaussian" else args.lams)]


def label(method: str, lam: float | None) -> str:
    return method if lam is None else f"{method} lam={lam:g}"


# ----------------------------------------------------------------------------------------------------
# Report


def summarize(rows: list[dict]) -> dict:
    """Over the seeds of one (method, lam): medians and worsts of the mean error and variance ratios."""
    errors = [r["mean_error"] for r in rows]
    ratios = [x for r in rows for x in r["var_ratios"]]
    worst = worst_ratio(ratios)
    return {"seeds": len(rows), "mean_error_median": statistics.median(errors), "mean_error_worst": max(errors),
            "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
            "ratio_worst": worst,
            "gaussian_kl_median": statistics.median(r["gaussian_kl"] for r in rows),
            "seeds_on_target": sum(r["meets_target"] for r in rows),
            "meets_target": all(r["meets_target"] for r in rows)}


def markdown_table(rows: list[dict], args) -> str:
    lo, hi = TARGET_RATIOS
    lines = [f"Target: mean error < {TARGET_MEAN_ERROR:g} posterior std and every variance ratio in [{lo:g}, {hi:g}], "
             "on every seed. Mean error: max over dims of |mean_q - mu(x)| / sqrt(Sigma_ii), averaged over "
             f"{args.eval_points} held-out x; variance ratio: var_q / Sigma_ii per dim, averaged over x; "
             "medians and worsts over the seeds (ratios: over seeds x dims; worst = furthest from 1).",
             "",
             "| method | lam | seeds | mean err. median | mean err. worst | var. ratio median | var. ratio range "
             "| worst ratio | Gaussian KL median | on target |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for method, lam in configs(args):
        cell = [r for r in rows if r["method"] == method and r["lam"] == lam]
        if not cell:
            continue
        s = summarize(cell)
        verdict = "yes" if s["meets_target"] else "no"
        lines.append(f"| {method} | {'exact KL' if lam is None else f'{lam:g}'} | {s['seeds']} "
                     f"| {s['mean_error_median']:.3g} | {s['mean_error_worst']:.3g} | {s['ratio_median']:.3g} "
                     f"| {s['ratio_min']:.3g}-{s['ratio_max']:.3g} | {s['ratio_worst']:.3g} "
                     f"| {s['gaussian_kl_median']:.3g} | {verdict} ({s['seeds_on_target']}/{s['seeds']}) |")
    lines += ["", "Per seed (variance ratios per dimension):", "",
              "| method | lam | seed | mean err. | variance ratios | Gaussian KL | final loss | on target |",
              "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['method']} | {'exact KL' if r['lam'] is None else format(r['lam'], 'g')} | {r['seed']} "
                     f"| {r['mean_error']:.3g} | {', '.join(f'{v:.3g}' for v in r['var_ratios'])} "
                     f"| {r['gaussian_kl']:.3g} | {r['final_loss']:.4g} | {'yes' if r['meets_target'] else 'no'} |")
    return "\n".join(lines) + "\n"


def plot(path, rows: list[dict], args) -> None:
    """Variance ratios (every dim, per seed) and mean errors per (method, lam), with the target's bounds."""
    plt = runs.matplotlib_pyplot()
    cells = [c for c in configs(args) if any(r["method"] == c[0] and r["lam"] == c[1] for r in rows)]
    seeds = sorted({r["seed"] for r in rows})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, (method, lam) in enumerate(cells):
        for k, seed in enumerate(seeds):
            r = next((r for r in rows if r["method"] == method and r["lam"] == lam and r["seed"] == seed), None)
            if r is None:
                continue
            off = (k - (len(seeds) - 1) / 2) * 0.12
            kw = {"color": colors[k % len(colors)], "label": f"seed {seed}" if i == 0 else None}
            axes[0].scatter([i + off] * len(r["var_ratios"]), [max(v, 1e-3) for v in r["var_ratios"]], s=12, **kw)
            axes[1].scatter([i + off], [r["mean_error"]], s=16, **kw)
    lo, hi = TARGET_RATIOS
    axes[0].axhspan(lo, hi, color="green", alpha=0.12)
    axes[0].axhline(1.0, color="gray", lw=0.6)
    axes[0].set(yscale="log", ylabel="var_q / Sigma_ii (per dim, mean over x)", title="variance ratios")
    axes[1].set(yscale="log", ylabel="mean error (posterior stds)", title="mean error")
    bottom = min([0.02] + [r["mean_error"] / 2 for r in rows if r["mean_error"] > 0])
    axes[1].axhspan(bottom, TARGET_MEAN_ERROR, color="green", alpha=0.12)
    axes[1].set_ylim(bottom=bottom)
    for ax in axes:
        ax.set_xticks(range(len(cells)), [label(*c) for c in cells], rotation=35, ha="right", fontsize=8)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"amortized linear-Gaussian: encoders vs. the exact posterior (green: target), {args.steps} steps",
                 fontsize=10)
    runs.save_figure(fig, path, dpi=80)


# ----------------------------------------------------------------------------------------------------


def _load_previous(path, settings: dict) -> list[dict]:
    if not path.exists():
        return []
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        raise runs.RunError(f"{path} is not a results file of this command; remove it, or use another --run-dir") \
            from None
    if not isinstance(data, dict) or data.get("settings") != settings:
        return []  # other settings: start over (the file is rewritten)
    return list(data.get("runs", []))


def run(args) -> int:
    apply_quick(args, QUICK)  # (begin applies it too: the same values) for --samples in the check below
    if "kl" in args.methods:
        check_prior_samples("--samples", args.samples, "kl")
    out = runs.begin(args, NAME, QUICK)
    t0 = time.time()
    model = LinearGaussian.from_seed(args.model_seed, args.w_scale, args.noise_std)
    x_eval = model.sample(args.eval_points, torch.Generator().manual_seed(10_000 + args.model_seed))
    mu, sigma = exact_posterior(model.W, model.b, model.s, x_eval)
    settings = {k: getattr(args, k) for k in SETTINGS}
    rows = _load_previous(out / "results.json", settings)
    done = {(r["method"], r["lam"], r["seed"]) for r in rows}
    todo = [(m, lam, seed) for m, lam in configs(args) for seed in range(args.seed, args.seed + args.seeds)
            if (m, lam, seed) not in done]
    header = {"settings": settings, "config": {k: v for k, v in vars(args).items() if not k.startswith("_")},
              "machine": runs.machine(), "model": {"W": model.W.tolist(), "b": model.b.tolist(), "s": model.s},
              "posterior_cov": sigma.tolist(), "posterior_std": sigma.diagonal().sqrt().tolist()}
    with tqdm(total=len(todo) * args.steps, desc="amortized training steps", disable=args.no_progress) as bar:
        for method, lam, seed in todo:
            bar.set_postfix_str(f"{label(method, lam)} seed {seed}")
            t = time.time()
            encoder, loss = train(model, method, lam, seed, args, on_step=bar.update)
            metrics = evaluate(encoder, x_eval, mu, sigma, args.eval_samples, seed)
            rows.append({"method": method, "lam": lam, "seed": seed, "final_loss": loss, **metrics,
                         "meets_target": meets_target(metrics), "seconds": time.time() - t})
            runs.write_json(out / "results.json", {**header, "runs": rows})
    order = {c: i for i, c in enumerate(configs(args))}
    rows = sorted((r for r in rows if (r["method"], r["lam"]) in order),
                  key=lambda r: (order[(r["method"], r["lam"])], r["seed"]))
    summary = {label(m, lam): summarize([r for r in rows if r["method"] == m and r["lam"] == lam])
               for m, lam in configs(args) if any(r["method"] == m and r["lam"] == lam for r in rows)}
    elapsed = time.time() - t0
    run_seconds = sum(r["seconds"] for r in rows)  # over every run, including those an earlier call did
    runs.write_json(out / "results.json", {**header, "runs": rows, "summary": summary, "elapsed_s": elapsed,
                                           "run_seconds": run_seconds})
    table = markdown_table(rows, args)
    (out / "table.md").write_text(table)
    plot(out / "variance_ratios.png", rows, args)
    print(table.split("\n\nPer seed")[0])
    print(f"\n{len(rows)} runs; this call {elapsed:.0f} s, all runs {run_seconds:.0f} s; files in {out}: "
          "results.json, table.md, variance_ratios.png")
    return 0
