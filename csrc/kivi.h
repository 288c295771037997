// The KIVI estimator's shared math contracts: what every backend computes, and the functions each
// backend provides (generic:: in generic.cpp, ATen calls only, for any device; cpu:: in cpu/, fused
// kernels for CPU tensors; cuda:: in cuda/, the kl op and its backward for CUDA tensors). ops.cpp checks
// the arguments and picks the backend.
//
// Conventions: every sample tensor here is batched, [B, n, d], float32 or float64 (the kl ops also take
// an unbatched pair, which csrc/ops.cpp gives a batch dimension of 1). The fit, the kernel
// values and the ratio are computed in float64 whatever the input dtype: evaluating the fitted
// ratio cancels terms of size ~1/lam (its two parts have opposite signs), so float32 arithmetic
// there loses up to ~1e-1 relative accuracy at lam = 1e-3. Only the results go back to the input dtype.
// (The CPU kernels factor systems above 256 rows in float32, but refine the solve in float64 to
// float64's backward error: cpu/solve.h.)
//
// A fit of numer/denom works on the stacked points [denom; numer] ([B, N, d], N = n_den + n_num), so
// one Gram matrix serves the median bandwidth, the linear system and the evaluation at the samples:
//   r(z)  = sum_c coef_c k(c, z),  coef = [alpha; beta 1],  beta = 1 / (lam n_num),
//   alpha = -1 / (lam n_den n_num) (K_dd / n_den + lam I)^{-1} K_dn 1.
#pragma once

// Tensor only: the .cu files include this, and ATen.h (every op) costs nvcc ~14 s a file.
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

