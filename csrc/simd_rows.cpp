#include "simd_rows.h"

#include <algorithm>

namespace kivi_fast {
namespace rows {

KIVI_FAST_ISA_CLONES void to_double(const float* src, double* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<double>(src[i]);
}

KIVI_FAST_ISA_CLONES void to_double(const double* src, double* dst, int64_t n) { std::copy(src, src + n, dst); }

KIVI_FAST_ISA_CLONES void add_sq_diff(const double* x, double xi, double* o, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    const double t = x[j] - xi;
    o[j] += t * t;
  }
}

KIVI_FAST_ISA_CLONES void gram_row_to_sqdist(double* row, const double* norms, double ni, int64_t n) {
  for (int64_t j = 0; j < n; ++j) row[j] = std::max(0.0, ni + norms[j] - 2.0 * row[j]);
}

KIVI_FAST_ISA_CLONES void scale(double* row, double s, int64_t n) {
  for (int64_t j = 0; j < n; ++j) row[j] *= s;
}

KIVI_FAST_ISA_CLONES double mul_sum(const double* c, const double* k, double* w, int64_t n) {
  double sum = 0.0;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) {
    w[j] = c[j] * k[j];
    sum += w[j];
  }
  return sum;
}

KIVI_FAST_ISA_CLONES void axpby_out(const double* g, const double* z, double s, double t, float* out, int64_t n) {
  for (int64_t j = 0; j < n; ++j) out[j] = static_cast<float>(s * (g[j] - t * z[j]));
}

KIVI_FAST_ISA_CLONES void axpby_out(const double* g, const double* z, double s, double t, double* out, int64_t n) {
  for (int64_t j = 0; j < n; ++j) out[j] = s * (g[j] - t * z[j]);
}

}  // namespace rows
}  // namespace kivi_fast
