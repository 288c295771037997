"""Run folders: where an experiment writes its JSON results, PNG figures and checkpoints."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import time
import warnings
from pathlib import Path

import torch


class RunError(Exception):
    """A run cannot go on for a reason the user can fix (missing data, an unusable checkpoint); the
    command line prints the message, without a traceback, and exits with status 1."""


class Interrupted(RunError):
    """A run stopped by Ctrl-C or SIGTERM after saving its checkpoint: exit status 130, as for Ctrl-C."""
    exit_code = 130


class CheckpointError(RunError):
    """A checkpoint file that is not a kivi_fast checkpoint or cannot be loaded safely."""


def begin(args, name: str, quick: dict) -> Path:
    """An experiment's first steps: ``--quick``'s settings (:func:`options.apply_quick`), one torch CPU
    thread (the tensors are small; the machine may be shared), the run folder (``--out``, ``--run-dir``)."""
    from .options import apply_quick

    apply_quick(args, quick)
    torch.set_num_threads(1)
    return run_folder(args.out, name, args.run_dir)


RUN_MARKER = ".kivi-fast-run"  # in each run folder: the kind of run it holds (run_folder's name)


def run_folder(root: str | os.PathLike, name: str, explicit: str | None = None) -> Path:
    """``explicit`` if given (reused, so a run can resume), else ``root/name-YYYYmmdd-HHMMSS``. Refused,
    since the two would write over each other's files: a folder that holds another kind of run (its
    RUN_MARKER names another ``name``: another command, or another data set or method of uci; a marker
    alone, of a run that failed before it wrote anything, holds nothing), files without a marker, or a
    run that another process is running (the marker stays locked while this process lives: a job
    resubmitted while it still runs)."""
    from .options import UsageError

    if explicit is not None and not str(explicit).strip():
        raise UsageError("--run-dir: expected a folder, got an empty name")
    path = Path(explicit) if explicit else Path(root) / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    option = "--run-dir" if explicit else "--out"
    make_folder(path, option)
    marker = path / RUN_MARKER
    if marker.is_file():
        held = marker.read_text(errors="replace").strip()
        # (a marker alone is a run that failed before it wrote anything: e.g. a wrong --data-dir)
        if held != name and any(f.name != RUN_MARKER for f in path.iterdir()):
            raise UsageError(f"{option}: {path} holds a {held} run, not a {name} one: use another folder")
    elif any(path.iterdir()):
        raise UsageError(f"{option}: {path} holds files but no kivi_fast run (no {RUN_MARKER}: another program's "
                         f"files, or a run of a kivi_fast before the marker): use another folder; to resume such a "
                         f"run of this command there, write {name} into {marker}")
    if path.resolve() not in _HELD:  # (else this process's own run, again: a caller's loop)
        lock = exclusive_lock(marker)
        if lock is None:
            held = marker.read_text(errors="replace").strip() or name
            raise UsageError(f"{option}: {path} is in use: another process is running its {held} run; wait for "
                             "it to end, or use another folder")
        _HELD[path.resolve()] = lock
    if marker.read_text(errors="replace").strip() != name:
        marker.write_text(name + "\n")
    return path


_HELD: dict = {}  # run folder -> its locked marker, open until release_run_folders()


def release_run_folders() -> None:
    """Unlock the run folders this process holds: the end of a command (cli.main's), so that a caller
    that runs commands in its own process (a notebook, a sweep) does not keep them from others."""
    while _HELD:
        _HELD.popitem()[1].close()


def mark_new_folder(path: Path, name: str) -> None:
    """Mark an empty folder as holding a ``name`` run, for a child process's run_folder (a folder a parent
    makes and writes into first, as uci-batch does: its lock and log). A folder with files keeps what it
    has, for the child to judge."""
    if not any(path.iterdir()):
        (path / RUN_MARKER).write_text(name + "\n")


def exclusive_lock(path: Path):
    """``path`` (made if missing) opened with an exclusive lock on it, or None if another process holds
    one; the lock lasts while the file stays open, in any child that inherits it too. Opened to read: a
    lock needs no write permission. Where the system has no such locks (not POSIX; a network file
    system without them), open without one, with a warning for the latter."""
    f = os.fdopen(os.open(path, os.O_RDONLY | os.O_CREAT, 0o644), "rb")
    try:
        import fcntl
    except ImportError:
        return f
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:  # another process holds it
        f.close()
        return None
    except OSError as err:  # (ENOLCK on NFS without its lock daemon, ENOSYS on Lustre mounted without flock)
        warnings.warn(f"{path}: cannot lock it here ({err.strerror or err}); nothing keeps a second process from "
                      "running in this folder at the same time", RuntimeWarning, stacklevel=2)
    return f


def config_differences(old: dict, new: dict) -> dict:
    """{key: (old value, new value)} for each of ``new``'s keys whose value ``old`` does not share: what
    refuses a resumed run with other settings."""
    return {k: (old.get(k), v) for k, v in new.items() if old.get(k) != v}


def make_folder(path: Path, option: str) -> None:
    """``path`` and its parents, or a usage error naming ``option`` (a file in the way, no permission)."""
    from .options import UsageError

    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UsageError(f"{option}: cannot make the folder {path}: {err.strerror or err}") from None


class MissingField(RunError, KeyError):
    """A field a command needs is not in a run file's JSON object (a damaged file, or one another command
    or version wrote). Still a KeyError, for code that looks a field up and falls back."""

    def __str__(self) -> str:  # (KeyError's would quote the message)
        return str(self.args[0])


class Fields(dict):
    """A JSON object read by :func:`read_json`: looking up a field it lacks raises :class:`MissingField`
    naming the file and the field, not a bare KeyError. ``get``, ``in`` and equality are dict's."""

    def __init__(self, pairs=(), path=None):
        super().__init__(pairs)
        self.path = path

    def __missing__(self, key):
        raise MissingField(f"{self.path}: has no field {key!r} (a damaged file, or another command's or "
                           "version's)")


