// Row kernels of the CPU path: plain C++ loops that the compiler vectorizes, each compiled once per ISA
// level with the best one picked at load time (KIVI_FAST_ISA_CLONES, isa.h). The median's row kernels
// (range, histogram, bracket counts) are beside the selection, in median.h.
#pragma once

#include <cstdint>

#include "cpu/isa.h"

namespace kivi_fast {
namespace rows {

// dst[i] = src[i] as float64
void to_double(const float* src, double* dst, int64_t n);
void to_double(const double* src, double* dst, int64_t n);
// row[j] = max(0, ni + norms[j] - 2 row[j])
void gram_row_to_sqdist(double* row, const double* norms, double ni, int64_t n);
// o[j] = sum_k (pt[k n + j] - pt[k n + i])^2 for j0 <= j < n: squared distances from point i, with
// the points stored by coordinate (pt is [d, n]), 8 coordinates a pass. Exact up to the last rounding;
// distances.cpp's use_direct_distances says up to how many dimensions it beats a Gram.
void sqdist_from_point(const double* pt, int64_t n, int64_t d, int64_t i, int64_t j0, double* o);
// out[k] = sum_j w[j] pt[k n + j] for k < d (pt is [d, n], as for sqdist_from_point), 9 a pass (8
// coordinates and one more column: kl's ratio beside its projection). Each out[k] is summed alike
// whatever d is, to the last bit.
inline constexpr int64_t kDotsColumnsPerPass = 9;
// Up to this many dimensions the projection of a grad state (kivi.h) is summed row by row, all d sums
// in registers; above, a GEMM does it faster (the kl op at (1000, 32): 45 against 63 ms forward+backward).
inline constexpr int64_t kRowDotsMaxDim = 8;
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
// exact value down to exp(-708) (over 4 million points, against long double), 0 below (values
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

}  // namespace rows
}  // namespace kivi_fast
