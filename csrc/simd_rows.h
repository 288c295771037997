// Row kernels of the CPU path, each compiled for AVX-512, AVX2 with FMA (x86-64-v3) and the baseline
// ISA, with the best one picked at load time from the CPU's features (GCC function multiversioning, on
// the definitions only, so that callers go through the resolver; the loops are plain C++ that the
// compiler vectorizes, and helpers they call are always inlined, so that each clone gets its own
// copy). Elsewhere they compile once, for the baseline.
#pragma once

#include <cstdint>

#if defined(__GNUC__) && defined(__x86_64__) && defined(__linux__) && !defined(KIVI_FAST_NO_MULTIVERSION)
#if !defined(__clang__) && __GNUC__ >= 12
// x86-64-v3 = AVX2 + FMA (+ BMI), chosen by CPU features; older compilers get plain AVX2 (no FMA)
#define KIVI_FAST_ISA_CLONES __attribute__((target_clones("avx512f", "arch=x86-64-v3", "default")))
#else
#define KIVI_FAST_ISA_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#endif
#else
#define KIVI_FAST_ISA_CLONES
#endif

namespace kivi_fast {
namespace rows {

// dst[i] = src[i] as float64
void to_double(const float* src, double* dst, int64_t n);
void to_double(const double* src, double* dst, int64_t n);
// row[j] = max(0, ni + norms[j] - 2 row[j])
void gram_row_to_sqdist(double* row, const double* norms, double ni, int64_t n);
// o[j] = sum_k (pt[k n + j] - pt[k n + i])^2 for j0 <= j < n: squared distances from point i, with
// the points stored by coordinate (pt is [d, n]), 8 coordinates a pass. Exact up to the last rounding;
// cpu.cpp's use_direct_distances says up to how many dimensions it beats a Gram.
void sqdist_from_point(const double* pt, int64_t n, int64_t d, int64_t i, int64_t j0, double* o);
// out[k] = sum_j w[j] pt[k n + j] for k < d (pt is [d, n], as for sqdist_from_point), 9 a pass (8
// coordinates and one more column: kl's ratio beside its projection). Each out[k] is summed alike
// whatever d is, to the last bit.
inline constexpr int64_t kDotsColumnsPerPass = 9;
void dots_with_columns(const double* w, const double* pt, int64_t n, int64_t d, double* out);
// The same for two rows w0 and w1 (out0, out1), each sum to the last bit as dots_with_columns gives it.
void dots_with_columns_two_rows(const double* w0, const double* w1, const double* pt, int64_t n, int64_t d,
                                double* out0, double* out1);
// row[j] *= s
void scale(double* row, double s, int64_t n);
// In place, the upper Cholesky factor U (A = U^T U) of the symmetric positive definite n x n matrix
// in the upper triangle of a (row-major, rows ld apart). False if a pivot is not positive. For small
// systems (LAPACK's unblocked small-matrix path runs one matrix-vector product per column). The
// buffer must be padded: ld >= cholesky_ld(n) and cholesky_rows(n) rows, padding finite (zero it);
// the padding and the lower triangle are overwritten with values nothing should read.
inline constexpr int64_t kCholeskyPanel = 8;
inline constexpr int64_t cholesky_ld(int64_t n) { return (n + 7) / 8 * 8 + 8; }
inline constexpr int64_t cholesky_rows(int64_t n) { return n + 4; }
bool cholesky_upper(double* a, int64_t n, int64_t ld);
// b = A^{-1} b from the factor of cholesky_upper.
void cholesky_solve_upper(const double* u, int64_t n, int64_t ld, double* b);
// x[j] = exp(s x[j]) for s x[j] <= 0 (kernel values from squared distances): within 1.3 ulp of the
// exact value down to exp(-708) (measured on 4 million points against long double), 0 below (values
// under 1e-307 that no fit or ratio can tell from 0).
void scaled_exp(double* x, double s, int64_t n);
// out[j] = s x[j]
void scale_copy(const double* x, double s, double* out, int64_t n);
// out[j] = s x[j], rounded to float32 (0 below float32's smallest normal number)
void scale_copy(const double* x, double s, float* out, int64_t n);
// sum_j a[j] b[j], and sum_j x[j]
double dot(const double* a, const double* b, int64_t n);
double sum(const double* x, int64_t n);
// out[r] = sum_j k_r[j] x[j] for the four rows k_r = k + r ld, while y[j] += sum_r s[r] k_r[j]: both
// halves of a symmetric matrix's product with x in one pass over four rows of its upper triangle (from
// the column past their diagonal block, s = their x values). Four rows a pass: y is loaded and stored
// once for four multiply-adds of the matrix (one row a pass ran at half the bandwidth of a plain dot).
void dots4_axpy(const double* k, int64_t ld, const double* x, const double* s, double* y, int64_t n, double* out);
// max_j |x[j]| (NaN if any x[j] is NaN)
double max_abs(const double* x, int64_t n);
// w[j] = (c[j] k[j]) s
void mul_scale(const double* c, const double* k, double s, double* w, int64_t n);
// out[j] = s (g[j] - t z[j]), converted to the output type
void axpby_out(const double* g, const double* z, double s, double t, float* out, int64_t n);
void axpby_out(const double* g, const double* z, double s, double t, double* out, int64_t n);

// lo = min(lo, x[0, n)), hi = max(hi, x[0, n))
void min_max(const double* x, int64_t n, double& lo, double& hi);
// the same while copying x to out (one pass where a copy and a range would take two)
void copy_min_max(const double* x, double* out, int64_t n, double& lo, double& hi);
// Bin of v among `bins` equal-width bins starting at lo: min(bins - 1, floor((v - lo) inv_width)),
// monotone in v (v >= lo). histogram() adds the counts of x[0, n) to hist; gather_bins() writes the
// values whose bin is in [first, last] to out and returns how many. 32-bit counts: the histogram of
// a selection stays in L1, and no count can pass 2^31 (that takes N > 65536 points, a 34 GB matrix).
inline int32_t bin_of(double v, double lo, double inv_width, int32_t bins) {
  const auto b = static_cast<int32_t>((v - lo) * inv_width);
  return b < bins ? b : bins - 1;
}
void histogram(const double* x, int64_t n, double lo, double inv_width, int32_t bins, int32_t* hist);
int64_t gather_bins(const double* x, int64_t n, double lo, double inv_width, int32_t bins, int32_t first,
                    int32_t last, double* out);
// Adds to below how many of x[0, n) are < lo, writes those in [lo, hi] to out (room for n values) and
// returns how many it wrote: the one pass of a selection whose ranks a sample bracketed.
int64_t count_below_gather(const double* x, int64_t n, double lo, double hi, double* out, int64_t& below);
// Tests: count_below_gather's portable version even where the AVX2 one runs; returns the old setting.
bool set_portable_gather(bool flag);

}  // namespace rows
}  // namespace kivi_fast
