"""What the paper's trainers (vae, mnist) share: their common options, start-up, the loop over epochs and
steps (:func:`train_epochs`), checkpoints and exact resume, the device argument and torch.distributed's
process group.

Multi-process training (``torchrun --nproc-per-node K -m kivi_fast.cli <command> ...``) runs one
process per shard of every global batch under DistributedDataParallel: gloo on CPU, NCCL on CUDA (one
GPU per process, ``LOCAL_RANK``). A single process is rank 0 of 1 and runs the same code.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import signal
import threading
import time
import weakref
from pathlib import Path

import torch
from torch import distributed as dist
from tqdm.auto import tqdm

from ..nn.classification import BBB_INIT_STD
from .options import (UsageError, apply_quick, int_at_least, kivi_clip, kivi_lam, nonnegative_float, positive_float,
                      positive_int, random_seed, thread_count)
from . import runs
from .runs import CheckpointError


def start(args, quick: dict, folder_name, train_images: int = 50000) -> tuple["Distributed", Path]:
    """A trainer's first steps: ``--quick``'s settings, the checks of ``--train-images`` (at most
    ``train_images``) and ``--batch``, the torch threads, the process group and the run folder (rank 0's,
    on every rank: every rank resumes from it), named ``folder_name`` (or ``folder_name(args)``, with
    ``--quick``'s settings in args)."""
    apply_quick(args, quick)
    if args.train_images > train_images:
        raise UsageError(f"--train-images: the training set has {train_images} images, got {args.train_images}")
    if args.batch > args.train_images:
        raise UsageError(f"--batch {args.batch} is larger than --train-images {args.train_images}")
    torch.set_num_threads(args.threads)
    # this process's CUDA matmuls (a trainer is the process's only work)
    torch.backends.cuda.matmul.allow_tf32 = bool(getattr(args, "tf32", False))
    comm = Distributed(device_of(args.device))
    if args.batch % comm.world:
        raise UsageError(f"--batch {args.batch} must be divisible by the number of processes ({comm.world})")
    name = folder_name(args) if callable(folder_name) else folder_name
    folder = runs.run_folder(args.out, name, args.run_dir) if comm.main else None
    return comm, Path(comm.share(str(folder) if folder else None))


def config_of(args, keys, world: int) -> dict:
    """The settings a checkpoint must match to be resumed: ``keys`` of args, and the number of processes."""
    return {**{k: getattr(args, k) for k in keys}, "world_size": world}


class Checkpoints:
    """Calls ``save`` when ``every`` seconds have passed since the last save (at every call if ``every`` is
    0), or when forced (the end of a run). With ``minutes`` (``--minutes``), :meth:`tick` also says when
    this call has trained that long: it saves then, and the trainer stops (rerunning continues). Rank 0's
    clock decides for every rank, so that a ``save`` that gathers from all processes is called by all of
    them at the same step, and all of them stop there.

    In a single process, Ctrl-C (SIGINT) and SIGTERM (a job scheduler's stop) while it is open are held
    until the next :meth:`tick`, a step's end: it saves and raises :class:`runs.Interrupted`, so that the
    run resumes exactly from there; a second signal interrupts at once. The trainer closes it (a
    ``finally``: also when training raises), which gives the signals back their handlers."""

    def __init__(self, save, every: float, comm: "Distributed", minutes: float = 0.0, run_dir=None):
        self.save, self.every, self.comm, self.last = save, every, comm, time.monotonic()
        self.deadline = self.last + 60.0 * minutes if minutes > 0 else None
        self.run_dir, self.signalled, self.previous = run_dir, None, {}
        # One process only: under torchrun a rank blocked in a collective would hold its SIGTERM and be
        # killed after the agent's timeout instead. (Signal handlers live in the main thread only.)
        if comm.world == 1 and threading.current_thread() is threading.main_thread():
            me = weakref.ref(self)
            previous = {}

            def hold(signum, frame):
                owner = me()
                if owner is None or owner.signalled is not None:  # closed without close(), or a second one
                    for sig, handler in previous.items():
                        signal.signal(sig, handler)
                    raise KeyboardInterrupt
                owner.signalled = signum

            for sig in (signal.SIGINT, signal.SIGTERM):
                if signal.getsignal(sig) not in (signal.SIG_IGN, None):  # (ignored on purpose, or not Python's)
                    previous[sig] = signal.signal(sig, hold)
            self.previous = previous

    def close(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}

    def tick(self, force: bool = False) -> bool:
        """Saves when it is time; returns whether the trainer must stop (``--minutes`` have passed)."""
        now = time.monotonic()
        stop = self.deadline is not None and now >= self.deadline
        save, stop, signalled = self.comm.share(
            (force or stop or self.signalled is not None or now - self.last >= self.every, stop, self.signalled))
        if save:
            self.save()
            self.last = time.monotonic()
        if signalled is not None:
            self.close()
            where = f" in {self.run_dir}" if self.run_dir is not None else ""
            raise runs.Interrupted(f"interrupted ({signal.Signals(signalled).name}); checkpoint saved{where}: rerun "
                                   "the same command to continue")
        if stop:
            self.close()
        return stop


@contextlib.contextmanager
def diverged_as_run_error(epoch: int, step: int, run_dir):
    """A training step whose KL estimator refuses its samples (NaN/Inf from a diverged posterior, on the
    CPU; a GPU gives a NaN loss, which the trainers check) ends the run with one line, not a traceback."""
    try:
        yield
    except ValueError as err:
        raise runs.RunError(f"the KL estimate failed at epoch {epoch}, step {step}: {err}; "
                            f"{runs.last_checkpoint(run_dir)}") from err


def check_finite_loss(what: str, value: float, epoch: int, step: int, run_dir) -> None:
    """A step's loss that is not finite ends the run (without a save: the last checkpoint is the last
    good state)."""
    if not math.isfinite(value):
        raise runs.RunError(f"the {what} became {value} at epoch {epoch}, step {step}; {runs.last_checkpoint(run_dir)}")


@contextlib.contextmanager
def estimator_refusal_as_run_error(what: str, where: str, updated: bool, initial: str = "",
                                   failed: str = "the KL estimate"):
    """A training step whose KL estimator (or, naming it in ``failed``, a measurement that uses the
    library's median bandwidth) refuses its samples (NaN/Inf, or all equal in a dimension: the
    posterior diverged or collapsed) ends the run with one line (:func:`diverged`), not a traceback."""
    try:
        yield
    except ValueError as err:
        raise diverged(what, where, f"{failed} failed: {err}", updated, initial) from err


def check_loss_is_finite(what: str, value: float, where: str, updated: bool, initial: str = "") -> None:
    """A training loss that is not finite ends the run with one line (:func:`diverged`)."""
    if not math.isfinite(value):
        raise diverged(what, where, f"the loss became {value}", updated, initial)


def diverged(what: str, where: str, problem: str, updated: bool, initial: str = "") -> runs.RunError:
    """The error of a training run of ``what`` that broke down at ``where`` (e.g. "step 3"). Only after
    an optimizer update (``updated``) can the learning rate be the cause; before the first one it is the
    initial posterior (``initial``: what sets it, e.g. "check --s0")."""
    if updated:
        return runs.RunError(f"{what}: training diverged at {where}: {problem}; try a smaller --lr")
    return runs.RunError(f"{what}: the initial posterior gives unusable samples (at {where}, before any update, so "
                         f"not the learning rate): {problem}" + (f"; {initial}" if initial else ""))


def stopped_message(command: str, minutes: float, run_dir) -> str:
    """What a trainer prints when ``--minutes`` stopped it."""
    return (f"{command}: stopped after --minutes {minutes:g}, checkpoint in {run_dir}; rerun the same command to "
            "continue (the run is finished when its folder holds results.json)")


def halved_lr(base: float, epoch: int, every: int) -> float:
    """The paper's schedule: ``base`` halved every ``every`` epochs (epochs counted from 0)."""
    return base * 0.5 ** (epoch // every)


def set_lr(optimizer, value: float) -> None:
    """Every parameter group's learning rate to ``value``. A learning rate held as a tensor (a step
    captured in a CUDA graph reads it from there: graphs.capturable_adam) is written in place, on its
    device even where a checkpoint's load brought it back as a number or a CPU tensor."""
    for group in optimizer.param_groups:
        lr = group["lr"]
        if not isinstance(lr, torch.Tensor):
            group["lr"] = value
            continue
        device = group["params"][0].device
        if lr.device != device:
            group["lr"] = lr = torch.tensor(0.0, dtype=lr.dtype, device=device)
        lr.fill_(value)


# Settings added after checkpoints with other settings were written: an older checkpoint, without the
# key, was made with this value.
ADDED_SETTINGS = {"cuda_graph": False, "tf32": False, "bbb_init_std": BBB_INIT_STD}


def check_resumable(state: dict, config: dict, path) -> None:
    """A checkpoint continues only the run that made it: every setting in ``config`` must match."""
    saved = {**ADDED_SETTINGS, **state["config"]}
    differs = runs.config_differences(saved, config)
    if differs:
        raise CheckpointError(f"{path} was made with other settings ({differs}: checkpoint's, this run's); "
                              "use another --run-dir")


@dataclasses.dataclass
class Position:
    """Where a run stands, as its checkpoint holds it beside the model, the optimizer and the random
    generators: the epoch, the step within it, that epoch's data order (None until it is drawn), the
    history (an entry an evaluated epoch) and the training seconds so far."""
    epoch: int = 0
    step: int = 0
    perm: torch.Tensor | None = None
    history: list = dataclasses.field(default_factory=list)
    train_seconds: float = 0.0

    @classmethod
    def of(cls, state: dict | None) -> "Position":
        """A checkpoint's position (:func:`restore`'s result), or the start for None."""
        return cls() if state is None else cls(**{f.name: state[f.name] for f in dataclasses.fields(cls)})

    def saved(self) -> dict:
        """The fields as a checkpoint's entries (not copied: the checkpoint is written at once)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


# what every trainer's checkpoint holds; a trainer adds its own random generators' states
RESUME_KEYS = ("config", "model", "optimizer", "data_rng") + tuple(f.name for f in dataclasses.fields(Position))


def restore(path, config: dict, model, optimizer, data_rng: torch.Generator, extra_keys=()) -> dict | None:
    """Load the checkpoint at ``path`` (None if there is none) into ``model``, ``optimizer`` and the data
    order's generator, after :func:`check_resumable`; returns it, for the :class:`Position`
    (``Position.of``) and the trainer's ``extra_keys``."""
    state = runs.load_checkpoint(path, RESUME_KEYS + tuple(extra_keys))
    if state is not None:
        check_resumable(state, config, path)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        data_rng.set_state(state["data_rng"])
    return state


def finished_run(run_dir, epoch: int, epochs: int) -> dict | None:
    """A resumed run's position against ``--epochs``: past it is refused (continuing would not give a
    run of ``epochs``, and the results would mix the two); at it, with results.json written, the run is
    finished and that is its result (not retrained, re-timed or redrawn); otherwise None: train on (and
    a results.json of the run's earlier --epochs is removed)."""
    if epoch > epochs:
        raise runs.RunError(f"{Path(run_dir) / 'checkpoint.pt'} has trained {epoch} epochs, more than --epochs "
                            f"{epochs}: pass --epochs {epoch} or more to continue it, or use another --run-dir")
    results = Path(run_dir) / "results.json"
    if epoch == epochs and results.exists():
        return runs.read_json(results)
    # A finished run continued to more --epochs is no longer finished: its results.json (of fewer epochs)
    # goes, so that the reports do not take it for this run's until it is written again at the end.
    results.unlink(missing_ok=True)
    return None


def check_finite_parameters(model, epoch: int, step: int, path) -> None:
    """Parameters that are not finite (an update that diverged: its loss shows it only at the next step)
    are not saved over the last good checkpoint: a RunError instead. Every rank checks (their
    parameters are equal), so that all of them stop together rather than wait in the next all-reduce."""
    if not all(bool(v.isfinite().all()) for v in model.state_dict().values() if v.is_floating_point()):
        kept = f"; {path} keeps the last good state" if Path(path).exists() else ""
        raise runs.RunError(f"the parameters became NaN or Inf at epoch {epoch}, step {step} (training diverged: "
                            f"try a smaller --lr){kept}")


def save_resumable(path, history_path, position: Position, *, config: dict, model, optimizer,
                   data_rng: torch.Generator, **extra) -> None:
    """Write what :func:`restore` reads (and ``extra``), and the history as JSON beside it (after
    :func:`check_finite_parameters`, which every rank calls)."""
    runs.save_checkpoint(path, {
        "config": config, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
        "data_rng": data_rng.get_state(), **position.saved(), **extra})
    runs.write_json(history_path, position.history)


def train_epochs(at: Position, args, *, steps_per_epoch: int, optimizer, data_rng: torch.Generator,
                 checkpoints: Checkpoints, shard: tuple[int, int], device: torch.device, step, end_epoch,
                 loss_name: str, desc: str, show: bool, run_dir, max_steps: int | None = None) -> bool:
    """The trainers' loop over epochs and steps, from ``at`` (advanced in place, for ``checkpoints``'
    save to write): each epoch draws its data order from ``data_rng`` and sets the paper's halved
    learning rate (``args``: epochs, train_images, batch, lr, lr_halve_every); each step calls
    ``step(indices)`` with this process's rows (``shard``: Distributed.shard's) of the global batch's
    indices, on ``device``, and gets the step's loss value (a number, checked to be finite: the step wraps its training step in
    :func:`diverged_as_run_error`) and the progress bar's postfix; each finished epoch calls
    ``end_epoch(say)``, ``say`` printing above the bar, before the epoch's checkpoint tick.

    Returns True when ``args.epochs`` are trained, False when this call stopped early, saved: by
    ``--minutes`` (``checkpoints.tick``) or after ``max_steps`` steps (a test's interruption).
    The training seconds count each step from the slicing of its indices."""
    total = args.epochs * steps_per_epoch
    bar = tqdm(total=total, initial=min(total, at.epoch * steps_per_epoch + at.step), unit="step", desc=desc,
               disable=not show)
    say = bar.write if show else (lambda text: None)
    lo, hi = shard
    done_here = 0
    try:
        while at.epoch < args.epochs:
            if at.perm is None:
                at.perm = torch.randperm(args.train_images, generator=data_rng)
            set_lr(optimizer, halved_lr(args.lr, at.epoch, args.lr_halve_every))
            while at.step < steps_per_epoch:
                if max_steps is not None and done_here >= max_steps:
                    checkpoints.save()
                    return False
                t0 = time.perf_counter()
                value, postfix = step(at.perm[at.step * args.batch:(at.step + 1) * args.batch][lo:hi].to(device))
                check_finite_loss(loss_name, value, at.epoch, at.step, run_dir)
                at.train_seconds += time.perf_counter() - t0
                at.step += 1
                done_here += 1
                bar.update(1)
                bar.set_postfix(epoch=at.epoch + 1, **postfix)
                if checkpoints.tick():  # --minutes have passed: saved; rerunning continues
                    return False
            at.epoch, at.step, at.perm = at.epoch + 1, 0, None
            end_epoch(say)
            if checkpoints.tick(force=at.epoch == args.epochs) and at.epoch < args.epochs:
                return False
    finally:
        bar.close()
        checkpoints.close()
    return True


def timed(fn, device: torch.device) -> tuple[float, object]:
    """Seconds ``fn()`` takes on ``device`` (waiting for a CUDA device before and after), and its result."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    return time.perf_counter() - t0, out


def kl_share(step_seconds: list, kl_seconds: list) -> dict:
    """A trainer's ``step_profile`` in results.json: the median seconds of its training steps (forward
    and backward) and of their KL parts alone, and the KL's share of a step."""
    step, kl = sorted(step_seconds)[len(step_seconds) // 2], sorted(kl_seconds)[len(kl_seconds) // 2]
    return {"step_seconds": step, "kl_seconds": kl, "kl_share": kl / step}


def add_training_options(p, *, epochs: int, batch: int, lr_halve_every: int) -> None:
    """The options every trainer has, with the paper's values for that experiment as defaults: the
    schedule (``--epochs``, ``--train-images``, ``--batch``, Adam's ``--lr`` halved every
    ``--lr-halve-every`` epochs), KIVI's ``--lam`` and ``--clip``, ``--seed``, ``--checkpoint-every``."""
    p.add_argument("--epochs", type=positive_int, default=epochs, help=f"epochs (the paper: {epochs})")
    p.add_argument("--train-images", type=int_at_least(2), default=50000,
                   help="train on the first N of the 50,000 training images")
    p.add_argument("--batch", type=positive_int, default=batch, help="global minibatch size")
    p.add_argument("--lr", type=positive_float, default=1e-3, help="Adam's initial learning rate")
    p.add_argument("--lr-halve-every", type=positive_int, default=lr_halve_every,
                   help="halve the learning rate every N epochs")
    p.add_argument("--lam", type=kivi_lam, default=1e-3, help="KIVI's ridge coefficient (the paper's)")
    p.add_argument("--clip", type=kivi_clip, default=1e-8, help="KIVI's lower clip of the ratio")
    p.add_argument("--seed", type=random_seed, default=0, help="initialization, data order and draws")
    p.add_argument("--checkpoint-every", type=nonnegative_float, default=300.0, help="seconds between checkpoints")
    p.add_argument("--minutes", type=nonnegative_float, default=0.0,
                   help="stop after training this many minutes, with a checkpoint; rerunning the same command "
                        "continues (for time-limited jobs; 0: no limit)")


def add_device_options(p, data_folder: str) -> None:
    """``--device``, ``--threads`` and ``--data-dir`` (the folder holding ``data_folder``/)."""
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--threads", type=thread_count, default=1, help="torch CPU threads per process")
    p.add_argument("--data-dir", default=None,
                   help=f"folder holding {data_folder}/ (default: the checkout's data/)")


def add_gpu_options(p) -> None:
    """``--cuda-graph`` and ``--tf32``: the whole step replayed from a CUDA graph, the networks' matmuls on
    tensor cores."""
    p.add_argument("--cuda-graph", action="store_true",
                   help="capture the training step in a CUDA graph after 3 eager steps and replay it (one "
                        "process on a GPU): the same run, without the host launching each kernel")
    p.add_argument("--tf32", action="store_true",
                   help="the networks' float32 matmuls in TensorFloat-32 on a GPU's tensor cores (products of "
                        "10-bit mantissas, float32 sums; torch.backends.cuda.matmul.allow_tf32); the KL "
                        "estimator computes in float64 and is unaffected")


def check_gpu_options(args) -> None:
    """--cuda-graph's and --tf32's conditions, checked before a run folder is made: a GPU, and for a
    graph one process (a graph here does not capture DistributedDataParallel's communication)."""
    for flag, name in ((args.cuda_graph, "--cuda-graph"), (args.tf32, "--tf32")):
        if flag and device_of(args.device).type != "cuda":
            raise UsageError(f"{name} needs a GPU (--device cuda), got --device {args.device}")
    if args.cuda_graph and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UsageError("--cuda-graph runs in one process, not under torchrun with several")


def device_of(text: str) -> torch.device:
    try:
        device = torch.device(text)
    except RuntimeError:
        raise UsageError(f"--device: expected cpu, cuda or cuda:N, got {text!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: this torch has no usable CUDA device")
    if device.type not in ("cpu", "cuda"):
        raise UsageError(f"--device: expected cpu, cuda or cuda:N, got {text!r}")
    return device


class Distributed:
    """This process's place among ``torchrun``'s (rank, world size); a single process is rank 0 of 1."""

    def __init__(self, device: torch.device):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank, self.device = 0, device
        if self.world > 1:
            if device.type == "cuda":
                self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
                torch.cuda.set_device(self.device)
            if not dist.is_initialized():
                dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
            self.rank = dist.get_rank()

    @property
    def main(self) -> bool:
        return self.rank == 0

    def shard(self, batch: int) -> tuple[int, int]:
        per = batch // self.world
        return self.rank * per, (self.rank + 1) * per

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        if self.world == 1:
            return model
        from torch.nn.parallel import DistributedDataParallel

        ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def share(self, value):
        """Rank 0's ``value`` (a picklable object) on every rank."""
        if self.world == 1:
            return value
        holder = [value]
        dist.broadcast_object_list(holder, src=0)
        return holder[0]

    def mean(self, values) -> list[float]:
        """The mean over ranks of each of ``values`` (floats), on every rank. A step's loss goes through
        this before its finiteness check, so that every rank stops together (a checkpoint gathers from
        all ranks: one rank stopping alone would leave the others waiting). ``values`` may be 0-d tensors
        on the device: they are read back to the host once, together."""
        t = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=self.device) for v in values])
        if self.world > 1:
            dist.all_reduce(t)
        return (t / self.world).tolist()

    def gather(self, value) -> list:
        """Every rank's ``value`` (picklable), in rank order, on every rank."""
        if self.world == 1:
            return [value]
        out = [None] * self.world
        dist.all_gather_object(out, value)
        return out

    def close(self) -> None:
        """At the end of a run that every rank reaches: the group is torn down only once all ranks are
        done with it (a rank tearing down gloo's connections while another still works on, e.g. rank 0
        writing the results, was seen to abort: "terminate called without an active exception")."""
        if self.world > 1 and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
