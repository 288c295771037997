"""The best pure-PyTorch KIVI KL a competent user would write: the baseline of bench/run.py.

Not the test oracle (``kivi_fast.reference``, which materializes [n, m, d] differences). This one:

- one GEMM per block for the squared distances, ||x||^2 + ||y||^2 - 2 x y^T. With X = [q; p] stacked
  (N = n_q + n_p points), the rows of q, q X^T ([n_q, N]), are all the fit and the evaluation need; the
  median also needs the p-p block, p p^T. So 3 n^2 d multiply-adds instead of 4 n^2 d for the full
  N x N Gram. The GEMMs run in the input dtype (GEMM_IN_INPUT_DTYPE; float64 for everything after),
- the median Euclidean distance over the N (N - 1) / 2 distinct pairs with ``torch.kthvalue`` on the
  squared distances (the mean of the two middle distances for an even count, numpy's convention, as
  ``kivi_fast.reference.median_bandwidth``), no sort,
- float64 for the n x n fit and the evaluation (it cancels terms of size ~1/lam),
- ``torch.linalg.cholesky`` + ``torch.cholesky_solve``, batched for [B, n, d],
- autograd for the gradient w.r.t. q_z with the fit (alpha, sigma, the centres) detached: the paper's
  fixed-ratio gradient (Eq. 8), only the evaluation points carry gradient.

Reverse ratio only (``kivi_fast.kl``'s default), median bandwidth, lam and clip as in ``kivi_fast.kl``.
"""

from __future__ import annotations

import torch

# Float32 GEMM for float32 inputs agrees with the reference to ~1e-5 relative on the benchmark shapes
# (bench/run.py self-check: (100, 8) and (10, 314000)); float64 GEMM is the safer, slower choice.
GEMM_IN_INPUT_DTYPE = True

_TRIU_CACHE: dict = {}


def _triu(n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    key = (n, str(device))
    if key not in _TRIU_CACHE:
        _TRIU_CACHE[key] = tuple(torch.triu_indices(n, n, offset=1, device=device))
    return _TRIU_CACHE[key]


def _median_of_sqdist(pairs: torch.Tensor) -> torch.Tensor:
    """Median of sqrt(pairs) along the last dim (float64); the mean of the two middle values for an
    even count. One ``kthvalue`` for the lower middle; the upper one is the next larger value (or the
    same on a tie), two cheap elementwise passes instead of a second selection."""
    m = pairs.shape[-1]
    k = (m + 1) // 2  # 1-based rank of the (lower) middle element
    lo = torch.kthvalue(pairs, k, dim=-1).values
    if m % 2:
        hi = lo
    else:
        l_ = lo.unsqueeze(-1)
        tie = (pairs <= l_).sum(-1) >= k + 1
        nxt = torch.where(pairs > l_, pairs, torch.inf).amin(-1)
        hi = torch.where(tie, lo, nxt)
    return 0.5 * (lo.double().clamp_min(0).sqrt() + hi.double().clamp_min(0).sqrt())


def kl(prior_z: torch.Tensor, q_z: torch.Tensor, lam: float = 1e-3, clip: float = 1e-8,
       gemm_in_input_dtype: bool | None = None) -> torch.Tensor:
    """KL(q || p) by KIVI with the reverse ratio trick; [n, d] -> [] or [B, n, d] -> [B].

    Differentiable w.r.t. ``q_z`` (fixed-ratio gradient); ``prior_z`` gets none.
    """
    if gemm_in_input_dtype is None:
        gemm_in_input_dtype = GEMM_IN_INPUT_DTYPE
    batched = q_z.dim() == 3
    q = q_z if batched else q_z.unsqueeze(0)
    p = (prior_z if batched else prior_z.unsqueeze(0)).detach()
    out_dtype = q.dtype
    if not gemm_in_input_dtype:
        q, p = q.double(), p.double()
    n_q, n_p = q.shape[1], p.shape[1]

    centres = torch.cat([q.detach(), p], dim=1)               # [B, N, d], no gradient
    sq_c = centres.pow(2).sum(-1)                               # [B, N]
    sq_q = q.pow(2).sum(-1)                                     # [B, n_q], carries gradient
    # [B, n_q, N]: the evaluation points q (with gradient) against all centres; one GEMM.
    d2 = torch.baddbmm(sq_q.unsqueeze(-1) + sq_c.unsqueeze(-2), q, centres.transpose(1, 2), alpha=-2.0)

    with torch.no_grad():
        # Median over the distinct pairs of the N stacked points: q-q upper triangle, q-p all, p-p upper.
        sq_p = sq_c[:, n_q:]
        d2_pp = torch.baddbmm(sq_p.unsqueeze(-1) + sq_p.unsqueeze(-2), p, p.transpose(1, 2), alpha=-2.0)
        rq, cq = _triu(n_q, q.device)
        rp, cp = _triu(n_p, q.device)
        d2d = d2.detach()
        pairs = torch.cat([d2d[:, rq, cq], d2d[:, :, n_q:].reshape(q.shape[0], -1), d2_pp[:, rp, cp]], dim=1)
        sigma = _median_of_sqdist(pairs)                        # [B] float64
        if bool((sigma == 0).any()):
            raise ValueError("the median pairwise distance is 0; the median bandwidth is undefined")
        scale = (-0.5 / sigma**2)[:, None, None]

    # [B, n_q, N] float64 kernel of the evaluation points (gradient) against the centres (none).
    k = torch.exp(d2.double().clamp_min(0) * scale)

    with torch.no_grad():
        # Fit of r = p / q (closed form): alpha = -1/(lam n_q n_p) (K_qq / n_q + lam I)^{-1} K_qp 1.
        kd = k.detach()
        system = kd[:, :, :n_q] / n_q
        system.diagonal(dim1=-2, dim2=-1).add_(lam)
        chol = torch.linalg.cholesky(system)
        rhs = kd[:, :, n_q:].sum(-1, keepdim=True) / (lam * n_q * n_p)
        alpha = -torch.cholesky_solve(rhs, chol)                # [B, n_q, 1]
        beta = torch.full((q.shape[0], n_p, 1), 1.0 / (lam * n_p), dtype=torch.float64, device=q.device)
        weights = torch.cat([alpha, beta], dim=1)               # [B, N, 1]

    # Evaluation at q (the only tensor with gradient): r_j = sum_c w_c k(c, q_j).
    r = torch.bmm(k, weights)[..., 0]                           # [B, n_q]
    out = -torch.log(torch.clamp(r, min=clip)).mean(-1)
    out = out.to(out_dtype)
    return out if batched else out[0]