# how a JSON value's Python type reads in a message
_JSON_KINDS = {dict: "object", list: "list", str: "string", int: "number", float: "number", bool: "boolean",
               type(None): "null"}


def read_json(path, expect=dict):
    """The JSON value in ``path``, which must be of type ``expect`` (dict: a JSON object, list: an array).

    A file that cannot be read, is not JSON or holds another type raises :class:`RunError` naming it:
    the run folders and results the commands read may be damaged or another command's. Its objects, at
    any depth, are :class:`Fields`, so that a missing field is named too.
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text(), object_pairs_hook=lambda pairs: Fields(pairs, path))
    except OSError as err:
        raise RunError(f"{path}: cannot read it: {err.strerror or err}") from None
    except ValueError as err:  # JSONDecodeError, or UnicodeDecodeError for a binary file
        raise RunError(f"{path}: not JSON ({err})") from None
    if not isinstance(data, expect):
        got = next(_JSON_KINDS[t] for t in type(data).__mro__ if t in _JSON_KINDS)  # (Fields: "object")
        raise RunError(f"{path}: expected a JSON {_JSON_KINDS.get(expect, expect.__name__)}, got "
                       f"{'an' if got[0] in 'aeiou' else 'a'} {got}")
    return data


def write_json(path: str | os.PathLike, data) -> None:
    """Write atomically, so an interrupted run never leaves half a file."""
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=float) + "\n")
    os.replace(tmp, path)


def save_checkpoint(path: str | os.PathLike, state: dict) -> None:
    """Write ``state`` atomically. It must hold only tensors and plain Python values (dict, list,
    tuple, str, int, float, bool, None; e.g. state dicts and torch's RNG state, a uint8 tensor), so that
    :func:`load_checkpoint` can read it back without unpickling code."""
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: str | os.PathLike, keys=()) -> dict | None:
    """The checkpoint at ``path`` (None if there is none), read with ``torch.load(weights_only=True)``.

    That loader builds tensors and plain Python values only, so a file from someone else cannot run
    code here; a file that holds anything else (a pickled function or class instance), or that is not
    a dict with all of ``keys``, raises :class:`CheckpointError` naming the file.
    """
    path = Path(path)
    if not path.exists():
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, OSError) as err:  # (OSError: truncated)
        raise CheckpointError(
            f"{path} is not a kivi_fast checkpoint that can be loaded safely: not one kivi_fast wrote (it holds "
            f"something other than tensors and plain Python values), or damaged ({_load_failure(err)}); remove "
            "it, or use another --run-dir") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} is not a kivi_fast checkpoint: it holds a {type(state).__name__}, not a "
                              "dict; remove it, or use another --run-dir")
    missing = [k for k in keys if k not in state]
    if missing:
        raise CheckpointError(f"{path} is not a kivi_fast checkpoint: it lacks {', '.join(map(str, missing))}; "
                              "remove it, or use another --run-dir")
    return state


def state_dict_mismatch(err: Exception) -> str:
    """What ``load_state_dict`` found wrong, in a few words. torch's RuntimeError is a header ("Error(s) in
    loading state_dict for ...:") and then a line per problem; the first problem's kind is kept."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()] or [type(err).__name__]
    return lines[min(1, len(lines) - 1)].split(": ", 1)[0]


