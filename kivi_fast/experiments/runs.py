"""Run folders: where an experiment writes its JSON results, PNG figures and checkpoints."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch


def run_folder(root: str | os.PathLike, name: str, explicit: str | None = None) -> Path:
    """``explicit`` if given (reused, so a run can resume), else ``root/name-YYYYmmdd-HHMMSS``."""
    path = Path(explicit) if explicit else Path(root) / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_json(path: str | os.PathLike, data) -> None:
    """Write atomically, so an interrupted run never leaves half a file."""
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=float) + "\n")
    os.replace(tmp, path)


def save_checkpoint(path: str | os.PathLike, state: dict) -> None:
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: str | os.PathLike) -> dict | None:
    path = Path(path)
    return torch.load(path, weights_only=False) if path.exists() else None


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
