"""csrc/cuda/'s kernels and host code run on CPU tensors by their CPU emulation (csrc/cuda_emulation/),
against the CPU kernels and the reference: what a machine without a GPU (CI) can check of them.

The emulation runs each block's threads one at a time between barriers, in a seeded random order, with
shared memory poisoned with NaN: a missing barrier or a read of what was never written changes the
results (test_the_emulation_catches_the_bugs_it_is_for shows it does). It checks the kernels' index
arithmetic, barriers, warp collectives and shared-memory layouts, and the host code that picks them
for a device's multiprocessors and shared memory (settable here, so that small batches take the paths
of large ones). Not the GPU's memory model or speed: test_cuda.py runs the kernels on a GPU.
"""

import contextlib
import typing

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import kivi_fast
from kivi_fast import _cuda_emulation, reference

from conftest import bench_module, implementation
from test_cuda import (CUDA_KERNEL_SHAPES, REORDERING_SWITCHES, VARIANT_CASES, VARIANT_IDS, WEIGHT_STATE_SHAPES,
                       seeded_samples)

peak_bytes = bench_module("alloc_peak").peak_bytes

H100 = dict(multiprocessors=132, shared_per_block_optin=232448, shared_per_multiprocessor=233472,
            reserved_shared_per_block=1024)
EMU = None


@pytest.fixture(autouse=True, scope="module")
def emulation():
    global EMU
    if kivi_fast.backend() != "cpp":
        pytest.fail("the compiled ops are not built (pip install --no-build-isolation -e .)")
    EMU = _cuda_emulation.load()
    if EMU is None:
        pytest.fail("the CUDA emulation library is not built (CMake option KIVI_FAST_CUDA_EMULATION, default ON)")
    # the kernels' outputs start as NaN (at::empty filled), as shared memory starts poisoned: an output
    # the kernels forget to write cannot pass for a zero a previous test left in reused memory
    deterministic, fill = torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(deterministic)
        torch.utils.deterministic.fill_uninitialized_memory = fill
        device()


def device(seed: int = 0, **changes) -> None:
    """Sets the emulated device: an H100's attributes with `changes`, threads ordered by `seed`."""
    c = {**H100, **changes}
    EMU.configure(c["multiprocessors"], c["shared_per_block_optin"], c["shared_per_multiprocessor"],
                  c["reserved_shared_per_block"], seed)


@contextlib.contextmanager
def emulated_device(seed: int = 0, **changes):
    device(seed, **changes)
    try:
        yield
    finally:
        device()


ELIMINATIONS = ("two-columns", "one-column")


@contextlib.contextmanager
def elimination(mode: str):
    """The forward kernel's elimination: two columns a step (the default) or one (set_paired_elimination
    off)."""
    with _cuda_emulation.switched("set_paired_elimination", mode != "one-column"):
        yield


class Launch(typing.NamedTuple):
    kernel: str
    grid: tuple
    threads: int
    shared_bytes: int  # dynamic
    block_barriers: int  # __syncthreads passed, over all its blocks


def launches() -> list:
    """Each launch since the last call."""
    names, flat = EMU.take_launches()
    return [Launch(n, tuple(flat[6 * i:6 * i + 3]), *flat[6 * i + 3:6 * i + 6]) for i, n in enumerate(names)]


