"""Float32 accuracy, the fixed-ratio gradient against finite differences, opcheck and torch.compile."""

import pytest
import torch

import kivi_fast
from kivi_fast import reference

from conftest import implementation


def rel_err(actual, expected):
    return ((actual.double() - expected.double()).abs().max() / expected.double().abs().max()).item()


def kl_and_grad(p, q, **kw):
    q = q.clone().requires_grad_(True)
    value = kivi_fast.kernel_kl(p, q, **kw)
    value.sum().backward()
    return value.detach(), q.grad


@pytest.mark.parametrize("n,d,batch", [(100, 8, None), (100, 8, 16), (50, 700, None), (10, 20000, None), (300, 3, None)])
@pytest.mark.parametrize("reverse", [True, False])
def test_float32_agrees_with_float64_of_the_same_inputs(impl, n, d, batch, reverse):
    """The fit cancels terms of size ~1/lam: float32 must still agree with float64 to 1e-3."""
    g = torch.Generator().manual_seed(n + d)
    lead = () if batch is None else (batch,)
    p = torch.randn(*lead, n, d, generator=g)
    q = torch.randn(*lead, n, d, generator=g) * 0.7 + 0.5
    v32, g32 = kl_and_grad(p, q, reverse=reverse)
    v64, g64 = kl_and_grad(p.double(), q.double(), reverse=reverse)
    assert v32.dtype == g32.dtype == torch.float32
    assert rel_err(v32, v64) < 1e-3
    assert rel_err(g32, g64) < 1e-3


def test_float32_gradient_stays_within_1e_4_of_float64_at_the_papers_lam():
    """Why the ops work in float64: at lam = 1e-3 the fit's coefficients reach ~100 and cancel in the
    gradient, so a float32 evaluation loses digits in proportion (torch's float32 cdist evaluation of
    the same fit was off by up to 3.3e-3 over these 4 problems on this project's CPU: not asserted, as
    that depends on the BLAS). Ours, float32 in and out, stays within 1e-4 of its float64 result."""
    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        p = torch.randn(100, 8, generator=g, dtype=torch.float64)
        q = torch.randn(100, 8, generator=g, dtype=torch.float64) * 0.7 + 0.5
        _, ours32 = kl_and_grad(p.float(), q.float())
        _, ours64 = kl_and_grad(p.float().double(), q.float().double())
        assert rel_err(ours32, ours64) < 1e-4, seed


def test_float32_system_that_float32_cholesky_cannot_factor(impl):
    """Nearly coincident samples and a small lam: a float32 Cholesky of K/n + lam I fails; ours
    factors in float64 and returns the float64 answer instead of garbage."""
    g = torch.Generator().manual_seed(5)
    base = torch.randn(1, 4, generator=g, dtype=torch.float64)
    q = base + 1e-4 * torch.randn(60, 4, generator=g, dtype=torch.float64)
    p = torch.randn(60, 4, generator=g, dtype=torch.float64)
    lam = 1e-9
    fit = reference.DensityRatio(lam=lam).fit(p, q)
    k_qq = reference.rbf_gram(q, q, fit.sigma)
    system32 = (k_qq / 60 + lam * torch.eye(60, dtype=torch.float64)).float()
    assert torch.linalg.cholesky_ex(system32).info.item() != 0
    v32, g32 = kl_and_grad(p.float(), q.float(), lam=lam)
    v64, g64 = kl_and_grad(p.float().double(), q.float().double(), lam=lam)
    assert torch.isfinite(v32) and torch.isfinite(g32).all()
    assert rel_err(v32, v64) < 1e-3 and rel_err(g32, g64) < 1e-3


def fixed_ratio_objective(p, q0, reverse):
    """z -> the KL estimate with the ratio fitted on (p, q0) and held fixed (the paper's Eq. 8)."""
    fit = kivi_fast.DensityRatio(lam=1e-2).fit(p, q0) if reverse else kivi_fast.DensityRatio(lam=1e-2).fit(q0, p)
    sign = -1.0 if reverse else 1.0
    return lambda z: sign * fit.log_ratio(z, clip=1e-8).mean(-1)


