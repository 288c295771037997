"""Many UCI splits in parallel: one single-threaded ``kivi-fast uci`` process per split, a pool of them.

    python -m kivi_fast.cli uci-batch energy:kivi:9-19 boston:kivi-ac --workers 15 --out runs/batch
    python -m kivi_fast.cli uci-report --merge runs/batch/*/split_*      # one results folder per set/method

A job is ``dataset:method[:splits]`` (all splits of the set when none are named); each of its splits runs
in its own run folder ``<out>/<dataset>-<method>/split_NN/`` with its own checkpoint, so a batch that is
stopped (``--minutes``, a signal, a lost machine) resumes where each split stopped when it is started
again with the same arguments (exit status 130 after a signal). Splits start in the order the jobs are
given: put first what matters most. A lock file per split keeps two batches off the same split, and on
Linux a split's process ends with the batch that started it.
A split's result does not depend on which process or folder ran it (its seed is the run seed and the
split number), so the merged folder holds the same numbers as one sequential ``uci`` run on the same
machine (another CPU may take other floating-point paths).
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from tqdm import tqdm

from . import datasets, runs, uci
from .options import UsageError, add_common, nonnegative_float, plural, positive_float, positive_int
from .regression import METHODS, parse_splits


def parse_job(text: str, data_dir=None) -> list[tuple[str, str, int]]:
    """``"energy:kivi:9-19"`` -> [("energy", "kivi", 9), ..., ("energy", "kivi", 19)]."""
    parts = text.split(":")
    if len(parts) not in (2, 3):
        raise ValueError(f"job {text!r}: expected dataset:method[:splits], e.g. energy:kivi:0-19")
    dataset, method = parts[0], parts[1]
    if len(parts) == 3 and not parts[2]:
        raise ValueError(f"job {text!r}: no splits after the last ':' (leave out ':' for all of them)")
    if dataset in datasets.UNAVAILABLE:
        raise ValueError(f"job {text!r}: {datasets.UNAVAILABLE[dataset]}")
    if dataset not in datasets.DATASETS:
        raise ValueError(f"job {text!r}: unknown data set {dataset!r} (one of {', '.join(datasets.DATASETS)})")
    if method not in METHODS:
        raise ValueError(f"job {text!r}: unknown method {method!r} (one of {', '.join(METHODS)})")
    try:
        splits = parse_splits(parts[2] if len(parts) == 3 else None, datasets.n_splits(dataset, data_dir))
    except ValueError as err:
        raise ValueError(f"job {text!r}: {err}") from None
    return [(dataset, method, s) for s in splits]


def split_folder(out: Path, dataset: str, method: str, split: int) -> Path:
    return out / f"{dataset}-{method}" / f"split_{split:02d}"


def split_command(args, dataset: str, method: str, split: int, folder: Path) -> list[str]:
    """The `kivi-fast uci` command line that runs one split in its own folder."""
    cmd = [sys.executable, "-m", "kivi_fast.cli", "uci", "--dataset", dataset, "--method", method,
           "--splits", str(split), "--run-dir", str(folder), "--threads", "1", "--no-profile",
           "--checkpoint-seconds", str(args.checkpoint_seconds)]
    if args.data_dir:
        cmd += ["--data-dir", args.data_dir]
    if args.quick:
        cmd.append("--quick")
    if args.no_progress:
        cmd.append("--no-progress")
    return cmd + uci_arguments(args.uci_args)


# what the batch sets for each split itself (a different value through --uci-args would put another
# split's, set's or method's results in the split's folder)
BATCH_OPTIONS = ("--dataset", "--method", "--splits", "--run-dir", "--out", "--threads", "--checkpoint-seconds",
                 "--data-dir", "--quick", "--no-progress", "--no-profile")


def uci_arguments(text: str) -> list[str]:
    """--uci-args split as a shell would, without the options the batch sets (a usage error)."""
    try:
        words = shlex.split(text)
    except ValueError as err:
        raise UsageError(f"--uci-args: {err} in {text!r}") from None
    # (argparse takes any unambiguous prefix of an option: "--meth" is --method)
    taken = sorted({option for w in words if w.startswith("--") and len(w.split("=", 1)[0]) > 2
                    for option in BATCH_OPTIONS if option.startswith(w.split("=", 1)[0])})
    if taken:
        raise UsageError(f"--uci-args: {', '.join(taken)} {'is' if len(taken) == 1 else 'are'} set by uci-batch for "
                         "each split (use its own options, or the job's dataset:method:splits)")
    _check_with_the_uci_parser(words)
    return words


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message)


def _check_with_the_uci_parser(words: list[str]) -> None:
    """A mistake in --uci-args is said once, before any split starts, not once a split in its log."""
    if any(w in ("-h", "--help") for w in words):
        raise UsageError("--uci-args: -h/--help would print uci's help instead of training (see kivi-fast uci -h)")
    parser = _RaisingParser(prog="kivi-fast uci", add_help=False)
    uci.add_arguments(parser)
    try:
        parser.parse_args(words)
    except UsageError as err:
        raise UsageError(f"--uci-args: {err}") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("jobs", nargs="+", help="dataset:method[:splits], e.g. energy:kivi:9-19 boston:kivi-ac "
                                           "(all splits of the set when none are named)")
    p.add_argument("--workers", type=positive_int, default=max(1, runs.usable_cores() - 1),
                   help="processes at once, one thread each (default: usable cores - 1, here %(default)s)")
    p.add_argument("--out", default="runs/batch", help="batch folder")
    p.add_argument("--minutes", type=positive_float, default=None,
                   help="stop (checkpointed) after this long; rerun the same command to resume (default: no limit)")
    p.add_argument("--checkpoint-seconds", type=nonnegative_float, default=15.0,
                   help="seconds between checkpoints of each split (what a stop can lose)")
    p.add_argument("--data-dir", default=None,
                   help=f"folder holding the UCI sets' folders (default: ${datasets.ENV_VAR}, else the source "
                        "checkout's data/UCI_Datasets)")
    p.add_argument("--uci-args", default="",
                   help='more arguments for every `uci` process, e.g. "--epochs 100" (default: none)')
    add_common(p, out=False, quick="pass --quick to every uci process (a smoke run of each split)",
               progress="no progress bars (the batch's, and each split's in its log.txt)")


def _die_with_parent() -> None:
    """In the child (Linux): get SIGTERM when the batch process dies, so no split runs on orphaned."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class _Interrupted(Exception):
    pass


