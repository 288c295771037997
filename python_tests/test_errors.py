"""Bad input raises a clear Python exception naming the argument, on every implementation."""

import inspect
import math
import warnings

import pytest
import torch

import kivi_fast
from kivi_fast import reference

from conftest import implementation

# (drawn from their own generator: from the global one they depended on what ran before the import)
_DRAWS = torch.Generator().manual_seed(0)
P = torch.randn(10, 3, dtype=torch.float64, generator=_DRAWS)
Q = torch.randn(8, 3, dtype=torch.float64, generator=_DRAWS)


def with_value(x, index, value):
    x = x.clone()
    x[index] = value
    return x


BAD_SAMPLES = [
    ("rank", dict(prior_z=torch.randn(10), q_z=Q), ValueError, "prior_z must have shape"),
    ("rank4", dict(prior_z=P, q_z=torch.randn(2, 2, 8, 3, dtype=torch.float64)), ValueError, "q_z must have shape"),
    ("mixed rank", dict(prior_z=P, q_z=Q[None]), ValueError, "both be unbatched"),
    ("d", dict(prior_z=P, q_z=torch.randn(8, 4, dtype=torch.float64)), ValueError, "same sample dimension"),
    ("batch", dict(prior_z=P.expand(2, -1, -1), q_z=Q.expand(3, -1, -1)), ValueError, "same batch size"),
    ("too few", dict(prior_z=P[:1], q_z=Q[:0]), ValueError, "q_z must hold at least one sample"),
    ("empty prior", dict(prior_z=P[:0], q_z=Q), ValueError, "prior_z must hold at least one sample"),
    ("int", dict(prior_z=P.long(), q_z=Q.long()), TypeError, "prior_z must have dtype float32 or float64"),
    ("complex", dict(prior_z=P, q_z=Q.to(torch.complex128)), TypeError, "q_z must have dtype"),
    ("half and double", dict(prior_z=P.half(), q_z=Q), TypeError, "same dtype"),  # (half taken as float32)
    ("mixed dtype", dict(prior_z=P, q_z=Q.float()), TypeError, "same dtype"),
    ("device", dict(prior_z=P, q_z=Q.to("meta")), ValueError, "same device"),
    ("not a tensor", dict(prior_z=P.numpy(), q_z=Q), TypeError, "prior_z must be a torch.Tensor"),
    ("nan prior", dict(prior_z=with_value(P, (2, 1), float("nan")), q_z=Q), ValueError, "prior_z contains NaN or Inf"),
    ("inf q", dict(prior_z=P, q_z=with_value(Q, (0, 0), float("inf"))), ValueError, "q_z contains NaN or Inf"),
    ("nan batched", dict(prior_z=P.expand(2, -1, -1), q_z=with_value(Q.expand(2, -1, -1), (1, 3, 2), float("nan"))),
     ValueError, "q_z contains NaN or Inf"),
]


@pytest.mark.parametrize("case", BAD_SAMPLES, ids=[c[0] for c in BAD_SAMPLES])
@pytest.mark.parametrize("reverse", [True, False])
def test_bad_samples(impl, case, reverse):
    _, args, error, message = case
    with pytest.raises(error, match=message):
        kivi_fast.kernel_kl(**args, reverse=reverse)


@pytest.mark.parametrize("n_p,n_q,name", [(1, 8, "prior_z"), (10, 1, "q_z"), (1, 1, "prior_z")])
def test_one_sample_on_a_side_is_rejected(impl, n_p, n_q, name):
    """A ratio fitted to one sample estimates nothing: both sides need two (the documented minimum)."""
    with pytest.raises(ValueError, match=f"{name} must hold at least 2 samples to fit a density ratio"):
        kivi_fast.kernel_kl(P[:n_p], Q[:n_q])
    with pytest.raises(ValueError, match="must hold at least 2 samples to fit a density ratio"):
        kivi_fast.DensityRatio().fit(P[:n_p], Q[:n_q])
    with pytest.raises(ValueError, match="must hold at least 2 samples to fit a density ratio"):
        reference.DensityRatio().fit(P[:n_p], Q[:n_q])  # the oracle's own class holds the same rule


def test_two_samples_on_each_side_is_the_smallest_valid_input(impl):
    for bandwidth in ("median", 1.0):
        value = kivi_fast.kernel_kl(P[:2], Q[:2], bandwidth=bandwidth)
        assert value.shape == () and torch.isfinite(value)