@pytest.mark.parametrize("reverse", [True, False])
def test_kl_gradient_is_the_fixed_ratio_gradient(impl, reverse):
    g = torch.Generator().manual_seed(7)
    p = torch.randn(2, 15, 3, generator=g, dtype=torch.float64)
    q0 = torch.randn(2, 12, 3, generator=g, dtype=torch.float64) * 0.8 + 0.3
    _, grad = kl_and_grad(p, q0, lam=1e-2, reverse=reverse)
    objective = fixed_ratio_objective(p, q0, reverse)
    # Central finite differences of the fixed-ratio objective, coordinate by coordinate.
    eps = 1e-6
    numeric = torch.zeros_like(q0)
    flat = numeric.view(-1)
    for i in range(q0.numel()):
        step = torch.zeros_like(q0).view(-1)
        step[i] = eps
        step = step.view_as(q0)
        flat[i] = (objective(q0 + step).sum() - objective(q0 - step).sum()) / (2 * eps)
    torch.testing.assert_close(grad, numeric, rtol=1e-6, atol=1e-8)


def test_gradcheck_of_the_ratio(impl):
    g = torch.Generator().manual_seed(8)
    p = torch.randn(10, 3, generator=g, dtype=torch.float64)
    q = torch.randn(12, 3, generator=g, dtype=torch.float64) + 0.5
    fit = kivi_fast.DensityRatio(lam=1e-2).fit(p, q)
    z = torch.randn(7, 3, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: fit.ratio(x), (z,))
    assert torch.autograd.gradcheck(lambda x: fit.log_ratio(x, clip=1e-8), (z,))


def test_clipped_points_get_zero_gradient(impl):
    g = torch.Generator().manual_seed(9)
    p = torch.randn(50, 2, generator=g, dtype=torch.float64)
    q = torch.randn(50, 2, generator=g, dtype=torch.float64) * 0.3 + 4.0   # far from p: tiny p/q
    q[:5] = torch.randn(5, 2, generator=g, dtype=torch.float64) * 0.3     # a few points where p lives
    clip = 1e-3
    r = kivi_fast.DensityRatio(lam=1e-3).fit(p, q).ratio(q)
    clipped = r <= clip
    assert clipped.any() and (~clipped).any()
    _, grad = kl_and_grad(p, q, clip=clip)
    assert (grad[clipped] == 0).all()
    assert (grad[~clipped].abs().sum(-1) > 0).all()


def test_a_second_derivative_is_refused_by_name_and_the_first_is_unchanged(compiled):
    """The ops' gradients (Eq. 8, the fitted ratio held fixed) are differentiable once: a gradient taken
    with create_graph=True equals the plain one, and differentiating it raises. Without an autograd
    kernel for the backwards' ops, torch gave no second derivative or a partial one, with a warning."""
    g = torch.Generator().manual_seed(12)
    p = torch.randn(2, 30, 3, generator=g, dtype=torch.float64)
    q = torch.randn(2, 30, 3, generator=g, dtype=torch.float64)
    fit = kivi_fast.DensityRatio(lam=1e-2).fit(p, q)

    def log_prior(z):
        return -0.5 * z.square().sum(-1)

    # (the per-dimension contrast has its own backward, and with a log prior a term of the gradient that is
    # differentiable: a refusal that torch.autograd.grad(..., inputs=z) prunes left that term alone, silently)
    estimates = {"kernel_kl": lambda z: kivi_fast.kernel_kl(p, z).sum(),
                 "kl": lambda z: kivi_fast.kl(p, z, generator=torch.Generator().manual_seed(1)).sum(),
                 "kl diagonal": lambda z: kivi_fast.kl(p, z, contrast="diagonal",
                                                      generator=torch.Generator().manual_seed(1)).sum(),
                 "adaptive_contrast_kl diagonal": lambda z: kivi_fast.adaptive_contrast_kl(
                     z, log_prior, contrast="diagonal", generator=torch.Generator().manual_seed(1)).sum(),
                 "adaptive_contrast_kl auto, n <= d": lambda z: kivi_fast.adaptive_contrast_kl(
                     z[..., :3, :], log_prior, generator=torch.Generator().manual_seed(1)).sum(),
                 "ratio": lambda z: fit.log_ratio(z).sum()}
    for name, estimate in estimates.items():
        z = q.clone().requires_grad_()
        (first,) = torch.autograd.grad(estimate(z), z, create_graph=True)
        z2 = q.clone().requires_grad_()
        (plain,) = torch.autograd.grad(estimate(z2), z2)
        torch.testing.assert_close(first.detach(), plain, rtol=0, atol=0, msg=name)
        with pytest.raises(NotImplementedError, match="second derivatives of the KIVI estimators are not supported"):
            torch.autograd.grad(first.square().sum(), z)


