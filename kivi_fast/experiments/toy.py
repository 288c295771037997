"""``kivi-fast toy``: the paper's 1-D Gaussian-mixture toy (Sec. 5.1 and Appendix "Toy Experiments").

    kivi-fast toy                  # ~20 s on one core: results.json, densities.png, training.png
    kivi-fast toy --quick          # a smoke run in seconds

Target: p(z) = 0.5 N(z; -3, 1) + 0.5 N(z; 3, 1), a normalized log-density known in closed form. Both
methods do variational inference on it, maximizing ELBO = E_q[log p(z)] + H[q]; since p is normalized,
ELBO = -KL(q || p) exactly (0 is the best possible value).

* KIVI: an implicit q. z = MLP(eps), eps ~ N(0, I_k) (k = ``--noise-dim``, default 4), two hidden layers
  of 10 units (``--activation``, default ReLU) and one linear output unit. Its entropy is intractable,
  so the KL is split against a tractable reference N(0, s0^2):

      KL(q || p) = KL(q || N(0, s0^2)) + E_q[log N(z; 0, s0^2) - log p(z)],

  the first term by ``kivi_fast.kernel_kl(s0 * randn(n_p, 1), q_samples, lam=0.003, clip=1e-8,
  bandwidth=0.5)`` (the paper's lambda and clipping threshold, the reverse ratio trick), the second by
  Monte Carlo. ``--contrast adaptive`` uses ``kivi_fast.adaptive_contrast_kl`` (the reference is a
  Gaussian fitted to q) instead; it fits less well here (KL ~0.3): the bandwidth then applies to the
  standardized q, whose modes are only ~0.3 wide.
* Gaussian VI (the baseline): q = N(m, softplus(rho)^2), reparameterized, exact entropy.

Choices not fixed by the paper (recorded in results.json too):

* s0 = 3 (``--s0``): the reference must cover both modes; p itself has standard deviation sqrt(10).
* Kernel bandwidth 0.5 (``--bandwidth``), not the median heuristic. Here the median pairwise distance
  is ~3, set by the gap between the modes. The kernel fit then only sees q smoothed at that scale,
  so the KIVI term resists q's modes becoming narrow far less than the true entropy does, while the
  exact term E_q[-log p] pulls samples onto the modes: with ``--bandwidth median`` each mode
  shrinks into a spike (KL ~0.5 to 2 instead of ~0.05; a larger lambda makes it worse). A bandwidth
  below the modes' width (1) avoids that.
* Gradient-norm clipping at 10 (``--grad-clip``): -log r(z) of the fitted ratio r has huge gradients
  where r(z) nears 0 (norms up to ~10^4 against a median of ~10); unclipped, such steps throw q off.
* The generator's output layer is rescaled once at initialization (from 10,000 noise draws) so that q
  starts with mean 0 and standard deviation s0, covering both modes. With PyTorch's default
  initialization q starts as a narrow blob on a random side of 0; KIVI fills the near mode first and
  moves mass across the gap only slowly, so the modes end up unequal.
* The Gaussian starts at N(m0, 1) with m0 ~ N(0, 1) (``--gaussian-init standard``), the usual VI
  start, and settles on one mode (KL ~ log 2). Started as wide as KIVI (``--gaussian-init wide``,
  N(~0, s0^2)) it stays at the local optimum between the modes, N(0, 2.75^2), KL ~0.84.
* Adam, learning rate 3e-3 decayed linearly to 3e-4, 3000 steps, n_q = n_p = 100 samples per step.

With these defaults, seeds 0 to 7 gave KIVI a KL of 0.03 to 0.07 with 0.46 to 0.54 of its mass on
each side of 0, and the Gaussian a KL of 0.69 with all but ~0.5% of its mass on one mode.

Evaluation (``results.json``), on ``--eval-samples`` (default 10^6) fresh samples of each q:

* Gaussian VI: ELBO = Monte Carlo mean of log p(z) + exact entropy, KL = -ELBO (``kl_stderr``: the MC
  standard error).
* KIVI: q has no density, so log q is estimated by a histogram of the samples (bins of width
  ``--bin-width``, default 0.02): H[q] ~ -sum_b P_b log(P_b / width), ELBO = mean of log p(z) + H,
  KL = -ELBO. The same histogram estimate on the Gaussian's samples is reported as its
  ``kl_histogram``: a check of this estimator against the accurate value (they agree to ~0.005).
* ``final_train_kl_estimate``: the training objective averaged over the last 10% of steps; for KIVI
  it shows the bias of the kernel estimate at this bandwidth (it reads ~0.5 where the KL is ~0.05).
* ``mass_left`` / ``mass_right``: the fraction of q's mass with z < 0 / z > 0 (target: 0.5 / 0.5).

Files in the run folder: ``results.json`` (keys: ``RESULT_KEYS``, per method ``METHOD_KEYS`` and
more), ``densities.png`` (the target, the Gaussian VI density and a histogram of KIVI samples) and
``training.png`` (the KL estimates during training).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

import kivi_fast
from kivi_fast._validate import MIN_BANDWIDTH

from ..nn import FactorizedGaussian, MLPGenerator
from . import runs
from .options import (UsageError, add_common, apply_quick, int_at_least, kivi_clip, kivi_lam, nonnegative_float,
                      plural, positive_float, positive_float_at_most, positive_int, random_seed, thread_count)
from .training import check_loss_is_finite, estimator_refusal_as_run_error

# the target: equal-weight mixture of N(-3, 1) and N(3, 1)
MIX_WEIGHTS = (0.5, 0.5)
MIX_MEANS = (-3.0, 3.0)
MIX_STDS = (1.0, 1.0)
HIDDEN = 10  # units in each of the generator's two hidden layers (the paper's setting)
QUICK = {"steps": 200, "n_samples": 50, "eval_samples": 20_000}

_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)

# keys written to results.json (the tests hold the module to them)
RESULT_KEYS = ("experiment", "settings", "target", "methods", "evaluation", "backend", "run_dir",
               "wall_seconds", "files")
METHOD_KEYS = ("kl", "elbo", "mass_left", "mass_right", "kl_method", "final_train_kl_estimate",
               "train_seconds")


# ---------------------------------------------------------------------------------------------------
# target and variational families


def target_log_prob(z: torch.Tensor) -> torch.Tensor:
    """log p(z) of the normalized mixture 0.5 N(-3, 1) + 0.5 N(3, 1), elementwise."""
    terms = [math.log(w) - _LOG_SQRT_2PI - math.log(s) - 0.5 * ((z - m) / s) ** 2
             for w, m, s in zip(MIX_WEIGHTS, MIX_MEANS, MIX_STDS)]
    return torch.logsumexp(torch.stack(terms), dim=0)


def target_cdf(z: torch.Tensor) -> torch.Tensor:
    """P(Z <= z) under the target, elementwise."""
    return sum(w * 0.5 * (1 + torch.erf((z - m) / (s * math.sqrt(2))))
               for w, m, s in zip(MIX_WEIGHTS, MIX_MEANS, MIX_STDS))


def normal_log_prob(z: torch.Tensor, mean, std) -> torch.Tensor:
    std = torch.as_tensor(std, dtype=z.dtype)
    return -0.5 * ((z - mean) / std) ** 2 - torch.log(std) - _LOG_SQRT_2PI


def kivi_generator(noise_dim: int = 4, activation: str = "relu") -> MLPGenerator:
    """Implicit q: z = MLP(eps), eps ~ N(0, I_noise_dim); two hidden layers of 10 units, 1 output,
    torch.nn.Linear's initialization (then :func:`init_output`)."""
    return MLPGenerator((noise_dim, HIDDEN, HIDDEN, 1), activation=activation, init="torch")


