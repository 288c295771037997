"""kivi_fast.nn's modules, for training loops of one's own: a bad argument or input is named, never
truncated, broadcast into a plausible result, or turned into NaN (each case below did one of these)."""

from __future__ import annotations

import math

import pytest
import torch

from kivi_fast.nn import (MMNN, BernoulliDecoder, FactorizedGaussian, GammaPrecision, GaussianEncoder,
                          ImplicitEncoder, MatrixMultiplicationLayer, MLPGenerator, NoiseInjection, PlanarFlow,
                          RegressionBNN, VAE, build_vae)
from kivi_fast.nn.classification import ClassificationBNN, MatrixPosterior


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---- PlanarFlow -------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_planar_flow_as_built_trains(seed):
    """Its parameters started at 0, where u_hat was 0 / 0: every sample and the KL were NaN (and at
    u = w = b = 0 every gradient is 0, so not even the identity could have trained). Built, its samples
    and KL are finite, every parameter gets a gradient, and Adam steps toward N(2, I) move its mean."""
    flow = PlanarFlow(3, generator=gen(seed))
    z, log_q = flow.sample_with_log_prob(50, gen(0))
    assert z.dtype == torch.float32 and z.isfinite().all() and log_q.isfinite().all()
    kl, error = flow.kl_to_standard_normal(2000, gen(1))
    assert math.isfinite(kl) and math.isfinite(error)
    opt = torch.optim.Adam(flow.parameters(), lr=0.05)
    target = torch.distributions.Normal(2.0, 1.0)
    for step in range(20):
        z, log_q = flow.sample_with_log_prob(200, gen(10 + step))
        loss = (log_q - target.log_prob(z).sum(-1)).mean()  # KL(q || N(2, I)) + const
        opt.zero_grad()
        loss.backward()
        assert all(p.grad.abs().sum() > 0 for p in flow.parameters())
        opt.step()
    moved = flow.sample(2000, gen(99)).mean(0)
    assert (moved > 0.3).all(), moved


def test_a_planar_flow_of_zero_scale_is_the_identity():
    """init_scale=0 (random()'s start): w = 0, where the floor of |w|^2 keeps u_hat from 0 / 0."""
    flow = PlanarFlow(3, init_scale=0.0)
    z, log_q = flow.sample_with_log_prob(50, gen(0))
    base = torch.randn(50, 3, generator=gen(0))
    assert torch.equal(z, base)
    torch.testing.assert_close(log_q, torch.distributions.Normal(0.0, 1.0).log_prob(base).sum(-1))
    assert flow.kl_to_standard_normal(1000, gen(1)) == (0.0, 0.0)


