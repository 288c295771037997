"""``kivi-fast reverse-ablation``: the reverse ratio trick (the paper's App. F.1, Fig. "reverse-trick").

The stochastic network of the 2-D logistic regression (:func:`kivi_fast.nn.stochastic_net_2d`) is trained
to minimize only the KIVI estimate of KL(q || N(0, I)), so the right answer is q = N(0, I):

* with the trick: ``kivi_fast.kernel_kl(prior, q, lam, reverse=True)`` fits p/q and returns -E_q log(p/q);
* without it: ``reverse=False`` fits q/p, whose squared loss is weighted by p rather than by q.

Both runs start from the same initial network and see the same random numbers. The figure shows the
final sample clouds over the prior's contours; the JSON records the distance to the prior (mean,
covariance, an RBF MMD^2 against prior samples) every ``--log-every`` steps.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from tqdm.auto import tqdm

import kivi_fast

from ..nn import MLPGenerator, stochastic_net_2d
from . import runs
from .options import add_common, int_at_least, kivi_clip, kivi_lam, plural, positive_float, positive_int, random_seed
from .sample_metrics import mmd2_rbf, moment_gaps
from .training import check_loss_is_finite, estimator_refusal_as_run_error

NAME = "reverse-ablation"
VARIANTS = {"with the reverse ratio trick": True, "without (fit q/p)": False}
QUICK = {"steps": 10, "samples": 100, "log_every": 5, "eval_samples": 100}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seed", type=random_seed, default=0, help="random seed")
    parser.add_argument("--steps", type=positive_int, default=1000, help="Adam steps of each variant")
    parser.add_argument("--samples", type=int_at_least(2), default=1000,
                        help="q samples per step (and as many prior samples)")
    parser.add_argument("--lam", type=kivi_lam, default=0.1,
                        help="KIVI's ridge coefficient lambda (as in the logistic regression)")
    parser.add_argument("--clip", type=kivi_clip, default=1e-8, help="KIVI's lower clip of the density ratio")
    parser.add_argument("--lr", type=positive_float, default=0.01, help="Adam learning rate")
    parser.add_argument("--log-every", type=positive_int, default=50,
                        help="steps between the distance measurements (and the last step)")
    parser.add_argument("--eval-samples", type=int_at_least(2), default=2000,
                        help="q and prior samples of each distance measurement and the figure")
    add_common(parser, name=NAME, quick="a seconds-long smoke run (10 steps, 100 samples)")


def distance_to_prior(q: torch.Tensor, prior: torch.Tensor) -> dict:
    """Moment distance of samples q [n, 2] to N(0, I), and their MMD^2 to prior samples."""
    d = q.shape[-1]
    gaps = moment_gaps(q, (torch.zeros(d), torch.eye(d)))
    mmd2, _ = mmd2_rbf(q, prior)
    return {"mean_error": gaps["mean_error"], "cov_error": gaps["cov_error"], "mean": gaps["mean"],
            "cov": gaps["cov"], "mmd2": mmd2}


def train(net: MLPGenerator, reverse: bool, args, generator: torch.Generator, desc: str) -> list[dict]:
    opt = torch.optim.Adam(net.parameters(), lr=args.lr)
    history = []
    for step in tqdm(range(1, args.steps + 1), desc=desc, disable=args.no_progress):
        where, updated = f"step {step}", step > 1
        q = net.sample(args.samples, generator)
        prior = torch.randn(args.samples, 2, generator=generator)
        with estimator_refusal_as_run_error(desc, where, updated):
            loss = kivi_fast.kernel_kl(prior, q, args.lam, clip=args.clip, reverse=reverse)
        check_loss_is_finite(desc, loss.item(), where, updated)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % args.log_every == 0 or step == args.steps:
            with torch.no_grad():
                q_eval = net.sample(args.eval_samples, generator)
            with estimator_refusal_as_run_error(desc, where, updated, failed="the distance to the prior"):
                distance = distance_to_prior(q_eval, torch.randn(args.eval_samples, 2, generator=generator))
            history.append({"step": step, "kl_estimate": float(loss.detach()), **distance})
    return history


def plot(path, clouds: dict, titles: dict) -> None:
    """Top row: the clouds over the prior's contours in a fixed window; bottom row: each cloud on its
    own scale, so that one that ran away from the prior is still seen."""
    plt = runs.matplotlib_pyplot()
    fig, axes = plt.subplots(2, len(clouds), figsize=(4.2 * len(clouds), 8.4), squeeze=False)
    t = torch.linspace(-4, 4, 200)
    g1, g2 = torch.meshgrid(t, t, indexing="xy")
    prior = torch.exp(-0.5 * (g1**2 + g2**2)) / (2 * torch.pi)
    for j, (name, s) in enumerate(clouds.items()):
        s = s.numpy()
        for i, ax in enumerate(axes[:, j]):
            ax.contour(g1.numpy(), g2.numpy(), prior.numpy(), levels=6, colors="0.5", linewidths=0.8)
            ax.scatter(s[:, 0], s[:, 1], s=2, alpha=0.4, c="tab:blue", rasterized=True)
            if i == 0:
                ax.set(xlim=(-4, 4), ylim=(-4, 4), title=titles[name])
                ax.set_aspect("equal")
            else:
                ax.set_title("same samples, own scale", fontsize=9)
                ax.ticklabel_format(style="sci", scilimits=(-3, 3))
            ax.set(xlabel="w1", ylabel="w2")
    fig.suptitle("q trained to minimize only the KIVI estimate of KL(q || N(0, I)) (gray: prior contours)",
                 fontsize=10)
    runs.save_figure(fig, path, dpi=80, rect=(0, 0, 1, 0.97))


def run(args) -> int:
    out = runs.begin(args, NAME, QUICK)
    torch.manual_seed(args.seed)
    init = stochastic_net_2d()
    eval_gen = torch.Generator().manual_seed(args.seed + 1)
    with torch.no_grad():
        clouds = {"initial q": init.sample(args.eval_samples, eval_gen)}
    initial = distance_to_prior(clouds["initial q"], torch.randn(args.eval_samples, 2, generator=eval_gen))
    histories, finals, timings = {}, {}, {}
    for name, reverse in VARIANTS.items():
        net = copy.deepcopy(init)
        t0 = time.time()
        histories[name] = train(net, reverse, args, torch.Generator().manual_seed(args.seed + 2), name)
        timings[name] = time.time() - t0
        with torch.no_grad():
            clouds[name] = net.sample(args.eval_samples, torch.Generator().manual_seed(args.seed + 3))
        with estimator_refusal_as_run_error(name, "the end", True, failed="the distance to the prior"):
            finals[name] = distance_to_prior(clouds[name], torch.randn(args.eval_samples, 2, generator=eval_gen))
    config = {k: v for k, v in vars(args).items() if not k.startswith("_")}
    runs.write_json(out / "metrics.json", {"config": config, "backend": kivi_fast.backend(), "initial": initial,
                                           "final": finals, "history": histories, "timings_s": timings})
    titles = {name: f"{name}\n|mean| {f['mean_error']:.3g}, ||cov - I||_F {f['cov_error']:.3g}"
              for name, f in {"initial q": initial, **finals}.items()}
    plot(out / "reverse_ablation.png", clouds, titles)

    print(f"distance to the prior N(0, I) after {plural(args.steps, 'step')} (lam={args.lam:g}, n={args.samples}):")
    print(f"{'':<32}{'|mean|':>11}{'||cov-I||_F':>13}{'MMD^2':>10}")
    for name, f in {"initial q": initial, **finals}.items():
        print(f"{name:<32}{f['mean_error']:>11.4g}{f['cov_error']:>13.4g}{f['mmd2']:>10.4f}")
    print(f"wrote {out}/reverse_ablation.png, metrics.json")
    return 0