@torch.no_grad()
def init_output(gen: MLPGenerator, mean: float, std: float, generator: torch.Generator, n: int = 10_000) -> None:
    """Rescale the generator's output layer so that its samples have this mean and standard deviation."""
    z = gen.sample(n, generator)
    scale = std / float(z.std())
    last = gen.output_layer
    last.weight.mul_(scale)
    last.bias.sub_(float(z.mean())).mul_(scale).add_(mean)


# ---------------------------------------------------------------------------------------------------
# objectives (each returns an estimate of KL(q || p) = -ELBO to minimize)


def kivi_kl(q_z: torch.Tensor, args, generator: torch.Generator) -> torch.Tensor:
    """KL(q || p) from samples q_z [n, 1] of the implicit q (differentiable w.r.t. q_z)."""
    if args.contrast == "adaptive":
        return kivi_fast.adaptive_contrast_kl(q_z, lambda z: target_log_prob(z[..., 0]), lam=args.lam,
                                              clip=args.clip, bandwidth=args.bandwidth, generator=generator)
    prior_z = args.s0 * torch.randn(args.n_samples, 1, generator=generator)
    kl_reference = kivi_fast.kernel_kl(prior_z, q_z, lam=args.lam, clip=args.clip, bandwidth=args.bandwidth)
    z = q_z[:, 0]
    return kl_reference + (normal_log_prob(z, 0.0, args.s0) - target_log_prob(z)).mean()


