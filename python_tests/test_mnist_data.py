"""The MNIST sets shipped in data/: their loaders check the published SHA-256s and give the splits the
paper uses."""

import numpy as np
import pytest
import torch

from kivi_fast.experiments import mnist_data


def test_a_damaged_data_file_is_an_error_not_another_benchmark(tmp_path):
    (tmp_path / "binarized_mnist").mkdir()
    x = np.zeros((3, 784), np.uint8)
    np.savez(tmp_path / "binarized_mnist" / "binarized_mnist.npz", x_train=x, x_valid=x, x_test=x)
    with pytest.raises(mnist_data.DataNotFoundError, match="x_train"):
        mnist_data.load_binarized_mnist(tmp_path)
    with pytest.raises(mnist_data.DataNotFoundError, match="not found"):
        mnist_data.load_binarized_mnist(tmp_path / "nowhere")


@pytest.mark.parametrize("content", [b"PK\x03\x04 truncated", b"not an npz at all", b""])
def test_a_truncated_or_foreign_data_file_is_an_error_naming_it(tmp_path, content):
    (tmp_path / "binarized_mnist").mkdir()
    (tmp_path / "binarized_mnist" / "binarized_mnist.npz").write_bytes(content)
    with pytest.raises(mnist_data.DataNotFoundError, match="binarized_mnist.npz is damaged"):
        mnist_data.load_binarized_mnist(tmp_path)


def test_the_shipped_binarized_mnist_is_the_larochelle_split():
    train, valid, test = mnist_data.load_binarized_mnist()
    assert train.shape == (50000, 784) and valid.shape == (10000, 784) and test.shape == (10000, 784)
    assert set(torch.unique(train).tolist()) == {0.0, 1.0}


def test_the_shipped_mnist_has_its_label_counts_and_the_last_10000_validate():
    data = mnist_data.load_mnist()
    counts = torch.bincount(torch.cat([data["y_train"], data["y_valid"]]), minlength=10).tolist()
    assert counts == [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]  # data/mnist/README.md
    assert data["x_train"].shape == (50000, 784) and data["x_valid"].shape == (10000, 784)
    assert 0.0 <= float(data["x_test"].min()) and float(data["x_test"].max()) == 1.0
