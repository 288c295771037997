"""The compiled ops (CPU and device-generic kernels) equal the pure-PyTorch reference.

Hypothesis draws shapes (n_p, n_q from 2 to a few hundred, d from 1 to thousands, batched or not),
lam, scales, dtypes and both settings of ``reverse``; values and gradients must agree.
"""

import contextlib
import hashlib
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from scipy.spatial.distance import cdist, pdist

import kivi_fast
from kivi_fast import reference

from conftest import implementation

# The reference materializes [N, N, d] differences: keep N^2 d moderate.
MAX_WORK = 4_000_000


@st.composite
def problems(draw):
    n_p = draw(st.integers(2, 300))
    n_q = draw(st.integers(2, 300))
    n = n_p + n_q
    d = min(draw(st.sampled_from([1, 2, 3, 8, 9, 17, 32, 33, 64, 300, 1000, 3000])), max(1, MAX_WORK // (n * n)))
    batch = draw(st.sampled_from([None, 1, 3]))
    if batch is not None:
        d = max(1, d // batch)
    return dict(
        n_p=n_p, n_q=n_q, d=d, batch=batch,
        lam=draw(st.floats(1e-4, 1e-1)),
        scale=draw(st.floats(0.1, 10.0)),
        shift=draw(st.floats(0.0, 3.0)),
        dtype=draw(st.sampled_from([torch.float32, torch.float64])),
        reverse=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


def make_samples(pr):
    g = torch.Generator().manual_seed(pr["seed"])
    lead = () if pr["batch"] is None else (pr["batch"],)
    p = torch.randn(*lead, pr["n_p"], pr["d"], generator=g, dtype=torch.float64) * pr["scale"]
    q = torch.randn(*lead, pr["n_q"], pr["d"], generator=g, dtype=torch.float64) * pr["scale"] * 0.8 + pr["shift"]
    return p.to(pr["dtype"]), q.to(pr["dtype"])


def value_and_grad(kl_fn, p, q, **kw):
    q = q.clone().requires_grad_(True)
    value = kl_fn(p, q, **kw)
    # Distinct weights per batch element check that each estimate gets its own gradient.
    weights = torch.arange(1, value.numel() + 1, dtype=value.dtype, device=value.device).reshape(value.shape)
    (value * weights).sum().backward()
    return value.detach(), q.grad


_REFERENCE_KL: dict = {}


def reference_value_and_grad(p, q, **kw):
    """value_and_grad(reference.kernel_kl, p, q, **kw), remembered by the inputs' bytes: the fixtures run
    each problem on two implementations (and some tests on two Gram paths), and the reference, which
    materializes [N, N, d] differences, takes most of this file's time."""
    if not all(v is None or isinstance(v, (bool, int, float, str)) for v in kw.values()):
        return value_and_grad(reference.kernel_kl, p, q, **kw)
    digest = hashlib.blake2b(digest_size=16)
    for x in (p, q):
        digest.update(repr((x.dtype, tuple(x.shape))).encode())
        digest.update(x.detach().contiguous().numpy().tobytes())
    key = (digest.digest(), tuple(sorted(kw.items())))
    if key not in _REFERENCE_KL:
        if len(_REFERENCE_KL) >= 256:
            _REFERENCE_KL.clear()
        _REFERENCE_KL[key] = value_and_grad(reference.kernel_kl, p, q, **kw)
    return tuple(t.clone() for t in _REFERENCE_KL[key])


def assert_close_rel(actual, expected, rtol):
    scale = expected.abs().max().clamp_min(1e-30)
    assert (actual - expected).abs().max() <= rtol * scale, (actual, expected)


def assert_kl_equals_reference(p, q, rtol):
    """Value and gradient of kivi_fast.kernel_kl against the reference, both settings of reverse."""
    for reverse in (True, False):
        ours = value_and_grad(kivi_fast.kernel_kl, p, q, reverse=reverse)
        ref = reference_value_and_grad(p, q, reverse=reverse)
        for a, b in zip(ours, ref):
            assert_close_rel(a, b, rtol)


@contextlib.contextmanager
def switched(flags, threads=None):
    """Sets the ops' test switches ({switch op: flag}; each returns its old value) and torch's thread
    count for the block, and restores them after."""
    old_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    old = {switch: switch(flag) for switch, flag in flags.items()}
    try:
        yield
    finally:
        torch.set_num_threads(old_threads)
        for switch, flag in old.items():
            switch(flag)


@st.composite
def few_point_problems(draw):
    """Up to 32 points in 33 to 5000 dimensions: the few-points kernels' regime (csrc/cpu/few_points.h)."""
    pr = draw(problems())
    pr.update(n_p=draw(st.integers(2, 16)), n_q=draw(st.integers(2, 16)), d=draw(st.integers(33, 5000)))
    return pr


@given(pr=st.one_of(problems(), few_point_problems()))
def test_kl_value_and_gradient_equal_reference(compiled, pr):
    p, q = make_samples(pr)
    kw = dict(lam=pr["lam"], reverse=pr["reverse"])
    ours_v, ours_g = value_and_grad(kivi_fast.kernel_kl, p, q, **kw)
    ref_v, ref_g = reference_value_and_grad(p, q, **kw)
    assert ours_v.dtype == p.dtype and ours_v.shape == ref_v.shape
    rtol = 1e-5 if pr["dtype"] == torch.float32 else 1e-8
    assert_close_rel(ours_v, ref_v, rtol)
    assert_close_rel(ours_g, ref_g, rtol if pr["dtype"] == torch.float32 else 1e-7)


@given(pr=st.one_of(problems(), few_point_problems()))
def test_density_ratio_equals_reference(compiled, pr):
    p, q = make_samples(pr)
    z = torch.cat([p, q], dim=-2)[..., ::2, :]
    ours = kivi_fast.DensityRatio(lam=pr["lam"]).fit(p, q)
    ref = reference.DensityRatio(lam=pr["lam"]).fit(p, q)
    torch.testing.assert_close(ours.sigma, ref.sigma, rtol=1e-12, atol=0)
    assert_close_rel(ours.alpha, ref.alpha, 1e-7)
    assert ours.beta == pytest.approx(ref.beta, rel=1e-14)
    z1 = z.clone().requires_grad_(True)
    z2 = z.clone().requires_grad_(True)
    r1, r2 = ours.log_ratio(z1, clip=1e-8), ref.log_ratio(z2, clip=1e-8)
    r1.sum().backward()
    r2.sum().backward()
    rtol = 1e-5 if pr["dtype"] == torch.float32 else 1e-7
    assert_close_rel(r1.detach(), r2.detach(), rtol)
    assert_close_rel(z1.grad, z2.grad, rtol)


@given(pr=problems())
def test_primitives_equal_reference(compiled, pr):
    p, q = make_samples(pr)
    torch.testing.assert_close(kivi_fast.median_bandwidth(p), reference.median_bandwidth(p), rtol=1e-6, atol=0)
    sigma = reference.median_bandwidth(q)
    torch.testing.assert_close(kivi_fast.rbf_gram(p, q, sigma), reference.rbf_gram(p, q, sigma),
                               rtol=1e-5, atol=1e-6 if pr["dtype"] == torch.float32 else 1e-12)


@pytest.mark.parametrize("bandwidth", [0.7, "tensor"])
def test_given_bandwidth_equals_reference(compiled, bandwidth):
    g = torch.Generator().manual_seed(0)
    p = torch.randn(3, 40, 5, generator=g, dtype=torch.float64)
    q = torch.randn(3, 30, 5, generator=g, dtype=torch.float64) + 0.3
    bw = torch.tensor([0.5, 1.0, 2.0]) if bandwidth == "tensor" else bandwidth
    ours = value_and_grad(kivi_fast.kernel_kl, p, q, bandwidth=bw)
    ref = reference_value_and_grad(p, q, bandwidth=bw)
    for a, b in zip(ours, ref):
        assert_close_rel(a, b, 1e-9)


def test_cpu_and_generic_kernels_agree():
    g = torch.Generator().manual_seed(1)
    p = torch.randn(4, 120, 50, generator=g)
    q = torch.randn(4, 90, 50, generator=g) * 0.5
    with implementation("cpu"):
        a = value_and_grad(kivi_fast.kernel_kl, p, q)
    with implementation("generic"):
        b = value_and_grad(kivi_fast.kernel_kl, p, q)
    for x, y in zip(a, b):
        assert_close_rel(x, y, 1e-6)


@pytest.mark.parametrize("n,d,ties", [(2, 3, False), (3, 1, False), (400, 3, False), (700, 2, True), (1200, 70, False)])
def test_median_bandwidth_equals_numpy(impl, n, d, ties):
    """Small and large pair counts (the CPU kernel selects among all pairs below 512 and in equal-width
    bins above, packing the pairs first below 2^20 on one thread; above 2^20, below), odd and even
    counts, and many tied distances."""
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    if ties:
        x = torch.round(x * 2) / 2  # a coarse grid: many equal distances
    expected = np.median(pdist(x.numpy()))
    assert kivi_fast.median_bandwidth(x).item() == pytest.approx(expected, rel=1e-12)


# Few points in many dimensions (an MNIST layer) take register-tiled kernels for AVX-512 or AVX2
# (csrc/cpu/few_points.h): up to 32 stacked points, up to 16 evaluation points in the backward, columns
# split over threads above 2 x 16384. The cases sit on both sides of each limit; hypothesis rarely
# draws them.
@pytest.mark.parametrize("n_p,n_q,d,batch,dtype,threads", [
    (10, 10, 33001, None, torch.float32, 2),  # the backward's columns over two threads, tail columns
    (10, 10, 50000, None, torch.float32, 2),  # the forward's Gram too (N^2 d past the split threshold)
    (16, 16, 33, None, torch.float64, 1),     # 32 points, the first dimension past the direct path
    (17, 16, 100, 3, torch.float32, 1),       # 33 points: the Gram's tiles (GEMMs without AVX2)
    (3, 16, 1001, 2, torch.float64, 2),       # 16 evaluation points in the backward
    (3, 17, 1001, 2, torch.float32, 1),       # 17: the backward in chunks of 15 and 2 (each element's
                                              # weights folded per chunk), the Gram's tiles
    (5, 6, 1023, 2, torch.float32, 1),        # 7 tail columns, 11 points (padded rows in the tiles)
    (16, 16, 1004, None, torch.float32, 1),   # 32 points over 15 blocks (more tiles than rows), 16
                                              # evaluation points (groups of 5, 5, 5 and 1), a 4-column step
    (7, 13, 780, 2, torch.float32, 1),        # 20 points, 13 evaluation points (5, 5, 3) and their
                                              # 4-column step, the Gram's 12 tail columns
    (2, 2, 300, None, torch.float64, 1),      # 4 points: one tile, three rows converted on their own
    (2, 3, 100, None, torch.float32, 1),      # 5 points (three padding rows in the last tile), one
                                              # block of the Gram (no next block to convert)
])
@pytest.mark.parametrize("avx512", [False, True])  # each version where the CPU has AVX-512 (the default: isa.h)
def test_few_points_kernels_equal_reference(compiled, n_p, n_q, d, batch, dtype, threads, avx512):
    if avx512 and not torch.ops.kivi_fast_testing.few_points_avx512_available():
        pytest.skip("the few-points kernels' AVX-512 version needs an AVX-512 CPU (this one runs the AVX2 one)")
    pr = dict(n_p=n_p, n_q=n_q, d=d, batch=batch, dtype=dtype, scale=1.0, shift=0.1, seed=n_p * d)
    p, q = make_samples(pr)
    with switched({torch.ops.kivi_fast_testing.set_few_points_avx512: avx512}, threads):
        assert_kl_equals_reference(p, q, 1e-5 if dtype == torch.float32 else 1e-8)
        z = (torch.cat([p, q], dim=-2)[..., 1::3, :] + 0.01).requires_grad_(True)  # points of neither set
        z_ref = z.detach().clone().requires_grad_(True)
        r = kivi_fast.DensityRatio().fit(p, q).log_ratio(z)
        r_ref = reference.DensityRatio().fit(p, q).log_ratio(z_ref)
        r.sum().backward()
        r_ref.sum().backward()
        assert_close_rel(r.detach(), r_ref.detach(), 1e-5 if dtype == torch.float32 else 1e-7)
        assert_close_rel(z.grad, z_ref.grad, 1e-5 if dtype == torch.float32 else 1e-7)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("d,dtype,n_numer", [(1, torch.float64, 21), (8, torch.float32, 21), (9, torch.float64, 21),
                                             (20, torch.float32, 21), (60, torch.float32, 21),
                                             (25000, torch.float32, 21), (1000, torch.float32, 1070)])
def test_the_cpu_ratio_kernel_equals_the_generic_composition(threads, d, dtype, n_numer):
    """csrc/cpu/ratio.cpp against the ATen composition it replaces on the CPU (still the other devices'
    path): rows of several batch elements split over the threads, d on both sides of the distance
    kernel's passes of 8 coordinates (and past the points' cache bound: distances from the Gram),
    float32 points, a bandwidth per element and one for all. Its grad state (csrc/kivi.h): the
    projection on the points summed row by row (d <= 8) or by a GEMM (9, 20, and 1000 over the Gram's
    distances), the weights where d + 1 >= N (60, 25000); without grad_state none, and the same r to
    the last bit."""
    assert kivi_fast.backend() == "cpp"  # the library loaded
    g = torch.Generator().manual_seed(d)
    b = 5 if d < 1000 else 2
    z, numer, denom = (torch.randn(b, n, d, generator=g, dtype=torch.float64).to(dtype) for n in (37, n_numer, 30))
    alpha = torch.randn(b, 30, generator=g, dtype=torch.float64)
    n = n_numer + 30
    width = d + 1 if d + 1 < n else n
    for sigma in (torch.linspace(0.5, 2.0, b, dtype=torch.float64) * d ** 0.5, torch.tensor([1.3 * d ** 0.5])):
        old = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            r, w = torch.ops.kivi_fast.ratio(z, numer, denom, alpha, 0.7, sigma)
            r_value, w_none = torch.ops.kivi_fast.ratio(z, numer, denom, alpha, 0.7, sigma, False)
        finally:
            torch.set_num_threads(old)
        with implementation("generic"):
            r_g, w_g = torch.ops.kivi_fast.ratio(z, numer, denom, alpha, 0.7, sigma)
        assert r.dtype == dtype and w.dtype == torch.float64 and w.shape == (b, 37, width)
        assert_close_rel(r, r_g, 1e-12 if dtype == torch.float64 else 1e-6)
        assert_close_rel(w, w_g, 1e-12 if d * n < 10 ** 6 else 1e-9)  # (the Gram's distances: its rounding)
        assert w_none.shape == (b, 37, 0) and torch.equal(r_value, r)


@pytest.mark.parametrize("d", [3, 25000], ids=["differences", "gram"])
def test_the_ratio_op_refuses_bad_arguments_and_values(d):
    """A direct call of the ratio op (DensityRatio's arguments are checked before): a bandwidth that is
    not positive or of the wrong size, coefficients of the wrong shape (an error, never a read past the
    end of a buffer), and on the CPU samples with NaN, Inf or too far apart to square, named."""
    assert kivi_fast.backend() == "cpp"
    z = torch.randn(2, 5, d, dtype=torch.float64)
    alpha, sigma = torch.ones(2, 4, dtype=torch.float64), torch.ones(2, dtype=torch.float64)
    with pytest.raises(ValueError, match="sigma must be finite and at least 1e-150 .* for batch element 1"):
        torch.ops.kivi_fast.ratio(z, z, z[:, :4], alpha, 0.5, torch.tensor([1.0, -1.0], dtype=torch.float64))
    with pytest.raises(ValueError, match="sigma must hold one bandwidth per batch element"):
        torch.ops.kivi_fast.ratio(z, z, z[:, :4], alpha, 0.5, torch.ones(3, dtype=torch.float64))
    for bad_alpha in (torch.ones(1, 4, dtype=torch.float64), torch.ones(2, 3, dtype=torch.float64)):
        with pytest.raises(ValueError, match=r"alpha must have shape \[B, n_denom\]"):
            torch.ops.kivi_fast.ratio(z, z, z[:, :4], bad_alpha, 0.5, sigma)
    for value in (float("nan"), float("inf"), 1e200):
        bad = z.clone()
        bad[1, 2, 0] = value
        with pytest.raises(ValueError, match="contains NaN or Inf"):
            torch.ops.kivi_fast.ratio(bad, z, z[:, :4], alpha, 0.5, sigma)
        with pytest.raises(ValueError, match="contains NaN or Inf"):
            kivi_fast.DensityRatio().fit(z[0], z[1]).log_ratio(bad[1])


# The ratio's gradient at many evaluation points of their own (per-row scales, unlike the kl op's one
# scale per element; z's term kept apart from the folded weights, csrc/cpu/grad.cpp, tiled_weighted_grad):
# above kMaxOutRows points the backward's tiles run in chunks of 15 rows, over column blocks (1408
# columns for 45 float32 rows), over two threads' columns (3000 >= 2 blocks) and over a batch. With few
# dimensions (d + 1 < N) from the projection state: summed row by row (d = 5), by a GEMM (d = 20).
@pytest.mark.parametrize("n_p,n_q,n_z,d,batch,threads", [
    (30, 35, 40, 300, None, 1), (20, 25, 33, 3000, None, 2), (6, 7, 20, 500, None, 1), (6, 7, 20, 500, 3, 2),
    (30, 35, 40, 5, None, 1), (30, 35, 40, 20, 3, 2)])
@pytest.mark.parametrize("tiles", [True, False])
def test_ratio_gradient_at_many_points_equals_reference(compiled, n_p, n_q, n_z, d, batch, threads, tiles):
    pr = dict(n_p=n_p, n_q=n_q, d=d, batch=batch, dtype=torch.float32, scale=1.0, shift=0.3, seed=n_z * d)
    p, q = make_samples(pr)
    g = torch.Generator().manual_seed(n_z)
    lead = () if batch is None else (batch,)
    z = (0.5 * torch.randn(*lead, n_z, d, generator=g) + 0.15).requires_grad_(True)
    z_ref = z.detach().clone().requires_grad_(True)
    with switched({torch.ops.kivi_fast_testing.set_gram_tiles: tiles}, threads):
        r = kivi_fast.DensityRatio().fit(p, q).log_ratio(z)
        r_ref = reference.DensityRatio().fit(p, q).log_ratio(z_ref)
        (r * torch.linspace(0.5, 2.0, n_z)).sum().backward()
        (r_ref * torch.linspace(0.5, 2.0, n_z)).sum().backward()
    assert_close_rel(r.detach(), r_ref.detach(), 1e-5)
    assert_close_rel(z.grad, z_ref.grad, 1e-5)


# More than 32 points take the distances from a Gram above 8 dimensions on AVX2 CPUs, by 4 x 8 register
# tiles over panels of 8 packed rows (csrc/cpu/gram_tiles.h), and above 32 dimensions elsewhere, by BLAS
# GEMMs of the split triangle (below: coordinate differences). The cases sit on the tiles' edges
# (points past a multiple of 4 or 8, columns past a multiple of 4), on both loop orders (256 points)
# and on each way of sharing the work between threads (an element is split from N^2 max(d, 8) >= 2^21).
# Hypothesis draws up to MAX_WORK, past that threshold too, but seldom on these edges. The gradient's projection
# (d + 1 < N above 8 dimensions) runs on the same tiles (the first five cases: rows past a multiple of 4,
# columns past or on a multiple of 8), above 256 points in chunks of 1024 points (281, 601, 1050 and
# 1100 points: one chunk, two with 26 and 76 points in the second; rows split over two threads at 601
# and 1100), and on a GEMM without tiles.
@pytest.mark.parametrize("n_p,n_q,d,batch,dtype,threads", [
    (16, 17, 9, None, torch.float64, 1),      # 33 points (edge tiles), 9 dimensions (tiles; differences without)
    (20, 23, 16, None, torch.float64, 1),     # 43 points, columns a multiple of 8 (the projection's full panels)
    (30, 3, 9, None, torch.float32, 1),       # 3 evaluation points: the projection's one row tile, all clamped
    (20, 21, 35, 2, torch.float32, 1),        # 41 points, 3 tail columns
    (100, 100, 51, None, torch.float32, 1),   # a UCI layer: one column block
    (150, 131, 40, None, torch.float32, 1),   # 281 points: row tiles first (past 256 points)
    (37, 40, 2101, None, torch.float32, 1),   # three column blocks: the later ones accumulate
    (65, 65, 1003, None, torch.float64, 2),   # two blocks over two threads: partial sums, 3 tail columns
    (100, 100, 700, None, torch.float32, 2),  # 3 blocks of 327 columns become 4 of 176 (the last 172)
                                              # for 2 threads
    (128, 128, 256, None, torch.float64, 2),  # one block whose tiles two threads share, panels first
    (550, 550, 16, None, torch.float64, 2),   # the same, row tiles first
    (520, 530, 21, None, torch.float32, 1),   # the projection's second chunk of 26 points accumulates
                                              # onto edge tiles (530 rows, 21 columns)
    (300, 301, 21, None, torch.float32, 2),   # the projection's kernel rows split over two threads
                                              # (edge panels of 5 columns)
    (40, 10, 60, None, torch.float32, 1),     # the backward's tiles over 50 rows, 10 evaluation points
                                              # in one pass, a 4-column step
])
@pytest.mark.parametrize("tiles", [True, False])  # False: the GEMMs, as most AVX-512 CPUs (isa.h)
def test_gram_paths_equal_reference(compiled, n_p, n_q, d, batch, dtype, threads, tiles):
    if tiles and not torch.ops.kivi_fast_testing.gram_tiles_available():
        pytest.skip("the Gram's register tiles need an AVX2 + FMA CPU")
    pr = dict(n_p=n_p, n_q=n_q, d=d, batch=batch, dtype=dtype, scale=1.0, shift=0.3, seed=n_p * d)
    p, q = make_samples(pr)
    with switched({torch.ops.kivi_fast_testing.set_gram_tiles: tiles}, threads):
        assert_kl_equals_reference(p, q, 1e-5 if dtype == torch.float32 else 1e-8)
        torch.testing.assert_close(kivi_fast.median_bandwidth(p), reference.median_bandwidth(p), rtol=1e-10, atol=0)


# Each distance path, far from the origin: a Gram's g_ii + g_jj - 2 g_ij keeps only the difference of
# the points' norms, which the kernels keep near the distances by centring the points (kivi.h,
# centre_coordinate; uncentred, at 1e6 standard deviations kernel_kl at (50, 64) moved by ~1e-2 of its
# value). The reference sums coordinate differences. The gradient's projection, sum_c w_jc (c - z_j), still loses
# digits in proportion to the offset (~6e-8 of its size at 1e6 standard deviations). Only the float64
# cases would fail uncentred (by ~1e-3); the float32 ones, 1e3 standard deviations out (where float32
# still resolves the spread), check the float32 conversions' centring against the same bound.
FAR_PATHS = {  # path: (n_p = n_q, d, threads, test switches)
    "tiles": (50, 64, 1, {"set_gram_tiles": True}),
    "tiles, two blocks over two threads": (40, 1003, 2, {"set_gram_tiles": True}),
    "split GEMMs": (50, 64, 1, {"set_gram_tiles": False}),
    "few points, AVX2": (10, 300, 1, {"set_few_points_avx512": False}),
    "few points, AVX-512": (10, 300, 1, {"set_few_points_avx512": True}),  # (AVX2 without it)
    # column chunks over two threads (from 2 x 16384 columns); the ratio op's evaluation from its
    # Gram (above 8 MB of points: 29 points in 60000 dimensions)
    "few points over two threads, the ratio op's Gram": (10, 60000, 2, {}),
    "differences": (50, 4, 1, {}),
    "generic": (50, 64, 1, {}),
    "generic, a Gram in chunks of columns": (10, 30000, 1, {}),  # (26214 columns a chunk at 20 points)
}


@contextlib.contextmanager
def on_far_path(path):
    """Runs the block on FAR_PATHS[path] (its implementation, test switches and threads), skipping where
    this CPU lacks it; yields its (n, d)."""
    n, d, threads, flags = FAR_PATHS[path]
    kivi_fast.backend()  # (loads the ops and their test switches)
    if flags.get("set_gram_tiles") and not torch.ops.kivi_fast_testing.gram_tiles_available():
        pytest.skip("the Gram's register tiles need an AVX2 + FMA CPU")
    if flags.get("set_few_points_avx512") and not torch.ops.kivi_fast_testing.few_points_avx512_available():
        pytest.skip("the few-points kernels' AVX-512 version needs an AVX-512 CPU (this one runs the AVX2 one)")
    switches = {getattr(torch.ops.kivi_fast_testing, name): flag for name, flag in flags.items()}
    with implementation(path.split(",")[0] if path.startswith("generic") else "cpu"), switched(switches, threads):
        yield n, d


@pytest.mark.parametrize("path", FAR_PATHS)
@pytest.mark.parametrize("dtype,offset", [(torch.float64, 1e6), (torch.float32, 1e3)])
def test_samples_far_from_the_origin_equal_reference(path, dtype, offset):
    with on_far_path(path) as (n, d):
        g = torch.Generator().manual_seed(d)
        shift = offset * (torch.rand(d, generator=g, dtype=torch.float64) - 0.5).sign()
        p = (torch.randn(n, d, generator=g, dtype=torch.float64) + shift).to(dtype)
        q = (torch.randn(n, d, generator=g, dtype=torch.float64) * 0.8 + 0.3 + shift).to(dtype)
        p64, q64 = p.double(), q.double()  # the same values: the reference's are exact differences
        tol = 1e-9 if dtype == torch.float64 else 1e-6  # (float32 results: rounded once)
        for reverse in (True, False):
            value, grad = value_and_grad(kivi_fast.kernel_kl, p, q, reverse=reverse)
            ref_value, ref_grad = reference_value_and_grad(p64, q64, reverse=reverse)
            assert_close_rel(value.double(), ref_value, tol)
            assert_close_rel(grad.double(), ref_grad, 1e-6 if dtype == torch.float64 else 1e-5)
        assert_close_rel(kivi_fast.median_bandwidth(p).double(), reference.median_bandwidth(p64), tol)
        ratio = kivi_fast.DensityRatio().fit(q, p).ratio(q[:9])
        assert_close_rel(ratio.double(), reference.DensityRatio().fit(q64, p64).ratio(q64[:9]), tol)


@pytest.mark.parametrize("path", FAR_PATHS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_an_outlying_first_sample_keeps_the_gradient_accurate(path, dtype):
    """One sample 1e5 standard deviations from the others, the first of the stacked points (kernel_kl's
    denominator: q_z with reverse, prior_z without; DensityRatio's denom; the ratio op's first
    evaluation point), on each distance path. The Gram paths centre the points on a middle of three
    of them (kivi.h, centre_coordinate); centred on the first point, as they were, the gradient was off
    by 1.4e-3 of its size at (100, 64) (all but the differences' path). The reference sums exact
    differences of the same values."""
    tol = 1e-9 if dtype == torch.float64 else 1e-6
    with on_far_path(path) as (n, d):
        g = torch.Generator().manual_seed(d + 1)
        for reverse in (True, False):
            p = torch.randn(n, d, generator=g, dtype=torch.float64)
            q = torch.randn(n, d, generator=g, dtype=torch.float64) * 1.1 + 0.4
            (q if reverse else p)[0] += 1e5
            p, q = p.to(dtype), q.to(dtype)
            value, grad = value_and_grad(kivi_fast.kernel_kl, p, q, reverse=reverse)
            ref_value, ref_grad = reference_value_and_grad(p.double(), q.double(), reverse=reverse)
            assert_close_rel(value.double(), ref_value, tol)
            assert_close_rel(grad.double(), ref_grad, 1e-6 if dtype == torch.float64 else 1e-5)
        # p: its first sample far out
        assert_close_rel(kivi_fast.median_bandwidth(p).double(), reference.median_bandwidth(p.double()), tol)
        ratio = kivi_fast.DensityRatio().fit(q, p).ratio(p[:9])
        expected = reference.DensityRatio().fit(q.double(), p.double()).ratio(p[:9].double())
        assert_close_rel(ratio.double(), expected, tol)


@pytest.mark.parametrize("path", FAR_PATHS)
def test_a_bad_value_in_a_centre_row_names_its_own_argument(path):
    """The centre's rows (stacked 0, N / 2 and N - 1: q_z[0], prior_z[0] and prior_z's last under
    kernel_kl's reverse) pass a NaN or Inf over, so that only the bad rows' norms are non-finite and
    the error names their argument (two Infs of three, taken as numbers, would make the centre Inf and
    every norm non-finite, q_z's first); with all three bad in one coordinate the centre is NaN there,
    and every row's norm with it, so the first row's argument (q_z's, which is bad) is named. (Centred
    on the first row, as the Gram paths were, these pass too: this guards the passing over.)"""
    with on_far_path(path) as (n, d):
        g = torch.Generator().manual_seed(5)
        p = torch.randn(n, d, generator=g, dtype=torch.float64)
        q = torch.randn(n, d, generator=g, dtype=torch.float64)
        cases = [  # (rows of q, rows of p) that get the bad value in column d - 1, the argument named
            ([0], [], "q_z"), ([], [0], "prior_z"), ([], [n - 1], "prior_z"), ([], [0, n - 1], "prior_z"),
            ([0], [0, n - 1], "q_z"),
        ]
        for bad in (float("nan"), float("inf")):
            for q_rows, p_rows, name in cases:
                pb, qb = p.clone(), q.clone()
                qb[q_rows, d - 1] = bad
                pb[p_rows, d - 1] = bad
                with pytest.raises(ValueError, match=f"^{name} contains NaN or Inf"):
                    kivi_fast.kernel_kl(pb, qb)


@pytest.mark.parametrize("path", ["tiles", "split GEMMs", "generic"])
def test_the_centre_passes_over_two_far_points_of_its_three(path):
    """The Gram paths' centre takes each coordinate's middle of stacked points 0, N / 2 and N - 1
    (kivi.h, centre_coordinate): with two of them far out in opposite directions it is the third's
    coordinate, and with the third far out in other coordinates, the others' there. The stacked points
    [x; y] (60: points 0 and 30 of x, 19 of y): sqdist's distances between x and y (on the CPU, one GEMM
    of the centred points a column block) and the median of all pairs (the fit's triangle, by the path
    named) against the reference's exact differences; centred on any of the three, the distances between
    near points would lose ~1e-7 of their size."""
    kivi_fast.backend()
    if path == "tiles" and not torch.ops.kivi_fast_testing.gram_tiles_available():
        pytest.skip("the Gram's register tiles need an AVX2 + FMA CPU")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 40, 40, generator=g, dtype=torch.float64)
    y = torch.randn(1, 20, 40, generator=g, dtype=torch.float64)
    x[0, 0, :20] += 1e5
    x[0, 30, :20] -= 1e5
    y[0, 19, 20:] += 1e5
    switches = {} if path == "generic" else {torch.ops.kivi_fast_testing.set_gram_tiles: path == "tiles"}
    with implementation("generic" if path == "generic" else "cpu"), switched(switches):
        sq = torch.ops.kivi_fast.sqdist(x, y)
        sigma = kivi_fast.median_bandwidth(torch.cat([x, y], 1))
    torch.testing.assert_close(sq, (x.unsqueeze(-2) - y.unsqueeze(-3)).pow(2).sum(-1), rtol=1e-12, atol=0)
    torch.testing.assert_close(sigma, reference.median_bandwidth(torch.cat([x, y], 1)), rtol=1e-12, atol=0)


@pytest.mark.parametrize("nx,ny,d,batch", [
    (300, 4, 3, 2),      # differences (few dimensions), many x against few y
    (3, 500, 8, 1),      # few x against many y
    (1, 1, 1, 3),
    (600, 7, 3, 1),      # differences, the x rows split over threads
    (10, 20, 3000, 2),   # few points (the few-points Gram of the stacked points, where the CPU has it)
    (70, 45, 40, 1),     # the Gram of the centred points, one column block
    (40, 260, 3000, 2),  # several column blocks
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cross_distances_equal_numpy_differences_far_from_the_origin(compiled, nx, ny, d, batch, dtype):
    """sqdist and rbf_gram compute the nx x ny distances between the two sets, not the triangle of their
    stacked points (csrc/cpu/distances.cpp, cross_distances_one; up to 32 points, where the few-points
    Gram reads the rows once, the triangle): against numpy's differences in float64, 1e4 standard
    deviations from the origin, to the centred Gram's rounding."""
    g = torch.Generator().manual_seed(nx + ny + d)
    x = (torch.randn(batch, nx, d, generator=g, dtype=torch.float64) + 1e4).to(dtype)
    y = (0.8 * torch.randn(batch, ny, d, generator=g, dtype=torch.float64) + 1e4 + 0.3).to(dtype)
    exact = np.stack([cdist(a, b, "sqeuclidean") for a, b in zip(x.double().numpy(), y.double().numpy())])
    sq = torch.ops.kivi_fast.sqdist(x, y)
    assert sq.shape == (batch, nx, ny) and sq.dtype == torch.float64
    np.testing.assert_allclose(sq.numpy(), exact, rtol=1e-9, atol=1e-9 * exact.max())
    np.testing.assert_allclose(kivi_fast.rbf_gram(x.double(), y.double(), 2.0).numpy(), np.exp(-exact / 8),
                               rtol=1e-9, atol=1e-12)


def test_cross_distances_of_many_points_against_few_take_no_square_of_their_count():
    """rbf_gram of 30,000 points against 3 allocates for their 90,000 distances, not for the 900 M of
    the stacked points' square (7.2 GB), which raised the process's peak memory by that much (measured
    in a process of its own). The ratio op's Gram path (many dimensions) takes these distances too."""
    code = ("import resource, torch, kivi_fast; kivi_fast.backend();"
            "x = torch.randn(1, 30000, 2, dtype=torch.float64); y = torch.randn(1, 3, 2, dtype=torch.float64);"
            "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss;"
            "k = torch.ops.kivi_fast.rbf_gram(x, y, torch.tensor(1.0, dtype=torch.float64));"
            "print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)")
    grown_mb = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert grown_mb < 200, grown_mb


def test_generic_gram_in_chunks_of_columns_far_from_the_origin_equals_numpy():
    """The generic path's Gram of many dimensions, summed over chunks of columns (generic.cpp's
    StackedDistances), centred too: the median 1e6 standard deviations out, against numpy's
    differences."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 2000, generator=g, dtype=torch.float64) + 1e6
    expected = np.median(pdist(x.numpy()))
    with implementation("generic"):
        assert kivi_fast.median_bandwidth(x).item() == pytest.approx(expected, rel=1e-10)


@pytest.mark.parametrize("n_p,n_q,d,batch,threads", [
    (290, 301, 13, None, 1),  # a tail row tile of one row, an edge panel of 5 columns
    (290, 301, 13, None, 2),  # the rows split over two threads; the exponentials too
    (500, 560, 12, None, 1),  # reverse=False: rows past 1024, whose lower parts span a whole chunk
    (270, 263, 9, 2, 2),      # a batch over the threads; 9 dimensions: the tiles' smallest
])
def test_projection_reading_the_upper_part_equals_reference(compiled, n_p, n_q, d, batch, threads):
    """Above 256 points the projection's row tiles read the kernel's lower part down the columns of its
    upper part (only the three entries left of the diagonal are mirrored): the value and the gradient
    against the oracle, and the value without the gradient state the same bits as with it."""
    if not torch.ops.kivi_fast_testing.gram_tiles_available():
        pytest.skip("the projection's register tiles need an AVX2 + FMA CPU")
    pr = dict(n_p=n_p, n_q=n_q, d=d, batch=batch, dtype=torch.float64, scale=1.0, shift=0.3, seed=n_q + d)
    p, q = make_samples(pr)
    # Leave a whole kernel of values near 1 in the per-thread buffers first (mirrored, tiles off): a
    # read of a lower part that the call below did not write would then be far off.
    with switched({torch.ops.kivi_fast_testing.set_gram_tiles: False}, threads):
        for reverse in (True, False):
            value_and_grad(kivi_fast.kernel_kl, p, q, reverse=reverse, bandwidth=1e6)
    with switched({torch.ops.kivi_fast_testing.set_gram_tiles: True}, threads):
        assert_kl_equals_reference(p, q, 1e-8)
        for reverse in (True, False):
            with_state, _ = value_and_grad(kivi_fast.kernel_kl, p, q, reverse=reverse)
            assert torch.equal(kivi_fast.kernel_kl(p, q, reverse=reverse), with_state)


@pytest.mark.parametrize("n_den", [2, 3, 4, 5, 7, 8, 9, 12, 15, 16, 17, 31, 33, 100, 255, 256])
def test_own_cholesky_at_block_edges_equals_reference(compiled, n_den):
    """Our Cholesky (systems up to 256 rows) works in panels of 8 rows and 4 x 8 register blocks over
    padded rows: sizes on and around those multiples, and the largest it takes, against the oracle.
    The reverse ratio trick fits prior_z / q_z: the system is n_q x n_q."""
    pr = dict(n_p=40, n_q=n_den, d=3, batch=None, dtype=torch.float64, scale=1.0, shift=0.2, seed=n_den)
    p, q = make_samples(pr)
    ours = value_and_grad(kivi_fast.kernel_kl, p, q, reverse=True)
    ref = reference_value_and_grad(p, q, reverse=True)
    for a, b in zip(ours, ref):
        assert_close_rel(a, b, 1e-8)


@pytest.mark.parametrize("external_blas", [True, False])  # False: the ATen calls of torch builds without them
@pytest.mark.parametrize("n_p,n_q,d", [
    (80, 90, 51),   # the Gram by GEMMs of the split upper triangle, the projection by one GEMM
    (80, 90, 400),  # two column blocks: the second accumulates into the Gram (beta = 1)
    (20, 300, 3),   # a 300-row system: LAPACK's float32 Cholesky refined in float64 (ours stops at 256 rows)
])
def test_blas_and_lapack_paths_equal_reference(compiled, n_p, n_q, d, external_blas):
    pr = dict(n_p=n_p, n_q=n_q, d=d, batch=None, dtype=torch.float64, scale=1.0, shift=0.2, seed=d)
    p, q = make_samples(pr)
    # the Gram by GEMMs (tiles off), as on the AVX-512 CPUs that keep them (isa.h)
    with switched({torch.ops.kivi_fast_testing.set_external_blas: external_blas,
                   torch.ops.kivi_fast_testing.set_gram_tiles: False}):
        assert_kl_equals_reference(p, q, 1e-8)


def refined_solves(fn):
    """fn()'s solves of systems above 256 rows by the CPU kernels: [converged, float32 could not
    factor, stalled (the last two fall back to a float64 Cholesky), float32 solves made]."""
    before = torch.ops.kivi_fast_testing.refined_solve_counts()
    result = fn()
    return [b - a for a, b in zip(before, torch.ops.kivi_fast_testing.refined_solve_counts())], result


@pytest.mark.parametrize("threads", [1, 2])  # 2: N^2 d is large enough to split the element over threads
@pytest.mark.parametrize("lam", [1e-2, 1e-6])
@pytest.mark.parametrize("n_p", [301, 302])  # with n_q = 283: the residual's 4-row blocks + 1, 2, 3 rows
def test_float32_factor_refined_in_float64_equals_reference(lam, threads, n_p):
    """Systems above 256 rows are factored by LAPACK in float32 and refined in float64 (solve_refined in
    csrc/cpu/solve.cpp) to float64's backward error: the answer is float64's, at lam = 1e-6 too, where the
    system's condition number (up to 1e6) makes each refinement step gain fewer digits and leaves
    float64 itself fewer: there ours and the reference differ by 1e-8 in the gradient at reverse=True,
    and so do the reference and our float64 Cholesky path (3e-9; _set_external_blas(False))."""
    pr = dict(n_p=n_p, n_q=283, d=64, batch=None, dtype=torch.float64, scale=1.0, shift=0.3, seed=3)
    p, q = make_samples(pr)
    with implementation("cpu"), switched({}, threads):
        for reverse in (True, False):  # a 283-row system, then an n_p-row one
            counts, ours = refined_solves(lambda: value_and_grad(kivi_fast.kernel_kl, p, q, lam=lam, reverse=reverse))
            assert counts[:3] == [1, 0, 0] and 2 <= counts[3] <= 5  # 3-4 solves here
            ref = reference_value_and_grad(p, q, lam=lam, reverse=reverse)
            for a, b in zip(ours, ref):
                assert_close_rel(a, b, 1e-8 if lam == 1e-2 else 1e-7)


@pytest.mark.parametrize("lam,outcomes", [
    (1e-7, [[1, 0, 0]]),             # converges, ~10 steps
    # float32 factors it here, but the first refinement step cannot halve the residual; at a condition
    # number above 1 / eps(float32), whether float32 factors it at all depends on the BLAS's summation order
    (2e-8, [[0, 0, 1], [0, 1, 0]]),
    (1e-8, [[0, 1, 0], [0, 0, 1]]),  # float32 cannot factor it here (MKL, AVX2); another BLAS might, then stall
])
def test_system_float32_cannot_solve_is_solved_in_float64(lam, outcomes):
    """Nearly coincident prior samples make K_pp / n_p + lam I ill-conditioned: ~6e6 at lam = 1e-7
    (float32 factors it, and the refinement gains about a digit a step), ~3e7 at 2e-8 (a float32
    step makes the error larger), ~6e7 at 1e-8. In the last two the float64 Cholesky takes over, at
    once: a stalled refinement stops at its first step that does not halve the residual. Each time,
    the reference's answer, within what a condition number of 6e7 leaves of float64's 1e-16 (two
    float64 Cholesky paths, LAPACK's and ATen's, differ by 5e-6 in the gradient here; returning the
    stalled iterate instead is off by 3x). CPU kernels only: the device-generic path takes
    distances from a GEMM, whose cancellation (squared norms ~1, squared distances ~1e-8) this
    condition number amplifies to ~1e-5."""
    g = torch.Generator().manual_seed(11)
    base = torch.randn(1, 3, generator=g, dtype=torch.float64)
    p = base + 1e-4 * torch.randn(300, 3, generator=g, dtype=torch.float64)
    q = base + 1e-4 * (0.8 * torch.randn(40, 3, generator=g, dtype=torch.float64) + 0.3)
    with implementation("cpu"):  # reverse=False: the system is n_p x n_p
        counts, ours = refined_solves(lambda: value_and_grad(kivi_fast.kernel_kl, p, q, lam=lam, reverse=False))
    assert counts[:3] in outcomes
    if counts[2] == 1:
        assert counts[3] <= 3  # without the halving test, dsposv's 31 solves
    ref = reference_value_and_grad(p, q, lam=lam, reverse=False)
    for a, b in zip(ours, ref):
        assert_close_rel(a, b, 1e-5)


@pytest.mark.parametrize("n_p,expected", [(256, [0, 0, 0, 0]), (257, [1, 0, 0, 0])])
def test_float32_path_from_257_rows_and_a_zero_right_hand_side(n_p, expected):
    """Our float64 Cholesky up to 256 rows, the float32 factor from 257. The prior samples sit 1e3
    bandwidths from q_z: every kernel value between the two underflows, the right-hand side of the
    fit is 0, and the refined solve returns x = 0 without a solve."""
    g = torch.Generator().manual_seed(n_p)
    p = torch.randn(n_p, 2, generator=g, dtype=torch.float64)
    q = torch.randn(30, 2, generator=g, dtype=torch.float64) + 1e3
    kw = dict(lam=1e-3, bandwidth=1.0, reverse=False)  # the system is n_p x n_p
    with implementation("cpu"):
        counts, ours = refined_solves(lambda: value_and_grad(kivi_fast.kernel_kl, p, q, **kw))
    assert counts == expected
    ref = reference_value_and_grad(p, q, **kw)
    for a, b in zip(ours, ref):
        assert_close_rel(a, b, 1e-12)


@pytest.mark.parametrize("reverse", [True, False])
def test_kernel_values_across_the_range_of_exp(compiled, reverse):
    """Points on a line with a fixed bandwidth put -||x - y||^2 / (2 sigma^2) anywhere from 0 down to
    -2000: the kernel values (the C++ path has its own exp, 0 below exp(-708)) still give the
    reference's value and gradient."""
    t = torch.linspace(0.0, 1.0, 40, dtype=torch.float64).unsqueeze(1)
    p, q = t * 60.0, t * 60.0 + 0.37
    kw = dict(lam=0.1, bandwidth=1.0, reverse=reverse)
    ours_v, ours_g = value_and_grad(kivi_fast.kernel_kl, p, q, **kw)
    ref_v, ref_g = reference_value_and_grad(p, q, **kw)
    assert_close_rel(ours_v, ref_v, 1e-12)
    assert_close_rel(ours_g, ref_g, 1e-11)


# projection by rows (the ratio as one more column of their pass: 8 + 1 columns, and 62 points, a tail
# past the vectors of 4; 32 elements, as a last-bit difference in one r_j may not reach the mean of
# log r), by register tiles (by GEMM without AVX2), the same in chunks of 1024 points
# (the second one 178 wide), with its rows split over 2 threads; weights kept
@pytest.mark.parametrize("batch,n,d", [(2, 30, 3), (32, 31, 8), (2, 30, 40), (1, 601, 20), (2, 5, 60)])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_value_without_a_gradient_is_the_same(compiled, batch, n, d, reverse, threads):
    """Without grad the op skips the backward's state: the value must not change, to the last bit
    (where the projection's tiles sum the ratio at q_z along with it, they sum it without the state
    too)."""
    g = torch.Generator().manual_seed(n + d)
    p = torch.randn(batch, n, d, generator=g, dtype=torch.float64)
    q = torch.randn(batch, n, d, generator=g, dtype=torch.float64) * 0.8 + 0.3
    with switched({}, threads):
        with torch.no_grad():
            plain = kivi_fast.kernel_kl(p, q, reverse=reverse)
        with_grad = kivi_fast.kernel_kl(p, q.clone().requires_grad_(True), reverse=reverse)
    assert torch.equal(plain, with_grad.detach())
    torch.testing.assert_close(plain, reference.kernel_kl(p, q, reverse=reverse), rtol=1e-8, atol=0)


def clipped_samples(d, batched, dtype):
    """Posterior samples wider than and shifted from the prior's: at lam = 1e-3 the fitted ratio is <=
    clip at some of q_z's points, both ways round ((60, 50, 4): reverse 24-32% of them, forward 6-10%;
    (60, 50, 40): 6-10% and 0-4%), and no ratio within 1e-6 of clip for rounding to move across."""
    g = torch.Generator().manual_seed(7)
    p = torch.randn(3, 60, d, generator=g, dtype=torch.float64)
    q = torch.randn(3, 50, d, generator=g, dtype=torch.float64) * 1.5 + (1.0 if d < 10 else 0.5) / d ** 0.5
    if not batched:
        p, q = p[0], q[0]
    return p.to(dtype), q.to(dtype)


@pytest.mark.parametrize("d", [4, 40])  # the ratio from the row dots; from the tiles (AVX2) or a GEMM
@pytest.mark.parametrize("batched", [True, False])
@pytest.mark.parametrize("reverse", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_kl_clipped_fraction_equals_a_count_on_the_reference(compiled, d, batched, reverse, dtype):
    """The kl op's fourth output is the fraction of q_z's points whose fitted ratio is <= clip: the count
    on the reference's fit (of p/q at q_z with reverse, of q/p without), float64, [B] or [] like the
    estimate."""
    lam, clip = 1e-3, 1e-8
    p, q = clipped_samples(d, batched, dtype)
    fitted = reference.DensityRatio(lam).fit(p, q) if reverse else reference.DensityRatio(lam).fit(q, p)
    r = fitted.ratio(q)
    assert ((r - clip).abs() > 1e-6).all()
    expected = (r <= clip).double().mean(-1)
    assert 0 < expected.mean() < 1  # some points clipped, not all
    kl, _, _, clipped = torch.ops.kivi_fast.kl(p, q, lam, clip, None, reverse)
    assert clipped.dtype == torch.float64 and clipped.shape == kl.shape == expected.shape
    assert torch.equal(clipped, expected)


@pytest.mark.parametrize("reverse", [True, False])
def test_kl_clipped_fraction_with_and_without_a_gradient(compiled, reverse):
    """The fraction does not depend on whether the op keeps a grad state, on autograd (it gets no
    gradient, like the state and the bandwidth) or on a given bandwidth's path; kivi_fast.kernel_kl returns
    the estimate alone."""
    p, q = clipped_samples(4, True, torch.float64)
    qg = q.clone().requires_grad_(True)
    plain = torch.ops.kivi_fast.kl(p, q, 1e-3, 1e-8, None, reverse, False)
    with_grad = torch.ops.kivi_fast.kl(p, qg, 1e-3, 1e-8, None, reverse)
    assert with_grad[0].requires_grad and not with_grad[3].requires_grad
    assert torch.equal(plain[3], with_grad[3]) and (plain[3] > 0).all()
    given = torch.ops.kivi_fast.kl(p, q, 1e-3, 1e-8, plain[2], reverse, False)
    assert torch.equal(given[3], plain[3])
    torch.autograd.grad(with_grad[0].sum(), qg)  # the fraction's missing gradient is no obstacle
    value = kivi_fast.kernel_kl(p, qg, reverse=reverse)
    assert value.shape == (3,) and torch.equal(value.detach(), with_grad[0].detach())


def test_kl_grad_rejects_a_state_of_the_wrong_shape(compiled):
    p, q = torch.randn(1, 10, 3, dtype=torch.float64), torch.randn(1, 10, 3, dtype=torch.float64)
    _, state, _, _ = torch.ops.kivi_fast.kl(p, q, 1e-3, 1e-8, None, True, False)  # no state: width 0
    with pytest.raises(ValueError, match=r"state must be the float64 \[1, 10, 4\] grad state"):
        torch.ops.kivi_fast.kl_grad(torch.ones(1, dtype=torch.float64), state, q, p, True)


@pytest.mark.parametrize("reverse", [True, False])
def test_one_large_element_split_over_threads(compiled, reverse):
    """N^2 max(d, 8) >= 2^21 with one element and 2 threads: distances, median, kernel, evaluation and
    projection each split over the threads (smaller elements never are)."""
    pr = dict(n_p=750, n_q=750, d=3, batch=None, dtype=torch.float64, scale=1.0, shift=0.2, seed=7)
    p, q = make_samples(pr)
    with switched({}, threads=2):
        ours = value_and_grad(kivi_fast.kernel_kl, p, q, reverse=reverse)
    ref = reference_value_and_grad(p, q, reverse=reverse)
    assert_close_rel(ours[0], ref[0], 1e-8)
    assert_close_rel(ours[1], ref[1], 1e-7)


def assert_median_under_bracket_settings(x, expected, ties, min_held=None):
    """median_bandwidth(x) equals expected with the sampled brackets as shipped, with brackets too narrow
    to hold (0 standard deviations) and with none (no sample: the bins alone). Every bracket tried is
    counted, held or missed (median_counts): as shipped, at least one held per batch element and none
    missed (the outcome of this data and the kernel's fixed samples); at 0 standard deviations at least
    one tried per element (a miss hands that element to the bins; a small sample's bracket may still
    hold); with no sample, none. min_held: how many must hold as shipped (default one per element).
    Returns [held, missed] at 0 standard deviations."""
    ops = torch.ops.kivi_fast_testing
    shipped = ops.set_median_bracket(0, 0.0)
    ops.set_median_bracket(int(shipped[0]), shipped[1])
    elements = x.shape[0] if x.dim() == 3 else 1
    for size, sds in [(int(shipped[0]), shipped[1]), (int(shipped[0]), 0.0), (0, shipped[1])]:
        old = ops.set_median_bracket(size, sds)
        try:
            before = ops.median_counts()
            got = kivi_fast.median_bandwidth(x)
            after = ops.median_counts()
        finally:
            ops.set_median_bracket(int(old[0]), old[1])
        np.testing.assert_allclose(got.numpy(), expected, rtol=1e-12, err_msg=str((size, sds)))
        held, missed = (b - a for a, b in zip(before, after))
        if size == 0:
            assert (held, missed) == (0, 0), (size, sds)
        elif sds > 0:
            assert held >= (min_held or elements) and missed == 0, (size, sds, held, missed)
        else:
            assert held + missed >= elements, (size, sds, held, missed)
            narrow = [held, missed]
    return narrow


@pytest.mark.parametrize("n,ties", [(1449, False), (1451, False), (1500, True)])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("portable", [False, True])
def test_median_of_many_pairs_bracketed_by_a_sample_equals_numpy(n, ties, threads, portable):
    """Above 2^20 pairs the CPU kernel brackets the two middle ranks by a sample of the pairs and selects
    among the pairs inside the bracket (csrc/cpu/median.cpp, select_two_sampled), by more brackets of its own
    (select_two_of) while more than 4096 are inside; a bracket that misses a rank hands the call to the
    bins. Exact on every path: the brackets as shipped, too narrow to hold (0 standard deviations) and
    no sample (the bins alone). Even and odd pair counts (1449 and 1500 points; 1451), one or two
    threads, the counting pass in AVX2 (where the CPU has it) and in portable C++."""
    ops = torch.ops.kivi_fast_testing
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, 5, generator=g, dtype=torch.float64)
    if ties:
        x = torch.round(x * 2) / 2
    expected = np.median(pdist(x.numpy()))
    with implementation("cpu"), switched({ops.set_portable_gather: portable}, threads=threads):
        narrow = assert_median_under_bracket_settings(x, expected, ties)
    if not ties:  # 2 ranks each side of 32768 sampled pairs: the first bracket misses
        assert narrow == [0, 1]


@pytest.mark.parametrize("n,d,batch,ties,min_held", [
    (92, 5, None, False, 1),   # 4186 pairs, just past the sampled bracket's 4096: distances by
                               # differences, each row counted against the bracket as it is computed
                               # (direct_sqdist)
    (91, 5, None, False, 0),   # 4095 pairs: the bins alone, no bracket tried
    (200, 8, 8, False, 8),     # a VAE minibatch's elements (19900 pairs each); some of their narrow
                               # brackets miss
    (200, 20, None, False, 1), # distances from the Gram's tiles where they run (AVX2), then the
                               # bracket's pass over the finished triangle (select_two_sampled)
    (300, 1, None, True, 1),   # 1-d points on a grid: most distances tied, brackets that cannot shrink
    (1200, 3, None, False, 3), # 719400 pairs (split over threads: the pass over the finished
                               # triangle), then two more brackets among those inside the first
])
@pytest.mark.parametrize("portable", [False, True])
def test_median_of_fewer_pairs_bracketed_by_a_sample_equals_numpy(n, d, batch, ties, min_held, portable):
    """From 4096 to 2^20 pairs on one thread the bracket's sample is ~0.2 pairs^(2/3) (select_two_sampled,
    direct_sqdist, select_two_of): exact on every path, as above, per batch element."""
    ops = torch.ops.kivi_fast_testing
    g = torch.Generator().manual_seed(n * d)
    x = torch.randn(*(() if batch is None else (batch,)), n, d, generator=g, dtype=torch.float64)
    if ties:
        x = torch.round(x * 4) / 4
    expected = np.array([np.median(pdist(e.numpy())) for e in x.reshape(-1, n, d)])
    with implementation("cpu"), switched({ops.set_portable_gather: portable}, threads=1):
        if n * (n - 1) // 2 < 4096:
            before = ops.median_counts()
            np.testing.assert_allclose(kivi_fast.median_bandwidth(x).numpy(), expected, rtol=1e-12)
            assert ops.median_counts() == before
        else:
            narrow = assert_median_under_bracket_settings(x, expected if batch else expected[0], ties, min_held)
            if batch:
                assert narrow[1] >= 1, narrow


def test_median_when_a_bracket_ends_between_the_two_middle_ranks():
    """120 points, 85 of them at one place: 3570 of the 7140 distances are 0, exactly the lower half,
    so the two middle ranks are 0 and the smallest positive distance. A narrow bracket (0 standard
    deviations) whose upper end is a sampled 0 holds rank k but not rank k + 1 and must count as a
    miss; the points' order is drawn anew for each of 16 batch elements, so that the fixed sample
    sees a different share of zeros in each and some brackets end there."""
    ops = torch.ops.kivi_fast_testing
    g = torch.Generator().manual_seed(5)
    base = torch.cat([torch.zeros(85, 3, dtype=torch.float64),
                      1.0 + torch.rand(35, 3, generator=g, dtype=torch.float64)])
    x = torch.stack([base[torch.randperm(120, generator=g)] for _ in range(16)])
    expected = np.array([np.median(pdist(e.numpy())) for e in x])
    with implementation("cpu"):
        old = ops.set_median_bracket(1 << 15, 0.0)
        try:
            before = ops.median_counts()
            got = kivi_fast.median_bandwidth(x).numpy()
            after = ops.median_counts()
        finally:
            ops.set_median_bracket(int(old[0]), old[1])
    np.testing.assert_allclose(got, expected, rtol=1e-12)
    assert after[1] - before[1] >= 1  # some brackets missed


def test_median_bracket_switch_rejects_bad_settings(compiled):
    with pytest.raises(RuntimeError, match="sds must be finite and >= 0"):
        torch.ops.kivi_fast_testing.set_median_bracket(1 << 15, -1.0)
    with pytest.raises(RuntimeError, match="sample_size must be in"):
        torch.ops.kivi_fast_testing.set_median_bracket(-1, 5.0)


def test_kernel_matrix_above_32_mb_reused_between_calls():
    """A kernel matrix above 32 MB is handed back lazily after a call (MADV_FREE, csrc/cpu/buffers.cpp:
    Work::trim) and found again by the next call, with whatever its pages then hold: the old values or
    zeros. A larger problem first (2400 points, 46 MB), then a smaller one (2200 points, 39 MB) on the
    same buffers, twice: equal to the reference, and to each other bit for bit."""
    big = make_samples(dict(n_p=1200, n_q=1200, d=2, batch=None, dtype=torch.float64, scale=1.0, shift=0.1,
                            seed=12))
    pr = dict(n_p=1100, n_q=1100, d=2, batch=None, dtype=torch.float64, scale=1.0, shift=0.3, seed=11)
    p, q = make_samples(pr)
    with implementation("cpu"):
        assert torch.isfinite(kivi_fast.kernel_kl(*big))
        first = value_and_grad(kivi_fast.kernel_kl, p, q)
        second = value_and_grad(kivi_fast.kernel_kl, p, q)
    ref = reference_value_and_grad(p, q)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    assert_close_rel(first[0], ref[0], 1e-8)
    assert_close_rel(first[1], ref[1], 1e-7)


@pytest.mark.parametrize("ties", [False, True])
def test_distances_of_a_gram_larger_than_l3_written_by_row_tiles(ties):
    """Above 32 MB (2100 points) on one thread the Gram's row tiles turn into squared distances as they
    are computed, from the last tile up, and the median's counting pass runs on each tile's rows against
    a bracket from a sample of distances summed from the input rows (csrc/cpu/distances.cpp, gram_one): the median
    equals numpy's whether the bracket holds (as shipped), misses (0 standard deviations; tied
    distances fill it) and hands the call to the bins without a second count, or is off (no sample);
    the KL's value and gradient equal the device-generic kernels' (full ATen matrices) at 2100 points
    in 33 dimensions (the tiles' regime), with the median or a given bandwidth (no count), and the
    median of float32 rows is numpy's rounded to float32."""
    g = torch.Generator().manual_seed(21)
    x = torch.randn(2100, 33, generator=g, dtype=torch.float64)
    if ties:
        x = torch.round(x)
    p, q = x[:1050], 0.7 * x[1050:] + 0.2
    expected = np.median(pdist(x.numpy()))
    with switched({}, threads=1):
        with implementation("cpu"):
            assert_median_under_bracket_settings(x, expected, ties)
            ours = value_and_grad(kivi_fast.kernel_kl, p, q)
            ours_given = value_and_grad(kivi_fast.kernel_kl, p, q, bandwidth=1.7)  # no median: no count
            x32 = x.float()
            sigma32 = kivi_fast.median_bandwidth(x32).item()  # the sample from float32 rows
        with implementation("generic"):
            theirs = value_and_grad(kivi_fast.kernel_kl, p, q)
            theirs_given = value_and_grad(kivi_fast.kernel_kl, p, q, bandwidth=1.7)
    # float32 samples give a float32 bandwidth: the exact median, rounded
    assert sigma32 == float(np.float32(np.median(pdist(x32.double().numpy()))))
    for a, b in ((ours, theirs), (ours_given, theirs_given)):
        assert_close_rel(a[0], b[0], 1e-8)
        assert_close_rel(a[1], b[1], 1e-7)


def test_median_of_distances_at_the_ends_of_float64(impl):
    """Squared distances that are subnormal (1e-312): too narrow a range for bins; the selection over
    all pairs still gives numpy's median."""
    tiny = (torch.arange(40, dtype=torch.float64) * 1e-156).reshape(40, 1)
    assert kivi_fast.median_bandwidth(tiny).item() == pytest.approx(np.median(pdist(tiny.numpy())), rel=1e-12)


def test_median_of_overflowing_distances_is_refused():
    """Squared distances that overflow (finite squared norms of 1e308, differences of 2e154, whose
    squares numpy's median takes as inf): the CPU kernels refuse points whose squared distance from
    the centre exceeds a quarter of float64's largest, as points too far apart, rather than return inf
    (the reference's torch.quantile interpolates between two infinities: NaN)."""
    huge = torch.tensor([1e154, -1e154] * 20, dtype=torch.float64).reshape(40, 1)
    assert np.median(pdist(huge.numpy())) == float("inf")
    with implementation("cpu"), pytest.raises(ValueError, match="so far apart that their squared distances overflow"):
        kivi_fast.median_bandwidth(huge)
    with implementation("cpu"):  # at a quarter of the range and below: finite
        fine = huge / 5
        assert kivi_fast.median_bandwidth(fine).item() == pytest.approx(np.median(pdist(fine.numpy())))


def test_an_empty_batch_gives_empty_results(compiled):
    """B = 0 samples: empty estimates, gradients, bandwidths and fits, no error (the generic kernels
    once divided by the batch's row count)."""
    p, q = torch.randn(0, 30, 3), torch.randn(0, 20, 3, requires_grad=True)
    value = kivi_fast.kernel_kl(p, q)
    value.sum().backward()
    assert value.shape == (0,) and q.grad.shape == (0, 20, 3)
    assert kivi_fast.median_bandwidth(p).shape == (0,)
    assert kivi_fast.DensityRatio().fit(p, q.detach()).alpha.shape == (0, 20)


def test_the_ops_take_a_0_dim_bandwidth_for_one_batch_element(compiled):
    """torch.ops.kivi_fast.kl and fit accept sigma as [] for B = 1 (as [1]), on both paths."""
    p, q = make_samples(dict(n_p=30, n_q=20, d=3, batch=1, dtype=torch.float64, scale=1.0, shift=0.3, seed=5))
    ops = torch.ops.kivi_fast
    for s in (torch.tensor(1.5, dtype=torch.float64), torch.tensor([1.5], dtype=torch.float64)):
        value, _, used, _ = ops.kl(p, q, 1e-3, 1e-8, s, True, False)
        alpha, sigma = ops.fit(p, q, 1e-3, s)
        assert used.shape == sigma.shape == (1,) and used.item() == sigma.item() == 1.5
        assert_close_rel(value, kivi_fast.kernel_kl(p, q, bandwidth=1.5), 1e-12)


@pytest.mark.parametrize("batched", [False, True])
def test_negated_views_give_the_results_of_their_values(batched):
    """The kernels read raw memory; a negated view (torch._neg_view: the sign in a flag, as conj().imag
    makes) reaches them resolved by the dispatcher's fallback for the Negative key, on every device their
    ops are registered for by key (csrc/ops.cpp). Values and gradients equal those of the materialized
    tensor's."""
    gen = torch.Generator().manual_seed(5)
    shape = (2, 40, 3) if batched else (40, 3)
    p = torch.randn(shape, dtype=torch.float64, generator=gen)
    q0 = torch.randn(shape, dtype=torch.float64, generator=gen) + 0.5
    results = []
    for negate in (torch._neg_view, torch.neg):
        q = q0.clone().requires_grad_()
        nq, np_ = negate(q), negate(p)
        assert nq.is_neg() == (negate is torch._neg_view)
        kl = kivi_fast.kernel_kl(np_, nq).sum()
        fit = kivi_fast.DensityRatio(lam=1e-3).fit(numer=np_, denom=nq.detach())
        log_ratio = fit.log_ratio(nq).sum()
        results.append([kl.detach(), *torch.autograd.grad(kl, q), log_ratio.detach(),
                        *torch.autograd.grad(log_ratio, q), kivi_fast.rbf_gram(np_, nq.detach(), sigma=1.0),
                        kivi_fast.median_bandwidth(nq.detach())])
    for got, want in zip(*results):
        assert torch.equal(got, want)