def gaussian_kl(q: FactorizedGaussian, args, generator: torch.Generator) -> torch.Tensor:
    """-ELBO = -(E_q[log p] + H[q]) with the exact entropy."""
    z = q.sample(args.n_samples, generator)[:, 0]
    return -(target_log_prob(z).mean() + q.entropy())


def train(name: str, model: nn.Module, objective, args, generator: torch.Generator,
          progress: bool) -> dict:
    """Adam with a linear learning-rate decay to a tenth; returns the KL estimates per step.

    The bar shows the training objective smoothed over ~50 steps: for KIVI a biased kernel estimate
    of the KL (it reads ~0.6 where the evaluated KL is ~0.05), for the Gaussian a Monte Carlo one."""
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 - 0.9 * min(i / max(args.steps, 1), 1.0))
    history, grad_norms = [], []
    smooth = None
    start = time.perf_counter()
    bar = tqdm(range(args.steps), desc=f"{name:<11}", disable=not progress, dynamic_ncols=True,
               file=sys.stderr, mininterval=0.25)
    for step in bar:
        # a failure at step 0, before any update, comes from the initial scale, not from --lr
        where, updated, initial = f"step {step}", step > 0, "check --s0, its initial scale"
        with estimator_refusal_as_run_error(name, where, updated, initial):
            loss = objective(model, generator)
        value = loss.item()
        check_loss_is_finite(name, value, where, updated, initial)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        norm = nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip if args.grad_clip else float("inf"))
        grad_norms.append(float(norm))
        opt.step()
        sched.step()
        history.append(value)
        smooth = value if smooth is None else 0.98 * smooth + 0.02 * value
        if step % 20 == 0 or step == args.steps - 1:
            bar.set_postfix({"KL (training estimate)": f"{smooth:.3f}"}, refresh=False)
    bar.close()
    tail = history[-max(1, len(history) // 10):]
    norms = np.asarray(grad_norms)
    clip_at = args.grad_clip if args.grad_clip else float("inf")
    return {"history": history, "grad_norm_median": float(np.median(norms)), "grad_norm_max": float(norms.max()),
            "grad_clipped_fraction": float((norms > clip_at).mean()), "seconds": time.perf_counter() - start,
            "final_estimate": float(np.mean(tail)) if tail else float("nan")}


# ---------------------------------------------------------------------------------------------------
# evaluation


def histogram_entropy(z: np.ndarray, bin_width: float) -> float:
    """Differential entropy of the histogram density of the samples z (bins aligned at 0)."""
    idx = np.floor(z / bin_width).astype(np.int64)
    counts = np.bincount(idx - idx.min())
    p = counts[counts > 0] / z.size
    return float(-(p * np.log(p / bin_width)).sum())


def mass_split(z: np.ndarray) -> tuple[float, float]:
    return float((z < 0).mean()), float((z > 0).mean())


@torch.no_grad()
def evaluate_kivi(gen: MLPGenerator, n: int, bin_width: float, generator: torch.Generator) -> dict:
    z = torch.cat([gen.sample(min(n - i, 100_000), generator)[:, 0] for i in range(0, n, 100_000)]).double()
    log_p = target_log_prob(z)
    z_np = z.numpy()
    h = histogram_entropy(z_np, bin_width)
    elbo = float(log_p.mean()) + h
    left, right = mass_split(z_np)
    return {"kl": -elbo, "elbo": elbo, "entropy": h, "expected_log_p": float(log_p.mean()),
            "mass_left": left, "mass_right": right, "mean": float(z.mean()), "std": float(z.std()),
            "kl_method": f"histogram density of {n} samples (bin width {bin_width}): "
                         "KL = -(mean log p(z) + histogram entropy)",
            "samples": z_np}


@torch.no_grad()
def evaluate_gaussian(q: FactorizedGaussian, n: int, bin_width: float, generator: torch.Generator) -> dict:
    mean, std = float(q.mean), float(q.std)
    z = (mean + std * torch.randn(n, generator=generator, dtype=torch.float64))
    log_p = target_log_prob(z)
    entropy = 0.5 + _LOG_SQRT_2PI + math.log(std)
    elbo = float(log_p.mean()) + entropy
    z_np = z.numpy()
    right = 0.5 * (1 + math.erf(mean / (std * math.sqrt(2))))
    return {"kl": -elbo, "elbo": elbo, "kl_stderr": float(log_p.std()) / math.sqrt(n),
            "entropy": entropy, "expected_log_p": float(log_p.mean()),
            "kl_histogram": -(float(log_p.mean()) + histogram_entropy(z_np, bin_width)),
            "mass_left": 1.0 - right, "mass_right": right, "mean": mean, "std": std,
            "kl_method": f"Monte Carlo over {n} samples with the exact log-density and exact entropy",
            "samples": z_np}


def plot_densities(path: Path, kivi: dict, gauss: dict, seed: int, pyplot) -> None:
    plt = pyplot
    xs = torch.linspace(-8, 8, 1601, dtype=torch.float64)
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    edges = np.arange(-8, 8.001, 0.1)
    counts, _ = np.histogram(kivi["samples"], bins=edges)
    ax.stairs(counts / (kivi["samples"].size * 0.1), edges, fill=True, color="tab:orange", alpha=0.45,
              label=f"KIVI (histogram of samples), KL = {kivi['kl']:.3f}")
    ax.plot(xs, target_log_prob(xs).exp(), color="black", lw=2.2, label="target p(z)")
    ax.plot(xs, normal_log_prob(xs, gauss["mean"], gauss["std"]).exp(), color="tab:blue", lw=2, ls="--",
            label=f"Gaussian VI N({gauss['mean']:.2f}, {gauss['std']:.2f}²), KL = {gauss['kl']:.3f}")
    ax.set_xlim(-8, 8)
    ax.set_ylim(0, max(0.45, ax.get_ylim()[1]))
    ax.set_xlabel("z")
    ax.set_ylabel("density")
    ax.set_title(f"1-D Gaussian mixture 0.5 N(-3, 1) + 0.5 N(3, 1): KIVI vs. Gaussian VI (seed {seed})")
    ax.legend(loc="upper left", fontsize=8.5, framealpha=0.9)
    ax.grid(alpha=0.3)
    runs.save_figure(fig, path)


def plot_training(path: Path, histories: dict, final_kl: dict, pyplot) -> None:
    """The per-step training objective (an estimate of KL) and, dashed, each method's evaluated KL."""
    plt = pyplot
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    for (name, hist), color in zip(histories.items(), ("tab:orange", "tab:blue")):
        h = np.asarray(hist)
        ax.plot(h, color=color, alpha=0.2, lw=0.6)
        k = min(50, len(h))
        if k > 1:
            smooth = np.convolve(h, np.ones(k) / k, mode="valid")
            ax.plot(np.arange(k - 1, len(h)), smooth, color=color, lw=1.8,
                    label=f"{name}: training estimate ({k}-step mean)")
        ax.axhline(final_kl[name], color=color, lw=1.2, ls="--",
                   label=f"{name}: final KL evaluated = {final_kl[name]:.3f}")
    ax.axhline(0.0, color="black", lw=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("KL(q || p) = -ELBO")
    ax.set_ylim(-0.1, 3.0)
    ax.set_title("Training objective per step (KIVI's is a kernel estimate, biased upward here)", fontsize=10.5)
    ax.legend(fontsize=8, loc="upper right")
    ax.grid(alpha=0.3)
    runs.save_figure(fig, path)


# ---------------------------------------------------------------------------------------------------
# command line


def _bandwidth(text: str):
    if text == "median":
        return text
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not MIN_BANDWIDTH <= value < math.inf:
        raise argparse.ArgumentTypeError(f"bandwidth must be 'median' or a number >= {MIN_BANDWIDTH:g}, got {text!r}")
    return value


# The histogram entropy's error grows as bin width x samples shrinks (-0.07 nats at 100, with 20,000 or
# 1,000,000 samples; -0.3 at 20, -1.6 at 2); wide bins blur the modes instead (+0.03 at width 1, +0.12 at 2).
# The lower bound also keeps the bins (the samples' range / width) few: at most range x samples / 100.
MAX_BIN_WIDTH = 1.0
MIN_BIN_SAMPLES = 100


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=positive_int, default=3000, help="Adam steps for each method")
    parser.add_argument("--n-samples", type=int_at_least(2), default=100,
                        help="q samples (and reference samples) per step, n_q = n_p")
    parser.add_argument("--lr", type=positive_float, default=3e-3,
                        help="Adam learning rate, decayed linearly to a tenth")
    parser.add_argument("--noise-dim", type=positive_int, default=4, help="KIVI generator's noise dimension")
    parser.add_argument("--activation", choices=("relu", "tanh"), default="relu",
                        help="hidden activation of the KIVI generator")
    parser.add_argument("--s0", type=positive_float, default=3.0,
                        help="std of the N(0, s0^2) reference that KIVI's KL is taken against")
    parser.add_argument("--lam", type=kivi_lam, default=0.003, help="KIVI ridge coefficient lambda")
    parser.add_argument("--clip", type=kivi_clip, default=1e-8, help="KIVI ratio clipping threshold")
    parser.add_argument("--bandwidth", type=_bandwidth, default=0.5,
                        help="KIVI kernel bandwidth: a positive number or 'median' (the paper's heuristic, "
                             "which here shrinks each mode into a spike; see the module docstring)")
    parser.add_argument("--grad-clip", type=nonnegative_float, default=10.0,
                        help="clip the gradient norm at this value, 0 for none")
    parser.add_argument("--gaussian-init", choices=("standard", "wide"), default="standard",
                        help="Gaussian VI start: N(m0, 1), m0 ~ N(0, 1) (standard), or N(~0, s0^2) like KIVI (wide)")
    parser.add_argument("--contrast", choices=("reference", "adaptive"), default="reference",
                        help="KIVI's KL: against N(0, s0^2) (reference, the paper's form) or adaptive contrast")
    parser.add_argument("--eval-samples", type=int_at_least(2), default=1_000_000,
                        help="samples of each q for the final ELBO/KL")
    parser.add_argument("--bin-width", type=positive_float_at_most(MAX_BIN_WIDTH), default=0.02,
                        help=f"histogram bin width of the KIVI density estimate, at most {MAX_BIN_WIDTH:g} (the "
                             f"target's modes have std 1) and at least {MIN_BIN_SAMPLES} / --eval-samples")
    parser.add_argument("--seed", type=random_seed, default=0, help="random seed")
    parser.add_argument("--threads", type=thread_count, default=1, help="torch CPU threads (the tensors are small)")
    add_common(parser, name="toy", quick="a smoke run in seconds (200 steps, 50 samples, 20k eval samples)")


def _settings(args) -> dict:
    keys = ("steps", "n_samples", "lr", "noise_dim", "activation", "s0", "lam", "clip", "bandwidth", "contrast",
            "grad_clip", "gaussian_init", "eval_samples", "bin_width", "seed", "threads", "quick")
    settings = {k: getattr(args, k) for k in keys}
    settings.update(hidden_layers=[HIDDEN, HIDDEN], lr_schedule="linear decay to lr/10", optimizer="Adam",
                    kivi_init="output layer rescaled so that q starts with mean 0 and std s0",
                    gaussian_init_description={"standard": "N(m0, 1), m0 ~ N(0, 1)",
                                               "wide": "N(m0, s0^2), m0 ~ N(0, 0.1^2)"}[args.gaussian_init])
    return settings


def run(args) -> int:
    apply_quick(args, QUICK)
    if args.bin_width * args.eval_samples < MIN_BIN_SAMPLES:
        raise UsageError(f"--bin-width {args.bin_width:g} is too narrow for --eval-samples {args.eval_samples}: "
                         f"the histogram's entropy needs bin width x samples >= {MIN_BIN_SAMPLES} (here --bin-width "
                         f">= {MIN_BIN_SAMPLES / args.eval_samples:.3g})")

    started = time.perf_counter()
    out = runs.run_folder(args.out, "toy", args.run_dir)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    progress = not args.no_progress
    try:
        backend = kivi_fast.backend()
        if progress:
            print(f"kivi-fast toy: 1-D Gaussian mixture, {plural(args.steps, 'step')}, backend {backend}, "
                  f"run folder {out}", file=sys.stderr)

        # KIVI
        torch.manual_seed(args.seed)
        gen = kivi_generator(args.noise_dim, args.activation)
        g = torch.Generator().manual_seed(args.seed)
        init_output(gen, 0.0, args.s0, g)
        kivi_train = train("KIVI", gen, lambda m, g_: kivi_kl(m.sample(args.n_samples, g_), args, g_), args, g,
                           progress)

        # Gaussian VI
        g = torch.Generator().manual_seed(args.seed + 1)
        if args.gaussian_init == "wide":
            gauss = FactorizedGaussian(1, 0.1 * float(torch.randn((), generator=g)), args.s0)
        else:
            gauss = FactorizedGaussian(1, float(torch.randn((), generator=g)), 1.0)
        gauss_train = train("Gaussian VI", gauss, lambda m, g_: gaussian_kl(m, args, g_), args, g, progress)

        g = torch.Generator().manual_seed(args.seed + 2)
        kivi_eval = evaluate_kivi(gen, args.eval_samples, args.bin_width, g)
        gauss_eval = evaluate_gaussian(gauss, args.eval_samples, args.bin_width, g)

        plt = runs.matplotlib_pyplot()
        plot_densities(out / "densities.png", kivi_eval, gauss_eval, args.seed, plt)
        plot_training(out / "training.png", {"KIVI": kivi_train["history"], "Gaussian VI": gauss_train["history"]},
                      {"KIVI": kivi_eval["kl"], "Gaussian VI": gauss_eval["kl"]}, plt)
    finally:
        torch.set_num_threads(threads)

    methods = {}
    for name, ev, tr in (("kivi", kivi_eval, kivi_train), ("gaussian_vi", gauss_eval, gauss_train)):
        entry = {k: v for k, v in ev.items() if k != "samples"}
        entry["final_train_kl_estimate"] = tr["final_estimate"]
        entry["train_seconds"] = tr["seconds"]
        for key in ("grad_norm_median", "grad_norm_max", "grad_clipped_fraction"):
            entry[key] = tr[key]
        entry["train_kl_estimate_every_10_steps"] = tr["history"][::10]
        methods[name] = entry
    results = {
        "experiment": "toy_mixture",
        "settings": _settings(args),
        "target": {"weights": list(MIX_WEIGHTS), "means": list(MIX_MEANS), "stds": list(MIX_STDS),
                   "normalized": True, "note": "ELBO = E_q[log p] + H[q] = -KL(q || p) since p is normalized"},
        "methods": methods,
        "evaluation": {"eval_samples": args.eval_samples, "bin_width": args.bin_width,
                       "kivi": kivi_eval["kl_method"], "gaussian_vi": gauss_eval["kl_method"],
                       "final_train_kl_estimate": "mean of the training objective over the last 10% of steps "
                                                  "(for KIVI: the kernel estimate plus the MC reference term)",
                       "mass": "mass_left = fraction of samples with z < 0, mass_right with z > 0 "
                               "(exact for the Gaussian); the target has 0.5 / 0.5"},
        "backend": backend,
        "run_dir": str(out),
        "wall_seconds": time.perf_counter() - started,
        "files": ["results.json", "densities.png", "training.png"],
    }
    runs.write_json(out / "results.json", results)
    print(summary_table(results))
    print(f"run folder: {out}")
    return 0


def summary_table(results: dict) -> str:
    rows = [("method", "KL(q||p)", "ELBO", "P(z<0)", "P(z>0)", "train s")]
    for label, key in (("KIVI", "kivi"), ("Gaussian VI", "gaussian_vi")):
        m = results["methods"][key]
        rows.append((label, f"{m['kl']:.3f}", f"{m['elbo']:.3f}", f"{m['mass_left']:.3f}",
                     f"{m['mass_right']:.3f}", f"{m['train_seconds']:.1f}"))
    rows.append(("target", "0", "0", "0.500", "0.500", ""))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    n = results["evaluation"]["eval_samples"]
    lines.append(f"KL from {plural(n, 'sample')} of each q: KIVI's log q from a histogram, the Gaussian's exact; "
                 "ELBO = -KL (p is normalized).")
    return "\n".join(lines)
