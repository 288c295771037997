"""Fake (meta) kernels of the compiled ops ``torch.ops.kivi_fast.*``, for torch.compile and opcheck.

The ops are declared in csrc/ops.cpp (their test switches apart, in ``torch.ops.kivi_fast_testing``:
csrc/testing.cpp); their sample arguments are batched ([B, n, d]), except that ``kl`` and ``kl_grad``
also take an unbatched pair ([n, d]) and then return no batch dimension. Internally they work in
float64 (see csrc/kivi.h for why). What the backward needs is a float64 output of the forward, the
"grad state": the weights W [B, m, N] (N = n_denom + n_numer) of the gradient at the m evaluation
points, or with few dimensions (d + 1 < N) their projection [B, m, d + 1] on the points
(``grad_state_width`` in csrc/kivi.h; ``state_width`` below), or with ``grad_state=False`` (no
gradient to come) nothing ([B, m, 0]). ``ratio`` returns it second (after r); ``kl`` as the second of
its four outputs (the KL, that state, the bandwidth used, the fraction of q_z's points whose fitted
ratio was clipped). ``standardize`` and ``standardize_grad``, the diagonal contrast's forward and
backward (kivi_fast/contrast.py), have CUDA kernels only.

The autograd formulas of ``kl`` and ``ratio`` (the paper's Eq. 8, through the ``kl_grad`` and
``weighted_grad`` ops) are registered in C++ (csrc/autograd.cpp), so that a training step stays out
of Python. The other ops have no gradient: called on inputs that require one, their backward raises
naming the op.
"""

from __future__ import annotations

import torch


def _one_device(op: str, **tensors) -> None:
    """Every tensor argument on one device. One argument on 'meta' among real ones sends the call to
    these fake kernels (the dispatcher ranks the Meta key first), which would return uninitialized
    memory on the real device as the result."""
    devices = {name: t.device for name, t in tensors.items() if isinstance(t, torch.Tensor)}
    first_name, first = next(iter(devices.items()))
    for name, device in devices.items():
        if device != first:
            raise ValueError(f"kivi_fast::{op}: {name} must be on {first_name}'s device {first}, got {device}")


@torch.library.register_fake("kivi_fast::sqdist")
def _(x, y):
    _one_device("sqdist", x=x, y=y)
    return x.new_empty((x.shape[0], x.shape[1], y.shape[1]), dtype=torch.float64)


@torch.library.register_fake("kivi_fast::rbf_gram")
def _(x, y, sigma):
    _one_device("rbf_gram", x=x, y=y, sigma=sigma)
    return x.new_empty((x.shape[0], x.shape[1], y.shape[1]))


@torch.library.register_fake("kivi_fast::median_bandwidth")
def _(x):
    return x.new_empty((x.shape[0],), dtype=torch.float64)


@torch.library.register_fake("kivi_fast::fit")
def _(numer, denom, lam, sigma):
    _one_device("fit", numer=numer, denom=denom, sigma=sigma)
    b = numer.shape[0]
    return numer.new_empty((b, denom.shape[1]), dtype=torch.float64), numer.new_empty((b,), dtype=torch.float64)


def state_width(n: int, d: int) -> int:
    """The grad state's last dimension for n stacked points in d dimensions (csrc/kivi.h)."""
    return d + 1 if d + 1 < n else n


@torch.library.register_fake("kivi_fast::ratio")
def _(z, numer, denom, alpha, beta, sigma, grad_state=True):
    _one_device("ratio", z=z, numer=numer, denom=denom, alpha=alpha, sigma=sigma)
    b, m, d = z.shape
    width = state_width(numer.shape[1] + denom.shape[1], d) if grad_state else 0
    return z.new_empty((b, m)), z.new_empty((b, m, width), dtype=torch.float64)


@torch.library.register_fake("kivi_fast::kl")
def _(prior_z, q_z, lam, clip, sigma, reverse, grad_state=True):
    _one_device("kl", prior_z=prior_z, q_z=q_z, sigma=sigma)
    torch._check(q_z.dim() in (2, 3) and prior_z.dim() == q_z.dim(),
                 lambda: f"kivi_fast::kl: prior_z and q_z must both be [n, d] or both [B, n, d], "
                         f"got shapes {tuple(prior_z.shape)} and {tuple(q_z.shape)}")
    *batch, m, d = q_z.shape  # batch: [B], or [] for an unbatched pair
    n = prior_z.shape[-2] + m
    width = state_width(n, d) if grad_state else 0
    # (KL, grad state, sigma, the fraction of q_z's points clipped)
    return (q_z.new_empty(batch), q_z.new_empty((*batch, m, width), dtype=torch.float64),
            q_z.new_empty(batch, dtype=torch.float64), q_z.new_empty(batch, dtype=torch.float64))


@torch.library.register_fake("kivi_fast::weighted_grad")
def _(row_scale, state, z, numer, denom):
    _one_device("weighted_grad", row_scale=row_scale, state=state, z=z, numer=numer, denom=denom)
    return torch.empty_like(z)


@torch.library.register_fake("kivi_fast::kl_grad")
def _(grad_kl, state, q_z, prior_z, reverse):
    _one_device("kl_grad", grad_kl=grad_kl, state=state, q_z=q_z, prior_z=prior_z)
    return torch.empty_like(q_z, memory_format=torch.contiguous_format)


@torch.library.register_fake("kivi_fast::standardize")
def _(x, to_standard_normal, bias):
    b, n, d = x.shape
    # (z, the standard deviations, t), float64
    return (x.new_empty((b, n, d), dtype=torch.float64), x.new_empty((b, 1, d), dtype=torch.float64),
            x.new_empty((b,), dtype=torch.float64))


@torch.library.register_fake("kivi_fast::standardize_grad")
def _(grad_z, grad_t, z, std, x, to_standard_normal):
    _one_device("standardize_grad", grad_z=grad_z, grad_t=grad_t, z=z, std=std, x=x)
    return torch.empty_like(x, memory_format=torch.contiguous_format)