def test_a_planar_flow_samples_where_and_as_its_parameters_are():
    flow = PlanarFlow.random(3, generator=gen(0))
    assert flow.sample(4).dtype == torch.float32 and flow.double().sample(4).dtype == torch.float64
    assert flow.sample(4, dtype=torch.float64).dtype == torch.float64
    on_meta = PlanarFlow.random(3, generator=gen(0)).to("meta").sample(4)  # (was: drawn on the CPU)
    assert on_meta.device.type == "meta" and on_meta.shape == (4, 3)
    with pytest.raises(ValueError, match=r"x must have shape \[\.\.\., 3\], got \[4, 2\]"):
        flow(torch.zeros(4, 2))
    with pytest.raises(TypeError, match="x must be a floating-point tensor, got torch.int64"):
        flow(torch.zeros(4, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="n must be at least 2"):
        flow.kl_to_standard_normal(1)
    with pytest.raises(ValueError, match="chunk must be a positive int, got 0"):
        flow.kl_to_standard_normal(100, chunk=0)


# ---- sizes ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("build, error, message", [
    (lambda: MLPGenerator((2.7, 5, 3)), TypeError, r"sizes\[0\] must be a positive int, got 2.7"),
    (lambda: MLPGenerator("23"), TypeError, "sizes must be a sequence of positive ints"),
    (lambda: MLPGenerator((2, True, 3)), TypeError, r"sizes\[1\] must be a positive int, got True"),
    (lambda: MLPGenerator((2, 0, 3)), ValueError, r"sizes\[1\] must be a positive int, got 0"),
    (lambda: MLPGenerator((2, 5, 5, 3), noise_at=1.5), TypeError, "noise_at must be an int, got 1.5"),
    (lambda: MLPGenerator((2, 5, 5, 3), noise_at=True), TypeError, "noise_at must be an int, got True"),
    (lambda: MLPGenerator((2, 5, 5, 3), noise_at=3), ValueError, "noise_at must name a hidden layer, 1 to 2"),
    (lambda: MMNN([(2.7, 3), (4, 5)]), TypeError, r"shapes\[0\]\[0\] must be a positive int"),
    (lambda: MMNN([(True, 3), (4, 5)]), TypeError, r"shapes\[0\]\[0\] must be a positive int"),
    (lambda: MMNN([(2, 3, 1), (4, 5)]), ValueError, r"shapes\[0\] must be a \(rows, cols\) pair"),
    (lambda: MatrixMultiplicationLayer((0, 3), (4, 5)), ValueError, r"in_shape\[0\] must be a positive int"),
    (lambda: FactorizedGaussian(2.7), TypeError, "dim must be a positive int, got 2.7"),
    (lambda: FactorizedGaussian(3, std=0.0), ValueError, "std must be positive and finite"),
    (lambda: NoiseInjection(0), ValueError, "dim must be a positive int, got 0"),
    (lambda: PlanarFlow(3, n_layers=0), ValueError, "n_layers must be a positive int, got 0"),
    (lambda: GammaPrecision(alpha=0), ValueError, "alpha must be positive and finite, got 0.0"),
    (lambda: GammaPrecision(beta=float("inf")), ValueError, "beta must be positive and finite"),
    (lambda: GammaPrecision(prior=(6,)), ValueError, r"prior must be a Gamma's \(shape, rate\)"),
    (lambda: GammaPrecision(prior=(0, 1)), ValueError, r"prior\[0\] must be positive and finite"),
    (lambda: ImplicitEncoder(init_noise_std=0), ValueError, "init_noise_std must be positive and finite"),
    (lambda: ImplicitEncoder(hidden=()), ValueError, "hidden must name at least one layer"),
    (lambda: build_vae(hidden=()), ValueError, "hidden must name at least one layer"),  # (the implicit one's)
    (lambda: GammaPrecision(prior=6.0), ValueError, r"prior must be a Gamma's \(shape, rate\)"),
    (lambda: BernoulliDecoder(z_dim=8.0), TypeError, "z_dim must be a positive int, got 8.0"),
    (lambda: ClassificationBNN((784, 10, 10), mmnn_hidden=0), ValueError, "mmnn_hidden must be a positive int"),
    (lambda: ClassificationBNN((784, 10)), ValueError, "sizes must be .* at least three"),
    # the estimator's options, checked when the module is built (they failed at its first step)
    (lambda: build_vae("kivi-ac", contrast="bogus"), ValueError, "contrast must be one of"),
    (lambda: build_vae("kivi", lam=0.0), ValueError, "lam must be positive and finite"),
    (lambda: build_vae("kivi", clip=2.0), ValueError, r"clip must lie in \(0, 1\)"),
    (lambda: build_vae("kivi", n_q=1), ValueError, "n_q must be at least 2"),
    (lambda: build_vae("kivi", n_p=2.0), TypeError, "n_p must be a positive int"),
    (lambda: VAE(ImplicitEncoder(z_dim=4), BernoulliDecoder(z_dim=8), "kivi"), ValueError,
     r"the encoder's z_dim \(4\) and the decoder's \(8\) differ"),
    (lambda: RegressionBNN((3, 8, 1), [MLPGenerator((4, 10, 32)), MLPGenerator((4, 10, 9))], "kivi-ac",
                           contrast="bogus"), ValueError, "contrast must be one of"),
    (lambda: RegressionBNN((3, 8, 1), [MLPGenerator((4, 10, 32)), MLPGenerator((4, 10, 9))], lam=1e-12),
     ValueError, "lam must be at least 1e-10"),
    (lambda: ClassificationBNN((12, 6, 6, 3), clip=0.0), ValueError, "clip must be positive and finite"),
    (lambda: ClassificationBNN((12, 6, 6, 3), n_prior=1), ValueError, "n_prior must be at least 2"),
    # initial values: NaN or inf gave NaN samples, a string or a bool passed as a number, a std outside
    # float32's range was stored as 0 or overflowed without a name
    (lambda: FactorizedGaussian(3, mean=math.nan), ValueError, "mean must be finite"),
    (lambda: FactorizedGaussian(3, mean="1"), TypeError, "mean must be a number"),
    (lambda: FactorizedGaussian(3, mean_init_std=math.inf), ValueError, "mean_init_std must be finite"),
    (lambda: FactorizedGaussian(3, std=1e-50), ValueError, "std must lie within float32's normal range"),
    (lambda: FactorizedGaussian(3, std=1e40), ValueError, "std must lie within float32's normal range"),
    (lambda: MLPGenerator((4, 10, 3), noise_at=1, noise_init_log_std=math.inf), ValueError,
     "noise_init_log_std must be finite"),
    (lambda: PlanarFlow(3, init_scale=True), TypeError, "init_scale must be a number"),
    (lambda: PlanarFlow.random(3, strength=math.nan), ValueError, "strength must be finite"),
    (lambda: ClassificationBNN((12, 6, 6, 3), "bbb", bbb_init_std=0), ValueError, "bbb_init_std must be positive"),
    (lambda: MatrixPosterior([(2, 2), (4, 3)], init_std=0), ValueError, "init_std must be positive"),
    (lambda: RegressionBNN((3, 8, 1), [MLPGenerator((4, 10, 32)), MLPGenerator((4, 10, 9))], "kivi-contrast",
                           n_prior=3), ValueError, "n_prior must be at least 4 for kl_method 'kivi-contrast'"),
])
def test_bad_sizes_are_named(build, error, message):
    """Each was truncated (2.7 -> 2, True -> 1, '23' -> (2, 3)), passed over (noise_at=1.5 built no
    noise layer, mmnn_hidden=0 became the paper's 500), or failed inside math or torch without the
    argument's name ('math domain error', a ZeroDivisionError, an IndexError)."""
    with pytest.raises(error, match=message):
        build()


