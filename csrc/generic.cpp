// Device-generic implementation: ATen calls only, so it runs wherever ATen does (CUDA tensors for the
// ops and shapes that csrc/cuda/ does not take). It is also the baseline the CPU kernels (csrc/cpu/)
// are tested against.
//
// Off the CPU nothing here reads a value back to the host (a read stalls the stream at every call and
// breaks CUDA-graph capture): where the CPU raises an error for a value (NaN/Inf samples, a zero
// median, a system that is not positive definite), other devices give NaN for that batch element.
#include "kivi.h"

#include <c10/util/Exception.h>

#include <cmath>

namespace kivi_fast {

Tensor stack_points(const Tensor& denom, const Tensor& numer) { return at::cat({denom, numer}, 1); }

void check_finite_rows(const Tensor& sq_norms, int64_t n_den, Names names) {
  // A NaN/Inf coordinate makes the squared norm of its row NaN/Inf, so the norms (computed anyway
  // for the distances) tell which input is bad without another pass over the samples. Off the CPU
  // the NaN/Inf flows on instead (fit() turns the whole element's coefficients to NaN).
  if (!sq_norms.is_cpu()) return;
  auto ok = at::isfinite(sq_norms);
  TORCH_CHECK_VALUE(ok.narrow(1, 0, n_den).all().item<bool>(), names.denom, kNotFiniteMessage);
  TORCH_CHECK_VALUE(ok.narrow(1, n_den, sq_norms.size(1) - n_den).all().item<bool>(), names.numer,
                    kNotFiniteMessage);
}

Tensor median_from_sqdist(const Tensor& sq) {
  // Median over the N (N - 1) / 2 distinct pairs (upper triangle), numpy's convention for an even
  // count (mean of the two middle distances).
  const int64_t n = sq.size(1);
#ifdef KIVI_FAST_WITH_CUDA
  // Many pairs on a GPU: a radix selection over the triangle in place (no copy of the pairs, no sort).
  if (sq.is_cuda() && n * (n - 1) / 2 >= (int64_t{1} << 16)) return cuda::median_from_sqdist(sq);
#endif
  auto idx = at::triu_indices(n, n, 1, sq.options().dtype(at::kLong));
  auto flat = sq.flatten(1).index_select(1, idx[0] * n + idx[1]);  // [B, P]
  const int64_t p = flat.size(1), k = (p + 1) / 2;                  // k: 1-based rank of the lower middle
  Tensor lo, hi;
  if (!flat.device().is_cpu() && p >= (int64_t{1} << 16)) {
    // (Without the CUDA kernels.) CUDA's kthvalue gives each row to one thread block: 65 ms for one
    // row of 8 M pairs on an H100, where a device-wide sort takes 1.1 ms.
    auto sorted = std::get<0>(at::sort(flat, 1));
    lo = sorted.select(1, k - 1);
    hi = sorted.select(1, p / 2);
  } else {
    lo = std::get<0>(at::kthvalue(flat, k, 1));
    if (p % 2 == 1) {
      hi = lo;
    } else {  // the next larger value, or lo again when it occurs more than once: no second selection
      auto l = lo.unsqueeze(1);
      auto tie = (flat <= l).sum(1) > k;
      hi = at::where(tie, lo, at::where(flat > l, flat, INFINITY).amin(1));
    }
  }
  auto sigma = (lo.clamp_min(0).sqrt() + hi.clamp_min(0).sqrt()) * 0.5;
  if (!sigma.is_cpu()) return at::where(sigma > 0, sigma, NAN);
  TORCH_CHECK_VALUE((sigma > 0).all().item<bool>(), kZeroMedianMessage);
  return sigma;
}

Tensor solve_alpha(const Tensor& kernel, int64_t n_den, double lam) {
  const int64_t n_num = kernel.size(1) - n_den;
  auto k_dd = kernel.narrow(1, 0, n_den).narrow(2, 0, n_den);
  auto k_dn = kernel.narrow(1, 0, n_den).narrow(2, n_den, n_num);
  auto system = k_dd / static_cast<double>(n_den);
  system.diagonal(0, 1, 2).add_(lam);
  auto [chol, info] = at::linalg_cholesky_ex(system);
  if (chol.is_cpu()) {
    TORCH_CHECK_VALUE((info == 0).all().item<bool>(), kNotPositiveDefiniteMessage, " (lam = ", lam, ")");
  }
  auto rhs = k_dn.sum(-1, true) / (lam * static_cast<double>(n_den) * static_cast<double>(n_num));
  // two triangular solves rather than cholesky_solve, whose CUDA version may read its status back
  auto y = at::linalg_solve_triangular(chol, rhs, /*upper=*/false);
  auto alpha = -at::linalg_solve_triangular(chol.mH(), y, /*upper=*/true).squeeze(-1);
  return chol.is_cpu() ? alpha : at::where((info == 0).unsqueeze(-1), alpha, NAN);
}

namespace generic {

Tensor sqdist(const Tensor& x, const Tensor& y) {
  auto x64 = x.to(at::kDouble);
  auto y64 = y.to(at::kDouble);
  auto xn = x64.pow(2).sum(-1);
  auto yn = y64.pow(2).sum(-1);
  check_finite_rows(at::cat({xn, yn}, 1), x.size(1), {"y", "x"});
  auto sq = at::baddbmm(xn.unsqueeze(2) + yn.unsqueeze(1), x64, y64.transpose(1, 2), 1.0, -2.0);
  return sq.clamp_min_(0);
}

Tensor median_bandwidth(const Tensor& x) { return median_from_sqdist(sqdist(x, x)); }

Fit fit(const Tensor& numer, const Tensor& denom, double lam, const std::optional<Tensor>& sigma, Names names) {
  const int64_t n_den = denom.size(1);
  auto pts = stack_points(denom, numer).to(at::kDouble);
  auto norms = pts.pow(2).sum(-1);
  check_finite_rows(norms, n_den, names);
  auto sq = at::baddbmm(norms.unsqueeze(2) + norms.unsqueeze(1), pts, pts.transpose(1, 2), 1.0, -2.0).clamp_min_(0);
  sq.diagonal(0, 1, 2).zero_();  // exact zeros where the GEMM formula leaves rounding noise
  auto s = sigma.has_value() ? *sigma : median_from_sqdist(sq);
  if (sigma.has_value() && !s.is_cpu()) s = at::where(s.gt(0).logical_and(s.isfinite()), s, NAN);  // see above
  auto kernel = sq.div_((s * s * -2.0).view({-1, 1, 1})).exp_();  // in place: N x N is the largest buffer
  auto alpha = solve_alpha(kernel, n_den, lam);
  if (!alpha.is_cpu()) alpha = at::where(at::isfinite(norms).all(1, true), alpha, NAN);  // see check_finite_rows
  auto beta = at::full({alpha.size(0), numer.size(1)}, 1.0 / (lam * static_cast<double>(numer.size(1))),
                       alpha.options());
  return {at::cat({alpha, beta}, 1), s, kernel};
}

namespace {

// [sum_c W_jc c, sum_c W_jc] ([B, m, d + 1]), c over the stacked points [denom; numer]
Tensor project_weights(const Tensor& weights, const Tensor& denom, const Tensor& numer) {
  auto pts = stack_points(denom, numer).to(at::kDouble);
  return at::cat({at::bmm(weights, pts), weights.sum(-1, true)}, -1);
}

// grad_j = row_scale_j (sum_c W_jc c - (sum_c W_jc) z_j) from the projection (row_scale [B, m] or [B, 1])
Tensor grad_from_projection(const Tensor& projection, const Tensor& row_scale, const Tensor& z) {
  const int64_t d = z.size(2);
  auto grad = projection.narrow(2, 0, d) - projection.narrow(2, d, 1) * z.to(at::kDouble);
  return (grad * row_scale.unsqueeze(-1)).to(z.scalar_type());
}

}  // namespace

std::tuple<Tensor, Tensor, Tensor, Tensor> kl(const Tensor& prior_z, const Tensor& q_z, double lam, double clip,
                                              const std::optional<Tensor>& sigma, bool reverse, bool grad_state) {
  const KlRoles roles = kl_roles(prior_z, q_z, reverse);
  auto f = fit(roles.numer, roles.denom, lam, sigma, roles.names);
  // The evaluation points q_z are fitted samples too: their kernel rows are already in f.kernel.
  // r_j = sum_c coef_c k(c, z_j), and the projection below, are products with those rows: no
  // [B, n_q, N] temporary unless the state is the weights themselves.
  auto rows = f.kernel.narrow(1, roles.row0, q_z.size(1));
  auto r = at::bmm(rows, f.coef.unsqueeze(-1)).squeeze(-1);
  // d log r / dz = (d r / dz) / r, and grad_z k(c, z) = k(c, z) (c - z) / sigma^2; clipped: none.
  auto scale = (r > clip).to(at::kDouble) / (r * (f.sigma * f.sigma).unsqueeze(1));
  auto kl = at::log(r.clamp_min(clip)).mean(-1);
  if (reverse) kl.neg_();
  auto clipped = (r <= clip).to(at::kDouble).mean(-1);
  if (!grad_state) return {kl, r.new_empty({r.size(0), r.size(1), 0}), f.sigma, clipped};
  if (!kl_state_is_projection(f.kernel.size(1), q_z.size(2))) {
    return {kl, rows * f.coef.unsqueeze(1) * scale.unsqueeze(-1), f.sigma, clipped};
  }
  // W_jc = coef_c k(c, z_j) scale_j: [sum_c W_jc c, sum_c W_jc] = scale_j [rows (coef c), r_j]
  auto pts = stack_points(roles.denom, roles.numer).to(at::kDouble);
  auto projection = at::cat({at::bmm(rows, pts * f.coef.unsqueeze(-1)), r.unsqueeze(-1)}, -1);
  return {kl, projection.mul_(scale.unsqueeze(-1)), f.sigma, clipped};
}

Tensor kl_grad(const Tensor& grad_kl, const Tensor& state, const Tensor& q_z, const Tensor& prior_z, bool reverse) {
  auto row_scale = kl_row_scale(grad_kl, q_z.size(1), reverse).view({-1, 1});
  if (kl_state_is_projection(prior_z.size(1) + q_z.size(1), q_z.size(2))) {
    return grad_from_projection(state, row_scale, q_z);
  }
  const KlRoles roles = kl_roles(prior_z, q_z, reverse);
  return weighted_grad(row_scale.expand({-1, q_z.size(1)}), state, q_z, roles.numer, roles.denom);
}

Tensor weighted_grad(const Tensor& row_scale, const Tensor& weights, const Tensor& z, const Tensor& numer,
                     const Tensor& denom) {
  return grad_from_projection(project_weights(weights, denom, numer), row_scale.to(at::kDouble), z);
}

}  // namespace generic
}  // namespace kivi_fast
