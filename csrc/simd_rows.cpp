#include "simd_rows.h"

#include <algorithm>
#include <limits>

namespace kivi_fast {
namespace rows {

KIVI_FAST_ISA_CLONES void to_double(const float* src, double* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<double>(src[i]);
}

KIVI_FAST_ISA_CLONES void to_double(const double* src, double* dst, int64_t n) { std::copy(src, src + n, dst); }

KIVI_FAST_ISA_CLONES void sq_diff(const double* x, double xi, double* o, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    const double t = x[j] - xi;
    o[j] = t * t;
  }
}

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

KIVI_FAST_ISA_CLONES void scale_copy(const double* x, double s, double* out, int64_t n) {
  for (int64_t j = 0; j < n; ++j) out[j] = s * x[j];
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

KIVI_FAST_ISA_CLONES void min_max(const double* x, int64_t n, double& lo, double& hi) {
  double a = lo, b = hi;
  // The ternary form (not std::min) is what compilers turn into vector min/max reductions.
#pragma omp simd reduction(min : a) reduction(max : b)
  for (int64_t j = 0; j < n; ++j) {
    a = x[j] < a ? x[j] : a;
    b = x[j] > b ? x[j] : b;
  }
  lo = a;
  hi = b;
}

void histogram(const double* x, int64_t n, double lo, double inv_width, int64_t bins, int64_t* hist) {
  for (int64_t j = 0; j < n; ++j) ++hist[bin_of(x[j], lo, inv_width, bins)];
}

KIVI_FAST_ISA_CLONES int64_t gather_bins(const double* x, int64_t n, double lo, double inv_width, int64_t bins,
                                         int64_t first, int64_t last, double* out) {
  // Few values fall in the bins sought: test 8 at a time against value bounds half a bin wider than
  // those bins (a vectorizable test), and compute the exact bin only where one may hit.
  const double a = lo + (static_cast<double>(first) - 0.5) / inv_width;
  const double b = lo + (static_cast<double>(last) + 1.5) / inv_width;
  int64_t count = 0, j = 0;
  for (; j + 8 <= n; j += 8) {
    int hit = 0;
    for (int t = 0; t < 8; ++t) hit |= (x[j + t] >= a) & (x[j + t] <= b);
    if (hit == 0) continue;
    for (int t = 0; t < 8; ++t) {
      const int64_t bin = bin_of(x[j + t], lo, inv_width, bins);
      if (bin >= first && bin <= last) out[count++] = x[j + t];
    }
  }
  for (; j < n; ++j) {
    const int64_t bin = bin_of(x[j], lo, inv_width, bins);
    if (bin >= first && bin <= last) out[count++] = x[j];
  }
  return count;
}

}  // namespace rows
}  // namespace kivi_fast