def _load_failure(err: Exception) -> str:
    """What ``torch.load`` found wrong, in a few words. Its message first advises reloading with
    ``weights_only=False`` (or allow-listing the class): that would run whatever code the file holds, so
    only torch's diagnosis, after "WeightsUnpickler error:", and its first sentence are kept."""
    text = str(err).split("WeightsUnpickler error:", 1)[-1]
    line = next((line.strip() for line in text.splitlines() if line.strip()), type(err).__name__)
    return line.split(". ", 1)[0]


def last_checkpoint(run_dir) -> str:
    """Where a stopped run can resume from, for its error message (a run may stop before its first save)."""
    if run_dir is not None and (Path(run_dir) / "checkpoint.pt").exists():
        return f"the last checkpoint is in {run_dir}"
    return f"no checkpoint was written yet (run folder {run_dir})"


def collect_runs(folders, load, label_of) -> dict:
    """The reports' input: ``load(folder)`` for each run folder, named by ``label_of(run)``, as
    {label: (folder, run)} in the order given. Two runs with one label are a usage error."""
    from .options import UsageError

    loaded = {}
    for folder in map(Path, folders):
        run = load(folder)
        label = label_of(run)
        if label in loaded:
            raise UsageError(f"two runs of {label!r}: give one run per method and settings")
        loaded[label] = (folder, run)
    return loaded


def load_finished_run(folder: Path, command: str) -> dict:
    """A finished run folder's results.json (an object) and history.json (a list, one entry per evaluation),
    parsed; a RunError naming ``command`` when the folder holds no results.json, or naming a damaged file."""
    if not (folder / "results.json").exists():
        raise RunError(f"{folder} holds no results.json: not a finished kivi-fast {command} run")
    return {"results.json": read_json(folder / "results.json"),
            "history.json": read_json(folder / "history.json", list)}


def copy_run_files(folder: Path, dest: Path, names) -> None:
    """Copy the files ``names`` that ``folder`` holds into ``dest`` (a report's copy of a run, without
    its checkpoint)."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in names:
        source, target = folder / name, dest / name
        # (a report rerun over its own copies, e.g. to add runs to it, finds them in place)
        if source.exists() and not (target.exists() and os.path.samefile(source, target)):
            shutil.copyfile(source, target)


def write_report(out: Path, summary: dict, table: str) -> None:
    """A report's outputs beside its figures: ``summary.json``, ``table.md`` (also printed)."""
    write_json(out / "summary.json", summary)
    (out / "table.md").write_text(table)
    print(table)


def machine() -> dict:
    """What ran a result (timings depend on it): CPU model, cores, torch version and kivi_fast backend."""
    import platform

    import kivi_fast

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu": cpu, "cores": usable_cores(), "torch": torch.__version__, "backend": kivi_fast.backend()}


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one, not the machine's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def matplotlib_pyplot():
    """pyplot on the non-interactive Agg backend (no display on servers and CI)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str | os.PathLike, dpi: int = 100, rect=None) -> None:
    """Lay out, write and close a figure (closing frees it: long runs draw many)."""
    if rect is None:
        fig.tight_layout()
    else:
        fig.tight_layout(rect=rect)
    fig.savefig(path, dpi=dpi)
    matplotlib_pyplot().close(fig)
