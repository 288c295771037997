// The fit's linear system (K_dd / n_den + lam I) alpha = -K_dn 1 / (lam n_den n_num), symmetric positive
// definite for lam > 0, solved by Cholesky from the kernel's upper triangle:
//  - up to 256 rows by our own (rows::cholesky_upper);
//  - above, by LAPACK's float32 Cholesky refined in float64 to float64's backward error (solve_refined),
//    or LAPACK's float64 Cholesky where float32 cannot factor the system or the refinement stalls;
//  - by ATen's Cholesky where torch exports no LAPACK (or the test switch turned it off, blas.h).
#pragma once

#include <cstdint>
#include <vector>

#include "cpu/buffers.h"
#include "cpu/simd_rows.h"

namespace kivi_fast {
namespace cpu {

// The upper triangle (row-major; LAPACK's column-major lower one) of A = K_dd / n_den + lam I into a
// (leading dimension ld), from the first n_den rows of the N x N kernel (row-major, stride n).
template <class T>
void fill_system_row(const double* kernel, int64_t n, int64_t n_den, double lam, T* a, int64_t ld, int64_t i) {
  const double inv_n = 1.0 / static_cast<double>(n_den);
  rows::scale_copy(kernel + i * n + i, inv_n, a + i * ld + i, n_den - i);
  a[i * ld + i] = static_cast<T>(kernel[i * n + i] * inv_n + lam);
}

// Whether systems of n_den rows are solved by solve_refined (the float32 factor).
bool uses_refined_solve(int64_t n_den);

// What the kernel's exponentials pass fills of the fit's system while each of the first n_den rows is
// in cache: the right-hand side's sums over the numer columns, and where solve_refined will run its
// float32 system (n_den x n_den, upper triangle). At (2000, 32) each would be another pass over 16-32 MB
// of rows.
struct SystemRows {
  int64_t n_den;
  double lam;
  double* numer_sums;  // [n_den]
  float* system32;     // or null
};
// The float32 system's buffer in scratch (solve_refined's).
float* system32_buffer(Scratch& scratch, int64_t n_den);

// (K_dd / n_den + lam I) alpha = -K_dn 1 / (lam n_den n_num) by Cholesky, from the kernel of the
// stacked points [denom; numer] (N x N, row-major, upper triangle of rows [0, n_den)) and what the
// exponentials' pass filled (SystemRows: alpha holds K_dn 1, and where refined, the float32 system
// for solve_refined). alpha gets n_den values.
void solve_alpha_one(const double* kernel, int64_t n, int64_t n_den, double lam, double* alpha, Work& work,
                     bool parallel, bool refined);

// Tests: how the float32-factor-and-refine solves (systems above 256 rows) ended since load: converged,
// float32 could not factor, stalled (the last two fall back to float64's factor); then the float32
// solves made.
std::vector<int64_t> refined_solve_counts();

}  // namespace cpu
}  // namespace kivi_fast
