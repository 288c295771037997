// Row kernels of the CPU path, each compiled for AVX-512, AVX2 and the baseline ISA, with the best
// one picked at load time from the CPU's features (GCC function multiversioning, on the definitions only, so that
// callers go through the resolver; the loops are plain C++ that the compiler vectorizes). Elsewhere
// they compile once, for the baseline.
#pragma once

#include <cstdint>

#if defined(__GNUC__) && defined(__x86_64__) && defined(__linux__) && !defined(KIVI_FAST_NO_MULTIVERSION)
#define KIVI_FAST_ISA_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define KIVI_FAST_ISA_CLONES
#endif

namespace kivi_fast {
namespace rows {

// dst[i] = src[i] as float64
void to_double(const float* src, double* dst, int64_t n);
void to_double(const double* src, double* dst, int64_t n);
// o[j] = (x[j] - xi)^2
void sq_diff(const double* x, double xi, double* o, int64_t n);
// o[j] += (x[j] - xi)^2
void add_sq_diff(const double* x, double xi, double* o, int64_t n);
// row[j] = max(0, ni + norms[j] - 2 row[j])
void gram_row_to_sqdist(double* row, const double* norms, double ni, int64_t n);
// row[j] *= s
void scale(double* row, double s, int64_t n);
// out[j] = s x[j]
void scale_copy(const double* x, double s, double* out, int64_t n);
// w[j] = c[j] k[j]; returns sum_j w[j]
double mul_sum(const double* c, const double* k, double* w, int64_t n);
// out[j] = s (g[j] - t z[j]), converted to the output type
void axpby_out(const double* g, const double* z, double s, double t, float* out, int64_t n);
void axpby_out(const double* g, const double* z, double s, double t, double* out, int64_t n);

// lo = min(lo, x[0, n)), hi = max(hi, x[0, n))
void min_max(const double* x, int64_t n, double& lo, double& hi);
// Bin of v among `bins` equal-width bins starting at lo: min(bins - 1, floor((v - lo) inv_width)),
// monotone in v. histogram() adds the counts of x[0, n) to hist; gather_bins() writes the values
// whose bin is in [first, last] to out and returns how many.
inline int64_t bin_of(double v, double lo, double inv_width, int64_t bins) {
  const auto b = static_cast<int64_t>((v - lo) * inv_width);
  return b < bins ? b : bins - 1;
}
void histogram(const double* x, int64_t n, double lo, double inv_width, int64_t bins, int64_t* hist);
int64_t gather_bins(const double* x, int64_t n, double lo, double inv_width, int64_t bins, int64_t first,
                    int64_t last, double* out);

}  // namespace rows
}  // namespace kivi_fast
