// Kernels for few points in many dimensions (an MNIST BNN layer: n_p = n_q = 10, d = 314000): the
// Gram matrix and the backward's weighted sums read the float32 (or float64) samples from the input
// rows once and accumulate in float64 registers (the Gram converts and centres the rows in blocks of
// columns that stay in L1). The GEMM path copies the samples into a float64 buffer first, and a GEMM with a 20 x 20
// output and a long inner dimension runs far below peak.
//
// Written for AVX-512 (4 x 4 register tiles of 8 doubles) and for AVX2 + FMA (the Gram's triangle
// in 4 x 4 triangles and 4 x 3 and 4 x 2 rectangles of 4 doubles, the weighted sums in 5 x 2 tiles,
// rows prefetched), chosen by isa::prefer_512_bit(); available() says whether this CPU has either, and
// callers keep the GEMM path otherwise.
#pragma once

#include <cstdint>

namespace kivi_fast {
namespace few_points {

// The largest number of stacked points (rows) add_gram_lower takes (weighted_rows takes any number).
inline constexpr int64_t kMaxRows = 32;
// The largest number of output rows of weighted_rows in one pass (one accumulator register each).
inline constexpr int64_t kMaxOutRows = 16;

bool available();
// Whether this CPU runs the AVX-512 kernels (else set_avx512(true) leaves the AVX2 ones).
bool avx512_available();
// Tests: the AVX-512 kernels (true; where the CPU has AVX-512) or the AVX2 ones (false), so that both
// run where AVX-512 exists; by default isa::prefer_512_bit(). Returns the old setting.
bool set_avx512(bool flag);

// acc[i * n + j] += sum_{c < w} (x_i[c] - k[c]) (x_j[c] - k[c]) for j <= i < n (lower triangle only),
// rows[i] = x_i, k the centre (kivi.h, centre_coordinate, of rows centre_rows(n)): the Gram of the
// centred points, whose norms stay near the distances (far from the origin, uncentred norms would
// cancel to the distances' rounding).
void add_gram_lower(const float* const* rows, int64_t n, int64_t w, double* acc);
void add_gram_lower(const double* const* rows, int64_t n, int64_t w, double* acc);

// out_j[c] = sum_i weights[j * n + i] x_i[c] - t[j] z_j[c] for j < m <= kMaxOutRows, c < w, rows[i] =
// x_i (i < n), z[j] = z_j, computed in float64 and rounded once to the output type. z may be null (no
// second term: callers whose z rows are among the x_i fold t into the weights).
void weighted_rows(const double* weights, int64_t m, int64_t n, const float* const* rows, const float* const* z,
                   const double* t, float* const* out, int64_t w);
void weighted_rows(const double* weights, int64_t m, int64_t n, const double* const* rows, const double* const* z,
                   const double* t, double* const* out, int64_t w);

}  // namespace few_points
}  // namespace kivi_fast