@pytest.mark.parametrize("name,kwargs,error,message", [
    ("lam zero", dict(lam=0.0), ValueError, "lam must be positive"),
    ("lam negative", dict(lam=-1e-3), ValueError, "lam must be positive"),
    ("lam nan", dict(lam=float("nan")), ValueError, "lam must be positive and finite"),
    ("lam inf", dict(lam=float("inf")), ValueError, "lam must be positive and finite"),
    ("lam str", dict(lam="0.1"), TypeError, "lam must be a positive number"),
    ("clip zero", dict(clip=0.0), ValueError, "clip must be positive"),
    ("clip negative", dict(clip=-1.0), ValueError, "clip must be positive"),
    ("clip one", dict(clip=1.0), ValueError, "clip must lie in \\(0, 1\\)"),
    ("clip two", dict(clip=2.0), ValueError, "clip must lie in \\(0, 1\\)"),
    ("clip huge", dict(clip=1e10), ValueError, "clip must lie in \\(0, 1\\)"),
    ("lam below the floor", dict(lam=1e-11), ValueError, "lam must be at least 1e-10"),
    ("lam 1e-30", dict(lam=1e-30), ValueError, "lam must be at least 1e-10.*increase lam"),
    ("lam 1e-300", dict(lam=1e-300), ValueError, "lam must be at least 1e-10"),
    ("bandwidth zero", dict(bandwidth=0.0), ValueError, "bandwidth must be positive"),
    ("bandwidth negative tensor", dict(bandwidth=torch.tensor(-1.0)), ValueError, "bandwidth must be finite and at least"),
    # its square would underflow: exp(-0 / 0) is NaN where the points coincide
    ("bandwidth 1e-200", dict(bandwidth=1e-200), ValueError, "bandwidth must be at least 1e-150"),
    ("bandwidth tensor 1e-200", dict(bandwidth=torch.tensor(1e-200, dtype=torch.float64)), ValueError,
     "bandwidth must be finite and at least 1e-150"),
    ("bandwidth name", dict(bandwidth="mean"), ValueError, 'bandwidth must be "median"'),
    ("bandwidth shape", dict(bandwidth=torch.ones(3)), ValueError, "bandwidth must be a scalar or have shape"),
])
def test_bad_parameters(impl, name, kwargs, error, message):
    with pytest.raises(error, match=message):
        kivi_fast.kernel_kl(P, Q, **kwargs)


def test_all_points_equal_asks_for_a_bandwidth(impl):
    same = torch.ones(6, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match="median pairwise distance of the samples is 0.*bandwidth"):
        kivi_fast.kernel_kl(same, same.clone())
    with pytest.raises(ValueError, match="median pairwise distance"):
        kivi_fast.median_bandwidth(same)
    assert torch.isfinite(kivi_fast.kernel_kl(same, same.clone(), bandwidth=1.0))


def test_samples_too_small_for_a_median_bandwidth_ask_to_be_rescaled(impl):
    """A median distance below 1e-150 would be a bandwidth whose square underflows (the check a given
    bandwidth gets): a fit refuses it. median_bandwidth, the statistic, still returns it."""
    tiny = P * 1e-160
    message = "median pairwise distance of the samples is below 1e-150, too small a bandwidth .* rescale"
    with pytest.raises(ValueError, match=message):
        kivi_fast.kernel_kl(tiny, Q * 1e-160)
    with pytest.raises(ValueError, match=message):
        kivi_fast.DensityRatio().fit(tiny, Q * 1e-160)
    assert 0 < kivi_fast.median_bandwidth(tiny) < 1e-150
    # a median of ~1e-140 is fine: the median bandwidth makes the estimate scale-free
    torch.testing.assert_close(kivi_fast.kernel_kl(P * 1e-140, Q * 1e-140), kivi_fast.kernel_kl(P, Q), rtol=1e-9,
                               atol=0)


def test_system_that_float64_cannot_factor_raises(impl):
    """The guard behind the lam floor: the public API rejects lam < 1e-10 first, so the factorization's
    own error is reached through the backends' fit directly (torch.ops.kivi_fast for the ops)."""
    q = torch.ones(1, 7, 2, dtype=torch.float64)  # identical points: K_qq has rank one
    p, sigma = P[None, :, :2], torch.ones(1, dtype=torch.float64)
    with pytest.raises(ValueError, match="not positive definite.*increase lam"):
        if impl == "reference":
            reference._fit64(p, q, 1e-300, sigma)
        else:
            torch.ops.kivi_fast.kl(p, q, 1e-300, 1e-8, sigma, True)


def test_lam_at_its_floor_matches_a_high_precision_oracle(impl):
    """At lam = 1e-10 (the smallest allowed) every backend gives the formula's value to 1e-5 (2e-6 was
    the largest error measured), checked against the same formula in 40-digit arithmetic (mpmath); at
    1e-14 float64 is off by ~1e-3."""
    mpmath = pytest.importorskip("mpmath")
    g = torch.Generator().manual_seed(3)
    p, q = torch.randn(24, 3, generator=g, dtype=torch.float64), torch.randn(20, 3, generator=g, dtype=torch.float64) + 1
    lam, sigma = 1e-10, 1.3
    with mpmath.workdps(40):
        k = lambda a, b: mpmath.exp(-sum((mpmath.mpf(x) - mpmath.mpf(y)) ** 2 for x, y in zip(a, b)) / (2 * mpmath.mpf(sigma) ** 2))
        P_, Q_ = p.tolist(), q.tolist()
        k_qq = mpmath.matrix([[k(a, b) for b in Q_] for a in Q_])
        k_qp = [[k(a, b) for b in P_] for a in Q_]
        lam_ = mpmath.mpf(lam)
        rhs = mpmath.matrix([sum(row) / (lam_ * len(Q_) * len(P_)) for row in k_qp])
        alpha = -mpmath.lu_solve(k_qq / len(Q_) + lam_ * mpmath.eye(len(Q_)), rhs)
        r = [sum(alpha[i] * k_qq[i, j] for i in range(len(Q_))) + sum(k_qp[j]) / (lam_ * len(P_)) for j in range(len(Q_))]
        oracle = float(-sum(mpmath.log(max(v, mpmath.mpf(1e-8))) for v in r) / len(r))
    value = float(kivi_fast.kernel_kl(p, q, lam=lam, bandwidth=sigma))
    assert abs(value - oracle) <= 1e-5 * abs(oracle), (value, oracle)


