// Device-generic implementation: ATen calls only, so it runs wherever ATen does (CUDA tensors for the
// ops and shapes that csrc/cuda/ does not take). It is also the baseline the CPU kernels (csrc/cpu/)
// are tested against.
//
// Off the CPU nothing here reads a value back to the host (a read stalls the stream at every call and
// breaks CUDA-graph capture): where the CPU raises an error for a value (NaN/Inf samples, a zero
// median, a system that is not positive definite), other devices give NaN for that batch element.
//
// Memory (what a GPU holds for the shapes the CUDA kernels leave here: many points, or many points in
// many dimensions): a fit keeps the denominator's kernel rows against all N points and, only while the
// median or the evaluation needs it, the numerator's block, never the N x N matrix; the system is
// factored in place; samples with many dimensions are read in chunks of columns converted to float64
// (kChunkBytes), never as a float64 copy. python_tests/test_generic_path.py bounds the peaks;
// bench/generic_memory.py measures them against the pure sides.
#include "kivi.h"

#include <ATen/record_function.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>

namespace kivi_fast {

Tensor stack_points(const Tensor& denom, const Tensor& numer) { return at::cat({denom, numer}, 1); }

namespace {

// sq_norms: [B, N] of the stacked points [denom; numer]
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

// [B] median distance, checked > 0 on the CPU (NaN elsewhere)
Tensor median_of_pairs(const Tensor& top, const Tensor& tail) {
  // Median over the N (N - 1) / 2 distinct pairs i < j, numpy's convention for an even count (mean of
  // the two middle distances). top: rows 0..n_top-1 of the N x N squared distances [B, n_top, N];
  // tail: the block of the other rows and columns [B, N - n_top, N - n_top] (the fit's layout, which
  // never makes the whole matrix).
  // named for the profiler: bench/generic_memory.py sets the CPU's gathering of the pairs apart
  RECORD_FUNCTION("kivi_fast::median_of_pairs", c10::ArrayRef<const c10::IValue>{});
  const int64_t n = top.size(2), n_top = top.size(1), n_tail = n - n_top;
#ifdef KIVI_FAST_WITH_CUDA
  // Many pairs on a GPU: a radix selection over the blocks in place (no copy of the pairs, no sort).
  if (top.is_cuda() && n * (n - 1) / 2 >= (int64_t{1} << 16)) return cuda::median_of_pairs(top, tail);
#endif
  auto ix = top.options().dtype(at::kLong);
  auto it = at::triu_indices(n_top, n, 1, ix);
  auto flat = top.flatten(1).index_select(1, it[0] * n + it[1]);  // [B, P]
  if (n_tail > 1) {
    auto il = at::triu_indices(n_tail, n_tail, 1, ix);
    flat = at::cat({flat, tail.flatten(1).index_select(1, il[0] * n_tail + il[1])}, 1);
  }
  const int64_t p = flat.size(1), k = (p + 1) / 2;  // k: 1-based rank of the lower middle
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

// alpha [B, n_den] from the kernel rows of the denominator points [B, n_den, N]
Tensor solve_alpha(const Tensor& kernel_den, double lam) {
  const int64_t n_den = kernel_den.size(1), n_num = kernel_den.size(2) - n_den;
  auto k_dd = kernel_den.narrow(2, 0, n_den);
  auto k_dn = kernel_den.narrow(2, n_den, n_num);
  auto system = at::div(k_dd, static_cast<double>(n_den));
  system.diagonal(0, 1, 2).add_(lam);
  // Factored in place: the system is symmetric, so its transpose is the column-major layout LAPACK and
  // cuSOLVER factor, and at::linalg_cholesky_ex_out then neither copies it nor allocates the factor
  // (an n_den x n_den float64 matrix: 200 MB at n_den = 5,000).
  auto chol = system.mT();
  auto info = at::empty({system.size(0)}, system.options().dtype(at::kInt));
  at::linalg_cholesky_ex_out(chol, info, chol);
  if (chol.is_cpu()) {
    TORCH_CHECK_VALUE((info == 0).all().item<bool>(), kNotPositiveDefiniteMessage, " (lam = ", lam, ")");
  }
  auto rhs = k_dn.sum(-1, true) / (lam * static_cast<double>(n_den) * static_cast<double>(n_num));
  // two triangular solves rather than cholesky_solve, whose CUDA version may read its status back
  auto y = at::linalg_solve_triangular(chol, rhs, /*upper=*/false);
  auto alpha = -at::linalg_solve_triangular(chol.mH(), y, /*upper=*/true).squeeze(-1);
  return chol.is_cpu() ? alpha : at::where((info == 0).unsqueeze(-1), alpha, NAN);
}

}  // namespace

namespace generic {

namespace {

// Squared distances [B, n, m] in float64 of rows x to rows y from their float64 coordinates and squared
// norms: ||x||^2 + ||y||^2 - 2 x.y, the GEMM accumulated onto the norms in place (one [B, n, m]
// buffer, not two), clamped at 0.
Tensor sq_from_gram(const Tensor& x, const Tensor& xn, const Tensor& y, const Tensor& yn) {
  return (xn.unsqueeze(2) + yn.unsqueeze(1)).baddbmm_(x, y.transpose(1, 2), 1.0, -2.0).clamp_min_(0);
}

// Samples with many dimensions (an MNIST layer: (100, 50000)) are read in chunks of columns, each
// converted to float64 in a buffer of about this size, never as one float64 copy of the samples (80 MB
// at (100, 50000) float32, twice what the call needs otherwise). Large enough that the chunks' kernel
// launches stay few on a GPU (~20 chunks at (100, 50000)).
constexpr int64_t kChunkBytes = int64_t{4} << 20;
int64_t chunk_columns(int64_t rows) { return std::max<int64_t>(256, kChunkBytes / (8 * rows)); }

// Columns [s, s + c) of the stacked points [denom; numer] in float64, in the first c columns of buf
// ([B, N, >= c]: the last chunk, narrower, reuses the buffer).
Tensor stacked_chunk(const Tensor& denom, const Tensor& numer, int64_t s, int64_t c, const Tensor& buf) {
  auto x = buf.narrow(2, 0, c);
  x.narrow(1, 0, denom.size(1)).copy_(denom.narrow(2, s, c));
  x.narrow(1, denom.size(1), numer.size(1)).copy_(numer.narrow(2, s, c));
  return x;
}

// The fit's squared distances: the denominator's rows against all N stacked points ([B, n_den, N]),
// the numerator's block with itself where with_num ([B, n_num, n_num]), and the squared norms of the
// stacked points ([B, N]; NaN/Inf for a row with a NaN/Inf coordinate).
struct Distances {
  Tensor den, num, norms;
};

Distances distance_blocks(const Tensor& denom, const Tensor& numer, bool with_num) {
  const int64_t B = denom.size(0), n_den = denom.size(1), n_num = numer.size(1), N = n_den + n_num;
  const int64_t d = denom.size(2), width = chunk_columns(B * N);
  Distances out;
  if (d <= width) {  // one float64 copy of the points; the GEMM accumulates onto the norms
    auto pts = stack_points(denom, numer).to(at::kDouble);
    out.norms = pts.square().sum(-1);
    auto pd = pts.narrow(1, 0, n_den), pn = pts.narrow(1, n_den, n_num);
    auto nd = out.norms.narrow(1, 0, n_den), nn = out.norms.narrow(1, n_den, n_num);
    out.den = sq_from_gram(pd, nd, pts, out.norms);
    if (with_num) out.num = sq_from_gram(pn, nn, pn, nn);
  } else {  // the Grams over chunks of columns, then the norms from their diagonals
    auto buf = at::empty({B, N, width}, denom.options().dtype(at::kDouble));
    Tensor g_den, g_num;  // the numerator's Gram is small here (few points): always formed, for its norms
    for (int64_t s = 0; s < d; s += width) {
      auto x = stacked_chunk(denom, numer, s, std::min(width, d - s), buf);
      auto xd = x.narrow(1, 0, n_den), xn = x.narrow(1, n_den, n_num);
      if (s == 0) {
        g_den = at::bmm(xd, x.mT());
        g_num = at::bmm(xn, xn.mT());
      } else {
        g_den.baddbmm_(xd, x.mT());
        g_num.baddbmm_(xn, xn.mT());
      }
    }
    out.norms = at::cat({g_den.narrow(2, 0, n_den).diagonal(0, 1, 2), g_num.diagonal(0, 1, 2)}, 1);
    auto nd = out.norms.narrow(1, 0, n_den), nn = out.norms.narrow(1, n_den, n_num);
    out.den = g_den.mul_(-2.0).add_(nd.unsqueeze(2)).add_(out.norms.unsqueeze(1)).clamp_min_(0);
    if (with_num) out.num = g_num.mul_(-2.0).add_(nn.unsqueeze(2)).add_(nn.unsqueeze(1)).clamp_min_(0);
  }
  // exact zeros where the GEMM formula leaves rounding noise
  out.den.narrow(2, 0, n_den).diagonal(0, 1, 2).zero_();
  if (with_num) out.num.diagonal(0, 1, 2).zero_();
  return out;
}

// A fit's kernel values, which the kl op's evaluation reuses, in two blocks and never as one N x N
// matrix (at n_p = n_q the blocks are 3/4 of it, and the numerator's block is freed before the system
// is made where nothing reads it again): the denominator's rows against all N stacked points (the
// system, its right side, the evaluation at the denominator) and the numerator's block with itself
// (the median; the evaluation at the numerator).
struct Blocks {
  Fit fit;
  Tensor den;  // [B, n_den, N]
  Tensor num;  // [B, n_num, n_num]; undefined unless asked for (keep_num)
};

Blocks fit_blocks(const Tensor& numer, const Tensor& denom, double lam, const std::optional<Tensor>& sigma,
                  Names names, bool keep_num) {
  auto [den, num, norms] = distance_blocks(denom, numer, keep_num || !sigma.has_value());
  check_finite_rows(norms, denom.size(1), names);
  auto s = sigma.has_value() ? *sigma : median_of_pairs(den, num);
  if (sigma.has_value() && !s.is_cpu()) s = at::where(s.gt(0).logical_and(s.isfinite()), s, NAN);  // see above
  if (!keep_num) num = Tensor();  // before the system is made: the two are the largest buffers after den
  const auto scale = (s * s * -2.0).view({-1, 1, 1});
  den.div_(scale).exp_();  // in place, as num: the distances are not needed again
  if (keep_num) num.div_(scale).exp_();
  auto alpha = solve_alpha(den, lam);
  if (!alpha.is_cpu()) alpha = at::where(at::isfinite(norms).all(1, true), alpha, NAN);  // see check_finite_rows
  auto beta = at::full({alpha.size(0), numer.size(1)}, 1.0 / (lam * static_cast<double>(numer.size(1))),
                       alpha.options());
  return {{at::cat({alpha, beta}, 1), s}, den, num};
}

// grad_j = row_scale_j (sum_c W_jc c - (sum_c W_jc) z_j) from the projection (row_scale [B, m] or [B, 1])
Tensor grad_from_projection(const Tensor& projection, const Tensor& row_scale, const Tensor& z) {
  const int64_t d = z.size(2);
  auto grad = projection.narrow(2, 0, d) - projection.narrow(2, d, 1) * z.to(at::kDouble);
  return (grad * row_scale.unsqueeze(-1)).to(z.scalar_type());
}

// grad_j = sum_c W_jc c - zw_j z_j, c over the stacked points [denom; numer], with float64 products,
// returned in z's dtype: W [B, m, N] float64 with the row scales folded in; zw [B, m, 1], or undefined
// where z's term is folded into W too. Float32 samples are read in chunks of columns converted to
// float64 (chunk_columns), the buffers reused by every chunk: no float64 copy of the samples, and no
// temporary of the gradient's size.
Tensor weighted_points(const Tensor& w, const Tensor& zw, const Tensor& z, const Tensor& denom,
                       const Tensor& numer) {
  const int64_t B = z.size(0), m = z.size(1), d = z.size(2), n_den = denom.size(1), N = w.size(2);
  auto grad = at::empty(z.sizes(), z.options());
  if (z.scalar_type() == at::kDouble) {  // the samples as they are: straight into the gradient
    at::bmm_out(grad, w.narrow(2, 0, n_den), denom).baddbmm_(w.narrow(2, n_den, N - n_den), numer);
    if (zw.defined()) grad.addcmul_(zw, z, -1.0);
    return grad;
  }
  const int64_t width = std::min(d, chunk_columns(B * std::max(N, m)));
  auto buf = at::empty({B, N, width}, w.options());
  auto g = at::empty({B, m, width}, w.options());
  auto zbuf = zw.defined() ? at::empty({B, m, width}, w.options()) : Tensor();
  for (int64_t s = 0; s < d; s += width) {
    const int64_t c = std::min(width, d - s);
    auto gc = g.narrow(2, 0, c);
    at::bmm_out(gc, w, stacked_chunk(denom, numer, s, c, buf));
    if (zw.defined()) gc.addcmul_(zw, zbuf.narrow(2, 0, c).copy_(z.narrow(2, s, c)), -1.0);
    grad.narrow(2, s, c).copy_(gc);
  }
  return grad;
}

}  // namespace

Tensor sqdist(const Tensor& x, const Tensor& y) {
  auto x64 = x.to(at::kDouble);
  auto y64 = y.to(at::kDouble);
  auto xn = x64.pow(2).sum(-1);
  auto yn = y64.pow(2).sum(-1);
  check_finite_rows(at::cat({xn, yn}, 1), x.size(1), {"y", "x"});
  return sq_from_gram(x64, xn, y64, yn);
}

Tensor median_bandwidth(const Tensor& x) {
  return median_of_pairs(sqdist(x, x), at::empty({x.size(0), 0, 0}, x.options().dtype(at::kDouble)));
}

Fit fit(const Tensor& numer, const Tensor& denom, double lam, const std::optional<Tensor>& sigma, Names names) {
  return fit_blocks(numer, denom, lam, sigma, names, /*keep_num=*/false).fit;
}

std::tuple<Tensor, Tensor, Tensor, Tensor> kl(const Tensor& prior_z, const Tensor& q_z, double lam, double clip,
                                              const std::optional<Tensor>& sigma, bool reverse, bool grad_state) {
  const KlRoles roles = kl_roles(prior_z, q_z, reverse);
  const int64_t n_den = roles.denom.size(1), n_num = roles.numer.size(1), n_total = n_den + n_num;
  // q_z is the denominator (reverse) or the numerator: its kernel rows are den, or [den's numerator
  // columns transposed, num].
  auto blocks = fit_blocks(roles.numer, roles.denom, lam, sigma, roles.names, /*keep_num=*/!reverse);
  const Fit& f = blocks.fit;
  auto k_dn = blocks.den.narrow(2, n_den, n_num);
  // q_z's kernel rows times m [B, N, k] (rows over the stacked points): no [B, n_q, N] temporary.
  auto rows_times = [&](const Tensor& m) {
    if (reverse) return at::bmm(blocks.den, m);
    return at::baddbmm(at::bmm(blocks.num, m.narrow(1, n_den, n_num)), k_dn.mT(), m.narrow(1, 0, n_den));
  };
  // r_j = sum_c coef_c k(c, z_j)
  auto r = rows_times(f.coef.unsqueeze(-1)).squeeze(-1);
  // d log r / dz = (d r / dz) / r, and grad_z k(c, z) = k(c, z) (c - z) / sigma^2; clipped: none.
  auto scale = (r > clip).to(at::kDouble) / (r * (f.sigma * f.sigma).unsqueeze(1));
  auto kl = at::log(r.clamp_min(clip)).mean(-1);
  if (reverse) kl.neg_();
  auto clipped = (r <= clip).to(at::kDouble).mean(-1);
  if (!grad_state) return {kl, r.new_empty({r.size(0), r.size(1), 0}), f.sigma, clipped};
  if (!kl_state_is_projection(n_total, q_z.size(2))) {  // few points (N <= d + 1): the rows are small
    auto rows = reverse ? blocks.den : at::cat({k_dn.mT(), blocks.num}, 2);
    return {kl, rows * f.coef.unsqueeze(1) * scale.unsqueeze(-1), f.sigma, clipped};
  }
  // W_jc = coef_c k(c, z_j) scale_j: [sum_c W_jc c, sum_c W_jc] = scale_j [rows (coef c), r_j]
  auto pts = stack_points(roles.denom, roles.numer).to(at::kDouble);
  auto projection = at::cat({rows_times(pts * f.coef.unsqueeze(-1)), r.unsqueeze(-1)}, -1);
  return {kl, projection.mul_(scale.unsqueeze(-1)), f.sigma, clipped};
}

Tensor kl_grad(const Tensor& grad_kl, const Tensor& state, const Tensor& q_z, const Tensor& prior_z, bool reverse) {
  auto row_scale = kl_row_scale(grad_kl, q_z.size(1), reverse).view({-1, 1});
  if (kl_state_is_projection(prior_z.size(1) + q_z.size(1), q_z.size(2))) {
    return grad_from_projection(state, row_scale, q_z);
  }
  const KlRoles roles = kl_roles(prior_z, q_z, reverse);
  // q_z_j is stacked point row0 + j: its term -(sum_c W_jc) q_z_j folds into that weight.
  auto w = state * row_scale.unsqueeze(-1);
  w.narrow(2, roles.row0, q_z.size(1)).diagonal(0, 1, 2).sub_(w.sum(-1));
  return weighted_points(w, Tensor(), q_z, roles.denom, roles.numer);
}

Tensor weighted_grad(const Tensor& row_scale, const Tensor& weights, const Tensor& z, const Tensor& numer,
                     const Tensor& denom) {
  auto scale = row_scale.to(at::kDouble).unsqueeze(-1);  // [B, m, 1]
  return weighted_points(weights * scale, weights.sum(-1, true).mul_(scale), z, denom, numer);
}

}  // namespace generic
}  // namespace kivi_fast
