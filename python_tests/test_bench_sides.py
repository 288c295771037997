"""bench/pure_torch.py's two pure-PyTorch sides, the baselines every speed ratio is against: eager and
under torch.compile (bench/run.py and bench/gpu.py --compiled), against kivi_fast.reference."""

import re

import pytest
import torch

from kivi_fast import reference

from conftest import bench_module, no_host_sync
from test_ops_vs_reference import value_and_grad


pure_torch = bench_module("pure_torch")

LAM = 1e-3


def draw(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64),
            0.8 * torch.randn(*shape, generator=g, dtype=torch.float64) + 0.3)


@pytest.mark.parametrize("side", pure_torch.SIDES)
@pytest.mark.parametrize("shape", [(3, 12, 4), (40, 5), (300, 3)], ids=["batched", "unbatched", "above-256-rows"])
def test_sides_equal_the_reference_in_float64(side, shape):
    p, q = draw(shape, seed=len(shape) + shape[-1])
    want, want_g = value_and_grad(lambda a, b: reference.kernel_kl(a, b, LAM), p, q)
    got, got_g = value_and_grad(lambda a, b: pure_torch.kl(a, b, LAM, side=side), p, q)
    torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(got_g, want_g, rtol=1e-7, atol=1e-10)


@pytest.mark.parametrize("chunk_bytes", [1 << 20, 1 << 14], ids=["cpu-chunks", "256-columns"])
@pytest.mark.parametrize("shape", [(2, 10, 9000), (40, 9000)], ids=["batched-full-gram", "two-grams"])
def test_eager_tall_path_equals_the_reference(shape, chunk_bytes, monkeypatch):
    """d >= 8192 eagerly: the Grams accumulated over chunks of d (the last one partial), up to 64 points
    one X X^T, above them xq X^T and xp xp^T; both sides, float64."""
    monkeypatch.setattr(pure_torch, "_CHUNK_BYTES", chunk_bytes)
    p, q = draw(shape, seed=17)
    p, q = p / 60, q / 60  # (distances of order 1 in 9000 dimensions)
    want, want_g = value_and_grad(lambda a, b: reference.kernel_kl(a, b, LAM), p, q)
    for side in pure_torch.SIDES:
        got, got_g = value_and_grad(lambda a, b: pure_torch.kl(a, b, LAM, side=side), p, q)
        torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-10)
        torch.testing.assert_close(got_g, want_g, rtol=1e-7, atol=1e-10)


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("side, shape", [("strong", (3, 12, 4)), ("strong", (300, 3)), ("fast", (10, 9000))],
                         ids=["strong-batched", "strong-above-256-rows", "fast-tall"])
def test_compiled_sides_are_one_graph_equal_to_the_reference(side, shape, fresh_dynamo):
    """A side whose graph breaks (host reads, out= into views, a global cache written in the trace) is
    slower than it need be under torch.compile, or fails to compile: the compiled baseline would not
    be the strongest. (300, 3): above 256 rows and above 2^17 pairs, where the eager sides read values
    back (strong's refinement, the sampled median); (10, 9000): the tall path, which eager takes in
    chunks of d."""
    p, q = draw(shape, seed=7)
    fn = lambda a, b: pure_torch.kl(a, b, LAM, side=side)  # noqa: E731
    want, want_g = value_and_grad(lambda a, b: reference.kernel_kl(a, b, LAM), p, q)
    got, got_g = value_and_grad(torch.compile(fn, dynamic=False, fullgraph=True), p, q)  # (a break raises)
    torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(got_g, want_g, rtol=1e-7, atol=1e-10)


