"""The MNIST sets in ``data/``: statically binarized MNIST (the VAE) and MNIST (BNN classification).

    x_train, x_valid, x_test = load_binarized_mnist()        # float32 tensors in {0, 1}, [n, 784]
    data = load_mnist()    # {"x_train", "y_train", "x_valid", ...}: the last 10,000 training images validate

Where the files are is searched as for the UCI sets (:func:`datasets.search_dirs`): the ``data_dir``
argument (``--data-dir``) or the environment variable ``KIVI_FAST_DATA``, the folder holding
``binarized_mnist/`` or that folder itself; else the source checkout's ``data/binarized_mnist/`` and
``./data/binarized_mnist/`` (likewise ``mnist/``). The arrays' SHA-256s
(``data/*/README.md``) are checked on loading, so a damaged or different file is an error, not a
silently different benchmark.
"""

from __future__ import annotations

import hashlib
import os
import zipfile
from pathlib import Path

import numpy as np
import torch

from .datasets import ENV_VAR, DataNotFoundError, search_dirs

# SHA-256 of each array's raw C-order bytes (independent of the npz container)
BINARIZED_MNIST = ("binarized_mnist", "binarized_mnist.npz", {
    "x_train": "43490d4d6ac9002727af4426d8748609fdb7e4094fa65ad8d681ea60082a7a5a",
    "x_valid": "069b4f0beb389b776478c3e872b4df71c95ac4be64d7cbe6d32e24ebac8e6d5e",
    "x_test": "ca0294c3b8d984c7a1dc891015a8eea6f37bae59a34e35ea0fc8c47110a8dd86",
})
MNIST = ("mnist", "mnist.npz", {
    "x_train": "741c988805d008ac6e4c904b69001ba184c24b2c540a4ef403f4c71b676cf757",
    "y_train": "1feba77c54802fa5339a11837ea4b2866434b83314ec45192930f1df69120c13",
    "x_test": "6d87418db22cc8025d05968bec9bd5c3932904b23485740db143a061a2c9d161",
    "y_test": "ddeff807876a9661a1110d45c266c86239a3a1b7d37da0c3716a7a683c852ff5",
})


def find_file(folder: str, file: str, data_dir=None) -> Path:
    places = [place / file for place in search_dirs(data_dir, folder)]
    for place in places:
        if place.is_file():
            return place
    source = "--data-dir" if data_dir else f"${ENV_VAR}" if os.environ.get(ENV_VAR) else "the default places"
    raise DataNotFoundError(
        f"{folder}/{file} not found ({source}; looked at {', '.join(map(str, places))}). Pass --data-dir or set "
        f"{ENV_VAR} to the folder that holds {folder}/ (data/ of the kivi_fast source repository; "
        f"data/{folder}/README.md says where the file comes from)")


def load_arrays(spec, data_dir=None) -> dict[str, np.ndarray]:
    """The arrays of one of :data:`BINARIZED_MNIST`, :data:`MNIST`, each checked against its SHA-256."""
    folder, file, digests = spec
    path = find_file(folder, file, data_dir)
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {key: npz[key] for key in digests if key in npz.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:  # truncated, or not an .npz of arrays
        raise DataNotFoundError(f"{path} is damaged or not a NumPy .npz of arrays ({type(err).__name__}: "
                                f"{err}); copy it again (data/{folder}/README.md)") from None
    for key, digest in digests.items():
        if key not in arrays or hashlib.sha256(np.ascontiguousarray(arrays[key]).tobytes()).hexdigest() != digest:
            raise DataNotFoundError(f"{path}: array {key!r} is missing or not the published one (its SHA-256 "
                                    f"differs from data/{folder}/README.md's); copy the file again")
    return arrays


def load_binarized_mnist(data_dir=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(train [50000, 784], validation [10000, 784], test [10000, 784]), float32 in {0, 1}, the
    Larochelle split. The test rows are sorted by digit class: subsample them at random."""
    a = load_arrays(BINARIZED_MNIST, data_dir)
    return tuple(torch.from_numpy(a[k].astype(np.float32)) for k in ("x_train", "x_valid", "x_test"))


def load_mnist(data_dir=None, validation: int = 10000) -> dict[str, torch.Tensor]:
    """MNIST for classification: {"x_train", "y_train", "x_valid", "y_valid", "x_test", "y_test"}, images
    [n, 784] float32 in [0, 1], labels int64; the last ``validation`` training images are the validation
    set (the paper's Sec. 5.2.2)."""
    a = load_arrays(MNIST, data_dir)
    x = torch.from_numpy(a["x_train"].reshape(-1, 784).astype(np.float32) / 255.0)
    y = torch.from_numpy(a["y_train"].astype(np.int64))
    cut = x.shape[0] - validation
    return {"x_train": x[:cut], "y_train": y[:cut], "x_valid": x[cut:], "y_valid": y[cut:],
            "x_test": torch.from_numpy(a["x_test"].reshape(-1, 784).astype(np.float32) / 255.0),
            "y_test": torch.from_numpy(a["y_test"].astype(np.int64))}