def test_an_undefined_output_gradient_gives_no_gradient(compiled):
    """The autograd formula with no gradient for the estimate (what torch.autograd.gradcheck's
    check_undefined_grad sends): no gradient for q_z, not zeros made up or an error."""
    p = torch.randn(20, 2, dtype=torch.float64)
    q = torch.randn(20, 2, dtype=torch.float64, requires_grad=True)
    blocked = torch._C._functions.UndefinedGrad()(kivi_fast.kernel_kl(p, q))
    (grad,) = torch.autograd.grad(blocked, q, allow_unused=True, materialize_grads=False)
    assert grad is None


def test_the_ratios_backward_makes_no_gradient_for_its_state(compiled):
    """The ratio op's second output, the float64 grad state its backward reads (with few dimensions the
    projection of the weights [B, m, d + 1], else the weights [B, m, N]), never gets a gradient: the
    backward makes no tensor of its shape (zeros of the weights' size were, at kivi_fast.kl's
    128 x (100, 8), the backward's largest cost), and an undefined gradient of the ratio gives no
    gradient for z. Seen by a dispatch mode, which sees the autograd engine's zeros (not the ops'
    internals): it must see the backward op itself."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Made(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.outputs = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.outputs.append((str(func), tuple(t.shape)))
            return out

    for d, width in ((3, 4), (200, 110)):  # the projection state; the weights (N = 110 <= d + 1)
        p, q = torch.randn(4, 60, d, dtype=torch.float64), torch.randn(4, 50, d, dtype=torch.float64)
        z = torch.randn(4, 70, d, dtype=torch.float64, requires_grad=True)
        fitted = kivi_fast.DensityRatio().fit(p, q)
        r = fitted.log_ratio(z).sum()
        made = Made()
        with made:
            torch.autograd.grad(r, z)
        assert any("weighted_grad" in func for func, _ in made.outputs), made.outputs
        assert (4, 70, width) not in [shape for _, shape in made.outputs], made.outputs
        blocked = torch._C._functions.UndefinedGrad()(fitted.ratio(z))
        (grad,) = torch.autograd.grad(blocked.sum(), z, allow_unused=True, materialize_grads=False)
        assert grad is None


def test_prior_samples_get_no_gradient(impl):
    p = torch.randn(20, 2, dtype=torch.float64, requires_grad=True)
    q = torch.randn(20, 2, dtype=torch.float64, requires_grad=True)
    with pytest.warns(UserWarning, match="prior_z requires grad but gets no gradient"):
        kivi_fast.kernel_kl(p, q).backward()
    assert p.grad is None and q.grad is not None


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_samples_are_taken_as_float32(impl, dtype):
    """float16/bfloat16 samples (a network's output under torch.autocast) give exactly what their float32
    values give, in float32, with the gradient in their own dtype: every public function."""
    g = torch.Generator().manual_seed(3)
    p, q = (torch.randn(60, 4, generator=g).to(dtype) for _ in range(2))
    p32, q32 = p.float(), q.float()
    for estimate in (kivi_fast.kernel_kl,
                     lambda a, b: kivi_fast.kl(a, b, generator=torch.Generator().manual_seed(0)),
                     lambda a, b: kivi_fast.adaptive_contrast_kl(b, reference_z=a.float())):
        q_half = q.clone().requires_grad_()
        value = estimate(p, q_half)
        value.backward()
        q_single = q32.clone().requires_grad_()
        expected = estimate(p32, q_single)
        expected.backward()
        assert value.dtype == torch.float32
        torch.testing.assert_close(value, expected, rtol=0, atol=0)
        assert q_half.grad.dtype == dtype
        torch.testing.assert_close(q_half.grad, q_single.grad.to(dtype), rtol=0, atol=0)
    ratio = kivi_fast.DensityRatio().fit(p, q)
    torch.testing.assert_close(ratio.ratio(q), kivi_fast.DensityRatio().fit(p32, q32).ratio(q32), rtol=0, atol=0)
    torch.testing.assert_close(kivi_fast.median_bandwidth(q), kivi_fast.median_bandwidth(q32), rtol=0, atol=0)
    torch.testing.assert_close(kivi_fast.rbf_gram(p, q, 0.9), kivi_fast.rbf_gram(p32, q32, 0.9), rtol=0, atol=0)


def test_a_generator_under_autocast_trains_through_kl():
    """The use the half-precision inputs are for: a generator's bfloat16 output under CPU autocast."""
    torch.manual_seed(0)
    generator = torch.nn.Linear(4, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        samples = generator(torch.randn(50, 4))
        assert samples.dtype == torch.bfloat16
        value = kivi_fast.kl(torch.randn(50, 3), samples)
    value.backward()
    assert value.dtype == torch.float32 and torch.isfinite(generator.weight.grad).all()
    assert generator.weight.grad.abs().sum() > 0


# Gradients of 128 KB and more come from buffers kept between calls (csrc/cpu/kept_outputs.h): while held,
# each is its own memory; freed, the next call of that size takes it again (no page faults); and
# autograd accumulates into one as into any tensor. 10 x 60000: the backward's weighted sums (a 2.4 MB
# gradient in float32, 4.8 in float64); 1000 x 600 and 260 x 128 (130 KB in float32): the projection's
# (d + 1 < N).
@pytest.mark.parametrize("n,d", [(10, 60000), (1000, 600), (260, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_large_gradients_are_their_own_memory_and_reused(compiled, n, d, dtype):
    g = torch.Generator().manual_seed(3)
    p = torch.randn(n, d, generator=g, dtype=dtype)
    q = torch.randn(n, d, generator=g, dtype=dtype) * 0.8 + 0.1

    def grad_of(qs, fn=kivi_fast.kernel_kl):
        qs = qs.clone().requires_grad_(True)
        return torch.autograd.grad(fn(p, qs), qs)[0]

    g1 = grad_of(q)
    g1_copy = g1.clone()
    g2 = grad_of(q * 1.01)
    assert g1.data_ptr() != g2.data_ptr()
    assert torch.equal(g1, g1_copy)  # the second call wrote elsewhere
    if n * n * d < 10**7:  # the oracle holds [n, 2 n, d] differences
        assert rel_err(g2, grad_of(q * 1.01, reference.kernel_kl)) < (1e-5 if dtype == torch.float32 else 1e-8)
    freed = g2.data_ptr()
    del g2
    # the forward takes its state from the same pool first: were the state's rounded size the
    # gradient's, it could take this buffer (no case here: 10 x 60000's state is small, and 1000 x 600's
    # and 260 x 128's differ from their gradients by more than a page)
    g3 = grad_of(q * 1.01)
    if compiled == "cpu":  # the CPU kernels' outputs (the device-generic path's come from torch's allocator)
        assert not g3.untyped_storage().resizable()  # a kept buffer, not torch's allocator's
        assert g3.data_ptr() == freed
    g4 = grad_of(q * 1.01)  # a reused buffer is handed out once
    assert g4.data_ptr() != g3.data_ptr() and torch.equal(g3, g4)
    qs = q.clone().requires_grad_(True)
    kivi_fast.kernel_kl(p, qs).backward()
    kivi_fast.kernel_kl(p, qs).backward()
    assert torch.equal(qs.grad, 2 * g1_copy)


def test_the_kl_state_is_on_a_kept_buffer_and_reused():
    """The kl op's state for the backward comes from the kept buffers from 128 KB on, as the gradients
    do: a training loop's next step maps no fresh pages for it (bench/run.py's next-call peak memory was
    0.13-0.25 MB at (1000, 32) and 0.5 MB at (2000, 32), glibc mapping the state afresh)."""
    ops = torch.ops.kivi_fast
    g = torch.Generator().manual_seed(4)
    p = torch.randn(1, 1000, 20, generator=g)
    q = torch.randn(1, 1000, 20, generator=g) + 0.1
    with implementation("cpu"):
        _, s1, _, _ = ops.kl(p, q, 1e-3, 1e-8, None, True)  # [1, 1000, 21] float64: 168 KB
        assert not s1.untyped_storage().resizable()  # a kept buffer, not torch's allocator's
        s1_copy, freed = s1.clone(), s1.data_ptr()
        del s1
        _, s2, _, _ = ops.kl(p, q, 1e-3, 1e-8, None, True)
        assert s2.data_ptr() == freed and torch.equal(s2, s1_copy)
        _, s3, _, _ = ops.kl(p, q, 1e-3, 1e-8, None, True)  # while s2 is held: another buffer
        assert s3.data_ptr() != s2.data_ptr() and torch.equal(s3, s2)
        _, small, _, _ = ops.kl(p[:, :100], q[:, :100], 1e-3, 1e-8, None, True)  # 17 KB: torch's allocator
        assert small.untyped_storage().resizable()
        # through autograd: the saved state goes back to the pool after the backward, and the next
        # step's forward takes it again (a 168 KB state and a 160 KB float64 gradient: distinct sizes)
        p64, qs = p.double(), q.double().requires_grad_(True)
        saved = []

        def pack(t):
            if t.dim() == 3 and t.shape[-1] == 21:  # the state [1, 1000, d + 1]
                saved.append((t.data_ptr(), t.untyped_storage().resizable()))
            return t

        grads = []
        for _ in range(2):
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                value = kivi_fast.kernel_kl(p64, qs)
            grads.append(torch.autograd.grad(value, qs)[0])
            del value
        assert len(saved) == 2 and not saved[0][1] and saved[1][0] == saved[0][0]
        assert not grads[0].untyped_storage().resizable() and torch.equal(grads[0], grads[1])


def test_a_step_of_six_layers_takes_no_fresh_buffer():
    """Six kl calls a step, each with a state and a gradient of 128 KB or more: after the first step,
    all twelve buffers wait idle between the backward and the next forward (zero_grad frees the
    gradients), and the next steps take every one of them again (8 idle buffers at most had evicted
    the states)."""
    g = torch.Generator().manual_seed(6)
    widths = [20 + 2 * k for k in range(6)]  # states of 21, 23, ... columns, gradients 20, 22, ...: no size shared
    ps = [torch.randn(1, 1000, w, generator=g, dtype=torch.float64) for w in widths]
    qs = [(torch.randn(1, 1000, w, generator=g, dtype=torch.float64) + 0.1).requires_grad_(True) for w in widths]
    with implementation("cpu"):  # (loads the ops)
        fresh = torch.ops.kivi_fast_testing.kept_fresh_buffers
        before, counts = fresh(), []
        for _ in range(3):
            for q in qs:
                q.grad = None  # zero_grad(set_to_none=True)
            sum(kivi_fast.kernel_kl(p, q) for p, q in zip(ps, qs)).backward()
            counts.append(fresh())
    assert counts[0] > before  # the first step allocates (the counter counts)
    assert counts[1] == counts[0] and counts[2] == counts[0]


def test_kept_buffers_past_the_pool_limit(compiled):
    """More gradient sizes than the pool keeps idle (32): the oldest are evicted and freed, and no
    buffer is handed out twice (csrc/cpu/kept_outputs.cpp)."""
    g = torch.Generator().manual_seed(5)
    widths = [60000 + 1024 * k for k in range(35)]  # 35 sizes of float32 gradients, 2.4 to 3.8 MB
    p = torch.randn(10, widths[-1], generator=g)
    q = torch.randn(10, widths[-1], generator=g) + 0.1

    def grad(w):
        qs = q[:, :w].clone().requires_grad_(True)
        return torch.autograd.grad(kivi_fast.kernel_kl(p[:, :w], qs), qs)[0]

    first = [grad(w).clone() for w in widths]  # each freed at once: the pool fills and evicts
    held = [grad(w) for w in widths]  # all alive together
    assert len({h.data_ptr() for h in held}) == len(held)
    for a, b in zip(first, held):
        assert torch.equal(a, b)


def op_samples(requires_grad=False):
    g = torch.Generator().manual_seed(10)
    p = torch.randn(2, 9, 3, generator=g, dtype=torch.float64)
    q = (torch.randn(2, 7, 3, generator=g, dtype=torch.float64) + 0.2).requires_grad_(requires_grad)
    return p, q


def op_cases():
    ops = torch.ops.kivi_fast
    p, q = op_samples()
    _, qg = op_samples(requires_grad=True)
    sigma = torch.tensor([1.0, 1.5], dtype=torch.float64)
    alpha, sig = ops.fit(p, q, 1e-2, None)
    _, state_r = ops.ratio(q, p, q, alpha, 3.0, sig)  # d + 1 < N: the projection
    _, weights = ops.ratio(q[:, :2], p[:, :2], q[:, :2], alpha[:, :2], 3.0, sig)  # N <= d + 1: the weights
    _, state, _, _ = ops.kl(p, q, 1e-3, 1e-8, None, True)  # d + 1 < N: the projection of the weights
    _, state_w, _, _ = ops.kl(p[..., :2, :], q[..., :2, :], 1e-3, 1e-8, None, True)  # N <= d + 1: the weights
    g = torch.Generator().manual_seed(11)
    p_big, q_big = (torch.randn(1, 10, 60000, generator=g) for _ in range(2))
    _, state_big, _, _ = ops.kl(p_big, q_big, 1e-3, 1e-8, None, True)
    p_mid = torch.randn(1, 1000, 20, generator=g, dtype=torch.float64)
    q_mid = (torch.randn(1, 1000, 20, generator=g, dtype=torch.float64) + 0.1).requires_grad_(True)
    return [
        ("sqdist", ops.sqdist.default, (p, q)),
        ("rbf_gram", ops.rbf_gram.default, (p, q, sigma)),
        ("median_bandwidth", ops.median_bandwidth.default, (p,)),
        ("fit", ops.fit.default, (p, q, 1e-2, None)),
        ("fit_sigma", ops.fit.default, (p, q, 1e-2, sigma)),
        ("ratio", ops.ratio.default, (qg, p, q, alpha, 3.0, sig)),
        ("ratio_weights", ops.ratio.default, (qg[:, :2], p[:, :2], q[:, :2], alpha[:, :2], 3.0, sig)),
        ("ratio_no_state", ops.ratio.default, (q, p, q, alpha, 3.0, sig, False)),
        ("kl", ops.kl.default, (p, qg, 1e-3, 1e-8, None, True)),
        ("kl_forward", ops.kl.default, (p, qg, 1e-3, 1e-8, sigma, False)),
        ("kl_no_state", ops.kl.default, (p, q, 1e-3, 1e-8, None, True, False)),
        ("weighted_grad", ops.weighted_grad.default, (torch.ones(2, 7, dtype=torch.float64), state_r, q, p, q)),
        ("weighted_grad_weights", ops.weighted_grad.default,
         (torch.ones(2, 2, dtype=torch.float64), weights, q[:, :2], p[:, :2], q[:, :2])),
        ("kl_grad", ops.kl_grad.default, (torch.tensor([1.0, -2.0], dtype=torch.float64), state, q, p, True)),
        ("kl_grad_weights", ops.kl_grad.default,
         (torch.tensor([1.0, -2.0], dtype=torch.float64), state_w, q[..., :2, :], p[..., :2, :], True)),
        # kl and kl_grad also take one unbatched pair (what kivi_fast.kernel_kl passes for [n, d] samples)
        ("kl_unbatched", ops.kl.default, (p[0], qg[0].detach().requires_grad_(), 1e-3, 1e-8, None, False)),
        ("kl_grad_unbatched", ops.kl_grad.default, (torch.tensor(-2.0, dtype=torch.float64), state[1], q[1], p[1], True)),
        ("kl_unbatched_no_state", ops.kl.default, (p[0], q[0], 1e-3, 1e-8, None, True, False)),
        ("kl_grad_unbatched_weights", ops.kl_grad.default,
         (torch.tensor(1.0, dtype=torch.float64), state_w[0], q[0, :2, :], p[0, :2, :], True)),
        # a 168 KB state and a 2.4 MB gradient: on kept buffers (csrc/cpu/kept_outputs.h)
        ("kl_kept_state", ops.kl.default, (p_mid, q_mid, 1e-3, 1e-8, None, True)),
        ("kl_grad_kept_buffer", ops.kl_grad.default, (torch.tensor([-1.0], dtype=torch.float64), state_big, q_big,
                                                     p_big, True)),
    ]


def test_opcheck_of_the_backwards_ops_with_a_gradient_to_come(compiled):
    """kl_grad and weighted_grad with inputs that require grad run their Autograd kernels (differentiable
    once): schema, registration and fake-tensor checks hold. opcheck's test_aot_dispatch_dynamic,
    which differentiates them, is left out: a second derivative raises by design (above)."""
    ops = torch.ops.kivi_fast
    p, q = op_samples()
    _, qg = op_samples(requires_grad=True)
    alpha, sig = ops.fit(p, q, 1e-2, None)
    _, state_r = ops.ratio(q, p, q, alpha, 3.0, sig)
    _, state, _, _ = ops.kl(p, q, 1e-3, 1e-8, None, True)
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    grad_kl = torch.tensor([1.0, -2.0], dtype=torch.float64, requires_grad=True)
    torch.library.opcheck(ops.kl_grad.default, (grad_kl, state, qg, p, True), test_utils=checks)
    torch.library.opcheck(ops.weighted_grad.default, (torch.ones(2, 7, dtype=torch.float64), state_r, qg, p, q),
                          test_utils=checks)


OP_CASES = ("sqdist", "rbf_gram", "median_bandwidth", "fit", "fit_sigma", "ratio", "ratio_weights", "ratio_no_state",
            "kl", "kl_forward", "kl_no_state", "weighted_grad", "weighted_grad_weights", "kl_grad", "kl_grad_weights",
            "kl_unbatched", "kl_grad_unbatched", "kl_unbatched_no_state", "kl_grad_unbatched_weights", "kl_kept_state",
            "kl_grad_kept_buffer")


@pytest.mark.parametrize("case", OP_CASES)
def test_opcheck(compiled, case):
    cases = {name: (op, args) for name, op, args in op_cases()}
    assert tuple(cases) == OP_CASES  # every case of op_cases() is checked, by its name
    op, args = cases[case]
    torch.library.opcheck(op, args)


@pytest.mark.parametrize("batched", [True, False])  # unbatched: [n, d] samples straight to the op
def test_torch_compile_fullgraph(compiled, batched):
    p, q = op_samples()
    if not batched:
        p, q = p[1], q[1]

    @torch.compile(fullgraph=True, backend="aot_eager")
    def loss(prior, post):
        return kivi_fast.kernel_kl(prior, post * 1.5, lam=1e-3).sum()

    q1 = q.clone().requires_grad_(True)
    q2 = q.clone().requires_grad_(True)
    compiled_value = loss(p, q1)
    compiled_value.backward()
    eager_value = kivi_fast.kernel_kl(p, q2 * 1.5, lam=1e-3).sum()
    eager_value.backward()
    torch.testing.assert_close(compiled_value, eager_value)
    torch.testing.assert_close(q1.grad, q2.grad)


@pytest.mark.parametrize("reverse", [True, False])
def test_torch_compile_dynamic_shapes(compiled, reverse):
    # symbolic sizes reach the autograd formula (C++) when shapes are dynamic, as after a recompile
    @torch.compile(fullgraph=True, backend="aot_eager")
    def loss(prior, post):
        return kivi_fast.kernel_kl(prior, post * 1.5, lam=1e-3, reverse=reverse).sum()

    g = torch.Generator().manual_seed(3)
    for n_q in (7, 11):
        p = torch.randn(2, 9, 3, generator=g, dtype=torch.float64)
        q = torch.randn(2, n_q, 3, generator=g, dtype=torch.float64) + 0.2
        torch._dynamo.mark_dynamic(p, 1)
        q1 = q.clone().requires_grad_(True)
        torch._dynamo.mark_dynamic(q1, 1)
        q2 = q.clone().requires_grad_(True)
        value = loss(p, q1)
        value.backward()
        expected = kivi_fast.kernel_kl(p, q2 * 1.5, lam=1e-3, reverse=reverse).sum()
        expected.backward()
        torch.testing.assert_close(value, expected)
        torch.testing.assert_close(q1.grad, q2.grad)


def test_torch_compile_of_the_contrasts_and_a_sampler_at_another_sample_count():
    """kl's own N(0, I) draws (adaptive_contrast_kl's are the same function's) and a posterior's sampler,
    compiled and called at a second sample count (the sizes then symbolic): torch.randn(size,
    generator=None) failed there in torch 2.13 (kivi_fast._random)."""
    from kivi_fast.nn import FactorizedGaussian

    def estimate(p, q):
        return kivi_fast.kl(p, q)

    compiled_estimate = torch.compile(estimate, backend="aot_eager")
    sampler = FactorizedGaussian(3, std=0.5)
    compiled_sample = torch.compile(lambda n: sampler.sample(n), backend="aot_eager")
    g = torch.Generator().manual_seed(0)
    for n in (20, 24):
        p, q = (torch.randn(n, 3, generator=g, dtype=torch.float64) for _ in range(2))
        with torch.random.fork_rng():
            torch.manual_seed(n)  # the same draws in both
            value, draws = compiled_estimate(p, q), compiled_sample(n)
            torch.manual_seed(n)
            expected, expected_draws = estimate(p, q), sampler.sample(n)
        torch.testing.assert_close(value, expected)
        torch.testing.assert_close(draws, expected_draws)
