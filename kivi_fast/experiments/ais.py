"""Marginal log-likelihoods log p(x) = log E_{N(z; 0, I)} p(x | z) of latent-variable models.

:func:`ais_log_likelihood`: annealed importance sampling (Neal, 2001) as Wu et al. (2016) evaluate
decoders: from the prior N(0, I) to the posterior along the geometric path f_t(z) = N(z; 0, I) p(x | z)^beta_t,
a sigmoidal schedule of ``steps`` temperatures (Grosse et al., 2015), one HMC transition of ``leapfrog``
steps per temperature, its step size adapted per chain toward 65% acceptance. Each chain's log-weight
sum_t (beta_t - beta_{t-1}) log p(x | z_{t-1}) is an unbiased estimate of p(x) in expectation, so the
log of the chains' mean weight is a stochastic lower bound that tightens with ``steps``.

:func:`iwae_log_likelihood`: the importance-weighted bound log (1/k) sum_k p(x, z_k) / q(z_k | x) with a
proposal of known density (the Gaussian encoder), a check of the AIS numbers.

Both take ``log_likelihood(z)``: z [N, K, d] -> log p(x_i | z_ik) [N, K], for N data points at once.
"""

from __future__ import annotations

import math
from typing import Callable

import torch


def sigmoid_schedule(steps: int, delta: float = 4.0) -> torch.Tensor:
    """steps + 1 temperatures from 0 to 1, dense at both ends: a rescaled sigmoid over [-delta, delta]."""
    s = torch.sigmoid(torch.linspace(-delta, delta, steps + 1, dtype=torch.float64))
    return (s - s[0]) / (s[-1] - s[0])


def _log_prior(z: torch.Tensor) -> torch.Tensor:
    return -0.5 * z.pow(2).sum(-1) - 0.5 * z.shape[-1] * math.log(2 * math.pi)


def ais_log_likelihood(log_likelihood: Callable[[torch.Tensor], torch.Tensor], n_data: int, z_dim: int, *,
                       chains: int = 16, steps: int = 1000, leapfrog: int = 10, step_size: float = 0.05,
                       target_accept: float = 0.65, generator: torch.Generator | None = None,
                       device="cpu", dtype=torch.float32, progress=None) -> dict:
    """AIS estimates of log p(x_i), i < n_data: {"log_likelihood": [N] float64, "acceptance": mean
    acceptance rate, "log_weights": [N, chains] float64}. ``progress``: called with 1 after each temperature."""
    if chains < 1 or steps < 1 or leapfrog < 1:
        raise ValueError(f"chains, steps and leapfrog must be >= 1, got {chains}, {steps}, {leapfrog}")
    betas = sigmoid_schedule(steps).tolist()
    z = torch.randn((n_data, chains, z_dim), generator=generator, device=device, dtype=dtype)
    eps = torch.full((n_data, chains, 1), step_size, device=device, dtype=dtype)
    log_w = torch.zeros((n_data, chains), dtype=torch.float64, device=device)

    def likelihood_and_grad(z):
        with torch.enable_grad():
            z = z.detach().requires_grad_()
            ll = log_likelihood(z)
            (grad,) = torch.autograd.grad(ll.sum(), z)
        return ll.detach(), grad

    def energy(z, ll, beta):  # -log f_beta(z)
        return -(_log_prior(z) + beta * ll)

    # grow on acceptance, shrink on rejection, balanced at the target rate:
    # target * log(grow) = (1 - target) * log(1 / shrink)
    grow = 1.02
    shrink = grow ** (-target_accept / (1 - target_accept))
    accepted = torch.zeros((), dtype=torch.float64, device=device)
    ll, grad_ll = likelihood_and_grad(z)  # at the current z, carried from one temperature to the next
    for t in range(1, steps + 1):
        beta = betas[t]
        log_w += (beta - betas[t - 1]) * ll.double()
        p0 = torch.randn(z.shape, generator=generator, device=device, dtype=dtype)
        zn, lln, grad_n = z, ll, grad_ll
        p = p0 - 0.5 * eps * (zn - beta * grad_n)
        for i in range(leapfrog):
            zn = zn + eps * p
            lln, grad_n = likelihood_and_grad(zn)
            if i < leapfrog - 1:
                p = p - eps * (zn - beta * grad_n)
        p = p - 0.5 * eps * (zn - beta * grad_n)
        log_accept = (energy(z, ll, beta) - energy(zn, lln, beta)
                      + 0.5 * p0.pow(2).sum(-1) - 0.5 * p.pow(2).sum(-1)).nan_to_num(nan=-math.inf)
        u = torch.rand(log_accept.shape, generator=generator, device=device, dtype=dtype)
        accept = u.log() < log_accept
        z = torch.where(accept[..., None], zn, z)
        ll = torch.where(accept, lln, ll)
        grad_ll = torch.where(accept[..., None], grad_n, grad_ll)
        eps = eps * torch.where(accept[..., None], grow, shrink).to(dtype)
        accepted += accept.double().mean()
        if progress is not None:
            progress(1)
    log_p = torch.logsumexp(log_w, -1) - math.log(chains)
    return {"log_likelihood": log_p, "acceptance": float(accepted) / steps, "log_weights": log_w}


def iwae_log_likelihood(log_likelihood: Callable[[torch.Tensor], torch.Tensor], sample_q: Callable[[int], torch.Tensor],
                        log_q: Callable[[torch.Tensor], torch.Tensor], k: int, chunk: int = 500) -> torch.Tensor:
    """log (1/k) sum_j p(x_i | z_ij) N(z_ij; 0, I) / q(z_ij | x_i), [N] float64, z_ij ~ q (``sample_q(m)`` ->
    [N, m, d], ``log_q(z)`` -> [N, m]); drawn ``chunk`` at a time."""
    parts = []
    for lo in range(0, k, chunk):
        z = sample_q(min(chunk, k - lo))
        parts.append((log_likelihood(z) + _log_prior(z) - log_q(z)).double())
    log_w = torch.cat(parts, -1)
    return torch.logsumexp(log_w, -1) - math.log(k)