namespace kivi_fast {

using at::Tensor;

// Error messages shared by both backends (and matched by the tests).
inline constexpr char kNotFiniteMessage[] =
    " contains NaN or Inf (or points so far apart that their squared distances overflow float64)";
inline constexpr char kZeroMedianMessage[] =
    "the median pairwise distance of the samples is 0 (at least half of the pairs coincide, or their "
    "squared distances underflow: rescale samples that small); pass an explicit bandwidth=...";
inline constexpr char kSmallMedianMessage[] =
    "the median pairwise distance of the samples is below 1e-150, too small a bandwidth (its square would "
    "underflow); rescale samples that small";
inline constexpr char kNotPositiveDefiniteMessage[] =
    "the kernel system K/n + lam I is not positive definite in float64 (lam is too small for these samples); "
    "increase lam";

// The smallest bandwidth the kernels take, given or the median's: its square is a normal float64 (from
// 1e-154 it underflows, and exp(-d^2 / (2 sigma^2)) turns to NaN at d = 0). kivi_fast/_validate.py's
// MIN_BANDWIDTH is the same; kSmallMedianMessage names it. (median_bandwidth, a statistic, refuses 0 only.)
inline constexpr double kMinBandwidth = 1e-150;

// The largest squared norm of a sample, centred (x - c: centre_coordinate), that the CPU kernels
// take: with |x|^2, |y|^2 <= max / 4 the Gram's |x|^2 + |y|^2 - 2 x.y and the differences'
// |x - y|^2 stay finite (one squared norm below max is not enough: two points whose squared norms
// are each 0.9 max can be 3.6 max apart). NaN fails the test too.
inline constexpr double kMaxSquaredNorm = std::numeric_limits<double>::max() / 4;
inline bool squarable(double squared_norm) { return squared_norm <= kMaxSquaredNorm; }

// The Gram paths (the CPU kernels', the generic path's) multiply the stacked points less a centre c:
// |x - c|^2 + |y - c|^2 - 2 (x - c).(y - c) keeps only the norms' difference, so far from c the
// distances cancel to the norms' rounding. Coordinate by coordinate, c is the middle of stacked points
// 0, N / 2 and N - 1 (centre_rows): one sample far from the others never becomes the centre (centred
// on point 0, kernel_kl's q_z[0] 1e5 standard deviations out cost 1e-3 of the gradient at (100, 64)),
// and the middle is one of the inputs' values (exact in their dtype). Non-finite coordinates are
// passed over (fmin and fmax skip NaN), so that a NaN or Inf makes only its own row's norm non-finite
// and the value checks name that row's argument; all three non-finite: NaN. Two of the three far out
// together, in the same coordinates and direction, still move the centre there. generic.cpp's
// centre_point is this formula on tensors, cpu/x86_avx2.h's centre_of_columns on registers.
inline double centre_coordinate(double a, double b, double c) {
  if (std::isfinite(a) && std::isfinite(b) && std::isfinite(c))  // (min and max inline; fmin and fmax are calls)
    return std::max(std::min(a, b), std::min(std::max(a, b), c));
  const auto skipped = [](double v) { return std::isfinite(v) ? v : std::numeric_limits<double>::quiet_NaN(); };
  a = skipped(a), b = skipped(b), c = skipped(c);
  return std::fmax(std::fmin(a, b), std::fmin(std::fmax(a, b), c));
}
inline std::array<int64_t, 3> centre_rows(int64_t n) { return {0, n / 2, n - 1}; }

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

// What the kl and ratio ops' forwards keep for their backward (the "grad state", float64 [B, m, width]
// for m evaluation points z_j). The gradient at z_j is sum_c W_jc (c - z_j), c over the N stacked
// points, with the weights W_jc = coef_c k(c, z_j) / sigma^2 (the ratio op: of r itself; the kl op: of
// log r, so also divided by r_j, and 0 where r_j is clipped). With few dimensions (d + 1 < N) the
// forward stores the projection [sum_c W_jc c, sum_c W_jc] (width d + 1) instead of W itself (width
// N): smaller, and the backward is then one elementwise pass. Without a gradient to
// come (grad_state = false: the Python wrappers' choice then) its width is 0. The fake kernels in
// kivi_fast/_ops.py follow the same rules.
inline bool grad_state_is_projection(int64_t n_total, int64_t d) { return d + 1 < n_total; }
// The backward's scale per batch element: KL = -+ (1/n_q) sum_j log r(z_j) (reverse: minus), so
// d(sum_b grad_kl[b] KL_b) / d log r(z_j) = +- grad_kl[b] / n_q = grad_kl[b] kl_row_factor.
inline double kl_row_factor(int64_t n_q, bool reverse) { return (reverse ? -1.0 : 1.0) / static_cast<double>(n_q); }
// The same as a float64 [B] tensor.
inline Tensor kl_row_scale(const Tensor& grad_kl, int64_t n_q, bool reverse) {
  return grad_kl.to(at::kDouble).reshape({-1}).mul(kl_row_factor(n_q, reverse));
}
inline int64_t grad_state_width(int64_t n_total, int64_t d) {
  return grad_state_is_projection(n_total, d) ? d + 1 : n_total;
}

// A fitted ratio.
struct Fit {
  Tensor coef;    // [B, N] float64: alpha for the denom points, then beta for the numer points
  Tensor sigma;   // [B] float64
};

// Each backend provides the same functions; generic:: uses ATen calls only (any device), cpu::
// fuses loops and parallelizes for CPU tensors.
namespace generic {
// [B, n, m] float64; a row that is not finite (or too far out to square) is named as x's or y's, by
// names.denom and names.numer
Tensor sqdist(const Tensor& x, const Tensor& y, Names names = {"y", "x"});
Tensor median_bandwidth(const Tensor& x);  // [B] float64
// The centre of the stacked points [a; b] ([B, 1, d] float64: centre_coordinate of stacked rows
// centre_rows(N), the CPU kernels' centre), or none where there are none. Elementwise ATen calls only
// (no read-back): the generic path's and cuda::gemm_pair_sqdist's Gram points less this.
Tensor centre_point(const Tensor& a, const Tensor& b);
// sq [B, n, m], squared distances |x|^2 + |y|^2 - 2 x.y from a Gram over d dimensions (xn [B, n], yn
// [B, m]: the squared norms), in place: those below the Gram's rounding bound, (d + 2) 2^-52 (|x|^2 +
// |y|^2), set to 0. Points the Gram cannot tell apart (coincident ones, whose G_ij need not be summed
// in G_ii's order) are then 0 apart, as by differences, and none is negative (the radix medians read
// the distances' bits); NaN stays. The median's pairs from a Gram (the generic path's, and
// cuda::gemm_pair_sqdist's).
Tensor& zero_below_gram_rounding(Tensor& sq, const Tensor& xn, const Tensor& yn, int64_t d);
// Columns [s, s + c) of the stacked points [denom; numer] in float64, in the first c columns of buf
// ([B, N, >= c]: the last chunk, narrower, reuses the buffer): the chunks of a Gram over many
// dimensions (the generic path's, cuda::gemm_pair_sqdist's).
Tensor stacked_chunk(const Tensor& denom, const Tensor& numer, int64_t s, int64_t c, const Tensor& buf);
Fit fit(const Tensor& numer, const Tensor& denom, double lam, const std::optional<Tensor>& sigma, Names names);
// The kl op's forward: (KL [B], grad state [B, n_q, *] (see grad_state_width; width 0 unless
// grad_state), sigma [B], clipped [B]), float64. clipped: the fraction of the n_q evaluation points
// whose fitted ratio is <= clip (those the clip applies to, with zero gradient).
std::tuple<Tensor, Tensor, Tensor, Tensor> kl(const Tensor& prior_z, const Tensor& q_z, double lam, double clip,
                                              const std::optional<Tensor>& sigma, bool reverse, bool grad_state);
// The kl op's backward from its grad state: d(sum_b grad_kl[b] KL_b) / d q_z.
Tensor kl_grad(const Tensor& grad_kl, const Tensor& state, const Tensor& q_z, const Tensor& prior_z, bool reverse);
// The ratio op's backward: grad_j = row_scale_j (sum_c W_jc c - (sum_c W_jc) z_j), c over the stacked
// [denom; numer], from its grad state (grad_state_width: W [B, m, N] or the projection [B, m, d + 1]).
Tensor weighted_grad(const Tensor& row_scale, const Tensor& state, const Tensor& z, const Tensor& numer,
                     const Tensor& denom);
}  // namespace generic

// The CPU kernels (cpu/), and what they do differently from the device-generic path:
//  - one batch element at a time, fused: distances, median, kernel, Cholesky solve and evaluation of
//    the ratio run on per-thread buffers (an N x N matrix of 320 KB at n_p = n_q = 100 stays in L2;
//    cpu/buffers.h), in parallel over the batch when it has at least as many elements as there are
//    threads, and inside each stage otherwise (one large element; cpu/loops.h);
//  - samples are read in column blocks converted to float64 in a per-thread buffer, so float32
//    inputs never pay for a full float64 copy (d = 314000 for an MNIST layer), and each block's
//    Gram runs while the block is in cache (register tiles on AVX2 CPUs, cpu/gram_tiles.h; GEMMs of
//    the split triangle elsewhere, cpu/blas.h); with few dimensions, distances come from differences
//    (cpu/distances.h);
//  - only the upper triangle of the distances is computed (the median reads nothing else), and the
//    fit reads only the kernel's upper triangle (the refinement's residuals too); the evaluation reads
//    whole kernel rows: where its projection takes gram_tiles' row tiles (d > 8, AVX2) above 256
//    points, they read the lower part down the upper part's columns; elsewhere the lower part is
//    mirrored (cpu/fit.cpp, cpu/kl.cpp);
//  - few points in many dimensions (N <= 32, an MNIST layer) skip the buffer and the GEMM: the Gram and
//    the backward's weighted sums read the input rows directly with float64 register tiles
//    (cpu/few_points.h);
//  - the median is an exact selection, not a sort (cpu/median.h);
//  - systems up to 256 x 256 are factored by our own Cholesky, larger ones by LAPACK's float32
//    Cholesky refined in float64 to float64's backward error (cpu/solve.h);
//  - with few dimensions (d + 1 < N) the forward leaves the backward the projection of its weights on
//    the points (grad_state_width), so the backward is one elementwise pass; otherwise the backward
//    reads the samples once more, block by block, and writes the gradient once (cpu/grad.cpp);
//  - the kernels that vectorize are compiled per instruction set, picked at run time (cpu/isa.h).
namespace cpu {
Tensor sqdist(const Tensor& x, const Tensor& y);
Tensor median_bandwidth(const Tensor& x);
Fit fit(const Tensor& numer, const Tensor& denom, double lam, const std::optional<Tensor>& sigma, Names names);
// The kl op's forward, fused per batch element: as generic::kl.
std::tuple<Tensor, Tensor, Tensor, Tensor> kl(const Tensor& prior_z, const Tensor& q_z, double lam, double clip,
                                              const std::optional<Tensor>& sigma, bool reverse, bool grad_state);
Tensor kl_grad(const Tensor& grad_kl, const Tensor& state, const Tensor& q_z, const Tensor& prior_z, bool reverse);
// The ratio op's backward (cpu/grad.cpp): as generic::weighted_grad, from either state.
Tensor weighted_grad(const Tensor& row_scale, const Tensor& state, const Tensor& z, const Tensor& numer,
                     const Tensor& denom);
// The projection state's: grad_j = scale_j (P_j - S_j z_j) from the state rows [P_j, S_j] [B, m, d + 1],
// with scale_j = row_scale[b * stride_b + j * stride_j] (the kl op: one scale an element, stride_j 0).
Tensor projection_grad(const double* row_scale, int64_t stride_b, int64_t stride_j, const Tensor& state,
                       const Tensor& z);
// The ratio op (cpu/ratio.cpp): r [B, m] in z's dtype and the grad state (grad_state_width; width 0
// unless grad_state) of a ratio with coefficients coef [B, N] (float64, over [denom; numer]) and
// bandwidth sigma [B] (float64) at z.
std::tuple<Tensor, Tensor> ratio(const Tensor& z, const Tensor& numer, const Tensor& denom, const Tensor& coef,
                                 const Tensor& sigma, bool grad_state);
}  // namespace cpu

// The CUDA kernels (cuda/kl.cu, built when torch is a CUDA build; KIVI_FAST_WITH_CUDA): the kl op and
// its backward, for the shapes handles_kl and handles_kl_grad accept (the forward: a whole fit in one
// thread block, N = n_p + n_q <= 512 points with N d <= 6144, or N <= 256 with d + 1 >= N, within the device's
// shared memory per block; the backward: the projection state, and weight states of up to 65,536
// weights per element, whichever backend ran the forward, since the grad state is the same); other
// shapes take generic::.
// Arguments as generic::kl and generic::kl_grad, except that kl's KL comes in the samples' dtype and
// kl_grad reads grad_kl as it is (each is then one launch at the VAE's shapes). No value is read back to
// the host, so bad values (NaN/Inf samples, a median or bandwidth below kMinBandwidth, a system that is
// not positive definite) give NaN for their batch element instead of an error.
namespace cuda {
bool handles_kl(int64_t n_total, int64_t d, int64_t batch, int device);  // device: its shared memory
bool handles_kl_grad(int64_t n_total, int64_t n_q, int64_t d, int64_t batch);
std::tuple<Tensor, Tensor, Tensor, Tensor> kl(const Tensor& prior_z, const Tensor& q_z, double lam, double clip,
                                              const std::optional<Tensor>& sigma, bool reverse, bool grad_state);
Tensor kl_grad(const Tensor& grad_kl, const Tensor& state, const Tensor& q_z, const Tensor& prior_z, bool reverse);
// The squared distances of the pairs i < j of the stacked points [denom; numer] ([B, n, d] and
// [B, m, d], float32 or float64, CUDA; m may be 0), packed row by row: [B, N (N - 1) / 2] float64, pair
// (i, j) at i (2N - i - 1) / 2 + j - i - 1. From differences, as kl's own distances. cuda/kl.cu; the
// generic path's pairs for the median on CUDA tensors.
Tensor pair_sqdist(const Tensor& denom, const Tensor& numer);
// The kernel values exp(D_ij / scale_b) / divisor (scale [B] float64 = -2 sigma^2), plus `diagonal`
// where i = j, of the stacked points [denom; numer] for rows [r0, r0 + rows) and columns [c0, c0 + cols):
// [B, rows, cols] float64, D from differences (exact zeros for a point against itself). cuda/kl.cu;
// the generic path's kernel values and system on CUDA tensors with few dimensions.
Tensor kernel_block(const Tensor& denom, const Tensor& numer, int64_t r0, int64_t rows, int64_t c0, int64_t cols,
                    const Tensor& scale, double divisor, double diagonal);
// The same values by a GEMM (set_gemm_kernel_values): a block of kernel values, as kernel_block
// defines it, from the stacked points [denom; numer] as float64, centred (centre_coordinate: far from
// the origin the norms would cancel to the distances' rounding), [B, N, d], and their squared norms
// [B, N], by cuBLAS's x_i . x_j and one pass (the generic path prepares the points once a fit).
// cuda/kl.cu.
Tensor gram_kernel_block(const Tensor& points, const Tensor& norms, int64_t r0, int64_t rows, int64_t c0, int64_t cols,
                         const Tensor& scale, double divisor, double diagonal);
// The generic fit's coefficients [B, N] = [-x, beta 1] from its solve's x [B, n_den, 1], NaN for alpha
// where info [B] (Cholesky's, int32) is not 0 or the bandwidth sigma [B] is NaN (the generic path
// makes it NaN for non-finite samples). cuda/kl.cu.
Tensor fit_coef(const Tensor& x, const Tensor& info, const Tensor& sigma, int64_t N, double beta);
// The end of the generic kl forward in one launch: from the ratios r_j, the last column of r_src
// ([B, n_q, w] float64, contiguous), (KL [B], clipped fraction [B]) as generic::kl defines them, and
// the rows of state ([B, n_q, *] float64, contiguous, optional; it may be r_src) scaled in place by
// 1 / (sigma_b^2 r_j), 0 where r_j <= clip. cuda/kl.cu.
std::tuple<Tensor, Tensor> kl_finish(const Tensor& r_src, const std::optional<Tensor>& state, const Tensor& sigma,
                                     double clip, bool reverse);
// The median of the distances from their squares ([B, P] float64, CUDA, P > 0: pair_sqdist's layout,
// though any order will do). As the generic median, NaN where that raises. cuda/median.cu; the generic
// path's median on CUDA tensors with many pairs.
Tensor median_of_pairs(const Tensor& pairs);
// Its blocks for each of nb elements of P pairs on a device of sms multiprocessors (tests: the 32-bit
// counts of a block's histogram).
int64_t median_blocks_per_element(int64_t P, int64_t nb, int64_t sms);
// The diagonal Gaussian contrast of samples x [B, n, d] (float32 or float64, CUDA), the forward and
// backward of kivi_fast/contrast.py's _DiagonalContrast (the torch ops standardize and
// standardize_grad, CUDA only: other devices take that composition). standardize: (z, s, t) float64, z
// = (x - m) / s [B, n, d] with s [B, 1, d] the maximum-likelihood standard deviations and m the means,
// t [B] = sum_d -log s_d, or (to_standard_normal) sum_d (s_d^2 + m_d^2) / 2 - log s_d - 1 / 2 + bias.
// standardize_grad: the gradient w.r.t. x, in x's dtype, of sum grad_z z + grad_t t (either absent).
// cuda/contrast.cu.
std::tuple<Tensor, Tensor, Tensor> standardize(const Tensor& x, bool to_standard_normal, double bias);
Tensor standardize_grad(const std::optional<Tensor>& grad_z, const std::optional<Tensor>& grad_t, const Tensor& z,
                        const Tensor& std, const Tensor& x, bool to_standard_normal);
// Benches (testing.cpp): the kl forwards that follow on the buffer's device write block 0's clock64()
// at each of its kForwardStages stage boundaries into the buffer (int64, CUDA, kept alive by the
// caller, also by one that captures a CUDA graph meanwhile: the graph keeps the pointer) until it is
// unset (nullopt).
constexpr int64_t kForwardStages = 6;
void set_stage_clocks(const std::optional<Tensor>& buffer);
// Benches and tests: whether batches of more than one wave of blocks take the forward kernel's
// two-blocks-per-SM variant (the default); returns the old value.
bool set_two_blocks_per_sm(bool flag);
// Benches and tests: whether the forward kernel's elimination takes two columns a step (the default)
// or one; returns the old value.
bool set_paired_elimination(bool flag);
// Benches and tests: whether the medians (the forward kernel's, and median_of_pairs) gather the last
// few keys of their radix selection and rank them (the default) or take a pass for every digit;
// returns the old value. use_gathered_selection reads it.
bool set_gathered_selection(bool flag);
bool use_gathered_selection();
// Benches and tests: whether the generic path's kernel values come from gram_kernel_block (a GEMM of the
// centred points and one pass over its output) or from kernel_block's differences in tiles (the
// default); returns the old value. use_gemm_kernel_values reads it (StackedDistances, once a fit).
bool set_gemm_kernel_values(bool flag);
bool use_gemm_kernel_values();
// Benches and tests: whether the generic path on CUDA tensors takes the kernels above (pair_sqdist,
// kernel_block, fit_coef, kl_finish; the default) or ATen's composition of the same steps (the median
// is cuda/median.cu's either way); returns the old value. use_generic_kernels reads it.
bool set_generic_kernels(bool flag);
bool use_generic_kernels();
// Benches and tests: whether the tiled distances (pair_sqdist's tiles, kernel_block) compute only the
// 16 x 16 sub-blocks that hold a needed pair (the default) or all 16 of a tile; returns the old value.
bool set_tile_subblocks(bool flag);
// Benches and tests: whether pair_tile_kernel, with few tile pairs, splits each pair's dimensions in
// ranges by the pair's cost (more ranges for fuller tile pairs; the default) or the same ranges for
// all; returns the old value.
bool set_balanced_tile_ranges(bool flag);
// Benches and tests: whether the tiled distances (pair_tile_kernel's, kernel_block's) come from the
// points' norms and products (the GEMM's form) or from their differences (the default); returns the
// old value.
bool set_product_tile_distances(bool flag);
// Benches and tests: whether kl's many-dimension path with d >= N (and B N^2 <= 2^21) takes its pair
// distances from cuBLAS's float64 GEMM of the centred points (gemm_pair_sqdist in cuda/kl.cu) or from
// the pair kernels' differences (the default); returns the old value.
bool set_gemm_pair_distances(bool flag);
// Benches and tests: whether the weight state's backward kernel takes two dimensions a thread (the
// default) or one; returns the old value.
bool set_paired_weight_dims(bool flag);
// Benches and tests: whether the weight state's backward takes grad_from_weights_kernel where it
// applies (the default) or the generic path's GEMM; returns the old value.
bool set_weight_kernel(bool flag);
}  // namespace cuda

// Tests (testing.cpp): whether the ops run the device-generic kernels on CPU tensors too (the path
// CUDA tensors take); returns the old value.
bool set_force_generic(bool flag);

// The stacked points [denom; numer] ([B, N, d]) of a fit: generic.cpp, also for the ratio op.
Tensor stack_points(const Tensor& denom, const Tensor& numer);

}  // namespace kivi_fast