def cotangent(batch):
    """The g of the gradients below: sum_b g_b KL_b, g from a fixed seed."""
    return torch.randn(batch, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def emulated_kl(p, q, reverse, sigma=None, lam=1e-3, clip=1e-8):
    """The kl op's outputs (KL, grad state, bandwidth, clipped fraction) and the gradient of sum_b g_b KL_b
    w.r.t. q, as CUDA tensors take them (kl.cu's kernels, or the generic path's GPU composition where
    they do not apply), emulated."""
    return _cuda_emulation.kl(p, q, reverse, cotangent(p.shape[0]), sigma, lam, clip)


def cpu_kl(p, q, reverse, sigma=None, lam=1e-3, clip=1e-8):
    """The same from the CPU kernels."""
    out = torch.ops.kivi_fast.kl(p, q, lam, clip, sigma, reverse, True)
    return out, torch.ops.kivi_fast.kl_grad(cotangent(p.shape[0]), out[1], q, p, reverse)


def assert_close_rel(actual, expected, rtol):
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    scale = expected.abs().max().clamp_min(1e-30)
    assert (actual - expected).abs().max() <= rtol * scale, ((actual - expected).abs().max(), scale)


def gradient_scale(state, p, q, reverse, g):
    """Per gradient row j, the size of the sums it is computed from: |s| (sum_c |W_jc| |c| + |sum_c W_jc|
    |z_j|), with s = g / n_q and max-norms over the dimensions. Where z_j's own weight dominates, those
    terms cancel to a gradient far below them, known only to float64's rounding of them."""
    n_q, d = q.shape[1], q.shape[2]
    s = (g / n_q).abs().view(-1, 1)
    z = q.double().abs().amax(-1)  # [B, n_q]
    if state.shape[-1] == d + 1 and d + 1 < p.shape[1] + n_q:  # the projection [sum_c W_jc c, sum_c W_jc]
        return s * (state[..., :d].abs().amax(-1) + state[..., d].abs() * z)
    points = (q, p) if reverse else (p, q)  # the stacked [denom; numer]
    x = torch.cat(points, 1).double().abs().amax(-1)  # [B, N]
    w = state.abs()
    return s * ((w @ x.unsqueeze(-1)).squeeze(-1) + w.sum(-1) * z)


def assert_equals_cpu_kernels(p, q, reverse, sigma=None):
    """Every output and the gradient against the CPU kernels: both fit in float64 from the same inputs,
    so they agree to float64's rounding in different summation orders (the KL and the gradient also to
    the input dtype's rounding); the gradient's rounding relative to the sums it cancels from."""
    (ours, ours_g), (cpu, cpu_g) = emulated_kl(p, q, reverse, sigma), cpu_kl(p, q, reverse, sigma)
    rtol = 1e-6 if p.dtype == torch.float32 else 1e-9
    for a, e in zip(ours, cpu):
        assert_close_rel(a, e, rtol if a.dtype == p.dtype else 1e-9)
    bound = rtol * gradient_scale(cpu[1], p, q, reverse, cotangent(p.shape[0])).unsqueeze(-1) + 1e-300
    assert ours_g.dtype == cpu_g.dtype and ours_g.shape == cpu_g.shape
    err = (ours_g.double() - cpu_g.double()).abs()
    assert (err <= bound).all(), ((err / bound).max(), cpu_g.abs().max())


# CUDA_KERNEL_SHAPES (each path of csrc/cuda/kl.cu) at most 2 batch elements and 5000 dimensions: an
# emulated (100, 8) element takes ~0.2 s
EMULATED_SHAPES = sorted({(min(b, 2), n_p, n_q, min(d, 5000)) for b, n_p, n_q, d in CUDA_KERNEL_SHAPES}
                         | {(1, 40, 40, 64)})  # and the projection state with d > 32 (one lane a dimension)


@pytest.mark.parametrize("shape", EMULATED_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("reverse", [True, False])
def test_the_emulated_cuda_kernels_equal_the_cpu_kernels(shape, dtype, reverse):
    b, n_p, n_q, d = shape
    N = n_p + n_q
    p, q = seeded_samples(b, n_p, n_q, d, dtype, sum(shape) + reverse, 1.2, 0.3)
    assert EMU.handles_kl(N, d, b) and EMU.handles_kl_grad(N, n_q, d, b)
    launches()
    assert_equals_cpu_kernels(p, q, reverse)
    names = [launch[0] for launch in launches()]
    wide = N * d > 6144
    tiles, warps = "pair_tile_kernel<scalar_t, false>", "pair_sqdist_kernel<scalar_t>"
    distances = [tiles] if wide and N > 64 else [warps] if wide else []
    backward = "grad_from_projection_kernel<scalar_t>" if d + 1 < N else "grad_from_weights"
    assert names == distances + ["forward", backward]


# (shape, reverse, the shared memory a block may opt in to): from the most, which the fastest layout
# fits (more than an H100 has, for the wide shapes), down to the leanest layout
LAYOUT_CASES = [
    ((2, 100, 100, 8), False, (232448, 120000, 60000)),  # the distances share the system's region
    # the distances and the system (241 KB); an H100's 227 KB: the system, and the distances copied
    # into its region for the median (161 KB); 150,000 B: the system alone; the leanest
    ((1, 100, 100, 700), False, (260000, 232448, 150000, 60000)),
    ((1, 56, 200, 300), True, (600000, 340000, 310000, 60000)),  # a 200 x 200 system: all four layouts
]


@pytest.mark.parametrize("shape", WEIGHT_STATE_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("reverse", [True, False])
def test_the_weight_state_backward_from_the_cpu_forward_equals_the_cpu_kernels(shape, reverse):
    """The backward kernel takes any forward's grad state (the same contract): here the CPU kernels',
    also where the CUDA forward does not run (291 points: two column tiles of weights)."""
    b, n_p, n_q, d = shape
    p, q = seeded_samples(b, n_p, n_q, d, torch.float32, sum(shape) + reverse, 1.1, 0.2)
    state = cpu_kl(p, q, reverse)[0][1]
    assert state.shape[-1] == n_p + n_q and EMU.handles_kl_grad(n_p + n_q, n_q, d, b)
    g = cotangent(b)
    ours, cpu = EMU.kl_grad(g, state, q, p, reverse), torch.ops.kivi_fast.kl_grad(g, state, q, p, reverse)
    bound = 1e-6 * gradient_scale(state, p, q, reverse, g).unsqueeze(-1)
    assert ((ours.double() - cpu.double()).abs() <= bound).all()


@st.composite
def problems(draw):
    """Any shape the CUDA kernels take, on an emulated device of 1, 2 or 132 multiprocessors (so that
    batches of more than one wave take the two-blocks-a-multiprocessor layout)."""
    n_p, n_q = draw(st.integers(2, 260)), draw(st.integers(2, 260))
    d = draw(st.sampled_from([1, 2, 3, 8, 20, 64, 300, 1200]))
    assume(EMU.handles_kl(n_p + n_q, d, 3) and EMU.handles_kl_grad(n_p + n_q, n_q, d, 3))
    return dict(shape=(draw(st.integers(1, 3)), n_p, n_q, d), reverse=draw(st.booleans()),
                dtype=draw(st.sampled_from([torch.float32, torch.float64])),
                scale=draw(st.floats(0.1, 10.0)), shift=draw(st.floats(0.0, 3.0)), seed=draw(st.integers(0, 2**16)),
                multiprocessors=draw(st.sampled_from([1, 2, 132])))


@settings(max_examples=60)
@given(pr=problems())
def test_the_emulated_cuda_kernels_equal_the_cpu_kernels_on_drawn_problems(pr):
    p, q = seeded_samples(*pr["shape"], pr["dtype"], pr["seed"], pr["scale"], pr["shift"])
    with emulated_device(seed=pr["seed"], multiprocessors=pr["multiprocessors"]):
        assert_equals_cpu_kernels(p, q, pr["reverse"])


@pytest.mark.parametrize("shape,reverse,optins", LAYOUT_CASES, ids=["small", "wide", "wide-reverse"])
def test_each_shared_memory_layout_gives_the_same_results(shape, reverse, optins):
    """Less shared memory a block moves the distances or the system (or both) to global memory (kl()'s
    layouts): the same arithmetic in other places, so the same bits."""
    b, n_p, n_q, d = shape
    p, q = seeded_samples(b, n_p, n_q, d, torch.float64, 3, 1.2, 0.3)
    results, forward_bytes = [], []
    for optin in optins:
        with emulated_device(shared_per_block_optin=optin):
            assert EMU.handles_kl(n_p + n_q, d, b)
            launches()
            results.append(emulated_kl(p, q, reverse))
            forward_bytes.append(next(x.shared_bytes for x in launches() if x.kernel == "forward"))
    assert len(set(forward_bytes)) == len(optins), forward_bytes  # a layout each
    (first, first_g) = results[0]
    for out, g in results[1:]:
        assert all(torch.equal(a, e) for a, e in zip(out, first)) and torch.equal(g, first_g)
    assert_equals_cpu_kernels(p, q, reverse)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_batches_of_more_than_one_wave_fit_two_blocks_a_multiprocessor(dtype):
    """More batch elements than multiprocessors: a layout with which two forward blocks share one
    (kl_forward_kernel<T, 2>, its back substitution row by row), else (the switch off) the one-block
    layout (column by column in registers); both equal the CPU kernels."""
    p, q = seeded_samples(5, 100, 100, 8, dtype, 11, 1.2, 0.3)
    with emulated_device(multiprocessors=2):
        launches()
        two = emulated_kl(p, q, False)
        ((two_grid, two_bytes),) = [(x.grid, x.shared_bytes) for x in launches() if x.kernel == "forward"]
        assert two_grid == (4, 1, 1)  # two blocks on each of 2 multiprocessors take the 5 elements in turn
        with _cuda_emulation.switched("set_two_blocks_per_sm", False):
            one = emulated_kl(p, q, False)
        (one_bytes,) = [x.shared_bytes for x in launches() if x.kernel == "forward"]
    half = H100["shared_per_multiprocessor"] // 2 - H100["reserved_shared_per_block"]
    assert two_bytes < half < one_bytes, (two_bytes, one_bytes)
    cpu = cpu_kl(p, q, False)
    for out, g in (two, one):
        for a, e in zip(out, cpu[0]):
            assert_close_rel(a, e, 1e-6 if a.dtype == torch.float32 else 1e-9)
        assert_close_rel(g, cpu[1], 1e-6 if dtype == torch.float32 else 1e-9)


@pytest.mark.parametrize("reverse", [True, False])
def test_blocks_take_the_batch_in_turn_through_their_workspace_slots(reverse):
    """Where the forward keeps its distances and system in global memory, kl() launches only as many
    blocks as the GPU holds at once, each taking batch elements in turn through its own workspace slot:
    on an emulated device of one multiprocessor one block computes all 5 elements through one slot
    (what an element leaves there must not reach the next), the same bits as one block an element."""
    p, q = seeded_samples(5, 100, 100, 8, torch.float64, 4 + reverse, 1.2, 0.3)
    p[2] *= 3.0  # elements unlike each other: another scale, a zero median (NaN) in between
    p[3], q[3] = 0.0, 0.0
    results = []
    with _cuda_emulation.switched("set_two_blocks_per_sm", False):
        for multiprocessors, blocks in ((1, 1), (132, 5)):
            with emulated_device(multiprocessors=multiprocessors, shared_per_block_optin=60000):
                launches()
                results.append(emulated_kl(p, q, reverse))
                (grid,) = [x.grid for x in launches() if x.kernel == "forward"]
                assert grid == (blocks, 1, 1)
    (one_slot, one_slot_g), (own, own_g) = results
    for a, e in zip(one_slot, own):
        assert torch.equal(a.isnan(), e.isnan()) and torch.equal(a.nan_to_num(), e.nan_to_num())
    assert torch.equal(one_slot_g.nan_to_num(), own_g.nan_to_num())
    assert one_slot[0][3].isnan() and one_slot[0][[0, 1, 2, 4]].isfinite().all()


@pytest.mark.parametrize("paired", [True, False], ids=["two-columns", "one-column"])
@pytest.mark.parametrize("shape,reverse", [((2, 100, 100, 8), False), ((1, 37, 40, 8), False), ((2, 2, 5, 3), False),
                                           ((1, 3, 4, 3), False), ((1, 1, 5, 3), False), ((1, 128, 30, 8), False),
                                           ((1, 129, 30, 8), False), ((1, 56, 200, 300), True)],
                         ids=["100", "37-odd", "2", "3-odd", "1", "128", "129-odd", "200-global"])
def test_both_eliminations_equal_the_cpu_kernels(paired, shape, reverse):
    """solve_spd two columns a step (the default) and one (set_paired_elimination(False)), for even and
    odd systems (the paired loop's last column alone), down to 2 and 3 rows, and a 200-row system in
    global memory; the back substitution in registers up to 128 rows, row by row above."""
    b, n_p, n_q, d = shape
    p, q = seeded_samples(b, n_p, n_q, d, torch.float64, n_p + 7, 1.2, 0.3)
    with _cuda_emulation.switched("set_paired_elimination", paired):
        assert_equals_cpu_kernels(p, q, reverse)


def test_the_paired_elimination_switch_acts():
    """One column a step and two do the elimination's operations in different orders: their results
    differ in the last bits (each equals the CPU kernels, above), so the switch's A/B times two
    different eliminations."""
    p, q = seeded_samples(2, 100, 100, 8, torch.float64, 107, 1.2, 0.3)
    runs = []
    for mode in ELIMINATIONS:
        with elimination(mode):
            runs.append(emulated_kl(p, q, False))
    (a, ag), (e, eg) = runs
    assert not all(torch.equal(x, y) for x, y in zip((*a, ag), (*e, eg)))
    assert_close_rel(a[0], e[0], 1e-12)


@pytest.mark.parametrize("switch, shape", VARIANT_CASES, ids=VARIANT_IDS)
def test_the_benches_other_kernel_variants_give_the_same_bits(switch, shape):
    """The tiled distances with every sub-block computed (set_tile_subblocks(False)) and the weight
    state's backward with one dimension a thread (set_paired_weight_dims(False)): each sum is taken in
    the same order as by the defaults, so the outputs and gradients are the same bits, and each equals
    the CPU kernels. The distances' ranges by cost (set_balanced_tile_ranges, the default) and the
    same ranges for all split the dimensions differently, their norms and products
    (set_product_tile_distances(True)) and cuBLAS's GEMM of the centred points
    (set_gemm_pair_distances(True)) round another way, and the generic path's GEMM
    (set_weight_kernel(False)) sums in its own order, so theirs may differ in the last bits: within
    1e-12 (float64; 1e-10 for the norms and products), 1e-6 (float32)."""
    b, n_p, n_q, d = shape
    p, q = seeded_samples(b, n_p, n_q, d, torch.float32, sum(shape), 1.2, 0.3)
    runs, ran = [], []
    for flag in (True, False):
        with _cuda_emulation.switched(switch, flag):
            launches()
            runs.append(emulated_kl(p, q, False))
            ran.append(launches())
            assert_equals_cpu_kernels(p, q, False)
    if switch == "set_balanced_tile_ranges":  # (its blocks a row of ranges, one grid dimension)
        grids = [[launch.grid for launch in r if launch.kernel.startswith("pair_tile_kernel")] for r in ran]
        assert grids[0] and grids[0] != grids[1] and all(g[1] == 1 for g in grids[0]), grids
    if switch == "set_product_tile_distances":  # the tiles' kernels of that form, or of differences
        tiles = [{launch.kernel for launch in r if launch.kernel.startswith(("pair_tile", "kernel_block"))} for r in ran]
        assert tiles[0] and all(k.endswith(", true>") for k in tiles[0]), tiles
        assert tiles[1] == {k.replace(", true>", ", false>") for k in tiles[0]}, tiles
    if switch == "set_gemm_pair_distances":  # no pair kernel, or one (the GEMM is ATen's)
        pairs = [any(launch.kernel.startswith(("pair_tile", "pair_sqdist")) for launch in r) for r in ran]
        assert pairs == [False, True], pairs
    if switch == "set_weight_kernel":  # the backward's kernel, or none of it (the generic path's GEMM)
        assert [any(launch.kernel.startswith("grad_from_weights") for launch in r) for r in ran] == [True, False]
    (a, ag), (e, eg) = runs
    if switch in REORDERING_SWITCHES:
        # (norms minus products round relative to the norms: the generic path's grad state, from their
        # kernel values, 1.5e-12 off at (300, 290, 3))
        rtol64 = 1e-10 if switch in ("set_product_tile_distances", "set_gemm_pair_distances") else 1e-12
        for x, y in zip((*a[:3], ag), (*e[:3], eg)):
            assert_close_rel(x.double(), y.double(), rtol64 if x.dtype == torch.float64 else 1e-6)
    else:
        assert all(torch.equal(x, y) for x, y in zip((*a, ag), (*e, eg)))


@pytest.mark.parametrize("case", ["offset", "outlier"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("switch, shape", [("set_product_tile_distances", (1, 100, 100, 300)),
                                           ("set_product_tile_distances", (1, 300, 290, 3)),
                                           ("set_gemm_pair_distances", (1, 100, 100, 300)),
                                           ("set_gemm_pair_distances", (2, 9, 13, 3000))],
                         ids=["products-wide", "products-generic", "gemm-tiles", "gemm-warps"])
def test_product_distances_far_from_the_origin_keep_their_digits(switch, shape, dtype, case):
    """set_product_tile_distances and set_gemm_pair_distances (the benches' A/Bs): norms minus products
    round relative to the norms. Relative to a reference point, the norms are of the points' spread,
    so samples 1e4 from the origin (spread ~1) keep the differences' accuracy, where norms from the
    origin would lose ~8 digits of each distance (bench/distance_schemes.py, its offset problems):
    against the CPU kernels. And the reference, the middle of three points' coordinates, is not the
    first point when that one lies 1e6 from the others (as a reference it would cost ~12 digits):
    against the reference's differences."""
    b, n_p, n_q, d = shape
    p, q = seeded_samples(b, n_p, n_q, d, torch.float64, 11, 1.1, 0.4)
    if case == "offset":
        p, q = p + 1e4, q + 1e4
    else:
        p[:, 0] += 1e6  # the prior's first point, a centre row (stacked row N / 2: [q_z; prior_z], not reversed)
    p, q = p.to(dtype), q.to(dtype)
    with _cuda_emulation.switched(switch, True):
        if case == "offset":
            assert_equals_cpu_kernels(p, q, False)
            return
        (value, _, sigma, _), grad = emulated_kl(p, q, False)
    q64 = q.double().requires_grad_(True)
    ref = reference.kernel_kl(p.double(), q64, reverse=False)
    (ref_grad,) = torch.autograd.grad((cotangent(b) * ref).sum(), q64)
    rtol = 1e-6 if dtype == torch.float32 else 1e-9
    assert_close_rel(value.double(), ref.detach(), rtol)
    assert_close_rel(sigma, reference.median_bandwidth(torch.cat([p, q], 1).double()), 1e-9)
    assert_close_rel(grad.double(), ref_grad, 10 * rtol)


@pytest.mark.parametrize("shape", [(2, 50, 50, 8), (2, 10, 10, 3000), (1, 70, 60, 300), (1, 100, 100, 700)],
                         ids=["fused", "pair-sqdist", "pair-tile", "distances-in-global-memory"])
def test_a_given_bandwidth_equals_the_cpu_kernels(shape):
    """An explicit bandwidth per batch element (no median taken) on each distance path."""
    b, n_p, n_q, d = shape
    p, q = seeded_samples(b, n_p, n_q, d, torch.float64, 3, 1.2, 0.3)
    sigma = torch.linspace(0.5, 2.0, b, dtype=torch.float64) * d ** 0.5
    assert_equals_cpu_kernels(p, q, False, sigma)
    assert torch.equal(emulated_kl(p, q, False, sigma)[0][2], sigma)


@pytest.mark.parametrize("mode", ELIMINATIONS)
def test_a_system_that_is_not_positive_definite_gives_nan(mode):
    """A pivot <= 0 gives NaN for its batch element (the CPU raises), here from a negative lam (direct
    calls: the op refuses lam <= 0 before the kernels see it): the first pivot's, K/n - I/2 for 30
    points; the second's, two denominator points, lam = -0.45: the first pivot is 0.05 either way, the
    second 0.05 - k^2/(4 0.05) with k their kernel value, negative for equal points, positive for
    distant ones; and a later pivot's, in a pair and alone."""
    p, q = seeded_samples(3, 30, 30, 4, torch.float64, 1, 1.0, 0.5)
    two = torch.zeros(2, 2, 4, dtype=torch.float64)
    two[0, 1] = 100.0  # far apart: k ~ 0, a positive definite 2 x 2 system
    sigma = torch.ones(2, dtype=torch.float64)
    with elimination(mode):
        first = EMU.kl(p, q, -0.5, 1e-8, None, False, True)[0]
        second = EMU.kl(two, q[:2, :5], -0.45, 1e-8, sigma, False, True)[0]
        # n = 3 and 4 points 100 apart, lam = -0.9/n (every pivot 0.1/n > 0): finite; with the third
        # point moved onto the first, the third column's pivot fails, alone (odd n) or as the first of
        # the second pair (even n)
        later, control = [], []
        for n in (3, 4):
            x = torch.zeros(1, n, 4, dtype=torch.float64)
            x[0, :, 0] = 100.0 * torch.arange(n)
            control.append(EMU.kl(x, q[:1, :5] + 1000.0, -0.9 / n, 1e-8, sigma[:1], False, True)[0])
            x[0, 2] = x[0, 0]
            later.append(EMU.kl(x, q[:1, :5] + 1000.0, -0.9 / n, 1e-8, sigma[:1], False, True)[0])
    assert first.isnan().all()
    assert second[0].isfinite() and second[1].isnan(), second
    assert all(c.isfinite().all() for c in control) and all(t.isnan().all() for t in later), (control, later)


@pytest.mark.parametrize("shape,multiprocessors,mode", [((2, 100, 100, 8), 132, "two-columns"),
                                                        ((2, 100, 100, 8), 132, "one-column"),
                                                        ((1, 10, 10, 3000), 132, "two-columns"),
                                                        ((1, 20, 20, 1200), 1, "two-columns"),
                                                        ((1, 70, 60, 1000), 132, "two-columns"),
                                                        ((1, 70, 60, 1000), 1, "two-columns")],
                         ids=["fused", "fused-one-column", "pair-sqdist", "pair-sqdist-chunks", "pair-tile",
                              "pair-tile-slabs"])
def test_results_do_not_depend_on_the_order_threads_run_in(shape, multiprocessors, mode):
    """Each seed runs the threads between barriers, and the blocks, in another order: a read of shared
    memory before the barrier that orders it after its write would give other bits (or the poison's
    NaN). The fused path's results are the same bits; the wide paths add the blocks' partial distances
    with atomics, whose order (as on a GPU) moves the last bits. On one multiprocessor each block of the
    wide paths takes several chunks (pair_sqdist_kernel) or slabs (pair_tile_kernel) of dimensions,
    staged in turn."""
    b, n_p, n_q, d = shape
    p, q = seeded_samples(b, n_p, n_q, d, torch.float64, 5, 1.2, 0.3)
    runs = []
    for seed in (1, 2, 3):
        with emulated_device(seed=seed, multiprocessors=multiprocessors), elimination(mode):
            runs.append(emulated_kl(p, q, False))
    (first, first_g) = runs[0]
    assert all(t.isfinite().all() for t in (*first, first_g))
    for out, g in runs[1:]:
        if n_p + n_q <= 6144 // d:
            assert all(torch.equal(a, e) for a, e in zip(out, first)) and torch.equal(g, first_g)
        else:
            for a, e in zip((*out, g), (*first, first_g)):
                assert_close_rel(a, e, 1e-12)
    with elimination(mode):
        assert_equals_cpu_kernels(p, q, False)


# What reads a tensor's value back to the host: ATen's _local_scalar_dense (behind item() and bool()), and
# the ops whose output size is a value
HOST_READS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::unique_dim",
              "aten::_unique2", "aten::unique_consecutive"}


def host_reads(fn) -> tuple[list, object]:
    """The ops of HOST_READS that fn() runs, by the profiler (on a GPU each stalls the stream and breaks
    CUDA-graph capture; there test_cuda.py sets torch's sync debug mode instead), and fn()'s result."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = fn()
    return [e.name for e in prof.events() if e.name in HOST_READS], out


# kl.cu's fused small, pair_sqdist and pair_tile paths; the generic path's ATen median and median.cu;
# the tiles' norms and products (set_product_tile_distances, the benches' A/B) on the paths with tiles;
# cuBLAS's GEMM for the wide path's (set_gemm_pair_distances, another A/B) where d >= N
PRODUCTS, GEMM = "set_product_tile_distances", "set_gemm_pair_distances"


@pytest.mark.parametrize("n,d,switch", [(20, 3, None), (10, 3000, None), (70, 200, None), (160, 20, None),
                                        (200, 40, None), (70, 200, PRODUCTS), (160, 20, PRODUCTS),
                                        (200, 40, PRODUCTS), (10, 3000, GEMM), (70, 200, GEMM)])
def test_bad_values_give_nan_for_their_batch_element_without_host_reads(n, d, switch):
    """As test_cuda.py's test on a GPU: a NaN in q_z, every distance 0 (a zero median), an Inf in
    prior_z (with an explicit bandwidth too, where no median is taken), a bandwidth that is not
    positive, samples so small that their median is below 1e-150 (its square would underflow), every
    point but the first the same (a zero median again: with norms and products too, whose reference,
    the middle of three points' coordinates, then differs from the first point), half the points the
    same and the rest apart (a zero median by differences, and by a GEMM only where it sets the
    distances below its rounding to 0); the other elements equal the CPU kernels'. Nothing is read back to the host,
    where the generic path's CPU build reads its checks' results (which shows the profiler sees such
    reads)."""
    p, q = seeded_samples(8, n, n, d, torch.float64, n + d, 1.0, 0.0)
    q[1, 3, 1] = float("nan")
    p[2], q[2] = 0.0, 0.0
    p[3, 2, 0] = float("inf")
    p[5], q[5] = p[5] * 1e-160, q[5] * 1e-160
    p[6, 1:], q[6] = 0.7, 0.7
    # all points but the first of each sample at one point x0: over half the pairs are 0 ((2n - 2)
    # points of 2n), and the centre (the middle of stacked rows 0, N / 2 and N - 1: q_z's first, the
    # prior's first, x0) is not x0, so a Gram's entries for them are sums of many rounded products
    x0 = q[7, 1].clone()
    p[7, 1:], q[7, 1:] = x0, x0
    bandwidth = torch.tensor([1.0, 1.0, 1.0, 1.0, -1.0, 1.0, 1.0, 1.0], dtype=torch.float64) * d ** 0.5
    with contextlib.nullcontext() if switch is None else _cuda_emulation.switched(switch, True):
        reads, ((value, _, sigma, _), _) = host_reads(lambda: emulated_kl(p, q, False))
        given_reads, ((given, _, given_sigma, _), _) = host_reads(lambda: emulated_kl(p, q, False, sigma=bandwidth))
    assert reads == given_reads == []
    assert value[[0, 4]].isfinite().all() and value[[1, 2, 3, 5, 6, 7]].isnan().all()
    assert sigma[[1, 2, 3, 5, 6, 7]].isnan().all()
    assert given[0].isfinite() and given[[1, 3, 4]].isnan().all(), given
    assert given_sigma[[0, 2]].isfinite().all() and given_sigma[[1, 3, 4]].isnan().all(), given_sigma
    good = [0, 4]
    with implementation("generic"):
        cpu_reads, cpu = host_reads(lambda: cpu_kl(p[good], q[good], False))
    assert cpu_reads
    assert_close_rel(value[good], cpu[0][0], 1e-9)


@pytest.mark.parametrize("n,d", [(160, 20), (200, 40)])
def test_the_aten_compositions_coincident_points_away_from_the_centre_are_zero_apart(n, d):
    """The generic path's ATen composition (set_generic_kernels(False); other devices' path) takes its
    pairs from a Gram: all points of an element but the first of each sample at one point x0, the
    centre not x0. Coincident points' Gram entries need not round alike, so their distances would be
    rounding noise (a bandwidth of ~4e-8); below the Gram's rounding bound they are 0, the median 0
    and the element NaN, as with the CUDA kernels' differences. The other element equals them."""
    p, q = seeded_samples(2, n, n, d, torch.float64, n + d, 1.0, 0.0)
    x0 = q[1, 1].clone()
    p[1, 1:], q[1, 1:] = x0, x0
    (want, _, want_sigma, _), _ = emulated_kl(p, q, False)
    with _cuda_emulation.switched("set_generic_kernels", False):
        (value, _, sigma, _), _ = emulated_kl(p, q, False)
    assert want[1].isnan() and want_sigma[1].isnan()
    assert value[1].isnan() and sigma[1].isnan(), (value, sigma)
    assert_close_rel(value[0], want[0], 1e-9)
    assert_close_rel(sigma[0], want_sigma[0], 1e-12)


@pytest.mark.parametrize("n,d", [(10, 3000), (70, 300)], ids=["warp-pairs", "tiles"])
def test_gemm_distances_of_a_cluster_far_from_the_centre_give_nan(n, d):
    """set_gemm_pair_distances's limit (the benches' A/B): points within 1e-12 of x0 while two of the
    centre's three rows lie ~1 away per coordinate. The Gram's entries are then ~d, rounded to ~d 1e-16,
    far above the points' squared distances (~d 1e-24): the GEMM cannot tell them apart, and the
    element is NaN. By differences (the default) it has its value, its bandwidth the reference's. (The
    zeroing of distances below the GEMM's rounding bound is what the bad-values test's coincident
    points away from the centre check: without it their distances are rounding noise.)"""
    g = torch.Generator().manual_seed(5)
    x0 = torch.randn(d, dtype=torch.float64, generator=g)
    p, q = (x0 + 1e-12 * torch.randn(1, n, d, dtype=torch.float64, generator=g) for _ in range(2))
    q[0, 0] += torch.randn(d, dtype=torch.float64, generator=g)  # stacked row 0
    p[0, 0] += torch.randn(d, dtype=torch.float64, generator=g)  # stacked row N / 2
    (value, _, sigma, _), _ = emulated_kl(p, q, False)
    assert value.isfinite().all() and sigma.isfinite().all()
    assert_close_rel(sigma, reference.median_bandwidth(torch.cat([q, p], 1)), 1e-6)
    with _cuda_emulation.switched("set_gemm_pair_distances", True):
        launches()
        (value, _, sigma, _), _ = emulated_kl(p, q, False)
        assert not any(launch.kernel.startswith(("pair_tile", "pair_sqdist")) for launch in launches())
    assert value.isnan().all() and sigma.isnan().all()


@pytest.mark.parametrize("b,n,d", [(4, 100, 8), (1, 100, 700), (2, 10, 3000)],
                         ids=["projection-state", "tiles-weight-state", "warp-pairs-weight-state"])
def test_a_gpu_holds_the_grad_state_the_pairs_and_the_gradient_and_nothing_more(b, n, d):
    """The CUDA path's peak memory in one forward + backward, from the emulation's allocations (kl.cu's
    host code, the same calls as on a GPU): the grad state, then beside it the many-dimension path's
    pairs (the forward) or the gradient (the backward), and vectors; no copy of the samples, of
    either dtype (at (100, 700) a float64 copy, 1.07 MB, would more than triple the peak of 0.42 MB)."""
    p, q = seeded_samples(b, n, n, d, torch.float32, n + d, 1.2, 0.3)
    N, wide = 2 * n, 2 * n * d > 6144
    state = b * n * (N if d + 1 >= N else d + 1) * 8
    pairs = b * N * (N - 1) // 2 * 8 if wide else 0
    grad = b * n * d * 4
    peak = peak_bytes(lambda: emulated_kl(p, q, True))
    assert state + max(pairs, grad) <= peak <= state + max(pairs, grad) + 8192, (peak, state, pairs, grad)


# ATen ops that launch nothing on a GPU: allocations, views, a conversion to the dtype a tensor has and
# the resolution of a negation it has not (their work, where there is some, shows as ops of its own:
# _to_copy, clone, neg), and the fill of new memory with NaN that this module's fixture asks for (an
# at::zeros of ours would still show as aten::zeros)
NO_LAUNCH = {"aten::empty", "aten::empty_like", "aten::empty_strided", "aten::reshape", "aten::view", "aten::to",
             "aten::_reshape_alias", "aten::alias", "aten::as_strided", "aten::contiguous", "aten::expand",
             "aten::lift_fresh", "aten::detach", "aten::resolve_neg", "aten::fill_"}


@pytest.mark.parametrize("b,n_p,n_q,d", [(2, 60, 50, 8), (2, 5, 7, 20)], ids=["projection", "weights"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_fused_forward_and_backward_are_one_launch_each(b, n_p, n_q, d, dtype):
    """kl.cu's forward writes the KL in the samples' dtype and its backward reads grad_kl as autograd
    hands it over (the samples' dtype; expanded from a sum's gradient: stride 0), so that neither
    launches an ATen op beside its kernel (the weight state's backward: and the sum of its rows). The
    gradient equals the CPU kernels' for the same grad_kl."""
    p, q = seeded_samples(b, n_p, n_q, d, dtype, 3, 1.2, 0.3)
    grad_kls = [torch.ones((), dtype=dtype).expand(b), cotangent(b).to(dtype),  # (autograd's: the KL's dtype)
                cotangent(2 * b)[::2]]  # (float64, strided)
    launches()
    with torch.profiler.profile() as prof:
        kl, state, *_ = EMU.kl(p, q, 1e-3, 1e-8, None, True, True)
        grads = [EMU.kl_grad(g, state, q, p, True) for g in grad_kls]
    names = [launch.kernel for launch in launches()]
    assert names == ["forward"] + ["grad_from_projection_kernel<scalar_t>" if d + 1 < n_p + n_q
                                 else "grad_from_weights"] * 3  # (the forward, the backward: by their pointers)
    aten = [e.name for e in prof.events() if e.name.startswith("aten::") and e.name not in NO_LAUNCH]
    assert aten == ([] if d + 1 < n_p + n_q else ["aten::sum"] * 3), aten
    grad_kls.append(cotangent(b)._neg_view())  # a direct caller's negated view: its sign is resolved
    grads.append(EMU.kl_grad(grad_kls[-1], state, q, p, True))
    assert kl.dtype == dtype
    torch.testing.assert_close(kl, torch.ops.kivi_fast.kl(p, q, 1e-3, 1e-8, None, True, True)[0], rtol=1e-6, atol=0)
    cpu_state = torch.ops.kivi_fast.kl(p, q, 1e-3, 1e-8, None, True, True)[1]
    for g, got in zip(grad_kls, grads):
        want = torch.ops.kivi_fast.kl_grad(g, cpu_state, q, p, True)
        assert got.dtype == dtype
        torch.testing.assert_close(got, want, rtol=1e-5 if dtype == torch.float32 else 1e-9, atol=1e-12)
        # the same bits as from the same values in a contiguous float64 tensor
        assert torch.equal(got, EMU.kl_grad(g.double().contiguous(), state, q, p, True))


# Shapes kl.cu's forward leaves to the generic path (csrc/generic.cpp), each through other branches of
# its GPU composition: (the median's pairs: ATen's selection below 2^16, else cuda/median.cu; the kernel
# values: kernel_block from the samples, or the Gram's chunks of columns for many dimensions; the
# forward's end: kl_finish up to 2^17 state values, else ATen; the backward: kl.cu's where it handles
# the state, else the generic one)
GENERIC_GPU_SHAPES = [
    (2, 150, 160, 30),    # 51,040 pairs; kernel_block; projection state; kl_finish; kl.cu's backward
    (1, 300, 290, 3),     # 173,755 pairs: median.cu
    (1, 260, 260, 520),   # weight state of 135,200 values: ATen's end, the generic backward
    (1, 150, 150, 2000),  # the Gram in chunks of columns; kl.cu's weight-state backward
]


def generic_gpu_launches(b, n_p, n_q, d, reverse, gemm=False) -> list[str]:
    """The kernels the generic path launches for this shape on a GPU, by the rules above (gemm: with
    set_gemm_kernel_values, gram_kernel_block's pass after its GEMM)."""
    N, n_den = n_p + n_q, n_q if reverse else n_p
    width = d + 1 if d + 1 < N else N
    fused = d <= max(256, (4 << 20) // (8 * b * N))  # generic.cpp: chunk_columns(B N)
    P = N * (N - 1) // 2
    median = (["digit_histogram_kernel"] * 6 + ["second_middle_kernel"] * (P % 2 == 0)) * (P >= 2**16)

    def chunks(rows, cols):  # generic.cpp's chunk_rows: within the system's bytes, or 4 MB where larger
        step = max(1, -(-max(4 << 20, 8 * b * n_den * n_den) // (8 * b * cols)))
        return -(-rows // step)
    block = ["gram_kernel_kernel" if gemm else "kernel_block_kernel<scalar_t, false>"] * fused
    rhs, system, evaluation = block * chunks(n_den, N - n_den), block, block * chunks(n_q, N)
    end = ["kl_finish_kernel"] * (n_q * width <= 2**17)
    kernels_backward = EMU.handles_kl_grad(N, n_q, d, b)
    backward = ["grad_from_projection_kernel<scalar_t>" if width == d + 1 else "grad_from_weights"]
    return (["pair_tile_kernel<scalar_t, false>"] + median + rhs + system + ["fit_coef_kernel"] + evaluation + end
            + backward * kernels_backward)


@pytest.mark.parametrize("shape", GENERIC_GPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("reverse", [True, False])
def test_the_generic_path_on_a_gpu_equals_the_cpu_kernels(shape, dtype, reverse):
    """The generic path as CUDA tensors run it (csrc/generic.cpp built for a GPU: its CUDA kernels
    between the ATen calls), from the forward to the gradient, against the CPU kernels; and the
    kernels it launches, which say which branches ran."""
    b, n_p, n_q, d = shape
    p, q = seeded_samples(b, n_p, n_q, d, dtype, sum(shape) + reverse, 1.2, 0.3)
    assert not EMU.handles_kl(n_p + n_q, d, b)
    launches()
    assert_equals_cpu_kernels(p, q, reverse)
    assert [launch[0] for launch in launches()] == generic_gpu_launches(b, n_p, n_q, d, reverse)


@pytest.mark.parametrize("shape", GENERIC_GPU_SHAPES[:2], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("shift", [0.3, 1e3], ids=["near-0", "far-from-0"])
def test_the_generic_path_with_gemm_kernel_values_equals_the_cpu_kernels(shape, shift):
    """set_gemm_kernel_values (the benches' A/B): gram_kernel_block's values from a GEMM of the points and
    one pass, to the same tolerance as from differences; also for samples far from the origin, whose
    norms would cancel to the distances' rounding (the points are centred first). The points are
    centred once a fit (one centre: kivi.h's centre_coordinate, two fmax calls on tensors), not once a
    block of kernel values."""
    b, n_p, n_q, d = shape
    p, q = seeded_samples(b, n_p, n_q, d, torch.float64, sum(shape), 1.2, shift)
    p = p + shift
    with _cuda_emulation.switched("set_gemm_kernel_values", True):
        launches()
        assert_equals_cpu_kernels(p, q, True)
        names = [launch[0] for launch in launches()]
        with torch.profiler.profile() as prof:
            EMU.generic_kl(p, q, 1e-3, 1e-8, None, True, True)
        one_fit = [launch[0] for launch in launches()]
    assert names == generic_gpu_launches(b, n_p, n_q, d, True, gemm=True)
    assert one_fit.count("gram_kernel_kernel") >= 2
    assert [e.name for e in prof.events()].count("aten::fmax") == 2


@pytest.mark.parametrize("shape", [GENERIC_GPU_SHAPES[0], GENERIC_GPU_SHAPES[2]], ids=lambda s: "x".join(map(str, s)))
def test_the_generic_path_on_a_gpu_without_a_gradient_to_come_gives_the_same_kl(shape):
    """No grad state (kivi_fast.kl's forward): kl_finish without one, also where the state would have
    been too large for it (135,200 weights: ATen's end)."""
    p, q = seeded_samples(*shape, torch.float64, 7, 1.2, 0.3)
    with_state, without = (EMU.generic_kl(p, q, 1e-3, 1e-8, None, True, g) for g in (True, False))
    assert without[1].shape[-1] == 0
    assert_close_rel(without[0], with_state[0], 1e-12)
    assert torch.equal(without[2], with_state[2]) and torch.equal(without[3], with_state[3])


def test_the_generic_fit_on_a_gpu_equals_the_cpu_kernels():
    """DensityRatio's fit and the median bandwidth as CUDA tensors run them (generic.cpp built for a
    GPU; median.cu for these 173,755 pairs), with the median and with a given bandwidth."""
    p, q = seeded_samples(1, 300, 290, 3, torch.float64, 5, 1.2, 0.3)
    sigma = torch.tensor([1.7], dtype=torch.float64)
    for bandwidth in (None, sigma):
        coef, used = EMU.generic_fit(p, q, 1e-3, bandwidth)  # [alpha (q's points), beta (p's)]
        cpu_alpha, cpu_used = torch.ops.kivi_fast.fit(p, q, 1e-3, bandwidth)
        assert_close_rel(coef[:, :290], cpu_alpha, 1e-9)
        assert torch.equal(coef[:, 290:], torch.full((1, 300), 1 / (1e-3 * 300), dtype=torch.float64))
        assert_close_rel(used, cpu_used, 1e-14)
    assert_close_rel(EMU.generic_median_bandwidth(q), reference.median_bandwidth(q[0]).reshape(1), 1e-14)


@pytest.mark.parametrize("shape", GENERIC_GPU_SHAPES[:3], ids=lambda s: "x".join(map(str, s)))
def test_the_generic_path_on_a_gpu_without_its_kernels_equals_the_cpu_kernels(shape):
    """set_generic_kernels(False), the benches' A/B: ATen's composition of the same steps on a GPU (the
    median still cuda/median.cu's where the pairs are many)."""
    b, n_p, n_q, d = shape
    p, q = seeded_samples(b, n_p, n_q, d, torch.float64, sum(shape), 1.2, 0.3)
    with _cuda_emulation.switched("set_generic_kernels", False):
        launches()
        assert_equals_cpu_kernels(p, q, True)
        names = {launch[0] for launch in launches()}
    assert not {name for name in names if name.startswith(("pair_tile_kernel", "kernel_block_kernel", "fit_coef_kernel",
                                                            "kl_finish_kernel"))}, names


def test_the_generic_path_on_a_gpu_holds_the_pairs_and_no_copy_of_the_samples():
    """The generic path's peak on a GPU, from the emulation's allocations (generic.cpp's and the
    kernels' host code, the same calls as on a GPU): the pairs' squared distances (packed, float64;
    above ~550 points a side they outweigh the evaluation's chunk of kernel rows) and vectors. The
    kernels read the float32 samples as they are: a float64 copy (N d doubles) would add more than the
    bound's slack."""
    n, d = 600, 16
    p, q = seeded_samples(1, n, n, d, torch.float32, n + d, 1.2, 0.3)
    N = 2 * n
    pairs = N * (N - 1) // 2 * 8
    slack = N * d * 4  # half the copy: the norms, the median's and the solve's vectors fit in it
    peak = peak_bytes(lambda: emulated_kl(p, q, True))
    assert pairs <= peak <= pairs + slack, (peak, pairs, slack)


def packed_pairs(x, y=None):
    """The squared distances of the pairs i < j of the stacked points [x; y] ([B, n, d], [B, m, d]),
    packed row by row (cuda::pair_sqdist's layout), from differences in float64."""
    pts = (x if y is None else torch.cat([x, y], 1)).double()
    i, j = torch.triu_indices(pts.shape[1], pts.shape[1], 1)
    return (pts[:, i] - pts[:, j]).square().sum(-1)


@pytest.mark.parametrize("n_den,n_num,d,dtype", [
    (30, 20, 5, torch.float64),      # 50 points: pair_sqdist_kernel
    (150, 140, 3, torch.float32),    # 290: pair_tile_kernel, 5 x 5 tiles, the last partial
    (100, 100, 40, torch.float32),   # 200, the (100, 50000) tiling: the last tile of 8 points, one sub-block
    (70, 0, 300, torch.float64),     # one side (median_bandwidth), dimensions split in ranges
    (1300, 0, 2, torch.float64),     # 21 x 21 tiles: the tile pair from the closed form, stored
])
def test_pair_sqdist_packs_every_pair(n_den, n_num, d, dtype):
    """cuda::pair_sqdist, the generic path's pairs on CUDA, for each kernel: every pair once, packed
    row by row (outputs start as NaN: a pair never written fails), against differences."""
    g = torch.Generator().manual_seed(n_den + d)
    den = torch.randn(2, n_den, d, dtype=torch.float64, generator=g).to(dtype)
    num = torch.randn(2, n_num, d, dtype=torch.float64, generator=g).to(dtype) + 0.5
    with emulated_device(multiprocessors=4):
        pairs = EMU.pair_sqdist(den, num)
    assert pairs.dtype == torch.float64 and pairs.shape == (2, (n_den + n_num) * (n_den + n_num - 1) // 2)
    assert_close_rel(pairs, packed_pairs(den, num), 1e-12)


@pytest.mark.parametrize("n_den,n_num,d,block,dtype", [
    (100, 90, 5, (0, 100, 0, 100), torch.float64),     # a system: tiles against themselves, the last partial
    (100, 90, 5, (0, 100, 0, 130), torch.float64),     # tiles at the same points, the columns' running on
    (100, 90, 5, (0, 100, 100, 90), torch.float32),    # the right side's numerator columns
    (70, 60, 40, (30, 40, 0, 130), torch.float64),     # a chunk of evaluation rows, off the tile grid; 2 slabs
    (70, 0, 3, (5, 1, 64, 6), torch.float64),          # one row; one set of points, apart from the columns
])
def test_kernel_block_equals_the_kernel_of_cdist(n_den, n_num, d, block, dtype):
    """cuda::kernel_block, the generic path's kernel values on CUDA: exp(D / scale) of any block of the
    stacked points against differences, exact ones where a point meets itself, NaN for a NaN scale (a
    NaN bandwidth) in its batch element only; and the system's form, divided, plus the diagonal."""
    g = torch.Generator().manual_seed(n_den + d)
    den = torch.randn(3, n_den, d, dtype=torch.float64, generator=g).to(dtype)
    num = torch.randn(3, n_num, d, dtype=torch.float64, generator=g).to(dtype) + 0.5
    scale = -2.0 * torch.tensor([1.5, 3.0, float("nan")], dtype=torch.float64) ** 2
    r0, rows, c0, cols = block
    with emulated_device(multiprocessors=4):
        k = EMU.kernel_block(den, num, r0, rows, c0, cols, scale, 1.0, 0.0)
        system = EMU.kernel_block(den, num, r0, rows, c0, cols, scale, 7.0, 0.25)  # K / 7 + 0.25 where i = j
    pts = torch.cat([den, num], 1).double()
    sq = (pts[:, r0:r0 + rows, None] - pts[:, None, c0:c0 + cols]).square().sum(-1)
    expected = (sq / scale[:, None, None]).exp()
    assert k.shape == (3, rows, cols) and k.dtype == torch.float64
    assert_close_rel(k[:2], expected[:2], 1e-12)
    assert k[2].isnan().all()
    lo, hi = max(r0, c0), min(r0 + rows, c0 + cols)
    i = torch.arange(lo, max(lo, hi))  # the points in both ranges
    assert (k[:2, i - r0, i - c0] == 1.0).all()
    expected_system = expected / 7.0
    expected_system[:, i - r0, i - c0] += 0.25
    assert_close_rel(system[:2], expected_system[:2], 1e-12)
    assert (system[:2, i - r0, i - c0] == 1.0 / 7.0 + 0.25).all()


def test_fit_coef_assembles_the_coefficients():
    """cuda::fit_coef: [-x, beta 1] per batch element, NaN for alpha (not beta) where Cholesky failed or
    the bandwidth is NaN (non-finite samples); more points than threads."""
    B, n_den, N = 4, 300, 700
    x = torch.randn(B, n_den, 1, dtype=torch.float64)
    info = torch.tensor([0, 3, 0, 0], dtype=torch.int32)
    sigma = torch.tensor([1.5, 1.5, float("nan"), 2.0], dtype=torch.float64)
    with emulated_device(multiprocessors=4):
        coef = EMU.fit_coef(x, info, sigma, N, 0.125)
    assert coef.shape == (B, N)
    assert torch.equal(coef[[0, 3], :n_den], -x[[0, 3], :, 0]) and (coef[:, n_den:] == 0.125).all()
    assert coef[1:3, :n_den].isnan().all()


@pytest.mark.parametrize("reverse", [True, False])
@pytest.mark.parametrize("state", ["projection", "weights", "none"])
def test_kl_finish_equals_the_aten_composition(reverse, state):
    """cuda::kl_finish, the generic kl forward's last launch on CUDA, against the formula of the ATen
    branch it replaces (generic.cpp): the KL and the clipped fraction from the ratios (some clipped,
    some negative, one 0, more rows than threads), each state row scaled by 1 / (sigma^2 r_j) or 0
    where clipped, in place; the projection state is the ratios' own tensor (more columns than lanes
    in the weights state). A NaN bandwidth makes only its element's state NaN."""
    g = torch.Generator().manual_seed(7 + reverse)
    B, n_q, d = 3, 600, 4
    out = torch.rand(B, n_q, d + 1, dtype=torch.float64, generator=g) * 2.0
    out[:, ::7, d] = 1e-9        # clipped
    out[:, 3::11, d] = -0.25     # negative fits: clipped too
    out[:, 5, d] = 0.0           # 0: a row of 0, not 0 / 0
    sigma = torch.tensor([0.7, 1.9, float("nan")], dtype=torch.float64)
    clip = 1e-8
    r = out[..., d].clone()
    kl = torch.log(r.clamp_min(clip)).mean(-1) * (-1.0 if reverse else 1.0)
    clipped = (r <= clip).double().mean(-1)
    row_scale = torch.where(r > clip, 1.0 / (r * sigma[:, None] ** 2), 0.0)
    weights = torch.rand(B, n_q, 70, dtype=torch.float64, generator=g)
    target = {"projection": out, "weights": weights, "none": None}[state]
    expected = None if target is None else target * row_scale[..., None]
    with emulated_device(multiprocessors=4):
        got_kl, got_clipped = EMU.kl_finish(out, target, sigma, clip, reverse)
    assert_close_rel(got_kl, kl, 1e-13)
    assert torch.equal(got_clipped, clipped)
    if target is not None:  # element 2: NaN rows but for the clipped ones, which are 0
        torch.testing.assert_close(target, expected, rtol=1e-15, atol=0, equal_nan=True)
        assert target[2].isnan().any() and (target[2][r[2] <= clip] == 0).all()


def median_selection(pairs: torch.Tensor, gather_keys: int = 32, last_digit_gathers: bool = True):
    """Where a radix selection of the median of the squared distances `pairs` [P] ends: (the digits it
    takes, whether it gathers the keys left or finds every digit, whether an even count's upper middle
    lies above the gathered keys). A model of the selections apart from the kernels: the keys sorted,
    a digit's bin the keys that share the lower middle's bits down to that digit's lowest; kl.cu's
    gathers at most 32 keys, also after the last digit, median.cu's at most 256, before it."""
    keys = sorted(pairs.double().numpy().view("int64").tolist())
    P, r = len(keys), (len(keys) + 1) // 2 - 1
    for digits, low_bit in enumerate((53, 42, 31, 20, 9, 0), 1):
        in_bin = [k for k in keys if k >> low_bit == keys[r] >> low_bit]
        if len(in_bin) <= gather_keys and (digits < 6 or last_digit_gathers):
            return digits, "gather", P % 2 == 0 and r + 1 - keys.index(in_bin[0]) >= len(in_bin)
    return 6, "every digit", None


def point_selection(x: torch.Tensor):
    """median_selection for kl.cu's median of the points x [N, d] with integer coordinates (their
    squared distances exact, whatever the summation order)."""
    return median_selection(packed_pairs(x[None])[0])


def integer_points(b, n, d, seed, high):
    """b x [n, d] points with integer coordinates in [-high, high), as float64."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-high, high, (b, n, d), generator=g).double()


@pytest.mark.parametrize("gathered", [True, False], ids=["gather", "every-digit"])
@pytest.mark.parametrize("N,ties", [(151, False), (160, False), (160, True), (41, True)])  # 11325 pairs, 12720, ..., 820
def test_the_median_of_pairs_kernels_equal_the_reference(N, ties, gathered):
    """cuda/median.cu's multi-block radix selection over packed pairs (several blocks per element on a
    small emulated device, so that the last block of each pass picks the digit): odd and even pair
    counts, ties; NaN for NaN distances and a zero median; with the last keys gathered (the default)
    and with a pass for every digit (set_gathered_selection(False))."""
    x = torch.randn(3, N, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(N))
    if ties:
        x = x.round()
    P = N * (N - 1) // 2
    with emulated_device(multiprocessors=4), _cuda_emulation.switched("set_gathered_selection", gathered):
        launches()
        sigma = EMU.median_of_pairs(packed_pairs(x))
        grids = {x.grid for x in launches()}
    assert grids == {(min(-(-P // 256), (8 * 4 + 2) // 3), 3, 1)}
    for b in range(3):
        assert_close_rel(sigma[b:b + 1], reference.median_bandwidth(x[b]).reshape(1), 1e-14)
    bad = x.clone()
    bad[0, 5, 1] = float("nan")
    bad[1] = 0.0
    with emulated_device(multiprocessors=4), _cuda_emulation.switched("set_gathered_selection", gathered):
        sigma = EMU.median_of_pairs(packed_pairs(bad))
    assert sigma[[0, 1]].isnan().all()
    assert_close_rel(sigma[2:], reference.median_bandwidth(bad[2]).reshape(1), 1e-14)


# (the pairs' points, [B, N, d]): their selections gather after the second digit (the upper middle in
# the gathered bin and above it), after the third, and (ties) never
GATHER_CASES = {
    "spread": integer_points(4, 200, 3, 14, 2**20),  # 19,900 pairs
    "clustered": 2.0**24 * torch.eye(80).expand(2, 80, 80) + integer_points(2, 80, 80, 15, 2**10),  # 3160
    "tied": integer_points(2, 120, 2, 16, 3),  # 7140
}


@pytest.mark.parametrize("name", GATHER_CASES)
def test_the_median_of_pairs_gathers_where_the_model_says_and_then_returns_at_once(name):
    """median.cu's passes end with the gather of at most 256 keys, one pass after the digit that leaves
    them (a model of the selection, apart from the kernels, says which), and the launches after it
    return before their first barrier; with ties the selection takes every digit. The bandwidth is the
    reference's either way."""
    x = GATHER_CASES[name]
    pairs = packed_pairs(x)
    P = pairs.shape[1]
    model = [median_selection(pairs[b], 256, last_digit_gathers=False) for b in range(x.shape[0])]
    expected = {"spread": {(2, "gather", False), (2, "gather", True)}, "clustered": {(3, "gather", False), (3, "gather", True)},
                "tied": {(6, "every digit", None)}}[name]
    assert set(model) == expected, model
    # (the elements of a batch gather after the same digit here, so each launch either works or returns)
    digits = model[0][0]
    for gathered in (True, False):
        with emulated_device(multiprocessors=4), _cuda_emulation.switched("set_gathered_selection", gathered):
            launches()
            sigma = EMU.median_of_pairs(pairs)
            barriers = [x.block_barriers for x in launches()]
        assert len(barriers) == 6 + (P % 2 == 0)
        working = digits + 1 if gathered and digits < 6 else len(barriers)
        assert all(n > 0 for n in barriers[:working]) and all(n == 0 for n in barriers[working:]), barriers
        assert_close_rel(sigma, reference.median_bandwidth(x), 1e-14)


# (what the points stand for, p, q): each batch's elements take the selection's branches listed
MEDIAN_CASES = [
    ("few pairs, odd", integer_points(2, 3, 4, 0, 2**20), integer_points(2, 4, 4, 1, 2**20)),      # 21 pairs
    ("few pairs, even", integer_points(2, 4, 4, 2, 2**20), integer_points(2, 4, 4, 3, 2**20)),     # 28
    ("spread", integer_points(6, 30, 3, 4, 2**20), integer_points(6, 30, 3, 5, 2**20)),            # 1770
    # a simplex's vertices 2^24 apart, moved by up to 2^10: distances within ~2^-14 of each other
    ("clustered", 2.0**24 * torch.eye(40)[:20].expand(2, 20, 40) + integer_points(2, 20, 40, 6, 2**10),
     2.0**24 * torch.eye(40)[20:].expand(2, 20, 40) + integer_points(2, 20, 40, 7, 2**10)),
    ("tied, odd", integer_points(2, 12, 2, 8, 2), integer_points(2, 10, 2, 9, 2)),                # 231 pairs
    ("tied, even", integer_points(2, 20, 2, 10, 2), integer_points(2, 20, 2, 11, 2)),             # 780
]


def test_the_median_selection_model_covers_each_branch():
    """The cases below take every branch of the selection: a gather after the first digit, the second
    (the upper middle in the gathered bin and above it) and a later one; every digit (ties), for odd
    and even counts."""
    branches = {(name, point_selection(torch.cat([p[k], q[k]])))
                for name, p, q in MEDIAN_CASES for k in range(p.shape[0])}
    taken = {(digits, how, above) for _, (digits, how, above) in branches}
    assert {(1, "gather", False), (2, "gather", False), (2, "gather", True), (6, "every digit", None)} <= taken
    assert any(digits >= 3 and how == "gather" for digits, how, _ in taken)
    assert {name for name, (_, how, _) in branches if how == "every digit"} == {"tied, odd", "tied, even"}


@pytest.mark.parametrize("gathered", [True, False], ids=["gather", "every-digit"])
@pytest.mark.parametrize("case", range(len(MEDIAN_CASES)), ids=[c[0] for c in MEDIAN_CASES])
def test_the_fused_median_equals_the_reference(gathered, case):
    """kl.cu's median (the bandwidth kl returns) against the reference, with the gather of the last
    keys (the default) and with a pass for every digit (set_gathered_selection(False))."""
    _, p, q = MEDIAN_CASES[case]
    assert EMU.handles_kl(p.shape[1] + q.shape[1], p.shape[2], p.shape[0])
    with _cuda_emulation.switched("set_gathered_selection", gathered):
        sigma = EMU.kl(p, q, 1e-3, 1e-8, None, False, False)[2]
    expected = reference.median_bandwidth(torch.cat([p, q], 1))
    assert_close_rel(sigma, expected, 1e-15)


def test_the_gather_saves_the_passes_of_the_digits_left():
    """At 128 x (100, 8)'s size the selection gathers after the second digit: the forward kernel
    passes 4 barriers fewer for each digit left and one fewer for the even count's second middle, and
    2 more for the gather and its ranking (15 fewer here), with the same bandwidth."""
    p, q = integer_points(1, 100, 8, 12, 2**20), integer_points(1, 100, 8, 13, 2**20)
    digits, how, _ = point_selection(torch.cat([p[0], q[0]]))
    assert (digits, how) == (2, "gather")
    runs = {}
    for gathered in (True, False):
        with _cuda_emulation.switched("set_gathered_selection", gathered):
            launches()
            sigma = EMU.kl(p, q, 1e-3, 1e-8, None, False, False)[2]
            (runs[gathered],) = [(x.block_barriers, sigma) for x in launches() if x.kernel == "forward"]
    assert runs[False][0] - runs[True][0] == 4 * (6 - digits) + 1 - 2
    assert torch.equal(runs[True][1], runs[False][1])


def test_a_device_without_enough_shared_memory_is_refused():
    """The leanest layout of (100, 8) needs ~42 KB: handles_kl says no (the generic kernels take such
    shapes), and a direct call fails with what it needed."""
    p, q = seeded_samples(1, 100, 100, 8, torch.float64, 0, 1.0, 0.0)
    with emulated_device(shared_per_block_optin=40000):
        assert not EMU.handles_kl(200, 8, 1)
        with pytest.raises(RuntimeError, match="bytes of shared memory needed"):
            EMU.kl(p, q, 1e-3, 1e-8, None, False, True)
    assert EMU.handles_kl(200, 8, 1)


def test_the_emulation_catches_the_bugs_it_is_for():
    """Kernels with planted bugs (csrc/cuda_emulation/buggy_kernels.cu, translated as csrc/cuda/'s are):
    a read of a neighbour's shared-memory write without a barrier gives wrong values (the poison's NaN,
    or what the neighbour held before, as the seed orders the threads), and a __shared__ total never set
    to 0 sums onto the poison (NaN or a huge value), on every seed; a barrier the threads
    reach at two calls, a shuffle half a warp never reaches, a write past the dynamic shared memory,
    56 KB of shared memory without opting in, a pointer to global memory assumed to point to shared
    memory (kl.cu's assume_shared), a launch from a kernel and a partial warp mask (not emulated) are
    errors naming the place."""
    right = (torch.arange(64, dtype=torch.float64) + 1) % 64
    outs, totals = [], []
    for seed in (1, 2, 3, 4):
        with emulated_device(seed=seed):
            outs.append(EMU.run_buggy_kernel("unsynchronized_neighbours"))
            totals.append(EMU.run_buggy_kernel("unwritten_static_shared"))
    assert any(not torch.equal(o, right) for o in outs) and any(o.isnan().any() for o in outs)
    assert all(t.isnan().all() or (t > 1e100).all() for t in totals), totals
    for name, message in [
        ("divergent_barrier", r"divergent_barrier.*stuck.*32 threads \(first 0\) at __syncthreads"),
        ("shuffle_after_exit", r"shuffle_after_exit.*stuck.*16 threads \(first 16\) at __shfl_xor_sync, warp 0"),
        ("write_past_shared", r"write_past_shared.*wrote past its 512 bytes of dynamic shared memory"),
        ("shared_beyond_48kb",
         r"shared_beyond_48kb.*uses 16384 bytes of static and 40960 of dynamic shared memory, above the 49152"),
        ("global_assumed_shared", r"global_assumed_shared.*the assumption __isShared\(p\) is false"),
        ("launch_from_a_kernel", r"divergent_barrier launched from inside a kernel"),
        ("partial_warp_shuffle", r"__shfl_xor_sync with a partial warp mask"),
    ]:
        with pytest.raises(RuntimeError, match=message):
            EMU.run_buggy_kernel(name)
    with pytest.raises(ValueError, match="no kernel"):
        EMU.run_buggy_kernel("no_such_kernel")
    # the emulation goes on after each error
    with emulated_device(seed=1):
        assert torch.equal(EMU.run_buggy_kernel("unsynchronized_neighbours"), outs[0])


def test_translate_rewrites_launches_and_shared_variables_in_code_only():
    """csrc/cuda_emulation/translate.py: launches of 2 to 4 arguments, every declarator of a __shared__
    declaration (a union's too) poisoned, an extern __shared__ array made the dynamic memory; comments
    and strings untouched; lines kept (compiler messages point at the .cu file)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "csrc" / "cuda_emulation" / "translate.py"
    spec = importlib.util.spec_from_file_location("translate", path)
    translate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(translate)
    source = (
        '/* __shared__ int x; k<<<1, 2>>>(y) */ const char* s = "__shared__ <<<";\n'
        "__global__ void k(double* out) {\n"
        "  extern __shared__ double dyn[];\n"
        "  __shared__ double a[4], b[2][3];  // a comment's __shared__ c;\n"
        "  __shared__ union {\n    int i[3];\n    double d;\n  } u;\n"
        "}\n"
        "void host(double* x) {\n  k<<<1, 32>>>(x);\n  k<<<dim3(1, 2), 32, 0>>>(x);\n  k<<<g, 64, n * 8, stream>>>(x);\n}\n")
    out = translate.translate(source)
    assert out.count("\n") == source.count("\n")
    lines = out.splitlines()
    assert lines[0] == source.splitlines()[0]  # the comment and the string as they were
    assert "double* dyn = static_cast<double*>(::emu::dynamic_shared_memory());" in lines[2]
    assert lines[3].count("poison_shared") == 2 and "sizeof(a)" in lines[3] and "sizeof(b)" in lines[3]
    assert "// a comment's __shared__ c;" in lines[3]
    assert lines[7].strip() == "} u; ::emu::poison_shared(&u, sizeof(u));"
    assert lines[10].strip() == '::emu::launch("k", k, 1, 32)(x);'
    assert lines[11].strip() == '::emu::launch("k", k, dim3(1, 2), 32, 0)(x);'
    assert lines[12].strip() == '::emu::launch("k", k, g, 64, n * 8, stream)(x);'


def test_a_batch_the_forwards_int_step_could_overflow_goes_to_the_generic_path():
    """The forward's blocks take elements b = blockIdx.x + k gridDim.x in an int, with up to one block
    an element: b + gridDim.x <= 2 B - 1, past int's range above 2^30 elements, so such batches are not
    the fused forward's (the test needs no such tensor: handles_kl looks at shapes only)."""
    assert EMU.handles_kl(4, 1, 2**30)
    assert not EMU.handles_kl(4, 1, 2**30 + 1)


@pytest.mark.parametrize("nb", [1, 4, 1056, 65535])
@pytest.mark.parametrize("sms", [1, 132])
def test_no_median_block_counts_past_its_32_bit_histogram(nb, sms):
    """median.cu's blocks count their keys in 32-bit shared bins, taking every (grid.x * 256)-th run of
    256 pairs: with one block an element (many elements, nb >= 8 SMs) and N >= 92,682 points, P >= 2^32
    pairs would have wrapped a bin. Checked from the block count (no tensor that large is needed); below
    that the count is the one that fills the GPU."""
    threads = 256
    for P in (1, 255, 257, 10**6, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**32 + 1, 92_682 * 92_681 // 2, 2**40, 2**50):
        blocks = EMU.median_blocks_per_element(P, nb, sms)
        assert 1 <= blocks <= 2**31 - 1
        most = -(-P // (blocks * threads)) * threads  # a block's keys at most: its runs of 256
        assert most < 2**32, (P, blocks)
        if P < 2**31:
            assert blocks == max(1, min(-(-P // threads), -(-8 * sms // nb)))
