"""The device-generic kernels' memory layout (csrc/generic.cpp), on the CPU: what CUDA tensors run for
the shapes the CUDA kernels do not take (many points, or many points in many dimensions).

- A fit never makes the N x N kernel matrix: the median reads the pairs' squared distances (packed,
  N (N - 1) / 2) and frees them; the system is factored in place; the kernel values the right side
  and the evaluation read are made in chunks of rows.
- Samples with many dimensions are read in chunks of columns converted to float64: no float64 copy of
  the samples in the forward or the backward.

The peaks are the largest sum of the bytes allocated less those freed during one call, from the
profiler's memory events; each test also checks that the peak covers the one buffer the call cannot do
without, so that a profiler that recorded nothing fails it. The values themselves are checked against
the reference (the chunked columns with a batch and both settings of reverse; the rest in
test_ops_vs_reference.py, whose ``compiled`` fixture runs the generic kernels too).
"""

import pytest
import torch

import kivi_fast
from kivi_fast import reference

from conftest import bench_module, implementation
from test_ops_vs_reference import assert_kl_equals_reference, make_samples

MiB = 2**20
CHUNK_BYTES = 4 * MiB  # csrc/generic.cpp, kChunkBytes


@pytest.fixture(autouse=True)
def generic():
    with implementation("generic"):
        yield


# What the CPU allocates inside these ops and a GPU does not: the pairs' packing in chunks (a GPU makes
# them in one kernel, cuda::pair_sqdist) and the median's selection buffers (cuda/median.cu reads the
# pairs in place). test_cuda_emulation.py bounds the GPU build's peak itself.
CPU_ONLY = ("kivi_fast::pack_pairs", "kivi_fast::median_of_pairs")
peak_bytes = bench_module("alloc_peak").peak_bytes


def forward_backward(p, q, **kw):
    q = q.clone().requires_grad_(True)
    return lambda: kivi_fast.kernel_kl(p, q, **kw).backward()


@pytest.mark.parametrize("reverse", [True, False])
@pytest.mark.parametrize("median", [True, False], ids=["median", "given-bandwidth"])
def test_a_fit_of_many_points_holds_the_pairs_or_the_system_and_chunks(reverse, median):
    """The peak is the one buffer a fit cannot do without, the pairs' squared distances (with the
    median) or the system, or a chunk of kernel rows no larger, plus vectors (the denominator's kernel
    rows, n_den x N, held beside the system or the numerator's block would exceed the bound by 4 MB or
    more)."""
    n_p, n_q, d = 900, 800, 16
    p, q = make_samples(dict(n_p=n_p, n_q=n_q, d=d, batch=None, dtype=torch.float64, scale=1.0, shift=0.3,
                             seed=1))
    n_den = n_q if reverse else n_p
    n = n_p + n_q
    pairs = n * (n - 1) // 2 * 8               # the median's pairs, packed
    system = n_den * n_den * 8                 # K_dd / n_den + lam I, factored in place
    chunk = max(CHUNK_BYTES, system) + n * 8   # a chunk of kernel rows (generic.cpp, kernel_chunk_rows)
    small = 4 * n * d * 8 + MiB                # the points' float64 copy, the gradient, vectors
    floor = pairs if median else system
    kw = {} if median else dict(bandwidth=2.0)
    peak = peak_bytes(forward_backward(p, q, reverse=reverse, **kw), skip=CPU_ONLY)
    assert floor <= peak <= max(floor, system, chunk) + small, (peak, floor)


def test_many_dimensions_are_read_in_chunks_of_columns():
    """An MNIST-layer shape in float32: the call allocates the gradient and a few chunks, not a float64
    copy of the samples (4 x the gradient here)."""
    n, d = 20, 300_000
    p, q = make_samples(dict(n_p=n, n_q=n, d=d, batch=None, dtype=torch.float32, scale=1.0, shift=0.3, seed=2))
    grad = n * d * 4
    peak = peak_bytes(forward_backward(p, q))
    assert grad <= peak <= grad + 3 * CHUNK_BYTES + MiB, peak


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_chunked_columns_equal_the_reference(dtype):
    """A batch whose columns take three chunks (the last one partial), both settings of reverse; the
    gradient of a DensityRatio at points of neither set (the weighted_grad op) too."""
    p, q = make_samples(dict(n_p=6, n_q=5, d=70_000, batch=2, dtype=dtype, scale=1.0, shift=0.2, seed=3))
    rtol = 1e-5 if dtype == torch.float32 else 1e-8
    assert_kl_equals_reference(p, q, rtol)
    z = (q[:, :3] + 0.05).requires_grad_(True)
    z_ref = z.detach().clone().requires_grad_(True)
    kivi_fast.DensityRatio().fit(p, q).log_ratio(z).sum().backward()
    reference.DensityRatio().fit(p, q).log_ratio(z_ref).sum().backward()
    scale = z_ref.grad.abs().max()
    assert (z.grad - z_ref.grad).abs().max() <= (rtol if dtype == torch.float32 else 1e-7) * scale
