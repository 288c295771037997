"""``kivi-fast mnist``: BNN classification on MNIST (the paper's Sec. 5.2.2, App. F).

Network 784 -> L -> L -> 10 (ReLU, biases as an extra input row, N(0, I) prior on every weight), one
posterior per weight matrix (:class:`kivi_fast.nn.classification.ClassificationBNN`):

* ``kivi``: MMNN implicit posteriors as App. F gives them (30 x 30 noise, two hidden matrix layers of
  N x N, 30 x N for the last matrix; N = 500 for L = 400, else 800), the KL of each layer
  ``kivi_fast.kernel_kl`` between n_p = 10 prior and the n_q = M = 10 posterior samples the likelihood
  uses, lam = 1e-3, clip = 1e-8 (the KL shapes (10, 314000), (10, 160400), (10, 4010) for L = 400);
* ``bbb``: Bayes-by-Backprop, a factorized Gaussian per weight, KL in closed form;
* ``pc``: the prior-contrastive method, the same MMNNs, each layer's KL estimated by a logistic-regression
  discriminator (trained alongside on the same posterior samples and as many prior draws).

Training: batch 100, Adam, lr 1e-3 halved every 100 epochs, 300 epochs, on the first 50,000 training
images (the last 10,000 validate). Every ``--eval-every`` epochs: validation and test error of the
posterior predictive (``--eval-samples`` weight draws). Run folder: ``config.json``, ``history.json``
(per epoch: the training lower bound per image, its log-likelihood and KL parts, the errors),
``checkpoint.pt`` (every ``--checkpoint-every`` seconds; rerunning with the same ``--run-dir`` resumes
exactly), ``curves.png``, ``results.json`` (test and validation error at the end and at the best
validation epoch, time per epoch, the KL's share of a step, peak memory over all resumed pieces, the
device). ``kivi-fast mnist-report`` collects runs into ``results/mnist/``.

Several processes: ``torchrun --nproc-per-node K -m kivi_fast.cli mnist ...`` (DistributedDataParallel):
each process takes its shard of every global batch and draws its own posterior samples; the gradients
are averaged, so the parameters stay equal on every process.

On a GPU, ``--cuda-graph`` captures the training step in a CUDA graph after three eager steps and
replays it (graphs.py), posterior draws included (one process; Adam then keeps its learning rate and
step counters on the GPU).
"""

from __future__ import annotations

import argparse
import resource
from pathlib import Path

import torch

from ..nn.classification import BBB_INIT_STD, POSTERIORS, ClassificationBNN, n_weights
from . import runs
from .mnist_data import load_mnist
from .options import UsageError, add_common, int_at_least, plural, positive_float, positive_int
from .graphs import trainer_adam, trainer_step
from .training import (Checkpoints, Distributed, Position, add_device_options, add_gpu_options, add_training_options,
                       check_finite_parameters, check_gpu_options, config_of, device_of, diverged_as_run_error,
                       finished_run, halved_lr, kl_share, restore, save_resumable, start, stopped_message, timed,
                       train_epochs)

NAME = "mnist"
QUICK = {"epochs": 1, "train_images": 500, "eval_images": 200, "hidden": 50, "mmnn_hidden": 40}
CONFIG_KEYS = ("method", "hidden", "mmnn_hidden", "train_images", "batch", "lr", "lr_halve_every", "samples",
               "n_p", "lam", "clip", "seed", "eval_every", "eval_images", "eval_samples", "cuda_graph", "tf32",
               "bbb_init_std")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--method", choices=POSTERIORS, default="kivi",
                   help="kivi: MMNN posteriors, KIVI's KL; bbb: Bayes-by-Backprop (factorized Gaussian); "
                        "pc: MMNN posteriors, a logistic-regression discriminator's KL")
    p.add_argument("--hidden", type=positive_int, default=400,
                   help="hidden units L per layer (the paper: 400, 800, 1200)")
    p.add_argument("--mmnn-hidden", type=positive_int, default=None,
                   help="the MMNN's hidden matrix size N (default: App. F's, 500 for L <= 400, else 800)")
    add_training_options(p, epochs=300, batch=100, lr_halve_every=100)
    p.add_argument("--samples", type=int_at_least(2), default=10, help="posterior samples per step (n_q = M)")
    p.add_argument("--n-p", type=int_at_least(2), default=10, help="prior samples per layer for KIVI's KL")
    p.add_argument("--bbb-init-std", type=positive_float, default=BBB_INIT_STD,
                   help="bbb: the posteriors' standard deviation at the start (the means start at the prior's scale)")
    p.add_argument("--eval-every", type=positive_int, default=1, help="test and validation error every N epochs")
    p.add_argument("--eval-images", type=positive_int, default=10000, help="validation and test images evaluated")
    p.add_argument("--eval-samples", type=positive_int, default=10, help="weight draws of the posterior predictive")
    add_device_options(p, "mnist")
    add_gpu_options(p)
    add_common(p, quick="a smoke run: 1 epoch on 500 images, L = 50, N = 40", name=NAME)