def test_a_large_initial_std_does_not_overflow():
    """softplus^-1(800) by log(expm1(800)) overflowed (OverflowError: math range error)."""
    q = FactorizedGaussian(3, std=800.0)
    torch.testing.assert_close(q.std, torch.full((3,), 800.0))
    torch.testing.assert_close(FactorizedGaussian(3, std=0.3).std, torch.full((3,), 0.3))


# ---- shapes that broadcast into a plausible result ---------------------------------------------------


@pytest.mark.parametrize("call, message", [
    (lambda: FactorizedGaussian(5).log_prob(torch.zeros(4, 1)), r"w must have shape \[\.\.\., 5\], got \[4, 1\]"),
    (lambda: NoiseInjection(5)(torch.zeros(3, 1)), r"h must have shape \[\.\.\., 5\], got \[3, 1\]"),
    (lambda: MatrixMultiplicationLayer((2, 3), (4, 5))(torch.randn(7, 2, 1)),
     r"x must have shape \[\.\.\., 2, 3\], got \[7, 2, 1\]"),
    (lambda: MLPGenerator((4, 8, 3))(torch.randn(6, 1)), r"eps must have shape \[\.\.\., 4\], got \[6, 1\]"),
    (lambda: ImplicitEncoder(10, (6,), 2)(torch.rand(3, 10), 4, torch.randn(3, 4, 1)),
     r"noise must have shape \[3, 4, 6\], got \[3, 4, 1\]"),
    (lambda: ImplicitEncoder(10, (6,), 2)(torch.rand(3, 10), 4, torch.randn(4, 6)),
     r"noise must have shape \[3, 4, 6\], got \[4, 6\]"),
    (lambda: ImplicitEncoder(10, (6,), 2)(torch.rand(3, 10), 4, torch.randn(3, 9, 6)),
     r"noise must have shape \[3, 4, 6\], got \[3, 9, 6\]"),
    (lambda: GaussianEncoder(10, (6,), 2)(torch.rand(3, 10), 4, torch.randn(3, 4, 1)),
     r"noise must have shape \[3, 4, 2\], got \[3, 4, 1\]"),
    (lambda: GaussianEncoder(10, (6,), 2)(torch.rand(10), 4), r"x must have shape \[B, 10\], got \[10\]"),
    (lambda: BernoulliDecoder(2, (6,), 10).log_likelihood(torch.rand(3, 1, 9), torch.randn(3, 4, 2)),
     r"x must have shape \[\.\.\., 10\], got \[3, 1, 9\]"),
])
def test_a_wrong_trailing_shape_is_named(call, message):
    """Each broadcast the wrong shape and returned a result of the right one: one noise value reused
    across a layer's units, a [B, 1] input against every row."""
    with pytest.raises(ValueError, match=message):
        call()


