"""The UCI regression benchmarks with their standard 90/10 splits (PBP, MC-dropout, SVGD, KIVI).

    data = load_split("boston", split=0)            # normalized with training statistics
    data.x_train, data.y_train, data.x_test, data.y_test, data.y_scaler.inverse(y_hat)

Where the files are (``<folder>/data/`` per set, as in ``data/UCI_Datasets/`` of the source repository,
whose README.md says where they come from) is decided by :func:`search_dirs`: the ``data_dir``
argument (the command line's ``--data-dir``), else the environment variable ``KIVI_FAST_DATA``, else
the source checkout's ``data/UCI_Datasets`` and ``./data/UCI_Datasets``. An installed package has no
checkout, so it needs one of the first two.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .runs import RunError

ENV_VAR = "KIVI_FAST_DATA"
# In a source checkout the data sets are in data/UCI_Datasets/ at the repository root, two levels above
# this file (kivi_fast/experiments/datasets.py); in an installed package this folder does not exist.
CHECKOUT_DATA_DIR = Path(__file__).resolve().parents[2] / "data" / "UCI_Datasets"


class DataNotFoundError(RunError, FileNotFoundError):
    """A data set that is not where the search looked (the message names every place)."""


@dataclass(frozen=True)
class DatasetInfo:
    folder: str
    n_hidden: int  # hidden units of the BNN (PBP's protocol: 50, 100 for the two largest sets)
    n_splits: int = 20  # standard splits (n_splits.txt beside the data; a test holds the two equal)


# short name -> where it lives; the names are the row labels of the paper's Table 1
DATASETS = {
    "boston": DatasetInfo("bostonHousing", 50),
    "concrete": DatasetInfo("concrete", 50),
    "energy": DatasetInfo("energy", 50),
    "kin8nm": DatasetInfo("kin8nm", 50),
    "naval": DatasetInfo("naval-propulsion-plant", 50),
    "combined": DatasetInfo("power-plant", 50),
    "protein": DatasetInfo("protein-tertiary-structure", 100, 5),
    "wine": DatasetInfo("wine-quality-red", 50),
    "yacht": DatasetInfo("yacht", 50),
}
UNAVAILABLE = {
    "year": "Year Prediction MSD is not available offline (about 200 MB compressed, not stored in "
    "the project; see data/UCI_Datasets/README.md)",
}


def search_dirs(data_dir: str | os.PathLike | None = None, folder: str = "UCI_Datasets") -> list[Path]:
    """The places searched for the contents of ``data/<folder>`` (the UCI sets' folders, or another data
    set's files), in order (see the module docstring).

    A folder given by ``data_dir`` or ``KIVI_FAST_DATA`` may be that folder itself or the one above it
    (holding ``<folder>/``); an explicit one is the only place looked.
    """
    env = os.environ.get(ENV_VAR)
    if data_dir or env:
        root = Path(data_dir or env).expanduser()
        candidates = [root, root / folder]
    else:
        candidates = [CHECKOUT_DATA_DIR.parent / folder, Path.cwd() / "data" / folder]
    unique: dict[Path, Path] = {}
    for c in candidates:
        unique.setdefault(c.resolve(), c)
    return list(unique.values())


def _folder(name: str, data_dir: str | os.PathLike | None) -> Path:
    if name in UNAVAILABLE:
        raise DataNotFoundError(UNAVAILABLE[name])
    if name not in DATASETS:
        raise KeyError(f"unknown UCI data set {name!r}; known: {', '.join(DATASETS)}")
    sub = Path(DATASETS[name].folder) / "data"
    places = search_dirs(data_dir)
    for place in places:
        if (place / sub).is_dir():
            return place / sub
    source = "--data-dir" if data_dir else f"${ENV_VAR}" if os.environ.get(ENV_VAR) else "the default places"
    raise DataNotFoundError(
        f"UCI data set {name!r} not found: no folder {sub}/ in {', '.join(map(str, places))} ({source}). "
        f"Pass --data-dir or set {ENV_VAR} to the folder that holds {DATASETS[name].folder}/ (data/UCI_Datasets/ "
        "of the kivi_fast source repository; its README.md says where the files come from)")


CHECKSUMS = "SHA256SUMS"  # beside the sets' folders: "<digest>  <folder>/data/<file>" per line
_CHECKED: dict = {}  # path -> (size, mtime_ns) of the files found intact in this process
_DIGESTS: dict = {}  # checksum list path -> (its mtime_ns, {relative path: digest})


def _digests(listing: Path) -> dict:
    """{relative path: SHA-256} of a SHA256SUMS file, read once a process while it is unchanged."""
    mtime = listing.stat().st_mtime_ns
    if _DIGESTS.get(listing, (None,))[0] != mtime:
        pairs = (line.partition("  ") for line in listing.read_text().splitlines())
        _DIGESTS[listing] = (mtime, {name.strip(): digest.strip() for digest, _, name in pairs if name})
    return _DIGESTS[listing][1]


def _check_digest(path: Path) -> None:
    """A file of a set whose folder sits beside a SHA256SUMS that lists it must match its digest: a
    truncated split index, say, is still a table of numbers and would train on a subset, silently."""
    root = path.parents[2] if len(path.parents) > 2 else None
    if root is None or not (root / CHECKSUMS).is_file():
        return  # (a user's own copy without the list: nothing to check against)
    try:
        stat = path.stat()
    except OSError:
        return  # (missing: _table names it)
    if _CHECKED.get(path) == (stat.st_size, stat.st_mtime_ns):
        return
    digest = _digests(root / CHECKSUMS).get(path.relative_to(root).as_posix())
    if digest is not None and hashlib.sha256(path.read_bytes()).hexdigest() != digest:
        raise DataNotFoundError(f"{path} does not match its SHA-256 in {root / CHECKSUMS} (damaged or "
                                "changed); copy the data set's folder again (data/UCI_Datasets/README.md)")
    _CHECKED[path] = (stat.st_size, stat.st_mtime_ns)


def _table(path: Path) -> np.ndarray:
    """A whitespace-separated table of numbers; a missing or damaged file (one that does not match the
    checksum list beside the sets, where there is one) is a DataNotFoundError naming it."""
    _check_digest(path)
    try:
        table = np.loadtxt(path, ndmin=1)
    except (OSError, ValueError) as err:
        raise DataNotFoundError(f"{path}: missing or not a table of numbers ({err}); copy the data set's "
                                "folder again (data/UCI_Datasets/README.md)") from None
    if table.size == 0:
        raise DataNotFoundError(f"{path} is empty; copy the data set's folder again (data/UCI_Datasets/README.md)")
    return table


def _indices(path: Path, bound: int) -> np.ndarray:
    # the index files hold one 0-based integer per line (some written as floats)
    index = _table(path).reshape(-1)
    if (index != np.round(index)).any() or index.min() < 0 or index.max() >= bound:
        raise DataNotFoundError(f"{path} holds an index that is not a whole number in 0..{bound - 1}; copy the "
                                "data set's folder again (data/UCI_Datasets/README.md)")
    return index.astype(np.int64)


def n_splits(name: str, data_dir=None) -> int:
    path = _folder(name, data_dir) / "n_splits.txt"
    count = _table(path).reshape(-1)[0]
    if not np.isfinite(count) or count != round(count) or count < 1:
        raise DataNotFoundError(f"{path} says {count:g} splits, not a positive whole number; copy the data set's "
                                "folder again (data/UCI_Datasets/README.md)")
    return int(count)


def load_arrays(name: str, data_dir=None) -> tuple[np.ndarray, np.ndarray]:
    """All rows of a data set: inputs [N, D] and targets [N], float64, in original units."""
    folder = _folder(name, data_dir)
    data = _table(folder / "data.txt")
    if data.ndim != 2:
        raise DataNotFoundError(f"{folder / 'data.txt'} is not a table of rows and columns; copy the data set's "
                                "folder again (data/UCI_Datasets/README.md)")
    features = _indices(folder / "index_features.txt", data.shape[1])
    target = int(_indices(folder / "index_target.txt", data.shape[1])[0])
    return data[:, features], data[:, target]


def split_indices(name: str, split: int, data_dir=None, n_rows: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The 0-based (train, test) row indices of one standard split (checked against ``n_rows`` if given)."""
    folder = _folder(name, data_dir)
    if not 0 <= split < n_splits(name, data_dir):
        raise IndexError(f"{name} has splits 0..{n_splits(name, data_dir) - 1}, got {split}")
    bound = n_rows if n_rows is not None else np.iinfo(np.int64).max
    return (_indices(folder / f"index_train_{split}.txt", bound),
            _indices(folder / f"index_test_{split}.txt", bound))


@dataclass(frozen=True)
class Standardizer:
    """x -> (x - mean) / std with training statistics; a constant column gets std 1 (as in PBP),
    so it maps to 0 instead of dividing by zero.

    "Constant" means std <= 1e-9 max(|mean|, 1), not std == 0: Naval's feature 8 (all 288) has std 0,
    but its feature 11 (all 0.998) has a float std of 2.4e-13 from rounding, and dividing by it would
    blow rounding noise up to values of order 1.
    """

    RELATIVE_TOLERANCE = 1e-9

    mean: np.ndarray
    std: np.ndarray

    @classmethod
    def fit(cls, x: np.ndarray) -> "Standardizer":
        mean, std = x.mean(0), x.std(0)
        constant = std <= cls.RELATIVE_TOLERANCE * np.maximum(np.abs(mean), 1.0)
        return cls(mean, np.where(constant, 1.0, std))

    def __call__(self, x):
        return (x - self.mean) / self.std

    def inverse(self, z):
        return z * self.std + self.mean


@dataclass(frozen=True)
class Split:
    """One train/test split, normalized with the training statistics, as float32 tensors."""

    x_train: torch.Tensor  # [N, D]
    y_train: torch.Tensor  # [N]
    x_test: torch.Tensor
    y_test: torch.Tensor  # normalized; y_test_raw is in original units
    y_test_raw: torch.Tensor
    x_scaler: Standardizer
    y_scaler: Standardizer  # y_scaler.std is the factor between normalized and original units


def load_split(name: str, split: int, data_dir=None, dtype=torch.float32) -> Split:
    x, y = load_arrays(name, data_dir)
    train, test = split_indices(name, split, data_dir, n_rows=len(y))
    x_scaler, y_scaler = Standardizer.fit(x[train]), Standardizer.fit(y[train])

    def t(a):
        return torch.as_tensor(np.ascontiguousarray(a), dtype=dtype)

    return Split(
        x_train=t(x_scaler(x[train])), y_train=t(y_scaler(y[train])),
        x_test=t(x_scaler(x[test])), y_test=t(y_scaler(y[test])), y_test_raw=t(y[test]),
        x_scaler=x_scaler, y_scaler=y_scaler,
    )
