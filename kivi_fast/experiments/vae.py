"""``kivi-fast vae``: the paper's VAE on statically binarized MNIST (Sec. 5.3, App. D and F).

Model (:func:`kivi_fast.nn.vae.build_vae`): decoder 8 -> 500 -> 500 -> 784 (ReLU, Bernoulli logits);
encoder 784 -> 500 -> 500 -> 8, implicit (500-dimensional N(0, diag(s^2)) noise added to the first
hidden layer, s trainable) for ``--method kivi|kivi-ac``, Gaussian (mean and log std) for ``gaussian``.
The ELBO of a minibatch: the reconstruction term from M = 1 sample, the KL of the whole minibatch one
batched call on q_z [B, n_q, 8]:

* ``kivi``: ``kivi_fast.kernel_kl(prior [B, n_p, 8], q_z, lam, clip)``, the paper's estimator;
* ``kivi-ac``: ``kivi_fast.adaptive_contrast_kl(q_z, None, lam, contrast=--contrast, clip)``, the
  paper's KIVI with adaptive contrast (App. D) with the default ``--contrast diagonal``;
* ``gaussian``: the plain VAE, KL in closed form.

The paper's settings are the defaults: n_p = n_q = 100, lam = 1e-3, clip = 1e-8, batch 128, Adam, lr 1e-3
halved every 200 epochs, 3000 epochs on the 50,000 training images. ``--train-images N`` trains on the
first N (a random sample: the training rows are a random permutation of MNIST's); the epochs that do
not fill a batch drop the rest (each epoch reshuffles).

Every ``--eval-every`` epochs the ELBO of ``--eval-images`` fixed training and test images (the
estimator's KL for the implicit encoders, as the paper's Fig. 4b; 10 samples for the reconstruction
term). ``kivi-fast vae-ais`` estimates the test log-likelihood of a finished run by AIS.

Run folder: ``config.json``, ``history.json`` (the curves), ``checkpoint.pt`` (every
``--checkpoint-every`` seconds and at the end; rerunning with the same ``--run-dir`` resumes exactly,
and a larger ``--epochs`` trains on), ``curves.png``, ``samples.png``, ``reconstructions.png``,
``results.json`` (final ELBOs, time per epoch, the KL's share of a step, the device).

Several processes: ``torchrun --nproc-per-node 2 -m kivi_fast.cli vae ...`` trains with
DistributedDataParallel (gloo on CPU, NCCL on CUDA); each process takes its rows of every global
batch, and the random draws are made for the global batch and sliced, so the parameters follow a
single process's on the same batches (to float tolerance). Rank 0 writes the run folder.

On a GPU, ``--cuda-graph`` captures the training step in a CUDA graph after three eager steps and
replays it (graphs.py): the same draws and updates, without the host launching each of the step's
kernels (one process; Adam then keeps its learning rate and step counters on the GPU).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from ..nn.gaussian import gaussian_kl_to_standard_normal
from ..nn.vae import KL_ESTIMATORS, build_vae, slice_draws
from . import runs
from .mnist_data import load_binarized_mnist
from .graphs import trainer_adam, trainer_step
from .training import (Checkpoints, Distributed, Position, add_device_options, add_gpu_options, add_training_options,
                       check_finite_parameters, check_gpu_options, config_of, device_of, diverged_as_run_error,
                       finished_run, halved_lr, kl_share, restore, save_resumable, start, stopped_message, timed,
                       train_epochs)
from .options import UsageError, add_common, apply_quick, int_at_least, plural, positive_int

NAME = "vae"
PAPER = {"gaussian": -97.3, "kivi-ac": -94.8}  # AIS test LL after 3000 epochs, 2048 test images (Sec. 5.3)
QUICK = {"epochs": 1, "train_images": 512, "eval_images": 64, "n_q": 20, "n_p": 20}
CONFIG_KEYS = ("method", "train_images", "batch", "lr", "lr_halve_every", "n_q", "n_p", "lam", "clip", "contrast",
               "seed", "eval_images", "eval_every", "cuda_graph", "tf32")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--method", choices=KL_ESTIMATORS, default="kivi-ac",
                   help="kivi: implicit encoder, the paper's estimator; kivi-ac: with adaptive contrast "
                        "(the paper's VAE setting); gaussian: the plain VAE")
    add_training_options(p, epochs=3000, batch=128, lr_halve_every=200)
    p.add_argument("--n-q", type=int_at_least(2), default=100, help="encoder samples per data point for the KL")
    p.add_argument("--n-p", type=int_at_least(2), default=100, help="N(0, I) samples per data point for the KL")
    p.add_argument("--contrast", choices=("diagonal", "full", "auto"), default="diagonal",
                   help="kivi-ac's Gaussian contrast: diagonal is the paper's; auto is what the library's "
                        "adaptive_contrast_kl takes unless told")
    p.add_argument("--eval-every", type=positive_int, default=1, help="ELBO curves every N epochs")
    p.add_argument("--eval-images", type=positive_int, default=1000,
                   help="training and test images in each ELBO evaluation (fixed, seeded subsets)")
    add_device_options(p, "binarized_mnist")
    add_gpu_options(p)
    add_common(p, quick="a smoke run: 1 epoch on 512 images, n_p = n_q = 20", name=NAME)


@torch.no_grad()
def evaluate_elbo(model, x: torch.Tensor, generator: torch.Generator, n_rec: int = 10, chunk: int = 100) -> dict:
    """Mean ELBO, reconstruction term and KL over the rows of x (the estimator's KL for implicit encoders)."""
    rec_sum = kl_sum = 0.0
    for lo in range(0, x.shape[0], chunk):
        xb = x[lo:lo + chunk]
        n_q = max(model.n_q, n_rec) if model.kl_estimator != "gaussian" else n_rec
        draws = model.draws(xb.shape[0], generator, xb.device, n_q=n_q)
        rec, kl = model(xb, draws, n_rec=n_rec)
        rec_sum += float(rec.sum())
        kl_sum += float(kl.sum())
    n = x.shape[0]
    return {"elbo": (rec_sum - kl_sum) / n, "reconstruction": rec_sum / n, "kl": kl_sum / n}


def run(args) -> int:
    if args.method == "kivi-ac" and args.contrast == "full" and args.n_q <= 8:
        raise UsageError("--contrast full needs --n-q > 8 (the latent dimension)")
    check_gpu_options(args)
    apply_quick(args, QUICK)  # (start applies it too: the same values)
    if args.eval_images > min(args.train_images, 10000):
        raise UsageError(f"--eval-images: at most the training images ({args.train_images}) and the 10000 test "
                         f"images, got {args.eval_images}")
    comm, run_dir = start(args, QUICK, f"{NAME}-{args.method}")
    result = train(args, run_dir, comm)
    if comm.main and result is not None:
        print(summary_line(result))
    elif comm.main:
        print(stopped_message(NAME, args.minutes, run_dir))
    comm.close()
    return 0


def make_train_step(net, optimizer):
    """One training step on ``{"x": images, **draws}``: the loss (the minibatch's negative ELBO), its
    backward and the optimizer's step; returns the loss, detached. (A step of fixed shapes that
    graphs.CapturedStep can capture.)"""
    def train_step(inputs: dict) -> torch.Tensor:
        rec, kl = net(inputs["x"], {k: v for k, v in inputs.items() if k != "x"})
        loss = (kl - rec).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return loss.detach()
    return train_step


def train(args, run_dir, comm: Distributed | None = None, max_steps: int | None = None) -> dict | None:
    """Train (or resume) into ``run_dir``; returns results.json's content at the end (rank 0), None when
    stopped early (with a checkpoint) by ``--minutes`` or by ``max_steps`` (steps of this call: a test's
    interruption)."""
    comm = comm or Distributed(device_of(args.device))
    device = comm.device
    run_dir = Path(run_dir)
    if comm.main:
        run_dir.mkdir(parents=True, exist_ok=True)
    x_train_all, _, x_test_all = load_binarized_mnist(args.data_dir)
    x_train = x_train_all[:args.train_images].to(device)
    eval_rng = torch.Generator().manual_seed(12345)  # the same evaluation images for every run
    eval_train = x_train[torch.randperm(x_train.shape[0], generator=eval_rng)[:args.eval_images].to(device)]
    eval_test = x_test_all[torch.randperm(x_test_all.shape[0], generator=eval_rng)[:args.eval_images]].to(device)

    torch.manual_seed(args.seed)
    model = build_vae(args.method, n_q=args.n_q, n_p=args.n_p, lam=args.lam, clip=args.clip,
                      contrast=args.contrast).to(device)
    optimizer = trainer_adam(model.parameters(), args.lr, device, args.cuda_graph)
    data_rng = torch.Generator().manual_seed(args.seed)
    draw_rng = torch.Generator(device=device).manual_seed(args.seed + 1)
    config = config_of(args, CONFIG_KEYS, comm.world)
    steps_per_epoch = args.train_images // args.batch

    ckpt_path = run_dir / "checkpoint.pt"
    state = restore(ckpt_path, config, model, optimizer, data_rng, ("draw_rng",))
    at = Position.of(state)
    if state is not None:
        draw_rng.set_state(state["draw_rng"])
        finished = finished_run(run_dir, at.epoch, args.epochs)
        if finished is not None:  # (every rank reads the same checkpoint: all return here)
            return finished if comm.main else None
    if comm.main:
        runs.write_json(run_dir / "config.json", {**config, "epochs": args.epochs, "device": str(device),
                                                  "machine": runs.machine()})
    net = comm.wrap(model)
    lo, hi = comm.shard(args.batch)
    run_step = trainer_step(make_train_step(net, optimizer), device, args.cuda_graph)

    def save():
        check_finite_parameters(model, at.epoch, at.step, ckpt_path)
        if comm.main:
            save_resumable(ckpt_path, run_dir / "history.json", at, config=config, model=model, optimizer=optimizer,
                           data_rng=data_rng, draw_rng=draw_rng.get_state().cpu())

    running = None

    def step(idx):
        nonlocal running
        draws = slice_draws(model.draws(args.batch, draw_rng, device), lo, hi)
        with diverged_as_run_error(at.epoch, at.step, run_dir):
            loss = run_step({"x": x_train[idx], **draws})
        value, = comm.mean([-loss])  # also waits for the device
        running = value if running is None else 0.98 * running + 0.02 * value
        return value, {"elbo": f"{running:.1f}"}

    def end_epoch(say):
        if comm.main and (at.epoch % args.eval_every == 0 or at.epoch == args.epochs):
            model.eval()
            g = torch.Generator(device=device).manual_seed(args.seed + 7)
            tr, te = evaluate_elbo(model, eval_train, g), evaluate_elbo(model, eval_test, g)
            at.history.append({"epoch": at.epoch, "train_seconds": at.train_seconds, "train": tr, "test": te,
                               "lr": halved_lr(args.lr, at.epoch - 1, args.lr_halve_every)})
            say(f"epoch {at.epoch}: ELBO train {tr['elbo']:.2f}, test {te['elbo']:.2f} "
                f"(KL {tr['kl']:.2f}, {te['kl']:.2f})")
            model.train()

    model.train()
    finished = train_epochs(at, args, steps_per_epoch=steps_per_epoch, optimizer=optimizer, data_rng=data_rng,
                            checkpoints=Checkpoints(save, args.checkpoint_every, comm, args.minutes, run_dir),
                            shard=(lo, hi), device=device, step=step, end_epoch=end_epoch,
                            loss_name="ELBO", desc=f"vae {args.method}", show=comm.main and not args.no_progress,
                            run_dir=run_dir, max_steps=max_steps)
    if not finished:
        return None
    comm.barrier()
    if not comm.main:
        return None
    return finish(args, model, run_dir, at.history, at.train_seconds, steps_per_epoch, x_test_all, device, comm.world)


def step_profile(model, x: torch.Tensor, generator: torch.Generator, repeats: int = 5) -> dict:
    """Median seconds of a training step (forward + backward) and of its KL alone (forward + backward
    from the encoder's samples, or its moments for the closed form), on one global batch x."""
    def step(draws):
        rec, kl = model(x, draws)
        (kl - rec).mean().backward()

    full, kl_only = [], []
    for _ in range(repeats):
        draws = model.draws(x.shape[0], generator, x.device)
        full.append(timed(lambda: step(draws), x.device)[0])
        if model.kl_estimator == "gaussian":  # the closed form, from the encoder's moments
            moments = [m.detach().requires_grad_() for m in model.encoder.moments(x)]
            kl_part = lambda: gaussian_kl_to_standard_normal(*moments).mean().backward()  # noqa: E731
        else:  # the estimator, from the encoder's samples
            z = model.encoder(x, draws["noise"].shape[1], draws["noise"]).detach().requires_grad_()
            kl_part = lambda: model.estimated_kl(z, draws["prior"]).mean().backward()  # noqa: E731
        kl_only.append(timed(kl_part, x.device)[0])
    model.zero_grad(set_to_none=True)
    return kl_share(full, kl_only)


def finish(args, model, run_dir, history, train_seconds, steps_per_epoch, x_test, device, world: int) -> dict:
    g = torch.Generator(device=device).manual_seed(args.seed + 11)
    epochs = history[-1]["epoch"]  # the last epoch is always evaluated
    profile = step_profile(model, x_test[:args.batch].to(device), g)
    result = {
        "method": args.method, "epochs": epochs, "train_images": args.train_images,
        "final": {"train_elbo": history[-1]["train"]["elbo"], "test_elbo": history[-1]["test"]["elbo"],
                  "train_kl": history[-1]["train"]["kl"], "test_kl": history[-1]["test"]["kl"]},
        "seconds_per_epoch": train_seconds / max(1, epochs), "steps_per_epoch": steps_per_epoch,
        "step_profile": profile, "device": str(device), "machine": runs.machine(),
        "config": {**config_of(args, CONFIG_KEYS, world), "epochs": args.epochs},
    }
    if device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(device)
    runs.write_json(run_dir / "results.json", result)
    plot_curves({args.method: history}, run_dir / "curves.png")
    plot_images(model, x_test, run_dir, g)
    return result


def summary_line(result: dict) -> str:
    f = result["final"]
    return (f"vae {result['method']}: {plural(result['epochs'], 'epoch')} on {result['train_images']} images, "
            f"ELBO train {f['train_elbo']:.2f}, test {f['test_elbo']:.2f} (gap {f['train_elbo'] - f['test_elbo']:.2f}); "
            f"{result['seconds_per_epoch']:.1f} s/epoch on {result['device']}; test log-likelihood: kivi-fast "
            "vae-ais <this run folder>")


def plot_curves(histories: dict, path) -> None:
    """Train (dashed) and test (solid) ELBO against epochs, one colour per method (the paper's Fig. 4b)."""
    plt = runs.matplotlib_pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for i, (method, history) in enumerate(histories.items()):
        epochs = [h["epoch"] for h in history]
        color = f"C{i}"
        ax.plot(epochs, [h["train"]["elbo"] for h in history], "--", color=color, label=f"{method} train")
        ax.plot(epochs, [h["test"]["elbo"] for h in history], "-", color=color, label=f"{method} test")
    ax.set_xlabel("epoch")
    ax.set_ylabel("ELBO (nats per image)")
    values = [h[s]["elbo"] for hs in histories.values() for h in hs for s in ("train", "test")]
    if values:
        top = max(values)
        ax.set_ylim(max(min(values), top - 40), top + 2)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    runs.save_figure(fig, path)


@torch.no_grad()
def plot_images(model, x_test: torch.Tensor, run_dir, generator: torch.Generator, n: int = 64) -> None:
    """samples.png: decoder means at N(0, I) draws; reconstructions.png: test images (odd rows) and the
    decoder means at one encoder sample each (even rows)."""
    plt = runs.matplotlib_pyplot()
    device = next(model.parameters()).device
    z = torch.randn(n, model.encoder.z_dim, generator=generator, device=device)
    samples = torch.sigmoid(model.decoder.logits(z)).cpu()
    pick = torch.randperm(x_test.shape[0], generator=torch.Generator().manual_seed(3))[:32]
    x = x_test[pick].to(device)
    noise = model.draws(x.shape[0], generator, device, n_q=1)["noise"]
    recon = torch.sigmoid(model.decoder.logits(model.encoder(x, 1, noise)[:, 0])).cpu()
    pairs = torch.stack([x.cpu().view(4, 8, 784), recon.view(4, 8, 784)], 1).reshape(64, 784)
    for images, name, title in ((samples, "samples.png", "samples (decoder means)"),
                                (pairs, "reconstructions.png", "test images / reconstructions")):
        grid = images.view(8, 8, 28, 28).permute(0, 2, 1, 3).reshape(8 * 28, 8 * 28)
        fig, ax = plt.subplots(figsize=(4, 4))
        ax.imshow(grid.numpy(), cmap="gray", vmin=0, vmax=1)
        ax.set_axis_off()
        ax.set_title(f"{model.kl_estimator}: {title}", fontsize=9)
        runs.save_figure(fig, run_dir / name)
