"""The diagonal contrast's CUDA kernels (csrc/cuda/contrast.cu: the standardize ops that
kivi_fast/contrast.py's _DiagonalContrast calls on CUDA tensors), run by the CPU emulation of
test_cuda_emulation.py, against the ATen composition that every other device takes (the oracle: the
same formulas by other code), and kivi-ac's KL through them against the KL through the composition."""

from __future__ import annotations

import pytest
import torch

import kivi_fast
from kivi_fast import contrast

import test_cuda_emulation as emulation_tests
from conftest import DeviceOps
from test_cuda_emulation import launches

# test_cuda_emulation.py's autouse fixture: the emulation library loaded (emulation_tests.EMU), outputs
# filled with NaN where a kernel does not write
emulation = emulation_tests.emulation

f64 = {"dtype": torch.float64}

# (B, n, d): one column; a row group a row; rows over several passes of the row groups; 70 and 1000
# columns in 3 and 32 blocks (t summed over the blocks); a column count that is not a power of two
SHAPES = [(1, 2, 1), (3, 100, 8), (2, 300, 5), (2, 10, 70), (1, 5, 1000), (2, 7, 33)]


def samples(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    scale = torch.linspace(0.5, 3.0, shape[-1], **f64)
    return (torch.randn(shape, generator=g, **f64) * scale + 0.7).to(dtype)


@pytest.mark.parametrize("to_standard_normal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_standardize_equals_the_composition(shape, dtype, to_standard_normal):
    x = samples(shape, dtype, sum(shape))
    launches()
    got = emulation_tests.EMU.standardize(x, to_standard_normal, 0.25)
    names = [launch.kernel for launch in launches()]
    want = contrast.standardize(x, "x", to_standard_normal, 0.25)
    for g, w in zip(got, want):
        assert g.dtype == torch.float64 and g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    assert names == ["standardize_kernel<scalar_t>"]  # (more than 32 columns: and ATen's sum of t's parts)


@pytest.mark.parametrize("to_standard_normal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_standardize_grad_equals_the_composition(shape, dtype, to_standard_normal):
    """With a cotangent on z and t, on each alone: the kernel's gradient in x's dtype against the
    composition's backward (contrast._DiagonalContrast on a CPU tensor)."""
    x = samples(shape, dtype, sum(shape) + 1)
    g = torch.Generator().manual_seed(2)
    g_z, g_t = torch.randn(shape, generator=g, **f64), torch.randn(shape[0], generator=g, **f64)
    z, std, _ = emulation_tests.EMU.standardize(x, to_standard_normal, 0.0)
    for grad_z, grad_t in ((g_z, g_t), (g_z, None), (None, g_t)):
        launches()
        got = emulation_tests.EMU.standardize_grad(grad_z, grad_t, z, std, x, to_standard_normal)
        assert [launch.kernel for launch in launches()] == ["standardize_grad_kernel<scalar_t>"]
        xx = x.clone().requires_grad_()
        zz, tt = contrast._DiagonalContrast.apply(xx, "x", to_standard_normal, 0.0)
        loss = (zz * (0 if grad_z is None else grad_z)).sum() + (tt * (0 if grad_t is None else grad_t)).sum()
        (want,) = torch.autograd.grad(loss, xx)
        assert got.dtype == dtype
        tol = {"rtol": 1e-12, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-6, "atol": 1e-6}
        torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("value,n,dtype", [(1.5, 6, torch.float64), (0.1, 3, torch.float64), (0.7, 100, torch.float64),
                                           (0.3, 7, torch.float64), (0.1, 3, torch.float32)])
def test_a_column_of_equal_samples_gives_nan_and_inf_where_the_cpu_raises(value, n, dtype):
    """A zero standard deviation: no error read back on a GPU, but z NaN in that column and t = Inf; the
    other columns unchanged. Also where the mean of the float64 samples rounds (0.1 three times): the
    deviations are still exactly 0."""
    x = samples((2, n, 3), dtype, 5)
    x[1, :, 2] = value
    z, std, t = emulation_tests.EMU.standardize(x, True, 0.0)
    assert z[1, :, 2].isnan().all() and std[1, 0, 2] == 0 and t[1] == float("inf")
    want = contrast.standardize(x[:1], "x", True, 0.0)
    torch.testing.assert_close((z[:1], std[:1], t[:1]), want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(z[1, :, :2], contrast.standardize(x[1:, :, :2], "x")[0][0], rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="all samples are equal"):
        contrast.standardize(x, "x")


class CountedKernels:
    """The emulation's standardize ops, each call counted: on a GPU each is one launch (the emulated op
    itself is invisible to a dispatch mode, which sees the allocations inside it)."""

    def __init__(self):
        self.calls = 0

    def standardize(self, *args):
        self.calls += 1
        return emulation_tests.EMU.standardize(*args)

    def standardize_grad(self, *args):
        self.calls += 1
        return emulation_tests.EMU.standardize_grad(*args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(4, 100, 8), (30, 3)], ids=lambda s: "x".join(map(str, s)))
def test_kivi_ac_through_the_kernels_equals_kivi_ac_through_the_composition(shape, dtype, monkeypatch):
    """adaptive_contrast_kl with the diagonal contrast (the VAE's), forward and backward: values and
    gradients through the emulated kernels equal those through the composition, and the kernels take
    the device ops to at most half (from 38 to 12 in float32, 32 to 10 in float64, with torch 2.13):
    three launches of the contrast's kernels (the samples', the reference draws', the backward) in
    place of ~30 small ops."""
    q = samples(shape, dtype, 11).requires_grad_()
    ref_z = samples(shape, dtype, 12)
    w = torch.randn(shape[:-2], generator=torch.Generator().manual_seed(3), **f64).to(dtype)

    def run():
        kl = kivi_fast.adaptive_contrast_kl(q, None, 1e-3, contrast="diagonal", reference_z=ref_z)
        return kl, torch.autograd.grad((kl * w).sum(), q)[0]

    run()  # (a first call also fills a cache of the contrast's constants: one-time ops, not counted)
    with DeviceOps() as composition:
        want = run()
    kernels = CountedKernels()
    monkeypatch.setattr(contrast, "_standardize_ops", lambda x: kernels)
    with DeviceOps() as rest:
        got = run()
    tol = {"rtol": 1e-10, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-5}
    for g, wv in zip(got, want):
        assert g.dtype == dtype
        torch.testing.assert_close(g, wv, **tol)
    assert kernels.calls == 3
    # torch 2.13: 12 of 38 (float32), 10 of 32 (float64); the bounds leave torch's own ops some room
    with_kernels = len(rest.names) + kernels.calls
    assert with_kernels <= 14 and 2 * with_kernels <= len(composition.names), (rest.names, composition.names)


def test_the_choice_of_the_kernels_is_a_constant_under_torch_compile():
    """On CUDA, torch.compile traces _DiagonalContrast through contrast._standardize_ops: whether the
    library has the kernels is asked once, not traced (tracing it would break the graph at the
    backend's loading)."""
    compiled = torch.compile(lambda x: x + float(contrast._has_cuda_standardize()), backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(torch.zeros(2)), torch.full((2,), float(contrast._has_cuda_standardize())))
