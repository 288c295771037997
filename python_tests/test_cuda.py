"""The ops on CUDA tensors (the device-generic ATen kernels) equal the reference computed on the CPU.

These run only where torch sees a GPU; elsewhere pytest reports them as skipped (CI has none). The
generic kernels themselves are also tested on the CPU (the ``generic`` implementation of conftest).
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kivi_fast
from kivi_fast import reference

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


def test_mixed_devices_and_bad_input_raise_clear_errors():
    p, q = torch.randn(20, 3), torch.randn(20, 3)
    with pytest.raises(ValueError, match="same device"):
        kivi_fast.kernel_kl(p.to(CUDA), q)
    bad = q.clone()
    bad[3, 1] = float("nan")
    with pytest.raises(ValueError, match="q_z"):
        kivi_fast.kernel_kl(p.to(CUDA), bad.to(CUDA))
    with pytest.raises(ValueError, match="lam"):
        kivi_fast.kernel_kl(p.to(CUDA), q.to(CUDA), lam=0.0)


def test_torch_compile_on_cuda():
    p, q = torch.randn(2, 50, 4, device=CUDA), torch.randn(2, 50, 4, device=CUDA)
    compiled = torch.compile(kivi_fast.kernel_kl, fullgraph=True)
    torch.testing.assert_close(compiled(p, q), kivi_fast.kernel_kl(p, q))


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
