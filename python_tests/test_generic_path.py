"""The device-generic kernels' memory layout (csrc/generic.cpp), on the CPU: what CUDA tensors run for
the shapes the CUDA kernels do not take (many points, or many points in many dimensions).

- A fit never makes the N x N kernel matrix: the denominator's rows against all N points, the
  numerator's block only where the median or the evaluation reads it, the system factored in place.
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
from torch.profiler import ProfilerActivity, profile

import kivi_fast
from kivi_fast import reference

from conftest import implementation
from test_ops_vs_reference import assert_kl_equals_reference, make_samples

MiB = 2**20
CHUNK_BYTES = 4 * MiB  # csrc/generic.cpp, kChunkBytes


@pytest.fixture(autouse=True)
def generic():
    with implementation("generic"):
        yield


def peak_bytes(fn) -> int:
    """The peak of the bytes allocated less those freed while fn runs (on the CPU)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    now = top = 0
    for e in events:
        now += e.nbytes()
        top = max(top, now)
    return top


def forward_backward(p, q, **kw):
    q = q.clone().requires_grad_(True)
    return lambda: kivi_fast.kernel_kl(p, q, **kw).backward()


@pytest.mark.parametrize("reverse", [True, False])
def test_a_fit_of_many_points_never_makes_the_n_by_n_matrix(reverse):
    n_p, n_q, d = 500, 400, 16
    p, q = make_samples(dict(n_p=n_p, n_q=n_q, d=d, batch=None, dtype=torch.float64, scale=1.0, shift=0.3,
                             seed=1))
    n_den, n_num = (n_q, n_p) if reverse else (n_p, n_q)
    n = n_p + n_q
    rows = n_den * n * 8                      # the denominator's kernel rows: needed throughout
    system = n_den * n_den * 8                # K_dd / n_den + lam I, factored in place
    numer = 0 if reverse else n_num * n_num * 8  # the numerator's block: the evaluation at q_z reads it
    small = 8 * n * d * 8 + MiB               # the points, their float64 copies, the gradient, vectors
    peak = peak_bytes(forward_backward(p, q, bandwidth=2.0, reverse=reverse))
    assert rows <= peak <= rows + system + numer + small, (peak, n * n * 8)


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