def build(args) -> ClassificationBNN:
    return ClassificationBNN((784, args.hidden, args.hidden, 10), args.method, mmnn_hidden=args.mmnn_hidden,
                             lam=args.lam, clip=args.clip, n_prior=args.n_p, bbb_init_std=args.bbb_init_std)


@torch.no_grad()
def error_rate(model: ClassificationBNN, x: torch.Tensor, y: torch.Tensor, samples: int, chunk: int = 1000) -> float:
    """Test error (fraction) of the posterior predictive: class probabilities averaged over ``samples``
    weight draws, the same draws for every image."""
    flat = model.sample_weights(samples)
    wrong = 0
    for lo in range(0, x.shape[0], chunk):
        probs = model.logits(x[lo:lo + chunk], flat).softmax(-1).mean(0)
        wrong += int((probs.argmax(-1) != y[lo:lo + chunk]).sum())
    return wrong / x.shape[0]


def run(args) -> int:
    if args.eval_images > 10000:
        raise UsageError(f"--eval-images: the validation and test sets have 10000 images, got {args.eval_images}")
    if args.bbb_init_std != BBB_INIT_STD and args.method != "bbb":  # (else a setting that would refuse resumes)
        raise UsageError(f"--bbb-init-std: only --method bbb starts from standard deviations, got --method {args.method}")
    check_gpu_options(args)
    comm, run_dir = start(args, QUICK, lambda a: f"{NAME}-{a.hidden}-{a.method}")  # (named after --quick's L)
    result = train(args, run_dir, comm)
    if comm.main and result is not None:
        print(f"mnist L = {args.hidden} {args.method}: {plural(result['epochs'], 'epoch')}, test error "
              f"{100 * result['test_error']:.2f}% (validation {100 * result['valid_error']:.2f}%), "
              f"{result['seconds_per_epoch']:.1f} s/epoch on {result['device']}; {run_dir}")
    elif comm.main:
        print(stopped_message(NAME, args.minutes, run_dir))
    comm.close()
    return 0


STEP_OUTPUTS = ("elbo", "log_lik", "kl")


def make_train_step(net, optimizer, n_data: int, samples: int):
    """One training step on ``{"x": images, "y": labels}``: the negative lower bound's backward and the
    optimizer's step; returns the step's estimates (:data:`STEP_OUTPUTS`), detached. The posterior
    samples come from torch's generator of the device (in a CUDA graph too: each replay advances it as
    the eager step would). A step of fixed shapes that graphs.CapturedStep can capture."""
    def train_step(inputs: dict) -> dict:
        loss, out = net(inputs["x"], inputs["y"], n_data, samples)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return {k: out[k].detach() for k in STEP_OUTPUTS}
    return train_step


