"""The VAE of the paper's Sec. 5.3 / App. F: a Bernoulli MLP decoder, its implicit encoder (noise
injected into the first hidden layer, Fig. 4a right) and the plain VAE's Gaussian encoder (left).

Both encoders map x [B, D] to ``n`` reparameterized samples z [B, n, d]; the implicit one has no
density, so its KL to the prior is estimated from the samples (``kivi_fast.kernel_kl``,
``kivi_fast.adaptive_contrast_kl``), the Gaussian one has the closed form
:func:`kivi_fast.nn.gaussian_kl_to_standard_normal`. The random draws can be passed in (``noise=``),
so that several processes can share one stream of draws (multi-process training).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

import kivi_fast

from .._random import standard_normal
from ._checks import batch, exact, kl_options, positive_float, positive_int, positive_ints, samples, trailing
from .gaussian import gaussian_kl_to_standard_normal
from .generator import NoiseInjection


def _mlp(sizes: list[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class BernoulliDecoder(nn.Module):
    """p(x | z) = Bernoulli(sigmoid(f(z))), f an MLP z_dim -> hidden... -> x_dim with ReLU."""

    def __init__(self, z_dim: int = 8, hidden=(500, 500), x_dim: int = 784):
        super().__init__()
        self.z_dim, self.x_dim = positive_int("z_dim", z_dim), positive_int("x_dim", x_dim)
        self.net = _mlp([self.z_dim, *positive_ints("hidden", hidden), self.x_dim])

    def logits(self, z: torch.Tensor) -> torch.Tensor:
        """The pixels' logits: z [..., z_dim] -> [..., x_dim]."""
        trailing("z", z, (self.z_dim,))
        return self.net(z)

    def log_likelihood(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """log p(x | z) summed over pixels; z [..., z_dim], x broadcastable to z's leading shape + [x_dim]."""
        trailing("x", x, (self.x_dim,))
        logits = self.logits(z)
        return -F.binary_cross_entropy_with_logits(logits, x.expand_as(logits), reduction="none").sum(-1)


def _check_encoder_input(x, x_dim: int, n: int, noise, noise_shape) -> None:
    batch(x, x_dim, least=0)
    want = noise_shape(x.shape[0], positive_int("n", n))
    if noise is not None:
        exact("noise", noise, want)


class ImplicitEncoder(nn.Module):
    """q(z | x): x -> ReLU(W1 x + b1) + s * eps -> ReLU(W2 . + b2) -> W3 . + b3, eps ~ N(0, I) of the first
    hidden layer's width with trainable scales s (the paper: "Gaussian noises of 500 dimensions added to
    the first hidden layer ... 500-dimensional trainable variances"). The first layer runs once per x,
    the rest once per sample."""

    def __init__(self, x_dim: int = 784, hidden=(500, 500), z_dim: int = 8, init_noise_std: float = 1.0):
        super().__init__()
        hidden = positive_ints("hidden", hidden)
        if not hidden:
            raise ValueError("hidden must name at least one layer (the noise goes into the first)")
        self.x_dim, self.z_dim, self.noise_dim = positive_int("x_dim", x_dim), positive_int("z_dim", z_dim), hidden[0]
        self.first = nn.Linear(self.x_dim, hidden[0])
        self.noise = NoiseInjection(hidden[0], math.log(positive_float("init_noise_std", init_noise_std)))
        self.rest = _mlp([*hidden, self.z_dim])

    def noise_shape(self, batch: int, n: int) -> tuple[int, int, int]:
        """The shape of ``forward``'s noise for ``batch`` rows and ``n`` samples each."""
        return (batch, n, self.noise_dim)

    def forward(self, x: torch.Tensor, n: int, noise: torch.Tensor | None = None) -> torch.Tensor:
        """n samples of z per row of x: [B, x_dim] -> [B, n, z_dim]; ``noise``: eps [B, n, noise_dim]."""
        _check_encoder_input(x, self.x_dim, n, noise, self.noise_shape)
        h = F.relu(self.first(x))
        if noise is None:
            noise = torch.randn(self.noise_shape(x.shape[0], n), dtype=h.dtype, device=h.device)
        return self.rest(self.noise(h[:, None, :], xi=noise))


class GaussianEncoder(nn.Module):
    """q(z | x) = N(mu(x), diag(sigma(x)^2)), one MLP x -> hidden... -> [mu, log sigma] (the plain VAE)."""

    def __init__(self, x_dim: int = 784, hidden=(500, 500), z_dim: int = 8):
        super().__init__()
        self.x_dim, self.z_dim = positive_int("x_dim", x_dim), positive_int("z_dim", z_dim)
        self.net = _mlp([self.x_dim, *positive_ints("hidden", hidden), 2 * self.z_dim])

    def noise_shape(self, batch: int, n: int) -> tuple[int, int, int]:
        """The shape of ``forward``'s noise for ``batch`` rows and ``n`` samples each."""
        return (batch, n, self.z_dim)

    def moments(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, log std), each [B, z_dim], of x [B, x_dim]."""
        trailing("x", x, (self.x_dim,))
        mean, log_std = self.net(x).chunk(2, dim=-1)
        return mean, log_std

    def forward(self, x: torch.Tensor, n: int, noise: torch.Tensor | None = None) -> torch.Tensor:
        """n samples of z per row of x: [B, x_dim] -> [B, n, z_dim]; ``noise``: eps [B, n, z_dim]."""
        _check_encoder_input(x, self.x_dim, n, noise, self.noise_shape)
        mean, log_std = self.moments(x)
        if noise is None:
            noise = torch.randn(self.noise_shape(x.shape[0], n), dtype=mean.dtype, device=mean.device)
        return self.reparameterize(mean, log_std, noise)

    @staticmethod
    def reparameterize(mean: torch.Tensor, log_std: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """z = mean + std * noise: [B, d] moments, noise [B, n, d] -> [B, n, d]."""
        return mean[:, None, :] + log_std.exp()[:, None, :] * noise

    def log_prob(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """log q(z | x) for z [B, n, z_dim] -> [B, n] (importance weights: IWAE bounds)."""
        batch(x, self.x_dim, least=0)
        trailing("z", z, (self.z_dim,))
        if z.dim() != 3 or z.shape[0] != x.shape[0]:  # (else broadcast: each row's z under every row's q)
            raise ValueError(f"z must have shape [B, n, {self.z_dim}] with x's B = {x.shape[0]}, got {list(z.shape)}")
        mean, log_std = self.moments(x)
        u = (z - mean[:, None, :]) / log_std.exp()[:, None, :]
        return (-0.5 * u.pow(2) - log_std[:, None, :] - 0.5 * math.log(2 * math.pi)).sum(-1)


KL_ESTIMATORS = ("kivi", "kivi-ac", "gaussian")


class VAE(nn.Module):
    """Encoder + decoder + the KL of the ELBO, one module (so that DistributedDataParallel can wrap it).

    ``kl``: "kivi" (``kivi_fast.kernel_kl`` between n_p N(0, I) prior samples and the n_q encoder samples
    of each x: the paper's estimator), "kivi-ac" (``kivi_fast.adaptive_contrast_kl`` with the prior's
    density, against n_p N(0, I) reference draws; ``contrast="diagonal"`` is the paper's App. D) or
    "gaussian" (a :class:`GaussianEncoder` and the closed-form KL). The ELBO's reconstruction term uses
    the first ``n_rec`` samples (the paper: M = 1); the KL all n_q.

    Every random number a step uses comes from :meth:`draws`, made for the whole global batch from one
    generator; each process slices its rows (:func:`slice_draws`), so that a multi-process step draws
    what a single process would.
    """

    def __init__(self, encoder: nn.Module, decoder: BernoulliDecoder, kl: str = "kivi-ac", *, n_q: int = 100,
                 n_p: int = 100, lam: float = 1e-3, clip: float = 1e-8, contrast: str = "diagonal"):
        super().__init__()
        if kl not in KL_ESTIMATORS:
            raise ValueError(f"kl must be one of {', '.join(KL_ESTIMATORS)}, got {kl!r}")
        if (kl == "gaussian") != isinstance(encoder, GaussianEncoder):
            raise ValueError('kl="gaussian" goes with a GaussianEncoder, the others with an implicit encoder')
        if getattr(encoder, "z_dim", decoder.z_dim) != decoder.z_dim:
            raise ValueError(f"the encoder's z_dim ({encoder.z_dim}) and the decoder's ({decoder.z_dim}) differ")
        self.encoder, self.decoder, self.kl_estimator = encoder, decoder, kl
        self.lam, self.clip, self.contrast = kl_options(lam, clip, contrast)
        # (the Gaussian encoder's KL is closed-form: its n_q, n_p are unused)
        self.n_q, self.n_p = (n_q, n_p) if kl == "gaussian" else (samples("n_q", n_q), samples("n_p", n_p))

    def draws(self, batch: int, generator: torch.Generator | None, device, dtype=None,
              n_q: int | None = None) -> dict[str, torch.Tensor]:
        """The random numbers of one step on ``batch`` data points: ``noise``, the encoder's
        [batch, n_q, noise width] (``encoder.noise_shape``), and ``prior``, N(0, I) samples for the KL
        [batch, n_p, z_dim] (prior samples for "kivi", reference draws for "kivi-ac"; none for
        "gaussian", whose training step draws only the n_rec samples it needs: n_q 1 unless given).
        ``dtype``: default the parameters' (float32 draws for a float64 model failed its KL's check)."""
        n_q = (1 if self.kl_estimator == "gaussian" else self.n_q) if n_q is None else n_q
        dtype = next(self.parameters()).dtype if dtype is None else dtype
        out = {"noise": standard_normal(self.encoder.noise_shape(batch, n_q), generator, device=device, dtype=dtype)}
        if self.kl_estimator != "gaussian":
            out["prior"] = standard_normal((batch, self.n_p, self.encoder.z_dim), generator, device=device, dtype=dtype)
        return out

    def estimated_kl(self, z: torch.Tensor, prior: torch.Tensor) -> torch.Tensor:
        """KL(q(z | x) || N(0, I)) per x, [B], estimated from the implicit encoder's samples z [B, n_q, d]
        and the N(0, I) draws ``prior`` [B, n_p, d]."""
        if self.kl_estimator == "kivi":
            return kivi_fast.kernel_kl(prior, z, self.lam, clip=self.clip)
        return kivi_fast.adaptive_contrast_kl(z, None, self.lam, contrast=self.contrast, clip=self.clip,
                                              reference_z=prior)

    def forward(self, x: torch.Tensor, draws: dict[str, torch.Tensor], n_rec: int = 1
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(E_q log p(x | z) over the first ``n_rec`` samples, KL), each [B]; the ELBO is their difference."""
        noise = draws["noise"]
        if not isinstance(noise, torch.Tensor) or noise.dim() != 3:
            got = list(noise.shape) if isinstance(noise, torch.Tensor) else type(noise).__name__
            raise ValueError(f"draws['noise'] must be a [B, n, width] tensor (VAE.draws), got {got}")
        if positive_int("n_rec", n_rec) > noise.shape[1]:
            raise ValueError(f"n_rec must be between 1 and the {noise.shape[1]} samples of draws['noise'], "
                             f"got {n_rec}")
        if self.kl_estimator == "gaussian":  # one pass of the encoder gives the samples and the KL
            # (the checks of the encoder's forward, which this pass skips)
            _check_encoder_input(x, self.encoder.x_dim, noise.shape[1], noise, self.encoder.noise_shape)
            mean, log_std = self.encoder.moments(x)
            z = self.encoder.reparameterize(mean, log_std, noise)
            kl = gaussian_kl_to_standard_normal(mean, log_std)
        else:
            z = self.encoder(x, noise.shape[1], noise)
            kl = self.estimated_kl(z, draws["prior"])
        rec = self.decoder.log_likelihood(x[:, None, :], z[:, :n_rec]).mean(-1)
        return rec, kl


def slice_draws(draws: dict[str, torch.Tensor], lo: int, hi: int) -> dict[str, torch.Tensor]:
    """Rows lo:hi of every draw (this process's shard of the global batch)."""
    return {k: v[lo:hi] for k, v in draws.items()}


def build_vae(kl: str = "kivi-ac", *, x_dim: int = 784, hidden=(500, 500), z_dim: int = 8, **kl_options) -> VAE:
    """The paper's VAE for MNIST: decoder z_dim -> 500 -> 500 -> 784, encoder 784 -> 500 -> 500 -> z_dim
    (implicit, or Gaussian for ``kl="gaussian"``)."""
    hidden = positive_ints("hidden", hidden)
    encoder = GaussianEncoder(x_dim, hidden, z_dim) if kl == "gaussian" else ImplicitEncoder(x_dim, hidden, z_dim)
    return VAE(encoder, BernoulliDecoder(z_dim, tuple(reversed(hidden)), x_dim), kl, **kl_options)