def regression_bnn(**options) -> RegressionBNN:
    torch.manual_seed(0)
    return RegressionBNN((3, 8, 1), [MLPGenerator((4, 10, 32)), MLPGenerator((4, 10, 9))], **options)


def test_the_regression_bnn_names_bad_data():
    """y [B, 1] broadcast against the [S, B] predictions when B = S (the defaults' 100 and 100): sample s
    was scored against target s, a plausible ELBO, no error."""
    model = regression_bnn()
    x, y = torch.randn(10, 3), torch.randn(10)
    model.elbo(x, y, 100, n_samples=10)  # (the valid call)
    with pytest.raises(ValueError, match=r"y must have shape \[10\], got \[10, 1\]"):
        model.elbo(x, y[:, None], 100, n_samples=10)
    with pytest.raises(ValueError, match=r"y must have shape \[10\], got \[1\]"):
        model.elbo(x, y[:1], 100, n_samples=10)
    with pytest.raises(ValueError, match=r"x must have shape \[B, 3\] with B >= 1, got \[3\]"):
        model.predict(x[0])
    with pytest.raises(ValueError, match=r"x must have shape \[B, 3\] with B >= 1, got \[0, 3\]"):
        model.elbo(x[:0], y[:0], 100)
    with pytest.raises(ValueError, match="n_data .* must be at least the batch's 10, got 5"):
        model.elbo(x, y, 5, n_samples=10)
    with pytest.raises(ValueError, match="n_data must be a positive int, got 0"):
        model.elbo(x, y, 0, n_samples=10)
    # evaluate: a y_raw of another shape broadcast into a plausible RMSE (0.33 where it is 0.86)
    from kivi_fast.nn.bnn import evaluate

    assert set(evaluate(model, x, y, 0.0, 1.0, 20)) == {"rmse", "test_ll", "test_ll_plugin"}
    for y_raw in (y[:1], y[:, None]):
        with pytest.raises(ValueError, match=r"y_raw must have shape \[10\]"):
            evaluate(model, x, y_raw, 0.0, 1.0, 20)
    with pytest.raises(ValueError, match="y_std must be"):
        evaluate(model, x, y, 0.0, 0.0, 20)