def compiled_sides_equal_the_reference(p, q) -> dict:
    """Both sides compiled into one graph each, their values and gradients against the reference;
    {side: the code of its traced graph}."""
    want, want_g = value_and_grad(lambda a, b: reference.kernel_kl(a, b, LAM), p, q)
    graphs = {}
    for side in pure_torch.SIDES:
        fn = lambda a, b: pure_torch.kl(a, b, LAM, side=side)  # noqa: E731
        got, got_g = value_and_grad(torch.compile(fn, dynamic=False, fullgraph=True), p, q)
        torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-10)
        torch.testing.assert_close(got_g, want_g, rtol=1e-7, atol=1e-10)

        def record(gm, example_inputs):
            graphs.setdefault(side, gm.print_readable(print_output=False))  # noqa: B023 (called at once)
            return gm.forward
        torch.compile(fn, backend=record, dynamic=False, fullgraph=True)(p, q)
    return graphs


@pytest.mark.parametrize("n_q,n_p", [(20, 20), (20, 21), (20, 23), (7, 9), (1, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_cpus_middles_by_topk_on_bit_patterns_equal_the_sorted_pairs(n_q, n_p, dtype):
    """Eagerly on a CPU the median's two middles come from one topk of the pairs' integer views and
    its two least: the same as reading them off all pairs sorted, with ties (points on a grid: many
    equal distances, zeros among them), odd and even pair counts, per batch element."""
    g = torch.Generator().manual_seed(n_q * 100 + n_p)
    q, p = (torch.round(2 * torch.randn(4, n, 2, generator=g, dtype=dtype)) for n in (n_q, n_p))
    _, _, both = pure_torch._sqdists(q, p, dtype)
    pairs = both[:, pure_torch._pair_index(n_q, n_p, both.device)].clamp_min(0).sort(-1).values
    m = pairs.shape[1]
    lo, hi = pure_torch._median_small(both, n_q, n_p)
    assert torch.equal(lo, pairs[:, (m + 1) // 2 - 1]) and torch.equal(hi, pairs[:, m // 2])
    assert (pairs[:, 1:] == pairs[:, :-1]).any()  # (ties drawn)


@pytest.mark.parametrize("n_q", [300, 299], ids=["even-pairs", "odd-pairs"])
def test_a_gpus_selection_over_many_pairs_sorts_them(n_q, monkeypatch, fresh_dynamo):
    """Off the CPU a selection over more than 2^17 gathered pairs sorts them (a GPU's kthvalue gives a
    row to one thread block): under torch.compile, which gathers every pair, and on a miss of the eager
    bracket. Forced here on the CPU with 599 or 600 points (179,101 or 179,700 pairs): the middles read
    off the sorted pairs equal kthvalue's, and both sides compiled equal the reference."""
    p, q = draw((300, 3), seed=13)
    q = q[:n_q]
    n = 300 + n_q
    both = torch.rand(2, n_q * n + 300 * 300, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
    by_selection = pure_torch._median_small(both, n_q, 300)
    calls = []
    monkeypatch.setattr(pure_torch, "_sorts_long_rows", lambda t: calls.append(t.shape) or True)
    by_sort = pure_torch._median_small(both, n_q, 300)
    assert calls and all(torch.equal(a, b) for a, b in zip(by_sort, by_selection))
    monkeypatch.setattr(pure_torch, "_sorts_long_rows", lambda t: True)  # (no side effect in a traced graph)
    for graph in compiled_sides_equal_the_reference(p, q).values():
        assert "torch.sort" in graph and "kthvalue" not in graph  # (kthvalue would give the same values)


@pytest.mark.parametrize("shape", [(3, 12, 4), (300, 3)], ids=["batched", "above-256-rows"])
def test_the_solves_a_cuda_graph_can_capture_equal_the_reference(shape, monkeypatch, fresh_dynamo):
    """Compiled on a GPU (_in_cuda_graph), both sides factor by Cholesky and solve by two triangular
    solves, fast at every size: forced here on the CPU, the values and gradients of both sides against
    the reference, and the traced graph has no LU and no cholesky_solve."""
    monkeypatch.setattr(pure_torch, "_in_cuda_graph", lambda t: True)
    p, q = draw(shape, seed=5)
    for side, graph in compiled_sides_equal_the_reference(p, q).items():
        calls = re.findall(r"= (torch[\w.]+)\(", graph)  # (the graph's comments quote the source)
        assert "torch._C._linalg.linalg_solve_triangular" in calls, (side, sorted(set(calls)))
        assert not any("solve_ex" in c or "cholesky_solve" in c for c in calls), (side, sorted(set(calls)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("n_q", [300, 299], ids=["even-pairs", "odd-pairs"])
def test_on_a_gpu_the_middles_of_many_pairs_by_sorting_equal_the_cpus(n_q):
    """_sorts_long_rows itself: on a GPU the selection over 179,101 or 179,700 gathered pairs sorts them,
    and its middles equal the CPU's kthvalue."""
    n = 300 + n_q
    both = torch.rand(2, n_q * n + 300 * 300, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
    assert pure_torch._sorts_long_rows(both.cuda()) and not pure_torch._sorts_long_rows(both)
    for got, want in zip(pure_torch._median_small(both.cuda(), n_q, 300), pure_torch._median_small(both, n_q, 300)):
        assert torch.equal(got.cpu(), want)


def test_compiled_strong_keeps_the_contract_in_float32(fresh_dynamo):
    """float32 inputs, as the benches run them: strong compiled within the contract's 1e-3 of the float64
    reference, and equal to strong eager (the same float64 steps)."""
    p, q = (t.float() for t in draw((4, 30, 6), seed=11))
    fn = lambda a, b: pure_torch.kl(a, b, LAM, side="strong")  # noqa: E731
    want, want_g = value_and_grad(lambda a, b: reference.kernel_kl(a, b, LAM), p.double(), q.double())
    got, got_g = value_and_grad(torch.compile(fn, dynamic=False, fullgraph=True), p, q)
    eager, eager_g = value_and_grad(fn, p, q)
    assert got.dtype == got_g.dtype == torch.float32
    assert ((got.double() - want).abs() / want.abs()).max() <= 1e-3
    assert (got_g.double() - want_g).norm() / want_g.norm() <= 1e-3
    torch.testing.assert_close(got, eager, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got_g, eager_g, rtol=1e-5, atol=1e-6)


def test_a_zero_median_raises_eagerly_and_gives_nan_compiled(fresh_dynamo):
    """Compiled, a side reads nothing back to the host (as kivi_fast's CUDA ops): NaN for that element."""
    p, q = draw((2, 10, 3), seed=3)
    p[1] = 0.0
    q[1] = 0.0  # every point of element 1 the same: median distance 0
    fn = lambda a, b: pure_torch.kl(a, b, LAM, side="strong")  # noqa: E731
    with pytest.raises(ValueError, match="median pairwise distance is 0"):
        fn(p, q)
    out = torch.compile(fn, dynamic=False)(p, q)
    assert torch.isnan(out[1]) and torch.isfinite(out[0])
    torch.testing.assert_close(out[0], reference.kernel_kl(p[0], q[0], LAM), rtol=1e-8, atol=1e-10)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("side", pure_torch.SIDES)
def test_eager_sides_on_a_gpu_read_nothing_back_and_give_nan_for_a_bad_element(side):
    """The GPU baseline tuned for the GPU: up to 2^17 pairs and 256 rows an eager call never stalls the
    host (torch's sync debug mode raises on any read), and a zero median gives NaN for its element
    instead of an error; the other elements equal the CPU's."""
    p, q = draw((4, 100, 8), seed=5)
    p[3] = 0.0
    q[3] = 0.0  # every point of the last element the same: median distance 0
    fn = lambda a, b: pure_torch.kl(a, b, LAM, side=side)  # noqa: E731
    good = [0, 1, 2]  # (first: value_and_grad weights element i by i + 1 on both devices)
    want, want_g = value_and_grad(fn, p[good], q[good])
    p, q = p.cuda(), q.cuda()
    value_and_grad(fn, p, q)  # first calls create library handles, which may synchronize
    torch.cuda.synchronize()
    with no_host_sync():
        got, got_g = value_and_grad(fn, p, q)
    assert torch.isnan(got[3]).item()
    torch.testing.assert_close(got[good].cpu(), want, rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(got_g[good].cpu(), want_g, rtol=1e-7, atol=1e-10)


@pytest.mark.parametrize("side", pure_torch.SIDES)
def test_under_capturing_the_sides_read_nothing_back_and_equal_the_reference(side, monkeypatch):
    """pure_torch.capturing() (bench/gpu.py --graphed captures eager calls in a CUDA graph): above 2^17
    pairs the median takes the gathered selection, not the sampled bracket, whose reads a capture
    refuses; above 256 rows strong takes the float64 factor, not the refinement loop; the values and
    gradients still equal the reference."""
    def refused(*args):
        raise AssertionError("a path that reads values back, under capturing()")
    monkeypatch.setattr(pure_torch, "_median_bracket", refused)
    monkeypatch.setattr(torch, "baddbmm", refused)  # (strong's refinement loop, its residuals)
    p, q = draw((300, 3), seed=7)  # 600 points: 179,700 pairs
    fn = lambda a, b: pure_torch.kl(a, b, LAM, side=side)  # noqa: E731
    with pure_torch.capturing():
        got, got_g = value_and_grad(fn, p, q)
    want, want_g = value_and_grad(lambda a, b: reference.kernel_kl(a, b, LAM), p, q)
    torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(got_g, want_g, rtol=1e-6, atol=1e-10)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("side", pure_torch.SIDES)
def test_eager_sides_captured_in_a_cuda_graph_replay_their_eager_values(side):
    """pure_torch.capture (bench/gpu.py --graphed's: warm-up on a side stream, then the capture, under
    capturing()) of either side's forward + backward above 256 rows and 2^17 pairs: it captures, and a
    replay gives the eager call's value and gradient, up to the side's own float32 error. Inside a
    capture cuBLAS may pick other kernels, which sum in another order: on an H200 the strong side's
    replay equalled its eager call bitwise, while the fast side's float32 solve moved the gradient by
    4e-3 of its largest element, its eager error against float64 being 3.5e-3. A capture's bug (a stale
    or reused buffer) is off by order 1."""
    p64, q64 = draw((2, 300, 3), seed=7)
    want64, want64_g = (t.cuda() for t in value_and_grad(lambda a, b: reference.kernel_kl(a, b, LAM), p64, q64))
    p, q = p64.float().cuda(), q64.float().cuda()
    fn = lambda a, b: pure_torch.kl(a, b, LAM, side=side)  # noqa: E731
    want, want_g = value_and_grad(fn, p, q)
    out = {}

    def run():
        out["value"], out["grad"] = value_and_grad(fn, p, q)
    replay = pure_torch.capture(run)
    out["value"].zero_()
    replay()
    torch.cuda.synchronize()
    # each a distance relative to the float64 value's size (the gradient's: its largest element)
    scale, scale_g = want64.abs(), want64_g.abs().max()
    error = ((want.double() - want64).abs() / scale).max(), (want_g.double() - want64_g).abs().max() / scale_g
    moved = ((out["value"] - want).double().abs() / scale).max(), (out["grad"] - want_g).double().abs().max() / scale_g
    # two roundings of the same float32 computation: each about the eager one's error
    assert moved[0] <= 3 * error[0] + 1e-6 and moved[1] <= 3 * error[1] + 1e-6, (moved, error)


def test_a_compiled_side_that_fails_on_a_later_call_is_left_out(capsys):
    """bench/run.py's compiled_for (both benches' --compiled): with mode="reduce-overhead" the CUDA graph
    is recorded on a later call than the first, and an op that a capture refuses fails there; the side is
    left out of the cell, and said so, instead of ending the run."""
    run = bench_module("run")
    calls = []

    def fails_on_its_second_call(p, q):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        return (p * q).sum()
    ok = run.compiled_for({"a_compiled": fails_on_its_second_call, "b_compiled": lambda p, q: (p * q).sum()},
                          torch.ones(3), torch.ones(3), True)
    assert sorted(ok) == ["b_compiled"]
    assert "a_compiled left out: RuntimeError: CUDA error: operation not permitted" in capsys.readouterr().out
