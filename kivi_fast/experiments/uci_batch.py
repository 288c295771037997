"""Many UCI splits in parallel: one single-threaded ``kivi-fast uci`` process per split, a pool of them.

    python -m kivi_fast.cli uci-batch energy:kivi:9-19 boston:kivi-ac --workers 15 --out runs/batch
    python -m kivi_fast.cli uci-report --merge runs/batch/*/split_*      # one results folder per set/method

A job is ``dataset:method[:splits]`` (all splits of the set when none are named); each of its splits runs
in its own run folder ``<out>/<dataset>-<method>/split_NN/`` with its own checkpoint, so a batch that is
stopped (``--minutes``, a signal, a lost machine) resumes where each split stopped when it is started
again with the same arguments. Splits start in the order the jobs are given: put first what matters most.
A split's result does not depend on which process or folder ran it (its seed is the run seed and the
split number), so the merged folder holds the same numbers as one sequential ``uci`` run.
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

from ..data import uci as uci_data
from .uci import METHODS, parse_splits


def parse_job(text: str, data_dir=None) -> list[tuple[str, str, int]]:
    """``"energy:kivi:9-19"`` -> [("energy", "kivi", 9), ..., ("energy", "kivi", 19)]."""
    parts = text.split(":")
    if len(parts) not in (2, 3):
        raise ValueError(f"job {text!r}: expected dataset:method[:splits], e.g. energy:kivi:0-19")
    dataset, method = parts[0], parts[1]
    if dataset not in uci_data.DATASETS:
        raise ValueError(f"job {text!r}: unknown data set {dataset!r} (one of {', '.join(uci_data.DATASETS)})")
    if method not in METHODS:
        raise ValueError(f"job {text!r}: unknown method {method!r} (one of {', '.join(METHODS)})")
    splits = parse_splits(parts[2] if len(parts) == 3 else None, uci_data.n_splits(dataset, data_dir))
    return [(dataset, method, s) for s in splits]


def split_folder(out: Path, dataset: str, method: str, split: int) -> Path:
    return out / f"{dataset}-{method}" / f"split_{split:02d}"


def _command(args, dataset: str, method: str, split: int, folder: Path) -> list[str]:
    cmd = [sys.executable, "-m", "kivi_fast.cli", "uci", "--dataset", dataset, "--method", method,
           "--splits", str(split), "--run-dir", str(folder), "--threads", "1", "--no-profile",
           "--checkpoint-seconds", str(args.checkpoint_seconds)]
    if args.data_dir:
        cmd += ["--data-dir", args.data_dir]
    return cmd + shlex.split(args.uci_args)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("jobs", nargs="+", help="dataset:method[:splits], e.g. energy:kivi:9-19 boston:kivi-ac")
    p.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                   help="processes at once, one thread each (default: cores - 1)")
    p.add_argument("--out", default="runs/batch", help="batch folder (default runs/batch)")
    p.add_argument("--minutes", type=float, default=None,
                   help="stop (checkpointed) after this long; rerun the same command to resume")
    p.add_argument("--checkpoint-seconds", type=float, default=15.0)
    p.add_argument("--data-dir", default=None)
    p.add_argument("--uci-args", default="", help='more arguments for every `uci` process, e.g. "--epochs 100"')


def run(args) -> int:
    if args.workers < 1:
        print(f"--workers must be >= 1, got {args.workers}", file=sys.stderr)
        return 2
    try:
        tasks = [t for job in args.jobs for t in parse_job(job, args.data_dir)]
    except ValueError as err:
        print(err, file=sys.stderr)
        return 2
    out = Path(args.out)
    todo = [t for t in tasks if not (split_folder(out, *t) / f"split_{t[2]:02d}.json").exists()]
    deadline = time.time() + 60 * args.minutes if args.minutes else None
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    # a SIGTERM (a job scheduler, a lost session) stops the workers too, as Ctrl-C does
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    running: dict[tuple, subprocess.Popen] = {}
    failed = []
    bar = tqdm(total=len(tasks), initial=len(tasks) - len(todo), desc="splits", unit="split", file=sys.stderr)
    try:
        while todo or running:
            while todo and len(running) < args.workers and (deadline is None or time.time() < deadline):
                task = todo.pop(0)
                folder = split_folder(out, *task)
                folder.mkdir(parents=True, exist_ok=True)
                with open(folder / "log.txt", "ab") as log:
                    running[task] = subprocess.Popen(_command(args, *task, folder), stdout=log, stderr=log, env=env)
            if deadline is not None and time.time() >= deadline:
                break
            time.sleep(1.0)
            for task, proc in list(running.items()):
                if proc.poll() is not None:
                    del running[task]
                    if proc.returncode == 0:
                        bar.update(1)
                    else:
                        failed.append(task)
                        tqdm.write(f"{task}: exit {proc.returncode}, see {split_folder(out, *task) / 'log.txt'}",
                                   file=sys.stderr)
            bar.set_postfix(running=len(running), queued=len(todo), refresh=False)
    except KeyboardInterrupt:
        tqdm.write("interrupted: stopping the running splits (each resumes from its checkpoint)", file=sys.stderr)
    finally:
        for proc in running.values():  # stopped early: each resumes from its checkpoint next time
            proc.send_signal(signal.SIGTERM)
        for proc in running.values():
            proc.wait()
        bar.close()
    left = len(running) + len(todo)
    print(f"{bar.n} of {len(tasks)} splits done, {len(failed)} failed, {left} left"
          + (" (rerun the same command to resume)" if left else ""), file=sys.stderr)
    return 1 if failed else 0