def _interrupt(*_):
    raise _Interrupted


def run(args) -> int:
    try:
        tasks = list(dict.fromkeys(t for job in args.jobs for t in parse_job(job, args.data_dir)))  # (once each)
    except ValueError as err:
        raise UsageError(str(err)) from None
    uci_arguments(args.uci_args)  # (checked before any split starts)
    out = Path(args.out)
    runs.make_folder(out, "--out")
    # Every split gets a process, finished ones too: it only rereads its result, and refuses (exit 2)
    # a folder made with other settings, so a changed command never passes old results off as new.
    todo = list(tasks)
    deadline = time.time() + 60 * args.minutes if args.minutes else None
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    preexec = _die_with_parent if sys.platform.startswith("linux") else None
    running: dict[tuple, tuple[subprocess.Popen, object]] = {}
    done, failed, busy, interrupted = [], [], [], False
    bar = tqdm(total=len(tasks), desc="splits", unit="split", file=sys.stderr, disable=args.no_progress)

    def collect(task, proc, lock, stopping=False):
        lock.close()
        if proc.returncode == 0:
            done.append(task)
            bar.update(1)
        elif not (stopping and proc.returncode in (-signal.SIGTERM, 130)):  # (130: stopped by a signal it caught)
            failed.append(task)
            tqdm.write(f"{task}: exit {proc.returncode}, see {split_folder(out, *task) / 'log.txt'}", file=sys.stderr)

    # a SIGTERM (a job scheduler, a lost session) stops the workers too, as Ctrl-C does
    old_handlers = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        while todo or running:
            while todo and len(running) < args.workers and (deadline is None or time.time() < deadline):
                task = todo.pop(0)
                folder = split_folder(out, *task)
                runs.make_folder(folder, "--out")
                runs.mark_new_folder(folder, uci.run_name(task[0], task[1]))
                # None if another batch runs this split; the child inherits it: it holds while either lives
                lock = runs.exclusive_lock(folder / "lock")
                if lock is None:
                    busy.append(task)
                    tqdm.write(f"{task}: running in another batch, skipped", file=sys.stderr)
                    continue
                with open(folder / "log.txt", "ab") as log:
                    proc = subprocess.Popen(split_command(args, *task, folder), stdout=log, stderr=log, env=env,
                                            pass_fds=(lock.fileno(),), preexec_fn=preexec)
                running[task] = (proc, lock)
            if deadline is not None and time.time() >= deadline:
                break
            time.sleep(1.0)
            for task, (proc, lock) in list(running.items()):
                if proc.poll() is not None:
                    del running[task]
                    collect(task, proc, lock)
            bar.set_postfix(running=len(running), queued=len(todo), refresh=False)
    except _Interrupted:
        interrupted = True
        tqdm.write("interrupted: stopping the running splits (each resumes from its checkpoint)", file=sys.stderr)
    finally:
        for proc, _ in running.values():  # stopped early: each resumes from its checkpoint next time
            proc.send_signal(signal.SIGTERM)
        for task, (proc, lock) in list(running.items()):
            proc.wait()
            collect(task, proc, lock, stopping=True)
            if proc.returncode == 0:
                del running[task]
        for sig, handler in old_handlers.items():
            signal.signal(sig, handler)
        bar.close()
    left = len(running) + len(todo) + len(busy)
    print(f"{len(done)} of {plural(len(tasks), 'split')} done, {len(failed)} failed, {left} left"
          + (" (rerun the same command to resume)" if left else ""), file=sys.stderr)
    if interrupted:
        return 130
    return 1 if failed else 0
