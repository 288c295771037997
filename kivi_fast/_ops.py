"""Fake (meta) kernels and autograd formulas of the compiled ops ``torch.ops.kivi_fast.*``.

The ops are declared in csrc/ops.cpp; their tensor arguments are always batched ([B, n, d]).
Internally they work in float64 (see csrc/ops.cpp for why); ``weights`` outputs are the float64
[B, m, n_denom + n_numer] matrices that the backward needs, saved by the forward.

Gradient (the paper's Eq. 8): the fitted function is held fixed and only the evaluation points move,
so d/dz_j f(z_j) = row_scale_j * (sum_c W_jc c - (sum_c W_jc) z_j), one op: ``weighted_grad``.
"""

from __future__ import annotations

import torch

ops = torch.ops.kivi_fast


@torch.library.register_fake("kivi_fast::sqdist")
def _(x, y):
    return x.new_empty((x.shape[0], x.shape[1], y.shape[1]), dtype=torch.float64)


@torch.library.register_fake("kivi_fast::rbf_gram")
def _(x, y, sigma):
    return x.new_empty((x.shape[0], x.shape[1], y.shape[1]))


@torch.library.register_fake("kivi_fast::median_bandwidth")
def _(x):
    return x.new_empty((x.shape[0],), dtype=torch.float64)


@torch.library.register_fake("kivi_fast::fit")
def _(numer, denom, lam, sigma):
    b = numer.shape[0]
    return numer.new_empty((b, denom.shape[1]), dtype=torch.float64), numer.new_empty((b,), dtype=torch.float64)


@torch.library.register_fake("kivi_fast::ratio")
def _(z, numer, denom, alpha, beta, sigma):
    b, m = z.shape[0], z.shape[1]
    n = numer.shape[1] + denom.shape[1]
    return z.new_empty((b, m)), z.new_empty((b, m, n), dtype=torch.float64)


@torch.library.register_fake("kivi_fast::kl")
def _(prior_z, q_z, lam, clip, sigma, reverse):
    b, m = q_z.shape[0], q_z.shape[1]
    n = prior_z.shape[1] + m
    return (q_z.new_empty((b,)), q_z.new_empty((b, m, n), dtype=torch.float64),
            q_z.new_empty((b,), dtype=torch.float64))


@torch.library.register_fake("kivi_fast::weighted_grad")
def _(row_scale, weights, z, numer, denom):
    return torch.empty_like(z)


def _ratio_setup(ctx, inputs, output):
    z, numer, denom = inputs[0], inputs[1], inputs[2]
    ctx.save_for_backward(output[1], z, numer, denom)


def _ratio_backward(ctx, grad_r, grad_weights):
    weights, z, numer, denom = ctx.saved_tensors
    grad_z = ops.weighted_grad(grad_r.to(torch.float64), weights, z, numer, denom)
    return grad_z, None, None, None, None, None


torch.library.register_autograd("kivi_fast::ratio", _ratio_backward, setup_context=_ratio_setup)


def _kl_setup(ctx, inputs, output):
    prior_z, q_z, _, _, _, reverse = inputs
    ctx.reverse = reverse
    numer, denom = (prior_z, q_z) if reverse else (q_z, prior_z)
    ctx.save_for_backward(output[1], q_z, numer, denom)


def _kl_backward(ctx, grad_kl, grad_weights, grad_sigma):
    weights, q_z, numer, denom = ctx.saved_tensors
    # KL = -+ (1/n_q) sum_j log r(z_j); the saved weights already hold the 1 / r_j of d log r.
    sign = -1.0 if ctx.reverse else 1.0
    row_scale = (sign / q_z.shape[1]) * grad_kl.to(torch.float64)[:, None].expand(-1, q_z.shape[1])
    grad_q = ops.weighted_grad(row_scale, weights, q_z, numer, denom)
    return None, grad_q, None, None, None, None


torch.library.register_autograd("kivi_fast::kl", _kl_backward, setup_context=_kl_setup)
