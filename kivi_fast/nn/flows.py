"""A planar normalizing flow (Rezende & Mohamed, 2015): a flexible q whose density is exact.

    z_k = z_{k-1} + u_k tanh(w_k^T z_{k-1} + b_k),    z_0 ~ N(0, I),
    log q(z_K) = log N(z_0; 0, I) - sum_k log |1 + u_k^T w_k (1 - tanh^2(w_k^T z_{k-1} + b_k))|.

Each layer is invertible when w_k^T u_k >= -1; as in the paper, u_k is replaced by the closest u_hat_k
with w_k^T u_hat_k = -1 + softplus(w_k^T u_k) > -1. The density is only available at points the flow
produced (it is not inverted), which is all a Monte Carlo KL(q || p) needs; the KL-accuracy diagnostic
uses it as ground truth for the kernel estimate.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..contrast import standard_normal_log_prob
from .._random import standard_normal
from ._checks import finite_float, positive_int, trailing


class PlanarFlow(nn.Module):
    """``n_layers`` planar layers in ``dim`` dimensions on a standard normal base, for training: u, w
    and b start with U(-s, s) entries, s = ``init_scale`` (default 1/sqrt(dim), as Pyro's planar flow;
    from ``generator``, else torch's global one). Not at 0: with u = w = b = 0 every gradient is 0, and
    the invertibility projection of u (``u_hat``) jumps by ~0.3 / |w| as w leaves 0, so the flow could
    not train from there. ``init_scale=0`` is the identity (fixed); :meth:`random` builds a fixed
    non-Gaussian flow."""

    def __init__(self, dim: int, n_layers: int = 4, init_scale: float | None = None,
                 generator: torch.Generator | None = None):
        super().__init__()
        self.dim = dim = positive_int("dim", dim)
        n_layers = positive_int("n_layers", n_layers)
        scale = dim ** -0.5 if init_scale is None else finite_float("init_scale", init_scale, least=0.0)

        def start(*shape: int) -> torch.Tensor:  # (scale 0 draws nothing: random()'s stream stays its own)
            if scale == 0:
                return torch.zeros(shape)
            return (torch.rand(shape, generator=generator) * 2 - 1) * scale

        self.u, self.w, self.b = (nn.Parameter(start(n_layers, dim)), nn.Parameter(start(n_layers, dim)),
                                  nn.Parameter(start(n_layers)))

    @classmethod
    def random(cls, dim: int, n_layers: int = 4, strength: float = 1.0,
               generator: torch.Generator | None = None) -> "PlanarFlow":
        """A fixed, clearly non-Gaussian flow: each layer moves points by up to ``strength`` along a
        random direction u, switching sign across a random hyperplane with a steep tanh (|w| = 3), so
        the base splits into separated lobes."""
        flow = cls(dim, n_layers, init_scale=0.0)
        with torch.no_grad():
            u = torch.randn(n_layers, dim, generator=generator)
            w = torch.randn(n_layers, dim, generator=generator)
            flow.u.copy_(finite_float("strength", strength) * u / u.norm(dim=-1, keepdim=True))
            flow.w.copy_(3.0 * w / w.norm(dim=-1, keepdim=True))
            flow.b.copy_(torch.randn(n_layers, generator=generator))
        return flow

    def u_hat(self) -> torch.Tensor:
        """u projected so that w^T u_hat = -1 + softplus(w^T u) > -1 (invertibility), per layer."""
        wu = (self.w * self.u).sum(-1, keepdim=True)
        # (at w = 0 the correction is 0, and the floor keeps 0 / 0 from making it NaN)
        norm2 = self.w.pow(2).sum(-1, keepdim=True).clamp_min(torch.finfo(self.w.dtype).tiny)
        return self.u + (F.softplus(wu) - 1 - wu) * self.w / norm2

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Push base points x [..., dim] through the layers: returns (z, log|det dz/dx|) ([..., dim], [...])."""
        trailing("x", x, (self.dim,))
        u_hat = self.u_hat().to(x.dtype)
        w, b = self.w.to(x.dtype), self.b.to(x.dtype)
        log_det = torch.zeros(x.shape[:-1], dtype=x.dtype, device=x.device)
        z = x
        for k in range(u_hat.shape[0]):
            pre = z @ w[k] + b[k]
            h = torch.tanh(pre)
            # det(I + u psi^T) = 1 + psi^T u with psi = h'(pre) w (matrix determinant lemma)
            log_det = log_det + torch.log(torch.abs(1 + (1 - h.pow(2)) * (w[k] @ u_hat[k])))
            z = z + h.unsqueeze(-1) * u_hat[k]
        return z, log_det

    def sample_with_log_prob(self, n: int, generator: torch.Generator | None = None,
                             dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """n samples [n, dim] and their exact log-density log q(z) [n] (change of variables), on the
        parameters' device, in ``dtype`` (default: the parameters')."""
        p = self.u
        x = standard_normal((positive_int("n", n), self.dim), generator, dtype=dtype or p.dtype, device=p.device)
        z, log_det = self(x)
        return z, standard_normal_log_prob(x) - log_det

    def sample(self, n: int, generator: torch.Generator | None = None, dtype: torch.dtype | None = None
               ) -> torch.Tensor:
        """[n, dim] samples, as :meth:`sample_with_log_prob`'s."""
        return self.sample_with_log_prob(n, generator, dtype)[0]

    def kl_to_standard_normal(self, n: int = 100_000, generator: torch.Generator | None = None,
                              chunk: int = 20_000) -> tuple[float, float]:
        """Monte Carlo KL(q || N(0, I)) = E_q[log q(z) - log N(z; 0, I)] from ``n`` draws (in float64).

        Returns (estimate, standard error); the standard error tells how much of a ground truth it is.
        """
        if positive_int("n", n) < 2:
            raise ValueError(f"n must be at least 2 (a standard error needs two draws), got {n}")
        chunk = positive_int("chunk", chunk)
        terms = []
        with torch.no_grad():
            for start in range(0, n, chunk):
                z, log_q = self.sample_with_log_prob(min(chunk, n - start), generator, torch.float64)
                terms.append(log_q - standard_normal_log_prob(z))
        t = torch.cat(terms)
        return float(t.mean()), float(t.std() / t.numel() ** 0.5)