def test_the_predictive_and_the_encoders_density_name_bad_shapes():
    """A row's z was scored under every row's q ([3, 3] from x [3, 10], z [3, 2]), and one image [784]
    gave its samples' probabilities [S, 10] as if a batch: broadcast, no error."""
    encoder = GaussianEncoder(10, (6,), 2)
    x = torch.randn(3, 10)
    assert encoder.log_prob(x, torch.randn(3, 4, 2)).shape == (3, 4)
    for z in (torch.randn(3, 2), torch.randn(1, 4, 2), torch.randn(3, 4, 1)):
        with pytest.raises(ValueError, match="z must have shape"):
            encoder.log_prob(x, z)
    model = ClassificationBNN((12, 6, 6, 3), "bbb")
    assert model.predict_proba(torch.randn(5, 12), 4).shape == (5, 3)
    with pytest.raises(ValueError, match=r"x must have shape \[B, 12\]"):
        model.predict_proba(torch.randn(12), 4)


def test_the_regression_bnn_checks_its_layers_against_its_posteriors():
    with pytest.raises(ValueError, match=r"posteriors\[0\] samples 30 weights; layer 0 has \(3 \+ 1\) x 8 = 32"):
        RegressionBNN((3, 8, 1), [MLPGenerator((4, 10, 30)), MLPGenerator((4, 10, 9))])
    with pytest.raises(ValueError, match=r"layer_sizes must be \(inputs, \[hidden, \.\.\.\], 1\)"):
        RegressionBNN((3, 8, 2), [MLPGenerator((4, 10, 32)), MLPGenerator((4, 10, 18))])
    with pytest.raises(TypeError, match='kl_method="factorized" needs posteriors with a closed-form'):
        RegressionBNN((3, 8, 1), [MLPGenerator((4, 10, 32)), MLPGenerator((4, 10, 9))], kl_method="factorized")
    with pytest.raises(TypeError, match="n_prior must be a positive int, got 2.7"):
        regression_bnn(n_prior=2.7)


def test_the_vaes_n_rec_must_name_samples_it_has():
    """n_rec = 0 gave a NaN reconstruction term, and n_rec above the draws' samples averaged over
    fewer than asked, with no error."""
    torch.manual_seed(0)
    vae = build_vae("kivi", x_dim=12, hidden=(6,), z_dim=2, n_q=5, n_p=5)
    x = torch.rand(3, 12).round()
    draws = vae.draws(3, gen(0), "cpu")
    rec, kl = vae(x, draws, n_rec=5)
    assert rec.shape == kl.shape == (3,) and rec.isfinite().all()
    for n_rec, error, message in ((0, ValueError, "n_rec must be a positive int, got 0"),
                                  (-1, ValueError, "n_rec must be a positive int, got -1"),
                                  (1.5, TypeError, "n_rec must be a positive int, got 1.5"),
                                  (6, ValueError, r"n_rec must be between 1 and the 5 samples of draws\['noise'\]")):
        with pytest.raises(error, match=message):
            vae(x, draws, n_rec=n_rec)


def test_the_classifier_names_bad_batches_and_methods():
    torch.manual_seed(0)
    model = ClassificationBNN((12, 6, 6, 3), "kivi", mmnn_hidden=4, n_prior=4)
    x, y = torch.randn(5, 12), torch.randint(0, 3, (5,))
    loss, _ = model(x, y, 100, n_samples=4)
    assert loss.isfinite()
    with pytest.raises(ValueError, match=r"y must have shape \[5\], got \[5, 1\]"):
        model(x, y[:, None], 100, n_samples=4)
    for dtype in (torch.float32, torch.int32):  # (cross_entropy takes int64 and uint8 targets only)
        with pytest.raises(TypeError, match=f"y must hold class indices as int64 or uint8, got {dtype}"):
            model(x, y.to(dtype), 100, n_samples=4)
    assert model(x, y.to(torch.uint8), 100, n_samples=4)[0].isfinite()
    with pytest.raises(ValueError, match=r"x must have shape \[B, 12\] with B >= 1, got \[0, 12\]"):
        model(x[:0], y[:0], 100, n_samples=4)
    with pytest.raises(ValueError, match='discriminator_loss needs method="pc"'):
        model.discriminator_loss(model.sample_weights(4))