def train(args, run_dir, comm: Distributed | None = None, max_steps: int | None = None) -> dict | None:
    """Train (or resume) into ``run_dir``; results.json's content at the end (rank 0), None when stopped
    early (with a checkpoint) by ``--minutes`` or by ``max_steps`` (steps of this call: a test's
    interruption)."""
    comm = comm or Distributed(device_of(args.device))
    device, run_dir = comm.device, Path(run_dir)
    if comm.main:
        run_dir.mkdir(parents=True, exist_ok=True)
    data = load_mnist(args.data_dir)
    x_train, y_train = data["x_train"][:args.train_images].to(device), data["y_train"][:args.train_images].to(device)
    evals = {s: (data[f"x_{s}"][:args.eval_images].to(device), data[f"y_{s}"][:args.eval_images].to(device))
             for s in ("valid", "test")}

    torch.manual_seed(args.seed)
    model = build(args).to(device)
    optimizer = trainer_adam(model.parameters(), args.lr, device, args.cuda_graph)
    data_rng = torch.Generator().manual_seed(args.seed)
    # each process its own posterior samples (torch's default generator of the device)
    torch.manual_seed(args.seed + 1000 * (comm.rank + 1))
    config = config_of(args, CONFIG_KEYS, comm.world)
    steps_per_epoch = args.train_images // args.batch

    ckpt_path = run_dir / "checkpoint.pt"
    state = restore(ckpt_path, config, model, optimizer, data_rng, ("rng", "epoch_sums", "peak_memory_gib"))
    at = Position.of(state)
    earlier_peak = 0.0  # a resumed run's peak memory is the largest of its pieces'
    if state is not None:
        earlier_peak = state["peak_memory_gib"]
        set_rng_state(state["rng"][comm.rank] if comm.world > 1 else state["rng"], device)
        finished = finished_run(run_dir, at.epoch, args.epochs)
        if finished is not None:  # (every rank reads the same checkpoint: all return here)
            return finished if comm.main else None
    if comm.main:
        runs.write_json(run_dir / "config.json", {**config, "epochs": args.epochs, "device": str(device),
                                                  "weights": n_weights((784, args.hidden, args.hidden, 10)),
                                                  "machine": runs.machine()})
    net = comm.wrap(model)
    lo, hi = comm.shard(args.batch)
    run_step = trainer_step(make_train_step(net, optimizer, args.train_images, args.samples), device,
                            args.cuda_graph)
    sums = dict(state["epoch_sums"]) if state is not None else new_epoch_sums()

    def save():
        check_finite_parameters(model, at.epoch, at.step, ckpt_path)
        rng = comm.gather(rng_state(device))
        if comm.main:
            save_resumable(ckpt_path, run_dir / "history.json", at, config=config, model=model, optimizer=optimizer,
                           data_rng=data_rng, rng=rng if comm.world > 1 else rng[0], epoch_sums=dict(sums),
                           peak_memory_gib=max(earlier_peak, peak_memory_gib(device)))

    def step(idx):
        with diverged_as_run_error(at.epoch, at.step, run_dir):
            out = run_step({"x": x_train[idx], "y": y_train[idx]})
        # the global batch's estimate (each rank's mean over its shard and its own samples, averaged)
        values = [v / args.train_images for v in comm.mean([out[k] for k in STEP_OUTPUTS])]
        for k, v in zip(STEP_OUTPUTS, values):
            sums[k] += v
        sums["steps"] += 1
        return values[0], {"bound": f"{sums['elbo'] / sums['steps']:.3f}"}

    def end_epoch(say):
        if comm.main:
            n = max(1, sums["steps"])
            entry = {"epoch": at.epoch, "train_seconds": at.train_seconds,
                     "lr": halved_lr(args.lr, at.epoch - 1, args.lr_halve_every),
                     "lower_bound": sums["elbo"] / n, "log_lik": sums["log_lik"] / n, "kl": sums["kl"] / n}
            if at.epoch % args.eval_every == 0 or at.epoch == args.epochs:
                # the evaluation's weight draws from their own stream: how often it runs must not move the
                # training's samples (torch's generator of the device)
                with torch.random.fork_rng(devices=[device] if device.type == "cuda" else [],
                                           device_type=device.type):
                    torch.manual_seed(args.seed + 7)
                    for s, (x, y) in evals.items():
                        entry[f"{s}_error"] = error_rate(model, x, y, args.eval_samples)
                say(f"epoch {at.epoch}: lower bound {entry['lower_bound']:.4f} per image, validation error "
                    f"{100 * entry['valid_error']:.2f}%, test error {100 * entry['test_error']:.2f}%")
            at.history.append(entry)
        sums.update(new_epoch_sums())

    finished = train_epochs(at, args, steps_per_epoch=steps_per_epoch, optimizer=optimizer, data_rng=data_rng,
                            checkpoints=Checkpoints(save, args.checkpoint_every, comm, args.minutes, run_dir),
                            shard=(lo, hi), device=device, step=step, end_epoch=end_epoch,
                            loss_name="lower bound", desc=f"mnist L={args.hidden} {args.method}",
                            show=comm.main and not args.no_progress, run_dir=run_dir, max_steps=max_steps)
    if not finished:
        return None
    # DistributedDataParallel averages the gradients, so every process must hold the same parameters
    checksums = comm.gather(float(sum(p.detach().double().sum() for p in model.parameters())))
    if not comm.main:
        return None
    profile = step_profile(model, x_train[:args.batch], y_train[:args.batch], args.train_images, args.samples)
    return finish(args, at.history, at.train_seconds, device, comm.world, run_dir, max(checksums) - min(checksums),
                  max(earlier_peak, peak_memory_gib(device)), profile)


