"""Matrix Multiplication Neural Network (MMNN, the paper's Algorithm 2): an implicit posterior over
a weight matrix that never materializes a dense layer of size (input matrix) x (output matrix)."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from .._random import standard_normal
from ._checks import positive_int, positive_ints, trailing


def _matrix_shape(name: str, shape) -> tuple[int, int]:
    sizes = positive_ints(name, shape)
    if len(sizes) != 2:
        raise ValueError(f"{name} must be a (rows, cols) pair, got {shape!r}")
    return sizes[0], sizes[1]


class MatrixMultiplicationLayer(nn.Module):
    """X [.., M_in, N_in] -> (A_l X + B_l) A_r + B_r  [.., M_out, N_out] (Alg. 2, lines 2-3).

    A_l: [M_out, M_in], B_l: [M_out, N_in], A_r: [N_in, N_out], B_r: [M_out, N_out]; in all
    M_out M_in + M_out N_in + N_in N_out + M_out N_out parameters (Sec. 4), against
    M_in N_in M_out N_out for a dense layer between the flattened matrices.

    A_l and A_r are stored at unit scale (``left``, ``right``: U(-1, 1) entries) and multiplied by
    1/sqrt(fan-in) (M_in, N_in) in the forward, as the BNNs scale their weights: at initialization this
    is nn.Linear's default, and Adam's step, about lr per entry whatever the entry's size, then moves
    A_l, A_r by lr relative to their size instead of lr sqrt(fan-in). Stored at 1/sqrt(fan-in) scale, an
    Adam step of 1e-3 moves every entry of an 800 x 800 matrix by ~3% of its size in a coherent
    direction: the MNIST BNN's MMNNs for L = 1200 (N = 800) then tripled their samples' scale in 7
    steps and the network's log-likelihood fell from -2.3 to -300 per image (measured).
    """

    def __init__(self, in_shape: Sequence[int], out_shape: Sequence[int]):
        super().__init__()
        (m_in, n_in), (m_out, n_out) = _matrix_shape("in_shape", in_shape), _matrix_shape("out_shape", out_shape)
        self.in_shape, self.out_shape = (m_in, n_in), (m_out, n_out)
        self.left_scale, self.right_scale = m_in ** -0.5, n_in ** -0.5
        self.left = nn.Parameter(torch.empty(m_out, m_in).uniform_(-1, 1))
        self.left_bias = nn.Parameter(torch.zeros(m_out, n_in))
        self.right = nn.Parameter(torch.empty(n_in, n_out).uniform_(-1, 1))
        self.right_bias = nn.Parameter(torch.zeros(m_out, n_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., M_in, N_in] -> [..., M_out, N_out]."""
        trailing("x", x, self.in_shape)
        return ((self.left_scale * self.left) @ x + self.left_bias) @ (self.right_scale * self.right) + self.right_bias

    @staticmethod
    def n_parameters(in_shape: Sequence[int], out_shape: Sequence[int]) -> int:
        """The count of Sec. 4: M M0 + M N0 + N0 N + M N for an M0 x N0 -> M x N layer."""
        (m0, n0), (m, n) = tuple(in_shape), tuple(out_shape)
        return m * m0 + m * n0 + n0 * n + m * n


class MMNN(nn.Module):
    """Implicit posterior over an M x N matrix: W = MMNN(W0), W0 ~ N(0, I) of shape ``shapes[0]``.

    ``shapes`` lists the matrix shape after each layer, starting with the noise, e.g. the paper's
    MNIST first layer ``[(30, 30), (500, 500), (500, 500), (L, 785)]``; ReLU between layers, the
    last one linear. ``sample(n)`` returns the matrices flattened row-major, [n, M N], ready for
    :func:`kivi_fast.kl`; ``sample_matrices(n)`` keeps them [n, M, N].
    """

    def __init__(self, shapes: Sequence[Sequence[int]]):
        super().__init__()
        if isinstance(shapes, (str, bytes)) or not isinstance(shapes, Sequence) or len(shapes) < 2:
            raise ValueError(f"shapes must be at least two (rows, cols) pairs of positive sizes, got {shapes!r}")
        shapes = [_matrix_shape(f"shapes[{i}]", s) for i, s in enumerate(shapes)]
        self.noise_shape, self.shape = shapes[0], shapes[-1]
        self.dim = self.shape[0] * self.shape[1]
        self.layers = nn.ModuleList(MatrixMultiplicationLayer(a, b) for a, b in zip(shapes[:-1], shapes[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Matrices from noise matrices: [..., *noise_shape] -> [..., M, N]."""
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.relu(x)
        return x

    def sample_matrices(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """[n, M, N] samples, differentiable w.r.t. the parameters (reparameterized)."""
        p = self.layers[0].left
        return self(standard_normal((positive_int("n", n), *self.noise_shape), generator, dtype=p.dtype,
                                    device=p.device))

    def sample(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """[n, M N] samples, each matrix flattened row-major."""
        return self.sample_matrices(n, generator).reshape(n, self.dim)
