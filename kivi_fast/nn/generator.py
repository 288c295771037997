"""Implicit posterior: z = MLP(eps), eps ~ N(0, I) (the paper's Sec. 4 and Appendix "Regression"),
optionally with a second noise added inside the network (the paper's 2-D stochastic network)."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from .._random import standard_normal
from ._checks import finite_float, integer, positive_int, positive_ints, trailing

INITS = ("glorot", "torch")
ACTIVATIONS = {"relu": nn.ReLU, "tanh": nn.Tanh}


class NoiseInjection(nn.Module):
    """h -> h + xi, xi ~ N(0, diag(exp(2 log_std))), with a trainable ``log_std`` per unit."""

    def __init__(self, dim: int, init_log_std: float = 0.0):
        super().__init__()
        self.log_std = nn.Parameter(torch.full((positive_int("dim", dim),), finite_float("init_log_std", init_log_std)))

    def forward(self, h: torch.Tensor, generator: torch.Generator | None = None,
                xi: torch.Tensor | None = None) -> torch.Tensor:
        """h [..., dim] -> [..., dim]; ``xi``: standard-normal draws broadcastable with h, drawn by the
        caller (default: drawn here)."""
        trailing("h", h, self.log_std.shape)
        if xi is None:
            xi = standard_normal(h.shape, generator, dtype=h.dtype, device=h.device)
        return h + xi * self.log_std.exp()


class MLPGenerator(nn.Module):
    """Samples by pushing standard-normal noise through an MLP, hidden activations, linear output.

    ``sizes`` follows the paper's table of implicit posteriors: ``(20, 30, 700)`` is 20-dimensional
    noise, one hidden layer of 30 units and 700 outputs (Boston, layer 1); ``(100, 800, N, N)`` has
    two hidden layers (Yacht). The density of the samples is unknown (implicit), hence KIVI.

    ``activation``: "relu" (default) or "tanh", between the layers.

    ``init``: ``"glorot"`` (default) draws the weights Glorot-uniform and zeroes the biases, the
    defaults of TensorFlow's dense layers, on which the paper's code base (ZhuSuan) is built;
    ``"torch"`` keeps torch.nn.Linear's own initialization. It matters for KIVI: torch's starts Yacht's
    first-layer samples at a per-weight std of ~0.07 (Glorot's: ~0.2; the N(0, I) prior's: 1), where the
    median-bandwidth fit cannot see the posterior's width, and on Yacht the posterior then collapses
    to a point at the origin (``kivi-fast uci-kl-probe`` and results/uci/README.md).

    ``noise_at``: the hidden layer (1-based) whose activation is replaced by a :class:`NoiseInjection`
    (its output stays linear and gets a second, trainable Gaussian noise); None (default) for none.
    Injecting noise twice makes the samples' law a continuous mixture, which lets q bend along a
    correlated posterior (:func:`stochastic_net_2d`).
    """

    def __init__(self, sizes: Sequence[int], activation: str = "relu", init: str = "glorot",
                 noise_at: int | None = None, noise_init_log_std: float = 0.0):
        super().__init__()
        noise_init_log_std = finite_float("noise_init_log_std", noise_init_log_std)
        if init not in INITS:
            raise ValueError(f"init must be one of {INITS}, got {init!r}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {tuple(ACTIVATIONS)}, got {activation!r}")
        sizes = positive_ints("sizes", sizes)
        if len(sizes) < 2:
            raise ValueError(f"sizes must be (noise, [hidden, ...], output) with positive entries, got {sizes}")
        if noise_at is not None and not 1 <= integer("noise_at", noise_at) <= len(sizes) - 2:
            raise ValueError(f"noise_at must name a hidden layer, 1 to {len(sizes) - 2}, got {noise_at}")
        self.noise_dim, self.dim = sizes[0], sizes[-1]
        layers: list[nn.Module] = []
        for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
            layers.append(nn.Linear(n_in, n_out))
            if i + 1 == noise_at:
                layers.append(NoiseInjection(n_out, noise_init_log_std))
            elif i < len(sizes) - 2:
                layers.append(ACTIVATIONS[activation]())
        self.net = nn.Sequential(*layers)
        if init == "glorot":
            for layer in self.net:
                if isinstance(layer, nn.Linear):
                    nn.init.xavier_uniform_(layer.weight)
                    nn.init.zeros_(layer.bias)

    @property
    def output_layer(self) -> nn.Linear:
        return self.net[-1]

    def forward(self, eps: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Samples from noise: eps [..., noise_dim] -> [..., dim] (``generator``: the injected noise's,
        with ``noise_at``)."""
        trailing("eps", eps, (self.noise_dim,))
        h = eps
        for layer in self.net:
            h = layer(h, generator) if isinstance(layer, NoiseInjection) else layer(h)
        return h

    def sample(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """[n, dim] samples, differentiable w.r.t. the parameters (reparameterized)."""
        p = self.net[0].weight
        eps = standard_normal((positive_int("n", n), self.noise_dim), generator, dtype=p.dtype, device=p.device)
        return self(eps, generator)


def stochastic_net_2d(noise_dim: int = 2, hidden: int = 20, out_dim: int = 2, activation: str = "relu",
                      init_log_std: float = 0.0) -> MLPGenerator:
    """The implicit posterior of the paper's Appendix "Toy Experiments" (2-D Bayesian logistic regression):

        eps ~ N(0, I_noise) -> FC(hidden) + activation -> FC(hidden), linear -> h
        z = h + xi,  xi ~ N(0, diag(exp(2 log_std)))      (the second noise, trainable variances)
        w = Linear(activation(FC(hidden)(z)))             (2-D output)

    with torch.nn.Linear's initialization. The paper does not name the activation of the other
    layers; ReLU is used, as in its BNN posteriors.
    """
    return MLPGenerator((noise_dim, hidden, hidden, hidden, out_dim), activation=activation, init="torch",
                        noise_at=2, noise_init_log_std=init_log_std)
