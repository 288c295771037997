"""bench/pure_torch.py's two pure-PyTorch sides, the baselines every speed ratio is against: eager and
under torch.compile (bench/run.py and bench/gpu.py --compiled), against kivi_fast.reference."""

import os
import sys

import pytest
import torch

from kivi_fast import reference

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import pure_torch  # noqa: E402

LAM = 1e-3


def value_and_grad(fn, p, q):
    q = q.detach().requires_grad_(True)
    out = fn(p, q)
    (g,) = torch.autograd.grad(out.sum(), q)
    return out, g


def draw(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64),
            0.8 * torch.randn(*shape, generator=g, dtype=torch.float64) + 0.3)


@pytest.mark.parametrize("side", pure_torch.SIDES)
@pytest.mark.parametrize("shape", [(3, 12, 4), (40, 5), (300, 3)])  # batched; unbatched; above 256 rows
def test_sides_equal_the_reference_in_float64(side, shape):
    p, q = draw(shape, seed=len(shape) + shape[-1])
    want, want_g = value_and_grad(lambda a, b: reference.kernel_kl(a, b, LAM), p, q)
    got, got_g = value_and_grad(lambda a, b: pure_torch.kl(a, b, LAM, side=side), p, q)
    torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(got_g, want_g, rtol=1e-7, atol=1e-10)


@pytest.mark.parametrize("side, shape", [("strong", (3, 12, 4)), ("fast", (3, 12, 4)), ("strong", (300, 3))])
def test_compiled_sides_are_one_graph_equal_to_the_reference(side, shape):
    """A side whose graph breaks (host reads, out= into views, a global cache written in the trace) is
    slower than it need be under torch.compile, or fails to compile: the compiled baseline would not
    be the strongest. (300, 3): above 256 rows and above 2^17 pairs, where the eager sides read values
    back (strong's refinement, the sampled median)."""
    torch._dynamo.reset()
    p, q = draw(shape, seed=7)
    fn = lambda a, b: pure_torch.kl(a, b, LAM, side=side)  # noqa: E731
    want, want_g = value_and_grad(lambda a, b: reference.kernel_kl(a, b, LAM), p, q)
    got, got_g = value_and_grad(torch.compile(fn, dynamic=False, fullgraph=True), p, q)  # (a break raises)
    torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(got_g, want_g, rtol=1e-7, atol=1e-10)


def test_a_zero_median_raises_eagerly_and_gives_nan_compiled():
    """Compiled, a side reads nothing back to the host (as kivi_fast's CUDA ops): NaN for that element."""
    torch._dynamo.reset()
    p, q = draw((2, 10, 3), seed=3)
    p[1] = 0.0
    q[1] = 0.0  # every point of element 1 the same: median distance 0
    fn = lambda a, b: pure_torch.kl(a, b, LAM, side="strong")  # noqa: E731
    with pytest.raises(ValueError, match="median pairwise distance is 0"):
        fn(p, q)
    out = torch.compile(fn, dynamic=False)(p, q)
    assert torch.isnan(out[1]) and torch.isfinite(out[0])
    torch.testing.assert_close(out[0], reference.kernel_kl(p[0], q[0], LAM), rtol=1e-8, atol=1e-10)