def test_the_matrix_posteriors_take_a_generator():
    """MMNN.sample and MatrixPosterior.sample drew from the global stream only, unlike the other
    posteriors' sample(n, generator)."""
    torch.manual_seed(0)
    q = MMNN([(3, 3), (4, 5)])
    assert torch.equal(q.sample(6, gen(7)), q.sample(6, gen(7)))
    assert q.sample(6, gen(7)).shape == (6, 20)
    model = ClassificationBNN((12, 6, 6, 3), "kivi", mmnn_hidden=4)
    a, b = (model.posteriors[0].sample(3, gen(1)) for _ in range(2))
    assert torch.equal(a, b) and a.shape == (3, 13 * 6) and a.isfinite().all()


def test_the_gaussian_vae_checks_its_noise_and_takes_what_it_does_not_use():
    """The Gaussian VAE's step skips its encoder's forward (moments, then reparameterize), so a noise of
    the wrong shape broadcast there: one row's noise for the whole batch. Its n_q and n_p are unused
    (closed-form KL) and its hidden layers may be none (a linear encoder and decoder)."""
    torch.manual_seed(0)
    vae = build_vae("gaussian", x_dim=12, hidden=(6,), z_dim=2, n_q=1, n_p=1)
    x = torch.rand(3, 12).round()
    rec, kl = vae(x, vae.draws(3, gen(0), "cpu"))
    assert rec.shape == kl.shape == (3,)
    for bad, message in ((torch.randn(3, 1, 1), r"noise must have shape \[3, 1, 2\], got \[3, 1, 1\]"),
                         (torch.randn(1, 1, 2), r"noise must have shape \[3, 1, 2\], got \[1, 1, 2\]"),
                         (torch.randn(3, 2), r"draws\['noise'\] must be a \[B, n, width\] tensor")):
        with pytest.raises(ValueError, match=message):
            vae(x, {"noise": bad})
    linear = build_vae("gaussian", x_dim=12, hidden=(), z_dim=2)
    assert linear(x, linear.draws(3, gen(0), "cpu"))[0].shape == (3,)


def test_the_factorized_bnn_takes_closed_form_posteriors_only():
    model = RegressionBNN((3, 8, 1), [FactorizedGaussian(32), FactorizedGaussian(9)], "factorized", n_prior=1)
    assert model.elbo(torch.randn(4, 3), torch.randn(4), 10, n_samples=3)["elbo"].isfinite()
    with pytest.raises(TypeError, match=r"posteriors\[0\] is a PlanarFlow"):  # (its KL is Monte Carlo)
        RegressionBNN((3, 8, 1), [PlanarFlow(32), FactorizedGaussian(9)], "factorized")


@pytest.mark.parametrize("kl", ["kivi", "kivi-ac", "gaussian"])
def test_a_float64_vae_draws_in_float64(kl):
    """VAE.draws' default dtype is the model's: float32 draws for a float64 model failed its KL's dtype
    check ("kivi", "kivi-ac") or promoted the encoder's output."""
    torch.manual_seed(0)
    model = build_vae(kl, x_dim=12, hidden=(8,), z_dim=2, n_q=5, n_p=5).double()
    x = torch.rand(3, 12, dtype=torch.float64).round()
    draws = model.draws(3, torch.Generator().manual_seed(0), "cpu")
    assert all(d.dtype == torch.float64 for d in draws.values())
    for term in model(x, draws):  # (the reconstruction term and the KL, [B] each)
        assert term.dtype == torch.float64 and term.shape == (3,) and torch.isfinite(term).all()