def test_mostly_clipped_ratios_warn(impl):
    """lam = 1e10 shrinks the fitted ratio below the clip at every sample: the estimate is -log(clip),
    which says nothing about q, and the user is told so."""
    with pytest.warns(kivi_fast.ClippingWarning, match="more than half of the posterior samples"):
        value = kivi_fast.kernel_kl(P, Q, lam=1e10)
    torch.testing.assert_close(value, torch.tensor(-math.log(1e-8), dtype=torch.float64))
    with pytest.warns(kivi_fast.ClippingWarning):
        kivi_fast.kernel_kl(P.expand(3, -1, -1), Q.expand(3, -1, -1), lam=1e10)
    with warnings.catch_warnings(record=True) as seen:  # once per call site, not once per step
        warnings.simplefilter("default")
        for _ in range(3):
            kivi_fast.kernel_kl(P, Q, lam=1e10)
    assert sum(issubclass(w.category, kivi_fast.ClippingWarning) for w in seen) == 1
    # from inside kl and adaptive_contrast_kl too, it names the line that called them: once per such line
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        lines = []
        for _ in range(2):
            lines.append(inspect.currentframe().f_lineno + 1)
            kivi_fast.kl(P, Q, lam=1e10, generator=torch.Generator().manual_seed(0))
            lines.append(inspect.currentframe().f_lineno + 1)
            kivi_fast.adaptive_contrast_kl(Q, lam=1e10, generator=torch.Generator().manual_seed(0))
    clipping = [w for w in seen if issubclass(w.category, kivi_fast.ClippingWarning)]
    assert [(w.filename, w.lineno) for w in clipping] == [(__file__, line) for line in lines[:2]]
    g = torch.Generator().manual_seed(0)
    p, q = (torch.randn(100, 3, generator=g, dtype=torch.float64) for _ in range(2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kivi_fast.kernel_kl(p, q, lam=1e-3)  # q = p: at most 7% clipped over 200 draws, no warning


def test_prior_samples_that_ask_for_a_gradient_are_told_they_get_none(impl):
    """The gradient flows through q_z only (Eq. 8): a prior sampler with parameters would silently train
    on nothing. One warning per call (kl with contrast="none" calls kernel_kl: still one), none when
    prior_z is detached or grad mode is off; the gradient w.r.t. q_z is unchanged."""
    q = Q.clone().requires_grad_()
    p = P.clone().requires_grad_()
    def seeded_kl(a, b):  # the same N(0, I) draws at every call
        return kivi_fast.kl(a, b, generator=torch.Generator().manual_seed(0))

    for estimate in (seeded_kl, kivi_fast.kernel_kl, lambda a, b: kivi_fast.kl(a, b, contrast="none")):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            value = estimate(p, q)
        messages = [str(w.message) for w in seen if w.category is UserWarning]
        assert len(messages) == 1 and "prior_z requires grad but gets no gradient" in messages[0], messages
        grad_p, grad_q = torch.autograd.grad(value, [p, q], allow_unused=True)
        assert grad_p is None
        torch.testing.assert_close(grad_q, torch.autograd.grad(estimate(P, q), q)[0], rtol=0, atol=0)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            # (only the prior's warning is in question: whether these draws' ratios clip is not)
            warnings.simplefilter("ignore", kivi_fast.ClippingWarning)
            estimate(p.detach(), q)
            with torch.no_grad():
                estimate(p, q)


def test_torch_func_transforms_are_refused_by_name(impl):
    """vmap and torch.func.grad cannot run kivi_fast (a C++ autograd formula; the checks read the
    data): every public function names itself and what to use instead, not torch's internals."""
    from torch.func import grad, vmap

    pb, qb = P.expand(3, -1, -1), Q.expand(3, -1, -1) + torch.arange(3.0, dtype=torch.float64)[:, None, None]
    ratio = kivi_fast.DensityRatio().fit(P, Q)
    calls = {"kl": lambda p, q: kivi_fast.kl(p, q), "kernel_kl": lambda p, q: kivi_fast.kernel_kl(p, q),
             "adaptive_contrast_kl": lambda p, q: kivi_fast.adaptive_contrast_kl(q),
             "DensityRatio.fit": lambda p, q: kivi_fast.DensityRatio().fit(p, q).alpha.sum(),
             "DensityRatio.ratio": lambda p, q: ratio.ratio(q).sum(),
             "median_bandwidth": lambda p, q: kivi_fast.median_bandwidth(q),
             "rbf_gram": lambda p, q: kivi_fast.rbf_gram(p, q, 0.7).sum()}
    for name, call in calls.items():
        with pytest.raises(NotImplementedError, match=f"kivi_fast.{name} does not run under torch.func"):
            vmap(call)(pb, qb)
        with pytest.raises(NotImplementedError, match=f"kivi_fast.{name} does not run under torch.func"):
            grad(call, argnums=1)(P, Q)


def test_forward_mode_ad_is_refused_by_name(impl):
    """Dual tensors (torch.autograd.forward_ad): the compiled ops have no forward-mode formula, so
    kernel_kl's tangent was None and kl's only its Gaussian part's (0.59 against 0.37), silently.
    Every public function refuses them, naming itself; plain tensors inside a dual level still run."""
    import torch.autograd.forward_ad as fwAD

    ratio = kivi_fast.DensityRatio().fit(P, Q)
    calls = {"kl": lambda p, q: kivi_fast.kl(p, q), "kernel_kl": lambda p, q: kivi_fast.kernel_kl(p, q),
             "adaptive_contrast_kl": lambda p, q: kivi_fast.adaptive_contrast_kl(q),
             "DensityRatio.fit": lambda p, q: kivi_fast.DensityRatio().fit(p, q),
             "DensityRatio.ratio": lambda p, q: ratio.ratio(q),
             "median_bandwidth": lambda p, q: kivi_fast.median_bandwidth(q),
             "rbf_gram": lambda p, q: kivi_fast.rbf_gram(p, q, 0.7)}
    with fwAD.dual_level():
        dual = fwAD.make_dual(Q, torch.ones_like(Q))
        for name, call in calls.items():
            with pytest.raises(NotImplementedError, match=f"kivi_fast.{name} does not take forward-mode AD"):
                call(P, dual)
        assert torch.isfinite(kivi_fast.kernel_kl(P, Q))


def test_the_gram_and_the_median_record_no_gradient(impl):
    """rbf_gram and median_bandwidth have no gradient (their docstrings): on inputs that require one
    their results do not, so backward raises, where the compiled ops' results used to claim a
    gradient and give None."""
    x = P.clone().requires_grad_()
    for result in (kivi_fast.rbf_gram(x, Q, 0.7), kivi_fast.median_bandwidth(x)):
        assert not result.requires_grad and result.grad_fn is None
        with pytest.raises(RuntimeError, match="does not require grad"):
            result.sum().backward()
    torch.testing.assert_close(kivi_fast.rbf_gram(x, Q, 0.7), reference.rbf_gram(P, Q, 0.7), rtol=1e-12, atol=0)


@pytest.mark.parametrize("implementation_name", ["cpu", "generic"])
def test_the_ops_without_a_gradient_raise_at_backward_when_called_directly(implementation_name):
    """torch.ops.kivi_fast's sqdist, rbf_gram, median_bandwidth and fit have no gradient (the API
    detaches their inputs): called directly on inputs that require one, backward raises naming the op,
    where torch's fallback would have warned and left those inputs' gradients out."""
    kivi_fast.backend()
    ops = torch.ops.kivi_fast
    x, y = P.clone().requires_grad_(), Q.clone().requires_grad_()
    calls = {"sqdist": lambda: ops.sqdist(x[None], y[None]),
             "rbf_gram": lambda: ops.rbf_gram(x[None], y[None], torch.tensor(0.7, dtype=x.dtype)),
             "median_bandwidth": lambda: ops.median_bandwidth(x[None]),
             "fit": lambda: ops.fit(x[None], y[None], 1e-2, None)[0]}
    with implementation(implementation_name):
        for name, call in calls.items():
            with pytest.raises(RuntimeError, match=f"derivative for kivi_fast::{name} is not implemented"):
                (call().sum() + x.sum() + y.sum()).backward()
            with torch.no_grad():
                assert not call().requires_grad


def test_density_ratio_errors(impl):
    fit = kivi_fast.DensityRatio(lam=1e-2).fit(P, Q)
    with pytest.raises(ValueError, match="same sample dimension"):
        fit.ratio(torch.randn(4, 5, dtype=torch.float64))
    with pytest.raises(ValueError, match="clip must be positive"):
        fit.log_ratio(P, clip=0)
    with pytest.raises(ValueError, match="clip must lie in"):
        fit.log_ratio(P, clip=1.5)
    with pytest.raises(ValueError, match="lam must be at least 1e-10"):
        kivi_fast.DensityRatio(lam=1e-30)
    with pytest.raises(RuntimeError, match="call fit"):
        kivi_fast.DensityRatio().ratio(P)
    for attribute in ("alpha", "beta", "sigma"):
        with pytest.raises(RuntimeError, match=f"call fit\\(numer, denom\\) before reading {attribute}"):
            getattr(kivi_fast.DensityRatio(), attribute)
    with pytest.raises(ValueError, match="bandwidth must be at least 1e-150"):
        kivi_fast.DensityRatio(bandwidth=1e-200).fit(P, Q)
    with pytest.raises(ValueError, match="lam must be positive"):
        kivi_fast.DensityRatio(lam=0)
    with pytest.raises(ValueError, match="numer contains NaN"):
        kivi_fast.DensityRatio().fit(with_value(P, (0, 0), float("nan")), Q)


def test_adaptive_contrast_errors(impl):
    with pytest.raises(ValueError, match="at least 2 samples"):
        kivi_fast.adaptive_contrast_kl(Q[:1])
    with pytest.raises(ValueError, match="zero standard deviation"):
        kivi_fast.adaptive_contrast_kl(torch.ones(5, 2, dtype=torch.float64), contrast="diagonal")
    with pytest.raises(ValueError, match="q_z's sample covariance is singular"):
        kivi_fast.adaptive_contrast_kl(torch.ones(5, 2, dtype=torch.float64), contrast="full")
    with pytest.raises(ValueError, match="zero standard deviation"):  # "auto": its diagonal, which has none
        kivi_fast.adaptive_contrast_kl(torch.ones(5, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match="log_prior must map"):
        kivi_fast.adaptive_contrast_kl(Q, lambda z: z.sum())
    with pytest.raises(ValueError, match="n_prior must be an integer >= 2"):
        kivi_fast.adaptive_contrast_kl(Q, n_prior=1)
    assert torch.isfinite(kivi_fast.adaptive_contrast_kl(Q, n_prior=__import__("numpy").int64(6)))
    with pytest.raises(ValueError, match="reference_z must hold at least 2 samples"):  # (was a ZeroDivisionError)
        kivi_fast.adaptive_contrast_kl(Q, reference_z=P[:1])
    for contrast in ("full", "diagonal"):
        with pytest.raises(ValueError, match="reference_z contains NaN or Inf"):
            kivi_fast.adaptive_contrast_kl(Q, reference_z=with_value(P, (0, 0), float("nan")), contrast=contrast)
    for returned in (lambda z: 1.0, lambda z: torch.ones(z.shape[:-1], dtype=torch.bool)):
        with pytest.raises(TypeError, match="log_prior must return a floating-point tensor on q_z's device"):
            kivi_fast.adaptive_contrast_kl(Q, returned)
    for value in (float("nan"), -float("inf")):  # (was a NaN or an infinite estimate, silently)
        with pytest.raises(ValueError, match="log_prior returned NaN or Inf at some of q_z's samples"):
            kivi_fast.adaptive_contrast_kl(Q, lambda z: with_value(-z.pow(2).sum(-1), (3,), value))
    with pytest.raises(TypeError, match="reverse must be a Python bool \\(True or False\\), got numpy.bool"):
        kivi_fast.kernel_kl(P, Q, reverse=__import__("numpy").bool_(True))
    with pytest.raises(TypeError, match="reverse must be a Python bool \\(True or False\\), got str"):
        reference.kernel_kl(P, Q, reverse="no")  # (the oracle too: it took any truthy value)
    with pytest.raises(TypeError, match="generator must be a torch.Generator, got int"):
        kivi_fast.adaptive_contrast_kl(Q, generator=3)
    with pytest.raises(TypeError, match="generator must be a torch.Generator"):
        kivi_fast.kl(P, Q, generator="seed")


def test_nan_under_the_full_contrast_is_named_as_nan(impl):
    """Not as a singular covariance, which NaN makes of it."""
    for kl in (lambda q: kivi_fast.kl(P, q, contrast="full"), lambda q: kivi_fast.adaptive_contrast_kl(q, contrast="full")):
        with pytest.raises(ValueError, match="q_z contains NaN or Inf"):
            kl(with_value(Q, (2, 1), float("nan")))
    with pytest.raises(ValueError, match="prior_z contains NaN or Inf"):
        kivi_fast.kl(with_value(P, (2, 1), float("inf")), Q, contrast="full")


@pytest.mark.parametrize("contrast", ["auto", "full", "diagonal"])
def test_the_contrast_is_scale_free_within_float64_and_names_the_scale_outside(impl, contrast):
    """kl and adaptive_contrast_kl whiten the samples first, so scaling p and q (and the prior's
    density) by s leaves the estimate as it is and scales the gradient by 1 / s, from 1e-148 to 1e153.
    Past that a sample variance overflows float64 (1e154: a NaN estimate, or a Cholesky failure
    reported as a singular covariance or a zero standard deviation) or, with a full covariance, is
    not a normal float64 (1e-152: a finite value with a NaN gradient): both now raise, naming q_z."""
    p = torch.randn(40, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    q = torch.randn(35, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(2)) * 0.8 + 0.3

    def estimates(scale):
        log_prior = lambda z: -0.5 * (z / scale).pow(2).sum(-1) - 5 * math.log(scale * math.sqrt(2 * math.pi))
        out = []
        for kl in (lambda x: kivi_fast.kl(p * scale, x, contrast=contrast, generator=torch.Generator().manual_seed(3)),
                   lambda x: kivi_fast.adaptive_contrast_kl(x, log_prior, contrast=contrast,
                                                            generator=torch.Generator().manual_seed(3))):
            x = (q * scale).requires_grad_()
            value = kl(x)
            (grad,) = torch.autograd.grad(value, x)
            out.append((value, grad * scale))
        return out

    for (v1, g1), (vs, gs) in [pair for scale in (1e153, 1e-148) for pair in zip(estimates(1.0), estimates(scale))]:
        torch.testing.assert_close(vs, v1, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(gs, g1, rtol=1e-7, atol=1e-9)
    with pytest.raises(ValueError, match="q_z's samples are so far apart that their variance overflows float64"):
        estimates(1e154)
    if contrast == "diagonal":
        assert all(torch.isfinite(g).all() for _, g in estimates(1e-152))
    else:
        with pytest.raises(ValueError, match="q_z has a standard deviation below 1e-150 in some dimension"):
            estimates(1e-152)


def test_sparse_samples_and_a_bandwidth_on_meta_are_named(impl):
    """Sparse samples reached the contrast's ATen calls (kl, adaptive_contrast_kl: the dispatcher's
    'Could not run aten::mean.dim'), and a bandwidth tensor on 'meta' a copy out of it: both are named."""
    calls = {"kl": lambda x: kivi_fast.kl(P, x), "kernel_kl": lambda x: kivi_fast.kernel_kl(P, x),
             "adaptive_contrast_kl": lambda x: kivi_fast.adaptive_contrast_kl(x),
             "DensityRatio": lambda x: kivi_fast.DensityRatio().fit(P, x),
             "median_bandwidth": lambda x: kivi_fast.median_bandwidth(x)}
    for name, call in calls.items():
        with pytest.raises(ValueError, match="must be a dense tensor, got layout torch.sparse_coo"):
            call(Q.to_sparse())
    meta = torch.tensor(0.7, device="meta")
    for call in (lambda: kivi_fast.kernel_kl(P, Q, bandwidth=meta), lambda: kivi_fast.kl(P, Q, bandwidth=meta),
                 lambda: kivi_fast.DensityRatio(bandwidth=meta).fit(P, Q), lambda: kivi_fast.rbf_gram(P, Q, meta)):
        with pytest.raises(ValueError, match="bandwidth must hold values: .* got one on 'meta'"):
            call()


def test_samples_on_meta_give_shapes_or_a_named_refusal(impl):
    """On 'meta' the compiled ops run their fake kernels (shapes only); the reference, which reads the
    samples' values, raised torch's 'Tensor.item() cannot be called on meta tensors'."""
    p, q = P.to("meta"), Q.to("meta").requires_grad_()
    calls = {"kl": lambda: kivi_fast.kl(p, q), "kernel_kl": lambda: kivi_fast.kernel_kl(p, q),
             "adaptive_contrast_kl": lambda: kivi_fast.adaptive_contrast_kl(q),
             "median_bandwidth": lambda: kivi_fast.median_bandwidth(q),
             "rbf_gram": lambda: kivi_fast.rbf_gram(p, q, torch.tensor(0.7)),
             "DensityRatio": lambda: kivi_fast.DensityRatio(bandwidth=0.7).fit(p, q).alpha}
    shapes = {"rbf_gram": (P.shape[0], Q.shape[0]), "DensityRatio": (Q.shape[0],)}
    for name, call in calls.items():
        if impl == "reference":
            with pytest.raises(NotImplementedError, match="reference reads the samples' values and cannot run on "
                                                          "'meta' tensors"):
                call()
        else:
            out = call()
            assert out.device.type == "meta" and out.shape == shapes.get(name, ()), name


def test_an_empty_batch_gives_empty_results(impl):
    """B = 0 gives [0]-shaped results on every implementation, without warnings (the reference's
    quantile refused it; the contrast's moments warned of zero degrees of freedom)."""
    p, q = torch.empty(0, 5, 3, dtype=torch.float64), torch.empty(0, 4, 3, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        results = [kivi_fast.kernel_kl(p, q), kivi_fast.kl(p, q), kivi_fast.kl(p, q, contrast="diagonal"),
                   kivi_fast.adaptive_contrast_kl(q), kivi_fast.median_bandwidth(p), kivi_fast.DensityRatio().fit(p, q).sigma]
    for result in results:
        assert result.shape == (0,) and result.dtype == torch.float64
    assert kivi_fast.DensityRatio().fit(p, q).alpha.shape == (0, 4)
    # the arguments are checked all the same
    bad_calls = [(lambda: kivi_fast.adaptive_contrast_kl(q, lam=-1.0), ValueError, "lam must be positive"),
                 (lambda: kivi_fast.adaptive_contrast_kl(q, contrast="bogus"), ValueError, "contrast must be one of"),
                 (lambda: kivi_fast.adaptive_contrast_kl(q, 5), TypeError, "log_prior must be a callable"),
                 (lambda: kivi_fast.adaptive_contrast_kl(q[:, :1]), ValueError, "at least 2 samples"),
                 (lambda: kivi_fast.kl(p, q, generator=5), TypeError, "generator must be a torch.Generator"),
                 (lambda: kivi_fast.kl(p, q, reverse="no"), TypeError, "reverse must be a Python bool")]
    for call, error, message in bad_calls:
        with pytest.raises(error, match=message):
            call()


def test_points_whose_squared_distances_overflow_are_named(impl):
    """Finite samples 1e155 apart: each implementation names a set whose distances overflow (the
    reference gave NaN for the median and 'not positive definite' for the fit). Where only the
    distances between the two sets overflow, either may be named (the compiled ops name the one far
    from the Gram's centre)."""
    message = " contains NaN or Inf \\(or points so far apart that their squared distances overflow float64\\)"
    cases = [(lambda: kivi_fast.kernel_kl(P * 1e155, Q), "(prior_z|q_z)"),
             (lambda: kivi_fast.kernel_kl(P, Q * 1e155), "q_z"),
             (lambda: kivi_fast.kernel_kl(P, Q * 1e155, bandwidth=1.0), "q_z"),
             (lambda: kivi_fast.median_bandwidth(P * 1e155), "x"),
             (lambda: kivi_fast.DensityRatio().fit(P, Q * 1e155), "denom"),
             (lambda: kivi_fast.DensityRatio().fit(P, Q).ratio(Q * 1e155), "z"),
             # (a kernel of 0 by overflow; the reference names the set that reaches farther out)
             (lambda: kivi_fast.rbf_gram(P * 1e155, Q * 1e155, 1.0),
              "x" if impl != "reference" or P.abs().max() >= Q.abs().max() else "y"),
             (lambda: kivi_fast.rbf_gram(P, Q * 1e155, 1.0), "(x|y)" if impl != "reference" else "y")]
    for call, name in cases:
        with pytest.raises(ValueError, match=f"^{name}{message}"):
            call()
    torch.testing.assert_close(kivi_fast.kernel_kl(P * 1e153, Q * 1e153), kivi_fast.kernel_kl(P, Q), rtol=1e-9, atol=0)


def test_primitives_reject_nan(impl):
    bad = with_value(P, (3, 1), float("nan"))
    with pytest.raises(ValueError, match="x contains NaN or Inf"):
        kivi_fast.median_bandwidth(bad)
    with pytest.raises(ValueError, match="y contains NaN or Inf"):
        kivi_fast.rbf_gram(Q, with_value(P, (0, 0), float("inf")), 1.0)
    with pytest.raises(ValueError, match="x contains NaN or Inf"):
        kivi_fast.rbf_gram(bad, Q, 1.0)
    fit = kivi_fast.DensityRatio().fit(P, Q)
    with pytest.raises(ValueError, match="z contains NaN or Inf"):
        fit.ratio(bad)
    with pytest.raises(ValueError, match="z contains NaN or Inf"):
        fit.log_ratio(torch.full_like(P, math.inf))


def test_ops_called_directly_check_their_samples():
    """torch.ops.kivi_fast.* skip the Python checks: mismatched samples are still an error naming the
    op and the arguments, not a read past the end of a buffer."""
    kivi_fast.backend()
    ops = torch.ops.kivi_fast
    f64 = dict(dtype=torch.float64)
    p, q = torch.randn(1, 2, 50, **f64), torch.randn(1, 3, 40, **f64)
    with pytest.raises(ValueError, match="kl_grad: prior_z and q_z must have the same batch size and dimension"):
        ops.kl_grad(torch.ones(1, **f64), torch.zeros(1, 3, 5, **f64), q, p, False)
    with pytest.raises(ValueError, match="kl: prior_z and q_z must have the same batch size and dimension"):
        ops.kl(p, q, 1e-3, 1e-8, None, True)
    with pytest.raises(ValueError, match="kl: prior_z and q_z must have the same dtype and device"):
        ops.kl(p, p.float(), 1e-3, 1e-8, None, True)
    with pytest.raises(ValueError, match="kl: prior_z and q_z must both be unbatched \\[n, d\\] or both batched"):
        ops.kl(p[0], p, 1e-3, 1e-8, None, True)
    with pytest.raises(ValueError, match="kl_grad: prior_z and q_z must both be unbatched"):
        ops.kl_grad(torch.ones((), **f64), torch.zeros(3, 41, **f64), q[0], p, False)
    with pytest.raises(ValueError, match="kl: prior_z and q_z must have the same batch size and dimension, "
                                         "got shapes \\[2, 50\\] and \\[3, 40\\]"):
        ops.kl(p[0], q[0], 1e-3, 1e-8, None, True)  # the shapes as passed, not with a batch dimension added
    with pytest.raises(ValueError, match="kl: prior_z must be a float32 or float64 \\[n, d\\] or \\[B, n, d\\] tensor"):
        ops.kl(p[0, 0], q[0, 0], 1e-3, 1e-8, None, True)
    with pytest.raises(ValueError, match="kl: sigma must hold one bandwidth per batch element \\(1\\)"):
        ops.kl(q, q, 1e-3, 1e-8, torch.ones(2, **f64), True)
    with pytest.raises(ValueError, match="fit: sigma must hold one bandwidth per batch element \\(1\\)"):
        ops.fit(q, q, 1e-3, torch.ones(3, **f64))
    with pytest.raises(ValueError, match="weighted_grad: state must be float64 \\[1, 3, 5\\]"):
        ops.weighted_grad(torch.ones(1, 3, **f64), torch.zeros(1, 3, 4, **f64), q, q[:, :2], q)
    with pytest.raises(ValueError, match="weighted_grad: row_scale must have shape \\[1, 3\\]"):
        ops.weighted_grad(torch.ones(1, 4, **f64), torch.zeros(1, 3, 5, **f64), q, q[:, :2], q)
    with pytest.raises(ValueError, match="median_bandwidth: x must hold at least 2 samples"):
        ops.median_bandwidth(torch.randn(1, 1, 3, **f64))
    with pytest.raises(ValueError, match="fit: numer must be a float32 or float64 \\[B, n, d\\] tensor"):
        ops.fit(torch.randn(4, 3, **f64), torch.randn(1, 4, 3, **f64), 1e-3, None)


def test_ops_called_directly_check_their_other_arguments():
    """The scalars and bandwidths the kernels read, checked by the ops themselves: lam, clip and a
    bandwidth that is not finite or whose square underflows gave NaN; a bandwidth on 'meta' sent the
    call to the fake kernels, which returned uninitialized memory. (One sample a side is the public
    API's refusal, not the ops': the emulation's tests eliminate a one-row system through them.)"""
    kivi_fast.backend()
    ops = torch.ops.kivi_fast
    f64 = dict(dtype=torch.float64)
    p, q = torch.randn(2, 10, 3, **f64), torch.randn(2, 12, 3, **f64)
    one = torch.ones(2, **f64)
    for lam in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="kl: lam must be positive and finite"):
            ops.kl(p, q, lam, 1e-8, None, True)
        with pytest.raises(ValueError, match="fit: lam must be positive and finite"):
            ops.fit(p, q, lam, None)
    for clip in (0.0, 1.0, float("nan")):
        with pytest.raises(ValueError, match="kl: clip must lie in \\(0, 1\\)"):
            ops.kl(p, q, 1e-3, clip, None, True)
    for bad in (-1.0, 0.0, 1e-200, float("inf"), float("nan")):
        sigma = torch.tensor([1.0, bad], **f64)
        for call in (lambda: ops.kl(p, q, 1e-3, 1e-8, sigma, True), lambda: ops.fit(p, q, 1e-3, sigma),
                     lambda: ops.rbf_gram(p, q, sigma), lambda: ops.ratio(q, p, q, torch.zeros(2, 12, **f64), 1.0, sigma)):
            with pytest.raises(ValueError, match="sigma must be finite and at least 1e-150 .* for batch element 1"):
                call()
    with pytest.raises(ValueError, match="rbf_gram: sigma must hold one bandwidth per batch element \\(2\\) or one"):
        ops.rbf_gram(p, q, torch.ones(3, **f64))
    meta = torch.ones(2, device="meta", **f64)
    with pytest.raises(ValueError, match="kl: sigma must be on prior_z's device cpu, got meta"):
        ops.kl(p, q, 1e-3, 1e-8, meta, True)
    with pytest.raises(ValueError, match="rbf_gram: sigma must be on x's device cpu, got meta"):
        ops.rbf_gram(p, q, meta)
    with pytest.raises(ValueError, match="fit: sigma must be on numer's device"):
        ops.fit(p, q, 1e-3, meta)
    state = ops.kl(p, q, 1e-3, 1e-8, None, True)[1]
    with pytest.raises(ValueError, match="kl_grad: grad_kl must be a floating-point tensor of 2 elements"):
        ops.kl_grad(torch.tensor([1, 2]), state, q, p, True)
    torch.testing.assert_close(ops.rbf_gram(p, q, one), ops.rbf_gram(p, q, one[:1]))  # one for all


def test_ops_called_directly_refuse_what_they_cannot_compute():
    """Inputs the kernels would turn into NaN, Inf or a misnamed error, from a review of the ops: a
    subnormal lam (the fit's 1 / (lam n_p n_q) overflows), points so far apart that their squared
    distances overflow (and points whose squared norms do not fit a float64 but whose distances do,
    computed: the Gram's points are centred), too many points for the median's selection (refused before the
    N x N distances are allocated), bad alpha, beta or row_scale, sparse samples; and the ratio op's
    value check on its Gram path names the argument (sqdist's own check calls them x and y)."""
    kivi_fast.backend()
    ops = torch.ops.kivi_fast
    f64 = dict(dtype=torch.float64)
    p, q = torch.randn(2, 10, 3, **f64), torch.randn(2, 12, 3, **f64)
    for lam in (1e-310, 5e-324):
        with pytest.raises(ValueError, match="kl: lam must be positive and finite, and a normal float64"):
            ops.kl(p, q, lam, 1e-8, None, True)
    ops.kl(p, q, 1e-300, 1e-8, None, True)  # normal: taken (the public API's floor, 1e-10, is about accuracy)
    far_apart = "contains NaN or Inf \\(or points so far apart that their squared distances overflow float64\\)"
    huge_x, huge_y = torch.full((1, 1, 33), 1e154, **f64), torch.full((1, 1, 33), -1e154, **f64)
    for path in ("cpu", "generic"):  # (the generic path as CPU tensors take it: where values are read)
        with implementation(path):
            with pytest.raises(ValueError, match=far_apart):
                ops.sqdist(huge_x, huge_y)
            with pytest.raises(ValueError, match=far_apart):
                ops.kl(huge_x.expand(1, 2, 33).contiguous(), huge_y.expand(1, 2, 33).contiguous(), 1e-3, 1e-8,
                       torch.ones(1, **f64), True)
            # squared norms of 1.3e308 each, 3.3e305 apart
            assert ops.sqdist(huge_x / 5, huge_x * 0.19).item() == pytest.approx(33 * 1e152**2, rel=1e-12)
    with pytest.raises(ValueError, match="the median bandwidth takes at most 65536 points"):
        ops.median_bandwidth(torch.randn(1, 65537, 1, **f64))
    alpha = torch.zeros(2, 12, **f64)
    for bad in (alpha.long(), alpha.to(torch.complex128)):
        with pytest.raises(ValueError, match="ratio: alpha must be a dense floating-point tensor"):
            ops.ratio(q, p, q, bad, 1.0, torch.ones(2, **f64))
    for beta in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="ratio: beta must be finite"):
            ops.ratio(q, p, q, alpha, beta, torch.ones(2, **f64))
    for path in ("cpu", "generic"):
        with implementation(path):
            for v in (float("nan"), float("inf")):
                bad = alpha.clone()
                bad[1, 4] = v
                with pytest.raises(ValueError, match="ratio: alpha must be finite"):
                    ops.ratio(q, p, q, bad, 1.0, torch.ones(2, **f64))
    _, state = ops.ratio(q, p, q, alpha, 1.0, torch.ones(2, **f64))
    with pytest.raises(ValueError, match="weighted_grad: row_scale must be a dense floating-point tensor"):
        ops.weighted_grad(torch.ones(2, 12, dtype=torch.bool), state, q, p, q)
    with pytest.raises(ValueError, match="kl: q_z must be a dense tensor"):
        ops.kl(p, q.to_sparse(), 1e-3, 1e-8, None, True)
    # the ratio op on its Gram path ((N + 1) d float64 above 8 MB): each argument named
    g = torch.Generator().manual_seed(0)
    z, numer, denom = (torch.randn(1, 10, 60000, generator=g) for _ in range(3))
    fit = kivi_fast.DensityRatio(lam=1e-3).fit(numer, denom)
    for name in ("z", "numer", "denom"):
        args = {"z": z.clone(), "numer": numer.clone(), "denom": denom.clone()}
        args[name][0, 3, 7] = float("nan")
        with pytest.raises(ValueError, match=f"^{name} contains NaN or Inf"):
            ops.ratio(args["z"], args["numer"], args["denom"], fit.alpha, fit.beta, fit.sigma.reshape(-1))
