// The KIVI estimator's building blocks, shared by the device-generic (ATen) and the CPU kernels.
//
// Conventions: every sample tensor here is batched, [B, n, d], float32 or float64 (the kl ops also take
// an unbatched pair, which csrc/ops.cpp gives a batch dimension of 1). The fit, the kernel
// values and the ratio are computed in float64 whatever the input dtype: evaluating the fitted
// ratio cancels terms of size ~1/lam (its two parts have opposite signs), so float32 arithmetic
// there loses up to ~1e-1 relative accuracy at lam = 1e-3. Only the results go back to the input dtype.
// (The CPU kernels factor systems above 256 rows in float32, but refine the solve in float64 to
// float64's backward error: csrc/cpu.cpp, solve_refined.)
//
// A fit of numer/denom works on the stacked points [denom; numer] ([B, N, d], N = n_den + n_num), so
// one Gram matrix serves the median bandwidth, the linear system and the evaluation at the samples:
//   r(z)  = sum_c coef_c k(c, z),  coef = [alpha; beta 1],  beta = 1 / (lam n_num),
//   alpha = -1 / (lam n_den n_num) (K_dd / n_den + lam I)^{-1} K_dn 1.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <vector>

namespace kivi_fast {

using at::Tensor;

// Error messages shared by both backends (and matched by the tests).
inline constexpr char kNotFiniteMessage[] = " contains NaN or Inf (or values too large to square)";
inline constexpr char kZeroMedianMessage[] =
    "the median pairwise distance of the samples is 0 (at least half of the pairs coincide); "
    "pass an explicit bandwidth=...";
inline constexpr char kNotPositiveDefiniteMessage[] =
    "the kernel system K/n + lam I is not positive definite in float64 (lam is too small for these samples); "
    "increase lam";

// Which argument names to use in error messages for the two sample sets of a fit.
struct Names {
  const char* numer;
  const char* denom;
};

// The kl op's roles of its two sample sets. reverse (the paper's reverse ratio trick): fit p/q, so
// q_z is the denominator and KL = -mean log r(q_z); otherwise fit q/p and KL = mean log r(q_z).
// Fits stack [denom; numer], so q_z's rows start at row0.
struct KlRoles {
  const Tensor& numer;
  const Tensor& denom;
  Names names;
  int64_t row0;
};
inline KlRoles kl_roles(const Tensor& prior_z, const Tensor& q_z, bool reverse) {
  if (reverse) return {prior_z, q_z, {"prior_z", "q_z"}, 0};
  return {q_z, prior_z, {"q_z", "prior_z"}, prior_z.size(1)};
}

// What the kl op's forward keeps for its backward (the "grad state", float64 [B, n_q, width]). The
// gradient of log r at q_z_j is sum_c W_jc (c - z_j), c over the N stacked points, with the weights
// W_jc = coef_c k(c, z_j) / (sigma^2 r_j) (0 where r_j is clipped). With few dimensions (d + 1 < N)
// the forward stores the projection [sum_c W_jc c, sum_c W_jc] (width d + 1) instead of W itself
// (width N): smaller, and the backward is then one elementwise pass. Without a gradient to come
// (grad_state = false: kivi_fast.kl's choice) the width is 0. The fake kernel in
// kivi_fast/_ops.py follows the same rules.
inline bool kl_state_is_projection(int64_t n_total, int64_t d) { return d + 1 < n_total; }
// The backward's scale per batch element: KL = -+ (1/n_q) sum_j log r(z_j) (reverse: minus), so
// d(sum_b grad_kl[b] KL_b) / d log r(z_j) = +- grad_kl[b] / n_q = grad_kl[b] kl_row_factor.
inline double kl_row_factor(int64_t n_q, bool reverse) { return (reverse ? -1.0 : 1.0) / static_cast<double>(n_q); }
// The same as a float64 [B] tensor.
inline Tensor kl_row_scale(const Tensor& grad_kl, int64_t n_q, bool reverse) {
  return grad_kl.to(at::kDouble).reshape({-1}) * kl_row_factor(n_q, reverse);
}
inline int64_t kl_state_width(int64_t n_total, int64_t d) {
  return kl_state_is_projection(n_total, d) ? d + 1 : n_total;
}

// A fitted ratio together with what the evaluation at the fitted samples reuses.
struct Fit {
  Tensor coef;    // [B, N] float64: alpha for the denom points, then beta for the numer points
  Tensor sigma;   // [B] float64
  Tensor kernel;  // [B, N, N] float64, k over the stacked points [denom; numer] (generic:: only)
};

// Each backend provides the same functions; generic:: uses ATen calls only (any device), cpu::
// fuses loops and parallelizes for CPU tensors.
namespace generic {
Tensor sqdist(const Tensor& x, const Tensor& y);  // [B, n, m] float64
Tensor median_bandwidth(const Tensor& x);         // [B] float64
Fit fit(const Tensor& numer, const Tensor& denom, double lam, const std::optional<Tensor>& sigma, Names names);
// The kl op's forward: (KL [B], grad state [B, n_q, *] (see kl_state_width; width 0 unless
// grad_state), sigma [B]), float64.
std::tuple<Tensor, Tensor, Tensor> kl(const Tensor& prior_z, const Tensor& q_z, double lam, double clip,
                                      const std::optional<Tensor>& sigma, bool reverse, bool grad_state);
// The kl op's backward from its grad state: d(sum_b grad_kl[b] KL_b) / d q_z.
Tensor kl_grad(const Tensor& grad_kl, const Tensor& state, const Tensor& q_z, const Tensor& prior_z, bool reverse);
// grad_j = row_scale_j (sum_c W_jc c - (sum_c W_jc) z_j), c over the stacked [denom; numer].
Tensor weighted_grad(const Tensor& row_scale, const Tensor& weights, const Tensor& z, const Tensor& numer,
                     const Tensor& denom);
}  // namespace generic

namespace cpu {
Tensor sqdist(const Tensor& x, const Tensor& y);
Tensor median_bandwidth(const Tensor& x);
Fit fit(const Tensor& numer, const Tensor& denom, double lam, const std::optional<Tensor>& sigma, Names names);
// The kl op's forward, fused per batch element: (KL [B], grad state [B, n_q, *], sigma [B]), float64.
std::tuple<Tensor, Tensor, Tensor> kl(const Tensor& prior_z, const Tensor& q_z, double lam, double clip,
                                      const std::optional<Tensor>& sigma, bool reverse, bool grad_state);
Tensor kl_grad(const Tensor& grad_kl, const Tensor& state, const Tensor& q_z, const Tensor& prior_z, bool reverse);
Tensor weighted_grad(const Tensor& row_scale, const Tensor& weights, const Tensor& z, const Tensor& numer,
                     const Tensor& denom);
// Whether the CPU kernels call torch's exported dgemm_/dpotrf_/spotrf_ (default) or the ATen equivalents
// that builds without those symbols get (float64 Cholesky only); returns the old value (a test switch).
bool set_external_blas(bool flag);
// How the float32-factor-and-refine solves (systems above 256 rows) ended: converged, float32 could not
// factor, stalled (the last two fall back to float64's factor); then the float32 solves made. For tests.
std::vector<int64_t> refined_solve_counts();
// How the selections of the median above 2^20 pairs ended: [the sample's bracket held, it missed (the
// bins took over)]; and the sample's size (0: the bins only) and the bracket's half-width in standard
// deviations, returning the old pair. For tests.
std::vector<int64_t> median_counts();
std::vector<double> set_median_bracket(int64_t sample_size, double sds);
}  // namespace cpu

// ATen-only helpers of the generic path (stack_points also serves the ratio op on every device).
Tensor median_from_sqdist(const Tensor& sq);  // [B, N, N] float64 -> [B] median distance, checked > 0
Tensor solve_alpha(const Tensor& kernel, int64_t n_den, double lam);  // [B, n_den] float64
Tensor stack_points(const Tensor& denom, const Tensor& numer);        // [B, N, d]
void check_finite_rows(const Tensor& sq_norms, int64_t n_den, Names names);  // norms [B, N] of [denom; numer]

}  // namespace kivi_fast
