"""``kivi-fast vae-ais RUN...``: test log-likelihood of a trained ``kivi-fast vae`` run by AIS.

Loads the run's final checkpoint, draws ``--images`` test images at random (seeded; the test set is
sorted by class, so a prefix would not do), and estimates log p(x) by annealed importance sampling
(:func:`kivi_fast.experiments.ais.ais_log_likelihood`: ``--chains`` chains, ``--steps`` temperatures on
a sigmoidal schedule, one HMC transition of ``--leapfrog`` steps each). For a Gaussian encoder it also
gives the IWAE bound with ``--iwae-k`` samples on the same images, a check: AIS should not read below
it by more than its noise. Writes ``ais.json`` into the run folder (the estimate, its standard error
over images, each image's estimate (for paired comparisons: the same ``--seed`` draws the same images),
the settings, the time) and prints it.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..nn.vae import KL_ESTIMATORS, build_vae
from . import runs
from .ais import ais_log_likelihood, iwae_log_likelihood
from .mnist_data import load_binarized_mnist
from .options import UsageError, apply_quick, int_at_least, nonnegative_int, positive_int, random_seed
from .training import add_device_options, device_of

QUICK = {"images": 8, "chains": 2, "steps": 20, "leapfrog": 2, "iwae_k": 100}
# what a vae run's config.json must hold for its model to be rebuilt and its training images found
CONFIG_KEYS = ("method", "n_q", "n_p", "lam", "clip", "contrast", "train_images")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="+", help="run folder(s) of kivi-fast vae")
    # two at least: the standard error over images (and vae-report's paired difference) needs two
    p.add_argument("--images", type=int_at_least(2), default=2048, help="random test images (the paper: 2048)")
    p.add_argument("--split", choices=("test", "train"), default="test",
                   help="test images, or the training images the run was trained on (an overfitting measure "
                        "free of the KL estimator: the train - test log-likelihood gap); writes ais.json or "
                        "ais_train.json")
    p.add_argument("--chains", type=positive_int, default=16, help="AIS chains per image")
    p.add_argument("--steps", type=positive_int, default=1000, help="AIS temperatures")
    p.add_argument("--leapfrog", type=positive_int, default=10, help="leapfrog steps of each HMC transition")
    p.add_argument("--chunk", type=positive_int, default=256, help="images per AIS batch")
    p.add_argument("--iwae-k", type=nonnegative_int, default=5000,
                   help="IWAE samples per image for a Gaussian encoder (0: none)")
    p.add_argument("--seed", type=random_seed, default=0, help="the images and the chains")
    add_device_options(p, "binarized_mnist")
    p.add_argument("--quick", action="store_true", help="a smoke run: 8 images, 2 chains, 20 temperatures")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def load_model(run_dir: Path, device: torch.device):
    config_path = run_dir / "config.json"
    if not config_path.exists():
        raise runs.RunError(f"{run_dir} is not a kivi-fast vae run folder (no config.json)")
    config = runs.read_json(config_path)
    # another command's run (mnist's config also says "kivi") must not get as far as a KeyError
    missing = [k for k in CONFIG_KEYS if k not in config]
    if missing:
        raise runs.RunError(f"{run_dir} is not a kivi-fast vae run folder: its config.json lacks {', '.join(missing)}")
    if config["method"] not in KL_ESTIMATORS:
        raise runs.RunError(f"{run_dir} is not a kivi-fast vae run folder: its config.json's method "
                            f"{config['method']!r} is not a VAE's ({', '.join(KL_ESTIMATORS)})")
    state = runs.load_checkpoint(run_dir / "checkpoint.pt", ("model", "epoch"))
    if state is None:
        raise runs.RunError(f"{run_dir} has no checkpoint.pt to evaluate")
    model = build_vae(config["method"], n_q=config["n_q"], n_p=config["n_p"], lam=config["lam"],
                      clip=config["clip"], contrast=config["contrast"])
    try:
        model.load_state_dict(state["model"])
    except (RuntimeError, TypeError) as err:  # missing or other-shaped weights; not a dict at all
        raise runs.RunError(f"{run_dir} is not a kivi-fast vae run folder: its checkpoint.pt does not hold the "
                            f"model its config.json describes ({runs.state_dict_mismatch(err)})") from None
    return model.to(device).eval(), config, state["epoch"]


def evaluate(model, x: torch.Tensor, args, generator: torch.Generator, bar) -> dict:
    lls, accept, iwae = [], [], []
    for lo in range(0, x.shape[0], args.chunk):
        xb = x[lo:lo + args.chunk]
        ll = lambda z, xb=xb: model.decoder.log_likelihood(xb[:, None, :], z)  # noqa: E731
        r = ais_log_likelihood(ll, xb.shape[0], model.encoder.z_dim, chains=args.chains, steps=args.steps,
                               leapfrog=args.leapfrog, generator=generator, device=x.device,
                               progress=bar.update)
        lls.append(r["log_likelihood"].cpu())
        accept.append(r["acceptance"])
        if model.kl_estimator == "gaussian" and args.iwae_k:
            with torch.no_grad():
                iwae.append(iwae_log_likelihood(
                    ll, lambda m, xb=xb: model.encoder(xb, m), lambda z, xb=xb: model.encoder.log_prob(xb, z),
                    args.iwae_k).cpu())
    ll = torch.cat(lls)
    out = {"ais_log_likelihood": float(ll.mean()), "ais_standard_error": float(ll.std() / math.sqrt(len(ll))),
           "acceptance": sum(accept) / len(accept), "per_image": [round(v, 4) for v in ll.tolist()]}
    if iwae:
        iw = torch.cat(iwae)
        out.update(iwae_log_likelihood=float(iw.mean()), iwae_k=args.iwae_k,
                   ais_minus_iwae=float((ll - iw).mean()),
                   ais_minus_iwae_standard_error=float((ll - iw).std() / math.sqrt(len(ll))))
    return out


def run(args) -> int:
    apply_quick(args, QUICK)
    torch.set_num_threads(args.threads)
    device = device_of(args.device)
    x_train, _, x_test = load_binarized_mnist(args.data_dir)
    # every folder loaded before the first AIS: a mistyped second folder is named at once, not after
    # the first folder's AIS (minutes at the default settings)
    loaded = [(Path(folder), *load_model(Path(folder), device)) for folder in args.runs]
    for run_dir, model, config, epoch in loaded:
        pool = x_test if args.split == "test" else x_train[:config["train_images"]]
        if args.images > pool.shape[0]:
            raise UsageError(f"--images: the {args.split} images number {pool.shape[0]}, got {args.images}")
        pick = torch.randperm(pool.shape[0], generator=torch.Generator().manual_seed(args.seed))[:args.images]
        x = pool[pick].to(device)
        generator = torch.Generator(device=device).manual_seed(args.seed + 1)
        t0 = time.perf_counter()
        with tqdm(total=args.steps * math.ceil(args.images / args.chunk), desc=f"AIS {config['method']}",
                  disable=args.no_progress, unit="temperature") as bar:
            out = evaluate(model, x, args, generator, bar)
        out.update(method=config["method"], split=args.split, epoch=epoch, seconds=time.perf_counter() - t0,
                   device=str(device), settings={"images": args.images, "chains": args.chains, "steps": args.steps,
                             "leapfrog": args.leapfrog, "schedule": "sigmoid (delta 4)", "seed": args.seed,
                             "step_size": "per chain, adapted toward 65% acceptance"})
        runs.write_json(run_dir / ("ais.json" if args.split == "test" else "ais_train.json"), out)
        line = (f"{config['method']} (epoch {epoch}): AIS {args.split} log-likelihood "
                f"{out['ais_log_likelihood']:.2f} ± {out['ais_standard_error']:.2f} on {args.images} images")
        if "iwae_log_likelihood" in out:
            line += f"; IWAE (k = {args.iwae_k}) {out['iwae_log_likelihood']:.2f}"
        print(line)
    return 0
