"""The ops on CUDA tensors equal the reference computed on the CPU: the CUDA kernels (csrc/cuda/, for
the kl op and its backward at the shapes they take) and the device-generic ATen kernels (the rest);
nothing reads a value back to the host; a training step that calls kl is captured in a CUDA graph.

These run only where torch sees a GPU; elsewhere pytest reports them as skipped (CI has none). The
generic kernels themselves are also tested on the CPU (the ``generic`` implementation of conftest).
"""

import contextlib
import copy
import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kivi_fast
from kivi_fast import reference

from conftest import implementation, no_host_sync
from test_ops_vs_reference import MAX_WORK, make_samples, value_and_grad

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def compiled_ops():
    if kivi_fast.backend() != "cpp":
        pytest.fail("the compiled ops are not built (pip install --no-build-isolation -e .)")


@st.composite
def problems(draw):
    n_p, n_q = draw(st.integers(2, 300)), draw(st.integers(2, 300))
    d = min(draw(st.sampled_from([1, 3, 8, 64, 700, 5000])), max(1, MAX_WORK // (n_p + n_q) ** 2))  # the oracle's memory
    return dict(n_p=n_p, n_q=n_q, d=d,
                batch=draw(st.sampled_from([None, 1, 4])), lam=draw(st.floats(1e-4, 1e-1)),
                scale=draw(st.floats(0.1, 10.0)), shift=draw(st.floats(0.0, 3.0)),
                dtype=draw(st.sampled_from([torch.float32, torch.float64])), reverse=draw(st.booleans()),
                seed=draw(st.integers(0, 2**16)))


def assert_close_rel(actual, expected, rtol):
    actual = actual.cpu().to(expected.dtype)
    scale = expected.abs().max().clamp_min(1e-30)
    assert (actual - expected).abs().max() <= rtol * scale, ((actual - expected).abs().max(), scale)


@settings(max_examples=40)
@given(pr=problems())
def test_kl_on_cuda_equals_the_reference_on_cpu(pr):
    p, q = make_samples(pr)
    kw = dict(lam=pr["lam"], reverse=pr["reverse"])
    ours_v, ours_g = value_and_grad(kivi_fast.kernel_kl, p.to(CUDA), q.to(CUDA), **kw)
    ref_v, ref_g = value_and_grad(reference.kernel_kl, p, q, **kw)
    assert ours_v.device.type == "cuda" and ours_g.device.type == "cuda" and ours_v.dtype == p.dtype
    # float32 inputs are fitted in float64 on both sides; cuBLAS and MKL sum in other orders
    rtol = 1e-5 if pr["dtype"] == torch.float32 else 1e-8
    assert_close_rel(ours_v, ref_v, rtol)
    assert_close_rel(ours_g, ref_g, rtol if pr["dtype"] == torch.float32 else 1e-7)


@settings(max_examples=20)
@given(pr=problems())
def test_density_ratio_and_primitives_on_cuda_equal_the_reference(pr):
    p, q = make_samples(pr)
    if pr["batch"] is not None:
        p, q = p[0], q[0]
    p, q = p.double(), q.double()
    ours = kivi_fast.DensityRatio(lam=pr["lam"]).fit(numer=p.to(CUDA), denom=q.to(CUDA))
    ref = reference.DensityRatio(lam=pr["lam"]).fit(numer=p, denom=q)
    assert_close_rel(ours.sigma, ref.sigma, 1e-12)
    assert_close_rel(ours.alpha, ref.alpha, 1e-7)
    z = q[: min(5, len(q))]
    assert_close_rel(ours.ratio(z.to(CUDA)), ref.ratio(z), 1e-7)
    # its gradient, from the ratio op's grad state (the projection where d + 1 < N, else the weights)
    z_ours, z_ref = z.to(CUDA).requires_grad_(True), z.clone().requires_grad_(True)
    ours.log_ratio(z_ours).sum().backward()
    ref.log_ratio(z_ref).sum().backward()
    assert_close_rel(z_ours.grad, z_ref.grad, 1e-7)
    assert_close_rel(kivi_fast.median_bandwidth(torch.cat([p, q]).to(CUDA)),
                     reference.median_bandwidth(torch.cat([p, q])), 1e-12)
    assert_close_rel(kivi_fast.rbf_gram(p.to(CUDA), q.to(CUDA), sigma=1.7), reference.rbf_gram(p, q, sigma=1.7), 1e-10)


@pytest.mark.parametrize("n", [363, 400])  # 65703 pairs (odd count), 79800 (even)
@pytest.mark.parametrize("ties", [False, True])
def test_median_of_many_pairs_on_cuda_equals_the_reference(n, ties):
    """From 2^16 pairs the CUDA median sorts instead of selecting: an odd and an even pair count, on
    distinct distances and on many tied ones (where the two middles may coincide)."""
    x = torch.randn(n, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
    if ties:
        x = x.round()  # many equal distances, the middle two among them
    assert_close_rel(kivi_fast.median_bandwidth(x.to(CUDA)), reference.median_bandwidth(x), 1e-12)


def test_a_training_step_on_cuda_matches_the_cpu_step():
    """One SGD step of a generator trained through kl moves its weights on the GPU as on the CPU."""
    import copy

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)).double()
    eps, prior = torch.randn(100, 4, dtype=torch.float64), torch.randn(100, 3, dtype=torch.float64)
    stepped = {}
    for device in ("cpu", "cuda"):
        model = copy.deepcopy(net).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        kivi_fast.kernel_kl(prior.to(device), model(eps.to(device))).backward()
        opt.step()
        stepped[device] = [p.detach().cpu() for p in model.parameters()]
    for before, a, b in zip(net.parameters(), stepped["cpu"], stepped["cuda"]):
        assert not torch.equal(a, before.detach())  # the step moved the weights
        torch.testing.assert_close(b, a, rtol=1e-7, atol=1e-10)


def test_mixed_devices_and_bad_arguments_raise_clear_errors():
    p, q = torch.randn(20, 3), torch.randn(20, 3)
    with pytest.raises(ValueError, match="same device"):
        kivi_fast.kernel_kl(p.to(CUDA), q)
    with pytest.raises(ValueError, match="lam"):
        kivi_fast.kernel_kl(p.to(CUDA), q.to(CUDA), lam=0.0)


def assert_cuda_equals_cpu_kernels(p, q, reverse: bool, rtol: float, value_rtol: float | None = None) -> None:
    """kernel_kl's value (within value_rtol, default rtol) and gradient w.r.t. q (within rtol) on CUDA
    against the CPU kernels' (themselves checked against the reference in test_ops_vs_reference.py)."""
    ours_v, ours_g = value_and_grad(kivi_fast.kernel_kl, p.to(CUDA), q.to(CUDA), reverse=reverse)
    cpu_v, cpu_g = value_and_grad(kivi_fast.kernel_kl, p, q, reverse=reverse)
    assert_close_rel(ours_v, cpu_v, rtol if value_rtol is None else value_rtol)
    assert_close_rel(ours_g, cpu_g, rtol)


def seeded_samples(b, n_p, n_q, d, dtype, seed, scale, shift):
    """p ~ N(0, I) [b, n_p, d] and q ~ N(shift, scale^2 I) [b, n_q, d], drawn in float64 on the CPU."""
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(b, n_p, d, generator=g, dtype=torch.float64).to(dtype)
    q = (torch.randn(b, n_q, d, generator=g, dtype=torch.float64) * scale + shift).to(dtype)
    return p, q


def kernels_run(fn) -> set:
    """The names of the CUDA kernels that fn() launches."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.name for e in prof.events()}


# (batch, n_p, n_q, d): each path of csrc/cuda/kl.cu
CUDA_KERNEL_SHAPES = [
    (128, 100, 100, 8),  # the VAE: distances in the kernel, projection state, system in shared memory
    (3, 256, 256, 4),    # N = 512, the largest: the system in global memory
    (2, 5, 7, 20),       # d + 1 >= N: the weight state and its backward
    (1, 10, 10, 30000),  # N <= 64 in many dimensions: pair_sqdist_kernel over dimension chunks
    (2, 40, 24, 700),    # N = 64, the widest such set
    (2, 100, 100, 700),  # N = 200 in many dimensions: pair_tile_kernel, distances in global memory
    (1, 70, 60, 1000),   # N = 130: three tiles a side, the last partial; ranges of dimensions, the
                         # last slab partial; the distances staged in shared memory
    (1, 56, 200, 300),   # N = 256, four full tiles; reverse: the 200 x 200 system in global memory
]


@pytest.mark.parametrize("shape", CUDA_KERNEL_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("reverse", [True, False])
def test_cuda_kernels_run_and_equal_the_reference(shape, dtype, reverse):
    b, n_p, n_q, d = shape
    p, q = seeded_samples(b, n_p, n_q, d, dtype, sum(shape) + reverse, 1.2, 0.3)
    kw = dict(lam=1e-3, reverse=reverse)
    names = kernels_run(lambda: value_and_grad(kivi_fast.kernel_kl, p.to(CUDA), q.to(CUDA), **kw))
    assert any("kl_forward_kernel" in n for n in names), sorted(names)
    if n_p + n_q > 64 and (n_p + n_q) * d > 6144:
        assert any("pair_tile_kernel" in n for n in names), sorted(names)
    ours_v, ours_g = value_and_grad(kivi_fast.kernel_kl, p.to(CUDA), q.to(CUDA), **kw)
    ref_v, ref_g = value_and_grad(reference.kernel_kl, p, q, **kw)
    rtol = 1e-5 if dtype == torch.float32 else 1e-9
    assert_close_rel(ours_v, ref_v, rtol)
    assert_close_rel(ours_g, ref_g, rtol if dtype == torch.float32 else 1e-8)
    # the op's other outputs against the generic kernels on the same GPU
    args = (p.to(CUDA), q.to(CUDA), 1e-3, 1e-8, None, reverse, True)
    ours = torch.ops.kivi_fast.kl(*args)
    with implementation("generic"):  # the ATen kernels, what CUDA tensors ran before csrc/cuda/
        theirs = torch.ops.kivi_fast.kl(*args)
    # grad state, bandwidth, clipped fraction. The state's weights come out of a solve whose condition
    # number grows like 1/lam: the two kernels' summation orders differ by more than the values' 1e-9
    # there (1.6e-9 of the largest weight was seen in float64 on an H200).
    for a, e in zip(ours[1:], theirs[1:]):
        assert a.shape == e.shape
        assert_close_rel(a, e.cpu(), 1e-7)


# (batch, n_p, n_q, d): the weight state's backward kernel (d + 1 >= N) over its tiles: 8 rows of q_z
# per block, the weights staged 256 points at a time, 256 dimensions per block
WEIGHT_STATE_SHAPES = [
    (1, 9, 13, 3000),   # the CUDA forward (N <= 64); two row tiles, the second partial
    (2, 150, 141, 600),  # the generic forward; 291 points: two weight tiles; 600 = 2 x 256 + 88 dimensions
    (3, 40, 150, 400),  # the tiled forward (N = 190); 19 row tiles of q_z, the last partial
]


@pytest.mark.parametrize("shape", WEIGHT_STATE_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("reverse", [True, False])
def test_the_weight_state_backward_kernel_equals_the_cpu_kernels(shape, dtype, reverse):
    """Against the CPU kernels (the reference's [N, N, d] differences would not fit these shapes)."""
    b, n_p, n_q, d = shape
    p, q = seeded_samples(b, n_p, n_q, d, dtype, sum(shape) + reverse, 1.1, 0.2)
    names = kernels_run(lambda: value_and_grad(kivi_fast.kernel_kl, p.to(CUDA), q.to(CUDA), reverse=reverse))
    assert any("grad_from_weights_kernel" in n for n in names), sorted(names)
    assert_cuda_equals_cpu_kernels(p, q, reverse, 1e-5 if dtype == torch.float32 else 1e-8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("reverse", [True, False])
def test_batches_of_several_waves_share_multiprocessors_and_equal_the_cpu_kernels(dtype, reverse):
    """More batch elements than SMs: kl_forward_kernel<T, 2> (two blocks per SM, the distances in
    global memory) for the VAE's shape, against the CPU kernels."""
    b = 2 * torch.cuda.get_device_properties(CUDA).multi_processor_count + 3
    p, q = seeded_samples(b, 100, 100, 8, dtype, 7 + reverse, 1.2, 0.3)
    names = kernels_run(lambda: value_and_grad(kivi_fast.kernel_kl, p.to(CUDA), q.to(CUDA), reverse=reverse))
    # (the profiler's name spells the template's arguments: kl_forward_kernel<float, 2>)
    assert any(re.search(r"kl_forward_kernel<\w+, 2\b", n) for n in names), sorted(names)
    if dtype == torch.float32:
        assert_cuda_equals_cpu_kernels(p, q, reverse, 1e-5)
    else:  # (the gradient: 1.3e-8 of its largest entry with reverse=True on an H200, over 267 elements)
        assert_cuda_equals_cpu_kernels(p, q, reverse, 5e-8, value_rtol=1e-9)


@contextlib.contextmanager
def switched(setter: str, flag: bool):
    """One of the CUDA build's testing switches (torch.ops.kivi_fast_testing.set_*) set to flag inside
    the block, its old value restored after."""
    assert kivi_fast.backend() == "cpp"  # the library loaded (its testing ops with it)
    set_flag = getattr(torch.ops.kivi_fast_testing, setter)
    old = set_flag(flag)
    try:
        yield
    finally:
        set_flag(old)


def elimination(mode: str):
    """The forward kernel's elimination: two columns a step (the default) or one (set_paired_elimination
    off)."""
    return switched("set_paired_elimination", mode != "one-column")


@pytest.mark.parametrize("mode", ["two-columns", "one-column"])
@pytest.mark.parametrize("shape,reverse", [((4, 100, 100, 8), False), ((2, 37, 40, 8), True), ((1, 56, 200, 300), True)],
                         ids=["100", "37-odd", "200-global"])
def test_each_elimination_equals_the_cpu_kernels(mode, shape, reverse):
    """The forward kernel's elimination two columns a step (the default) and one
    (set_paired_elimination(False)): even and odd systems, one in global memory."""
    b, n_p, n_q, d = shape
    p, q = seeded_samples(b, n_p, n_q, d, torch.float64, n_p + 7, 1.2, 0.3)
    with elimination(mode):
        assert_cuda_equals_cpu_kernels(p, q, reverse, 1e-8, value_rtol=1e-9)


# The benches' switches of kernel variants, and shapes that take each variant (here and in
# test_cuda_emulation.py)
VARIANT_CASES = [
    ("set_tile_subblocks", (1, 100, 100, 300)),    # the fused wide path's pair_tile_kernel: the last tile of 8 points
    ("set_tile_subblocks", (2, 100, 100, 40)),     # the generic path's: its pairs' tiles as above, kernel_block's
    ("set_tile_subblocks", (1, 300, 290, 3)),      # the generic path: kernel_block's tiles, the last partial
    ("set_tile_subblocks", (1, 70, 60, 2011)),     # 3 tiles, the last of 2 points; a last slab of 27 dimensions
    ("set_balanced_tile_ranges", (1, 100, 100, 3000)),  # 10 tile pairs, ranges of 2 to 10 slabs on 132 SMs
    ("set_balanced_tile_ranges", (1, 70, 60, 2011)),    # 6 tile pairs, ranges of 1 to 4 slabs
    ("set_paired_weight_dims", (1, 9, 13, 3000)),  # the weight state's backward: 3000 = 5 x 512 + 440
    ("set_paired_weight_dims", (2, 40, 150, 400)),  # a block's second dimensions past d: 400 < 512
    ("set_weight_kernel", (1, 9, 13, 3000)),       # the weight state's backward by the generic path's GEMM
    ("set_weight_kernel", (2, 40, 150, 400)),
    ("set_product_tile_distances", (1, 100, 100, 3000)),  # the fused wide path's distances from norms and products
    ("set_product_tile_distances", (1, 70, 60, 2011)),    # 3 tiles, the last of 2 points; a partial last slab
    ("set_product_tile_distances", (1, 300, 290, 3)),     # the generic path's pairs for its median
    ("set_gemm_pair_distances", (1, 100, 100, 3000)),  # the wide path's distances by cuBLAS, not pair_tile_kernel
    ("set_gemm_pair_distances", (2, 9, 13, 50000)),    # not pair_sqdist_kernel; chunks of 2^21 / 44 = 47,662
                                                       # dimensions, the second partial
]
VARIANT_IDS = ["tiles-wide", "tiles-generic-200", "tiles-generic", "tiles-uneven", "ranges-wide", "ranges-uneven",
               "weights-fused", "weights-tiled", "weights-gemm-fused", "weights-gemm-tiled", "products-wide",
               "products-uneven", "products-generic", "gemm-pairs-tiles", "gemm-pairs-warps"]
# the variants whose sums are taken in another order or form than the defaults' (other ranges of
# dimensions, a GEMM, norms and products): the same values up to rounding, not the same bits
REORDERING_SWITCHES = ("set_balanced_tile_ranges", "set_weight_kernel", "set_product_tile_distances",
                       "set_gemm_pair_distances")


@pytest.mark.parametrize("switch, shape", VARIANT_CASES, ids=VARIANT_IDS)
def test_the_benches_other_kernel_variants_equal_the_defaults_on_cuda(switch, shape):
    """The tiled distances with every sub-block (set_tile_subblocks(False)), the same ranges of
    dimensions for every tile pair (set_balanced_tile_ranges(False): by cost is the default) or from
    norms and products (set_product_tile_distances(True)), the wide path's from cuBLAS's GEMM
    (set_gemm_pair_distances(True)),
    and the weight state's backward with one dimension a thread
    (set_paired_weight_dims(False)) or by the generic path (set_weight_kernel(False)) against the CPU
    kernels, and
    against the defaults: the backward's variants on one forward, the same bits; the distances' within
    1e-6 (their ranges of dimensions add up by atomics in any order, so two forwards may differ in the
    last bits whichever variant runs)."""
    b, n_p, n_q, d = shape
    p, q = seeded_samples(b, n_p, n_q, d, torch.float32, sum(shape), 1.2, 0.3)
    for flag in (True, False):
        with switched(switch, flag):
            assert_cuda_equals_cpu_kernels(p, q, False, 1e-5)
    if switch == "set_paired_weight_dims":
        qc = q.to(CUDA).requires_grad_(True)
        value = kivi_fast.kernel_kl(p.to(CUDA), qc).sum()
        grads = []
        for flag in (True, False):
            with switched(switch, flag):
                grads.append(torch.autograd.grad(value, qc, retain_graph=True)[0])
        assert torch.equal(*grads)
    else:
        runs = []
        for flag in (True, False):
            with switched(switch, flag):
                runs.append(value_and_grad(kivi_fast.kernel_kl, p.to(CUDA), q.to(CUDA)))
        for on, off in zip(*runs):
            assert_close_rel(off, on.cpu(), 1e-6)


@pytest.mark.parametrize("shape", [(1, 100, 100, 3000), (2, 9, 13, 3000)], ids=["tiles", "warp-pairs"])
def test_the_gemm_distances_run_instead_of_the_pair_kernels_without_host_reads(shape):
    """set_gemm_pair_distances (the benches' A/B): under the switch no pair kernel runs (cuBLAS's GEMM
    does), nothing is read back to the host, and the KL equals the default's within float32's rounding."""
    b, n_p, n_q, d = shape
    p, q = (t.to(CUDA) for t in seeded_samples(b, n_p, n_q, d, torch.float32, 17, 1.2, 0.3))
    want = kivi_fast.kernel_kl(p, q)
    with switched("set_gemm_pair_distances", True):
        names = kernels_run(lambda: kivi_fast.kernel_kl(p, q))
        with no_host_sync():
            got = kivi_fast.kernel_kl(p, q)
    assert not any("pair_tile" in k or "pair_sqdist" in k for k in names), names
    assert_close_rel(got, want, 1e-5)


def test_a_batch_beyond_one_grids_height_equals_its_elements_alone():
    """More batch elements than a grid's y dimension holds (65,535) take the generic path, whose pair
    distances run in chunks of the batch: the last chunk's ranges of dimensions add into zeroed rows of
    their own, not over the first chunk's stored sums (zeroing all of them gave the first chunk's
    elements a median of 0 and a NaN KL). Each element against itself alone (the fused kernels)."""
    b, n, d = 65537, 35, 200  # 70 points (pair_tile_kernel), 2 elements in the second chunk
    gen = torch.Generator(device=CUDA).manual_seed(0)
    p = torch.randn(b, n, d, device=CUDA, generator=gen)
    q = 0.5 * torch.randn(b, n, d, device=CUDA, generator=gen) + 0.3
    values = kivi_fast.kernel_kl(p, q)
    for i in (0, 1, b - 3, b - 2, b - 1):
        alone = kivi_fast.kernel_kl(p[i:i + 1], q[i:i + 1])
        assert torch.isfinite(values[i]) and abs(values[i] - alone[0]) <= 1e-5 * abs(alone[0]), (i, values[i], alone)


def test_the_forward_kernels_stage_clocks_are_recorded_in_order_and_then_stop():
    """bench/gpu.py --profile's per-stage latency: block 0's clock at each stage, nondecreasing; none
    once the buffer is unset."""
    assert kivi_fast.backend() == "cpp"  # the library loaded (its testing ops with it)
    clocks = torch.zeros(6, dtype=torch.int64, device=CUDA)
    p, q = torch.randn(4, 100, 8, device=CUDA), torch.randn(4, 100, 8, device=CUDA)
    torch.ops.kivi_fast_testing.set_forward_stage_clocks(clocks)
    try:
        kivi_fast.kernel_kl(p, q)
        torch.cuda.synchronize()
    finally:
        torch.ops.kivi_fast_testing.set_forward_stage_clocks(None)
    c = clocks.tolist()
    assert c[0] > 0 and all(a <= b for a, b in zip(c, c[1:])) and c[-1] > c[0], c
    clocks.zero_()
    kivi_fast.kernel_kl(p, q)
    torch.cuda.synchronize()
    assert clocks.count_nonzero() == 0
    with pytest.raises(ValueError, match="int64 CUDA tensor"):
        torch.ops.kivi_fast_testing.set_forward_stage_clocks(torch.zeros(6, dtype=torch.int64))


@pytest.mark.parametrize("gathered", [True, False], ids=["gather", "every-digit"])
@pytest.mark.parametrize("n", [120, 122])  # 7140 pairs (even count), 7381 (odd)
@pytest.mark.parametrize("ties", [False, True])
def test_the_cuda_kernels_median_equals_the_reference(n, ties, gathered):
    """The radix selection in kl_forward_kernel: both middles of an even count, and many tied
    distances; with the last keys gathered (the default) and with a pass for every digit
    (set_gathered_selection(False))."""
    x = torch.randn(4, n, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
    if ties:
        x = x.round()
    p, q = x[:, : n // 2], x[:, n // 2:]
    with switched("set_gathered_selection", gathered):
        sigma = torch.ops.kivi_fast.kl(p.to(CUDA), q.to(CUDA), 1e-3, 1e-8, None, True, False)[2]
    assert_close_rel(sigma, reference.median_bandwidth(torch.cat([q, p], 1)), 1e-14)


# (batch, n_p, n_q, d, ties): shapes the CUDA forward leaves to the generic one (csrc/generic.cpp)
GENERIC_SHAPES = [
    (1, 300, 250, 3, False),   # 550 points: 150,975 pairs by cuda::pair_sqdist, their median by cuda/median.cu
    (2, 260, 300, 4, True),    # a batch, many tied distances (the two middles may coincide)
    (1, 130, 140, 4000, False),  # 270 points in many dimensions (above kl.cu's 256): columns in 3 chunks
]


@pytest.mark.parametrize("shape", GENERIC_SHAPES, ids=lambda s: "x".join(map(str, s[:4])) + ("-ties" if s[4] else ""))
@pytest.mark.parametrize("reverse", [True, False])
def test_the_generic_kernels_on_cuda_equal_the_cpu_kernels_within_their_memory(shape, reverse):
    """Value and gradient against the CPU kernels (checked against the reference in
    test_ops_vs_reference.py), with the CUDA backward and with the generic one too; the peak memory of
    one call within what the generic layout needs: the larger of the median's packed pairs, the system
    and a chunk of kernel rows (csrc/generic.cpp), and buffers of a few MB (the columns' chunks, the
    Gram of many dimensions, vectors), the gradient."""
    b, n_p, n_q, d, ties = shape
    p, q = seeded_samples(b, n_p, n_q, d, torch.float64, n_p + d + reverse, 1.2, 0.3)
    if ties:
        p, q = p.round(), q.round()
    dtype = torch.float32 if d > 1000 else torch.float64
    p, q = p.to(dtype), q.to(dtype)
    kw = dict(lam=1e-3, reverse=reverse)
    value_and_grad(kivi_fast.kernel_kl, p.to(CUDA), q.to(CUDA), **kw)  # library handles and workspaces
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    ours_v, ours_g = value_and_grad(kivi_fast.kernel_kl, p.to(CUDA), q.to(CUDA), **kw)
    peak = torch.cuda.max_memory_allocated() - base
    ref_v, ref_g = value_and_grad(kivi_fast.kernel_kl, p, q, **kw)
    with implementation("generic"):  # the generic backward as well (the CUDA one takes every shape)
        gen_v, gen_g = value_and_grad(kivi_fast.kernel_kl, p.to(CUDA), q.to(CUDA), **kw)
    rtol = 1e-5 if dtype == torch.float32 else 1e-9
    for v, grad in ((ours_v, ours_g), (gen_v, gen_g)):
        assert_close_rel(v, ref_v, rtol)
        assert_close_rel(grad, ref_g, rtol if dtype == torch.float32 else 1e-8)
    # a given bandwidth (no median: the fit's peak is the system's), and the op's other outputs; the
    # bandwidth grows with sqrt(d) as the distances do (1.5 in 4000 dimensions: every kernel value off
    # the diagonal underflows, and the gradient is rounding, ~1e-19)
    bw = 1.5 * (d / 4) ** 0.5
    given_v, given_g = value_and_grad(kivi_fast.kernel_kl, p.to(CUDA), q.to(CUDA), bandwidth=bw, **kw)
    cpu_v, cpu_g = value_and_grad(kivi_fast.kernel_kl, p, q, bandwidth=bw, **kw)
    assert_close_rel(given_v, cpu_v, rtol)
    assert_close_rel(given_g, cpu_g, rtol if dtype == torch.float32 else 1e-8)
    outs = torch.ops.kivi_fast.kl(p.to(CUDA), q.to(CUDA), 1e-3, 0.5, None, reverse, True)
    cpu_outs = torch.ops.kivi_fast.kl(p, q, 1e-3, 0.5, None, reverse, True)  # clip 0.5: some ratios clipped
    for got, want in zip(outs, cpu_outs):
        assert_close_rel(got, want, rtol)
    n_den = n_q if reverse else n_p
    N = n_p + n_q
    system = b * 8 * n_den * n_den
    blocks = max(b * 8 * N * (N - 1) // 2, max(4 * 2**20, system) + b * 8 * N)
    inputs = 4 * max(p.numel(), q.numel()) * p.element_size()  # the copies to the GPU, q's clone, the gradient
    assert peak <= blocks + inputs + 16 * 2**20, (peak, blocks)


@pytest.mark.parametrize("shape", GENERIC_SHAPES[:2], ids=["550-points", "batch-ties"])
def test_the_generic_paths_cuda_kernels_equal_its_aten_composition(shape):
    """set_generic_kernels(False), the benches' A/B: the generic path on CUDA without its kernels
    (pair_sqdist, kernel_block, fit_coef, kl_finish) gives what it gives with them, median and given
    bandwidth, both settings of reverse."""
    b, n_p, n_q, d, ties = shape
    p, q = seeded_samples(b, n_p, n_q, d, torch.float64, n_p + d, 1.2, 0.3)
    if ties:
        p, q = p.round(), q.round()
    p, q = p.to(CUDA), q.to(CUDA)
    for kw in (dict(reverse=True), dict(reverse=False), dict(bandwidth=1.5)):
        with_kernels = value_and_grad(kivi_fast.kernel_kl, p, q, **kw)
        old = torch.ops.kivi_fast_testing.set_generic_kernels(False)
        try:
            composed = value_and_grad(kivi_fast.kernel_kl, p, q, **kw)
        finally:
            torch.ops.kivi_fast_testing.set_generic_kernels(old)
        for got, want in zip(with_kernels, composed):
            assert_close_rel(got, want.cpu(), 1e-9)


@pytest.mark.parametrize("shift", [0.3, 1e3], ids=["near-0", "far-from-0"])
def test_the_generic_paths_gemm_kernel_values_equal_its_tiles(shift):
    """set_gemm_kernel_values (the benches' A/B): the generic path's kernel values from a GEMM of the
    centred points and one pass give what kernel_block's differences give, also far from the origin."""
    p, q = seeded_samples(1, 300, 250, 3, torch.float64, 11, 1.2, shift)
    p, q = (p + shift).to(CUDA), q.to(CUDA)
    for kw in (dict(reverse=True), dict(bandwidth=1.5)):
        tiles = value_and_grad(kivi_fast.kernel_kl, p, q, **kw)
        with switched("set_gemm_kernel_values", True):
            gemm = value_and_grad(kivi_fast.kernel_kl, p, q, **kw)
        for got, want in zip(gemm, tiles):
            assert_close_rel(got, want.cpu(), 1e-9)


# CUDA (small, wide, tiles), generic (ATen's median of fewer than 2^16 pairs, median.cu's)
@pytest.mark.parametrize("n,d", [(20, 3), (10, 30000), (100, 700), (160, 20), (300, 3)])
def test_bad_values_on_cuda_give_nan_for_their_batch_element(n, d):
    """On the CPU these are errors; on a GPU reading them would stall every call, so they give NaN:
    a NaN in q_z, every distance 0 (a zero median), an Inf in prior_z (with an explicit bandwidth too,
    where no median is taken), a bandwidth that is not positive."""
    p, q = torch.randn(5, n, d, device=CUDA), torch.randn(5, n, d, device=CUDA)
    q[1, 3, 1] = float("nan")
    p[2], q[2] = 0.0, 0.0
    p[3, 2, 0] = float("inf")
    bandwidth = torch.tensor([1.0, 1.0, 1.0, 1.0, -1.0], device=CUDA) * math.sqrt(d)
    with no_host_sync():
        value = kivi_fast.kernel_kl(p, q)
        given = kivi_fast.kernel_kl(p, q, bandwidth=bandwidth)
    assert value[[0, 4]].isfinite().all() and value[[1, 2, 3]].isnan().all(), value
    assert given[0].isfinite() and given[[1, 3, 4]].isnan().all(), given


def test_a_non_finite_ratio_weight_on_cuda_gives_nan_for_its_element_only():
    """On the CPU the ratio op refuses a NaN or Inf alpha; on a GPU it gives NaN for that batch element
    (no read back), and the other elements their ratios."""
    g = torch.Generator().manual_seed(0)
    p, q = (torch.randn(3, 20, 4, generator=g, dtype=torch.float64) for _ in range(2))
    fit = kivi_fast.DensityRatio(lam=1e-2).fit(numer=p, denom=q)
    want = torch.ops.kivi_fast.ratio(q, p, q, fit.alpha, fit.beta, fit.sigma.reshape(-1), False)[0]
    alpha = fit.alpha.clone()
    alpha[1, 5] = float("nan")
    q_, p_, alpha_, sigma_ = (t.to(CUDA) for t in (q, p, alpha, fit.sigma.reshape(-1)))  # (copies sync)
    with no_host_sync():
        r = torch.ops.kivi_fast.ratio(q_, p_, q_, alpha_, fit.beta, sigma_, False)[0]
    assert r[1].isnan().all() and r[[0, 2]].isfinite().all()
    assert_close_rel(r[[0, 2]], want[[0, 2]], 1e-12)


@pytest.mark.parametrize("contrast", ["full", "auto"])
def test_contrast_variances_out_of_range_on_cuda_give_nan_for_their_element(contrast):
    """contrast.variances_in_range's mask on a GPU (the CPU raises, naming the cause): a standard
    deviation below 1e-150 and a variance that overflows float64 make their element's estimate NaN,
    the others finite and equal to the CPU's."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(4, 60, 3, generator=g, dtype=torch.float64)
    q[1] = q[1] * 1e-152
    q[2] = q[2] * 1e154
    on_device = q.to(CUDA)
    with no_host_sync():
        got = kivi_fast.adaptive_contrast_kl(on_device, None, contrast=contrast, generator=None,
                                             reference_z=torch.randn(4, 60, 3, device=CUDA, dtype=torch.float64))
    assert got[[1, 2]].isnan().all() and got[[0, 3]].isfinite().all(), got


def test_auto_contrast_of_samples_on_a_subspace_on_cuda_equals_the_cpu():
    """"auto" whitens a batch element whose samples lie on a subspace by its diagonal: on a GPU too,
    without reading back which element that is (the CPU knows it; the GPU factors the batch anew)."""
    from kivi_fast.contrast import gaussian_contrast

    g = torch.Generator().manual_seed(0)
    subspace = torch.randn(40, 3, generator=g, dtype=torch.float64) @ torch.randn(3, 6, generator=g, dtype=torch.float64)
    batch = torch.stack([torch.randn(40, 6, generator=g, dtype=torch.float64), subspace])
    on_cpu = gaussian_contrast(batch, "auto")
    on_device = batch.to(CUDA)  # (a copy from pageable memory waits for the host: outside the check)
    with no_host_sync():
        on_gpu = gaussian_contrast(on_device, "auto")
    for cpu, gpu in zip(on_cpu, on_gpu):
        torch.testing.assert_close(gpu.cpu(), cpu, rtol=1e-9, atol=1e-9)


def test_direct_op_calls_with_arguments_on_another_device_raise():
    p, q = torch.randn(2, 10, 3, device=CUDA), torch.randn(2, 10, 3, device=CUDA)
    with pytest.raises(ValueError, match="sigma must be on the samples' device"):
        torch.ops.kivi_fast.kl(p, q, 1e-3, 1e-8, torch.ones(2, dtype=torch.float64), True, True)
    state = torch.ops.kivi_fast.kl(p, q, 1e-3, 1e-8, None, True, True)[1]
    with pytest.raises(ValueError, match="kl_grad: grad_kl must be on the samples' device"):
        torch.ops.kivi_fast.kl_grad(torch.ones(2), state, q, p, True)
    with pytest.raises(ValueError, match="kl_grad: state must be on the samples' device"):
        torch.ops.kivi_fast.kl_grad(torch.ones(2, device=CUDA), state.cpu(), q, p, True)


def test_an_empty_batch_on_cuda_gives_empty_results_and_gradients():
    """B = 0 goes through every estimator's whole path (its arguments are checked as for any batch),
    where the kernels launch nothing."""
    p = torch.randn(0, 20, 3, device=CUDA)
    q = torch.randn(0, 20, 3, device=CUDA, requires_grad=True)
    g = torch.Generator(device=CUDA).manual_seed(0)
    for estimate in (kivi_fast.kernel_kl(p, q), kivi_fast.kl(p, q, generator=g),
                     kivi_fast.kl(p, q, contrast="diagonal", generator=g), kivi_fast.adaptive_contrast_kl(q, generator=g),
                     kivi_fast.adaptive_contrast_kl(q, contrast="diagonal", generator=g)):
        assert estimate.shape == (0,) and estimate.device.type == "cuda"
        (grad,) = torch.autograd.grad(estimate.sum(), q, allow_unused=True, materialize_grads=True)
        assert grad.shape == q.shape


@pytest.mark.parametrize("b,n,d", [(4, 100, 8), (2, 10, 30000), (2, 100, 700), (2, 300, 8), (2, 300, 700)],
                         ids=["cuda-kernels", "cuda-kernels-wide", "cuda-kernels-tiles", "generic", "generic-wide"])
def test_the_estimators_never_read_a_value_back_to_the_host(b, n, d):
    p = torch.randn(b, n, d, device=CUDA)
    q = torch.randn(b, n, d, device=CUDA, requires_grad=True)
    g = torch.Generator(device=CUDA).manual_seed(0)

    def calls():
        out = [kivi_fast.kernel_kl(p, q).sum(), kivi_fast.kernel_kl(p[0], q[0]),
               kivi_fast.kernel_kl(p, q, bandwidth=1.5).sum(),
               kivi_fast.kernel_kl(p, q, bandwidth=torch.full((b,), 2.0, device=CUDA)).sum(),
               kivi_fast.kl(p, q, generator=g).sum(), kivi_fast.adaptive_contrast_kl(q, generator=g).sum(),
               kivi_fast.adaptive_contrast_kl(q, contrast="diagonal", generator=g).sum()]  # the VAE's
        ratio = kivi_fast.DensityRatio().fit(numer=p[0], denom=q[0].detach())
        out.append(ratio.log_ratio(q[0][:5]).sum())  # the ratio op's forward and backward
        torch.stack(out).sum().backward()
        return ratio.log_ratio(q[0].detach()[:5])  # without a gradient: no grad state

    calls()  # first calls create library handles, which may synchronize
    torch.cuda.synchronize()
    with no_host_sync():
        calls()


def test_a_training_step_that_calls_kl_is_captured_in_a_cuda_graph():
    """A generator trained through kernel_kl and adaptive_contrast_kl: its step captured once and
    replayed moves the weights as the same steps run eagerly."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3)).double().to(CUDA)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    prior = torch.randn(8, 100, 3, dtype=torch.float64, device=CUDA)
    ref_z = torch.randn(8, 100, 3, dtype=torch.float64, device=CUDA)
    inputs = [torch.randn(8, 100, 4, dtype=torch.float64, device=CUDA) for _ in range(6)]

    def loss_of(model, eps):
        q = model(eps)
        return (kivi_fast.kernel_kl(prior, q) + kivi_fast.adaptive_contrast_kl(q, reference_z=ref_z)
                + kivi_fast.adaptive_contrast_kl(q, contrast="diagonal", reference_z=ref_z)).mean()  # the VAE's

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up before capture, as torch's CUDA-graph recipe asks
        for eps in inputs[:3]:
            opt.zero_grad(set_to_none=True)
            loss_of(net, eps).backward()
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    eager = copy.deepcopy(net)
    eager_opt = torch.optim.SGD(eager.parameters(), lr=0.05)

    static_eps = inputs[0].clone()
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        static_loss = loss_of(net, static_eps)
        static_loss.backward()
        opt.step()
    before = [w.detach().clone() for w in eager.parameters()]
    for eps in inputs[3:]:
        static_eps.copy_(eps)
        graph.replay()
        eager_opt.zero_grad(set_to_none=True)
        eager_loss = loss_of(eager, eps)
        eager_loss.backward()
        eager_opt.step()
        assert math.isfinite(static_loss.item())
        torch.testing.assert_close(static_loss, eager_loss, rtol=1e-9, atol=1e-12)
    for w0, a, b in zip(before, net.parameters(), eager.parameters()):
        assert not torch.equal(b.detach(), w0)  # the steps moved the weights
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("b,n,d", [(2, 10, 30000), (2, 100, 700), (2, 300, 8), (1, 300, 700)],
                         ids=["cuda-kernels-wide", "cuda-kernels-tiles", "generic", "generic-wide"])
def test_kernel_kl_captured_in_a_cuda_graph_replays_its_eager_values(b, n, d):
    """The paths the training-step capture above does not take, captured in a CUDA graph: the wide
    ones (distances split over dimension chunks, summed with atomics into buffers zeroed in the graph:
    pair_sqdist_kernel, pair_tile_kernel) and the generic one (median.cu's launches, cuSOLVER's
    Cholesky). Each replay on new samples gives the eager call's value and gradient on them."""
    g = torch.Generator(device=CUDA).manual_seed(n + d)
    draws = [(torch.randn(b, n, d, device=CUDA, dtype=torch.float64, generator=g),
              0.8 * torch.randn(b, n, d, device=CUDA, dtype=torch.float64, generator=g) + 0.3) for _ in range(4)]
    weights = torch.arange(1, b + 1, dtype=torch.float64, device=CUDA)  # each element its own gradient

    def value_and_gradient(p, q):
        value = kivi_fast.kernel_kl(p, q)
        return value, torch.autograd.grad((value * weights).sum(), q)[0]

    static_p, static_q = draws[0][0].clone(), draws[0][1].clone().requires_grad_()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up before capture: library handles, the allocator's blocks
        for _ in range(3):
            value_and_gradient(static_p, static_q)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_value, static_grad = value_and_gradient(static_p, static_q)
    for p, q in draws[1:]:
        with torch.no_grad():
            static_p.copy_(p)
            static_q.copy_(q)
        graph.replay()
        value, grad = value_and_gradient(p, q.clone().requires_grad_())
        assert torch.isfinite(value).all()
        torch.testing.assert_close(static_value, value, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(static_grad, grad, rtol=1e-8, atol=1e-12)


def test_torch_compile_on_cuda():
    p, q = torch.randn(2, 50, 4, device=CUDA), torch.randn(2, 50, 4, device=CUDA)
    compiled = torch.compile(kivi_fast.kernel_kl, fullgraph=True)
    torch.testing.assert_close(compiled(p, q), kivi_fast.kernel_kl(p, q))
    # kivi-ac with the diagonal contrast: the contrast's CUDA ops (their fake kernels) inside the graph

    def kivi_ac(q):
        return kivi_fast.adaptive_contrast_kl(q, None, 1e-3, contrast="diagonal", reference_z=p)
    q.requires_grad_()
    got = torch.compile(kivi_ac)(q)
    want = kivi_ac(q)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(torch.autograd.grad(got.sum(), q)[0], torch.autograd.grad(want.sum(), q)[0])


@pytest.mark.parametrize("shape", [(128, 100, 8), (1, 10, 30000), (3, 7, 33), (2, 300, 1), (70000, 3, 2)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_contrast_kernels_equal_the_composition_on_the_cpu(shape, dtype):
    """kivi_fast/contrast.py's standardize and _DiagonalContrast's backward: one launch each way on
    CUDA (csrc/cuda/contrast.cu), against ATen's composition on the CPU; the last shape's batch takes
    two grids (at most 65,535 elements each)."""
    from kivi_fast import contrast

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * 1.3 + 0.5).to(dtype)
    g_z, g_t = torch.randn(shape, generator=g, dtype=torch.float64), torch.randn(shape[0], generator=g, dtype=torch.float64)
    assert contrast._standardize_ops(x.to(CUDA)) is torch.ops.kivi_fast
    for to_standard_normal in (False, True):
        results = []
        for device in (CUDA, torch.device("cpu")):
            xx = x.to(device).requires_grad_()
            z, t = contrast._DiagonalContrast.apply(xx, "x", to_standard_normal, 0.25)
            grad = torch.autograd.grad((z * g_z.to(device)).sum() + (t * g_t.to(device)).sum(), xx)[0]
            results.append([v.cpu() for v in (z, t, grad)])
        tol = {"rtol": 1e-10, "atol": 1e-10} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-5}
        for got, want in zip(*results):
            torch.testing.assert_close(got, want, **tol)


def test_the_vae_trains_resumes_and_evaluates_on_cuda(tmp_path):
    # the VAE trainer's device path: draws, checkpoint (a CUDA generator's state), exact resume, AIS
    from kivi_fast import cli
    from kivi_fast.experiments import runs
    from kivi_fast.experiments import vae as vae_cmd

    parser = cli.build_parser()[1]["vae"]
    argv = ["--train-images", "96", "--batch", "32", "--n-q", "10", "--n-p", "10", "--epochs", "2",
            "--eval-images", "16", "--no-progress", "--device", "cuda"]
    vae_cmd.train(parser.parse_args([*argv, "--run-dir", str(tmp_path / "a")]), tmp_path / "a")
    assert vae_cmd.train(parser.parse_args([*argv, "--run-dir", str(tmp_path / "b")]), tmp_path / "b",
                         max_steps=4) is None
    vae_cmd.train(parser.parse_args([*argv, "--run-dir", str(tmp_path / "b")]), tmp_path / "b")
    a = runs.load_checkpoint(tmp_path / "a" / "checkpoint.pt")["model"]
    b = runs.load_checkpoint(tmp_path / "b" / "checkpoint.pt")["model"]
    for k in a:  # CUDA kernels may sum in another order from run to run: equal to float tolerance
        torch.testing.assert_close(a[k], b[k])
    assert cli.main(["vae-ais", "--quick", "--no-progress", "--device", "cuda", str(tmp_path / "a")]) == 0


def test_the_vae_step_captured_in_a_cuda_graph_equals_its_eager_steps():
    """graphs.CapturedStep: three eager warm-up steps, the capture, replays; the learning rate halved
    midway (written in place: the replays read it). Same losses and weights as the eager steps."""
    from kivi_fast.experiments.graphs import CapturedStep, capturable_adam
    from kivi_fast.experiments.training import set_lr
    from kivi_fast.experiments.vae import make_train_step
    from kivi_fast.nn.vae import build_vae

    torch.manual_seed(0)
    base = build_vae("kivi-ac", n_q=20, n_p=20, lam=1e-3, clip=1e-8).to(CUDA)
    g = torch.Generator(device=CUDA).manual_seed(1)
    batches = [{"x": (torch.rand(16, 784, device=CUDA) < 0.3).float(), **base.draws(16, g, CUDA)} for _ in range(8)]
    results = {}
    for name in ("eager", "graph"):
        model = copy.deepcopy(base)
        opt = capturable_adam(model.parameters(), 1e-3, CUDA)
        step = make_train_step(model, opt)
        run = CapturedStep(step, CUDA) if name == "graph" else step
        losses = []
        for i, inputs in enumerate(batches):
            if i == 5:
                set_lr(opt, 5e-4)
            losses.append(run(inputs).clone())
        results[name] = (torch.stack(losses), [p.detach().clone() for p in model.parameters()])
    assert results["graph"][0].isfinite().all()
    torch.testing.assert_close(results["graph"][0], results["eager"][0], rtol=1e-5, atol=1e-5)
    for w0, a, b in zip(base.parameters(), results["graph"][1], results["eager"][1]):
        assert not torch.equal(a, w0.detach())
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def assert_graphed_runs_resume_and_follow_eager(train, tmp_path, stop_after: int) -> None:
    """After train("graph", "--cuda-graph"): a graphed run stopped after ``stop_after`` steps and resumed
    (warm-up and capture again) ends with the uninterrupted run's weights, and an eager run with close
    ones (another Adam implementation: to rounding). train(folder, *options, max_steps=None)."""
    from kivi_fast.experiments import runs

    assert train("resumed", "--cuda-graph", max_steps=stop_after) is None
    train("resumed", "--cuda-graph")
    train("eager")
    weights = {name: runs.load_checkpoint(tmp_path / name / "checkpoint.pt")["model"]
               for name in ("graph", "resumed", "eager")}
    off = total = 0
    for k in weights["graph"]:
        torch.testing.assert_close(weights["resumed"][k], weights["graph"][k])
        eager, graph = weights["eager"][k], weights["graph"][k]
        off += int(((eager - graph).abs() > 1e-4 + 1e-3 * graph.abs()).sum())
        total += graph.numel()
    # Not every weight: where a gradient is near zero, a rounding difference can flip the sign of its
    # Adam step (m / sqrt(v) is about +-1 whatever the magnitude), a difference of 2 lr per step. A
    # graph that replayed stale inputs or missed an update would move most weights off.
    assert off <= 1e-3 * total, (off, total)


def test_the_vae_trains_with_a_cuda_graph_and_resumes(tmp_path):
    """--cuda-graph: an interrupted run resumes (warm-up and capture again) to the uninterrupted run's
    weights, and both follow the eager run (another Adam implementation: to rounding)."""
    from kivi_fast import cli
    from kivi_fast.experiments import runs
    from kivi_fast.experiments import vae as vae_cmd

    parser = cli.build_parser()[1]["vae"]
    argv = ["--train-images", "96", "--batch", "32", "--n-q", "10", "--n-p", "10", "--epochs", "3",
            "--eval-images", "16", "--no-progress", "--device", "cuda"]

    def train(folder, *extra, max_steps=None):
        return vae_cmd.train(parser.parse_args([*argv, *extra, "--run-dir", str(tmp_path / folder)]),
                             tmp_path / folder, max_steps=max_steps)

    assert train("graph", "--cuda-graph")["epochs"] == 3
    assert_graphed_runs_resume_and_follow_eager(train, tmp_path, stop_after=5)
    with pytest.raises(runs.CheckpointError, match="other settings"):  # the optimizers differ
        train("graph", "--epochs", "4")


@pytest.mark.parametrize("method", ["kivi", "pc"])
def test_mnist_trains_with_a_cuda_graph_and_resumes(method, tmp_path):
    """--cuda-graph with posterior draws inside the graph (torch's generator of the device, which each
    replay advances as the eager step would): an interrupted run resumes to the uninterrupted run's
    weights, and both follow the eager run (another Adam implementation: to rounding)."""
    from kivi_fast import cli
    from kivi_fast.experiments import mnist as mnist_cmd

    parser = cli.build_parser()[1]["mnist"]
    argv = ["--method", method, "--hidden", "16", "--mmnn-hidden", "12", "--train-images", "100", "--batch", "20",
            "--epochs", "2", "--samples", "4", "--n-p", "4", "--eval-images", "50", "--no-progress",
            "--device", "cuda"]

    def train(folder, *extra, max_steps=None):
        return mnist_cmd.train(parser.parse_args([*argv, *extra, "--run-dir", str(tmp_path / folder)]),
                               tmp_path / folder, max_steps=max_steps)

    train("graph", "--cuda-graph")
    assert_graphed_runs_resume_and_follow_eager(train, tmp_path, stop_after=6)


def test_the_trainers_tf32_option_turns_on_tensor_float_matmuls(tmp_path):
    """--tf32: the run's float32 CUDA matmuls in TF32 (set for the process, recorded in the run's
    config), and the run trains to a finite ELBO (the KL's fit is float64 either way)."""
    import json

    from kivi_fast import cli

    old = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        assert cli.main(["vae", "--quick", "--tf32", "--device", "cuda", "--no-progress",
                         "--run-dir", str(tmp_path)]) == 0
        assert torch.backends.cuda.matmul.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    assert json.loads((tmp_path / "config.json").read_text())["tf32"] is True
    assert math.isfinite(json.loads((tmp_path / "results.json").read_text())["final"]["test_elbo"])