def new_epoch_sums() -> dict:
    """An epoch's running sums of the step outputs (:data:`STEP_OUTPUTS`), for its history entry."""
    return {**{k: 0.0 for k in STEP_OUTPUTS}, "steps": 0}


def rng_state(device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def set_rng_state(state: torch.Tensor, device) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def step_profile(model: ClassificationBNN, x: torch.Tensor, y: torch.Tensor, n_data: int, samples: int,
                 repeats: int = 3) -> dict:
    """Median seconds of a training step's forward and backward (one process, no optimizer step) and of
    its KL part alone (every layer's KL from detached posterior samples, forward and backward), and the
    KL's share of the step."""
    def step():
        loss, out = model(x, y, n_data, samples)
        loss.backward()
        return [w.detach().requires_grad_() for w in out["samples"]]

    full, kl_only = [], []
    for _ in range(repeats):
        seconds, flat = timed(step, x.device)
        full.append(seconds)
        kl_only.append(timed(lambda: torch.stack(model.layer_kls(flat)).sum().backward(), x.device)[0])
    model.zero_grad(set_to_none=True)
    return kl_share(full, kl_only)


def finish(args, history, train_seconds, device, world, run_dir, rank_spread: float, peak_memory: float,
           profile: dict) -> dict:
    evaluated = [h for h in history if "test_error" in h]
    best = min(evaluated, key=lambda h: h["valid_error"])
    result = {
        "method": args.method, "hidden": args.hidden, "epochs": history[-1]["epoch"],
        "test_error": evaluated[-1]["test_error"], "valid_error": evaluated[-1]["valid_error"],
        "best_valid": {"epoch": best["epoch"], "valid_error": best["valid_error"], "test_error": best["test_error"]},
        "final_lower_bound": history[-1]["lower_bound"], "seconds_per_epoch": train_seconds / history[-1]["epoch"],
        "step_profile": profile, "peak_memory_gib": peak_memory, "device": str(device), "machine": runs.machine(),
        "processes": world, "parameter_sum_spread_across_processes": rank_spread,
        "config": {**config_of(args, CONFIG_KEYS, world), "epochs": args.epochs},
    }
    if device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(device)
    runs.write_json(run_dir / "results.json", result)
    plot_history({f"{args.method} L={args.hidden}": history}, run_dir / "curves.png")
    return result


def peak_memory_gib(device) -> float:
    """This process's peak resident memory (CPU) or peak allocated GPU memory, GiB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


def plot_history(histories: dict, path, bound_labels=None, styles=None) -> None:
    """The training lower bound per image (left, the paper's Fig. 3 right; only the runs in
    ``bound_labels`` when given) and the test error (right, log scale) of each run in ``histories``;
    ``styles``: matplotlib keywords per label (the same line in both panels)."""
    plt = runs.matplotlib_pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    for i, (label, history) in enumerate(histories.items()):
        style = (styles or {}).get(label, {"color": f"C{i % 10}"})
        if bound_labels is None or label in bound_labels:
            a.plot([h["epoch"] for h in history], [h["lower_bound"] for h in history], label=label, **style)
        ev = [h for h in history if "test_error" in h]
        b.plot([h["epoch"] for h in ev], [100 * h["test_error"] for h in ev], label=label, **style)
    a.set_xlabel("epoch")
    a.set_ylabel("training lower bound per image")
    b.set_xlabel("epoch")
    b.set_ylabel("test error (%)")
    b.set_yscale("log")
    from matplotlib.ticker import FormatStrFormatter  # plain numbers on the log axis

    b.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    b.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    runs.save_figure(fig, path)
