#include "simd_rows.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <vector>

namespace kivi_fast {
namespace rows {

KIVI_FAST_ISA_CLONES void to_double(const float* src, double* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<double>(src[i]);
}

KIVI_FAST_ISA_CLONES void to_double(const double* src, double* dst, int64_t n) { std::copy(src, src + n, dst); }

KIVI_FAST_ISA_CLONES void gram_row_to_sqdist(double* row, const double* norms, double ni, int64_t n) {
  for (int64_t j = 0; j < n; ++j) row[j] = std::max(0.0, ni + norms[j] - 2.0 * row[j]);
}

namespace {

// D <= 8 coordinates at a time: the point's coordinates stay in registers and each output is
// loaded and stored once per 8 coordinates (a loop over the coordinates outside would do it d times).
// always_inline: each ISA clone of the callers must get its own copy (an out-of-line instance is
// compiled for the baseline ISA only: 8x slower for the row dots).
template <int D, bool kAdd>
__attribute__((always_inline)) inline void sqdist_from_point_fixed(const double* pt, int64_t n, int64_t i, int64_t j0,
                                                                   double* o) {
  double xi[D];
  for (int k = 0; k < D; ++k) xi[k] = pt[k * n + i];
#pragma omp simd
  for (int64_t j = j0; j < n; ++j) {
    double acc = kAdd ? o[j] : 0.0;
    for (int k = 0; k < D; ++k) {
      const double t = pt[k * n + j] - xi[k];
      acc += t * t;
    }
    o[j] = acc;
  }
}

// Four doubles; GCC lowers it to one AVX register or two SSE2 ones, whichever the clone has.
typedef double Vec4 __attribute__((vector_size(32), aligned(8)));

inline Vec4 load4(const double* p) {
  Vec4 v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

template <int D>
__attribute__((always_inline)) inline void dots_with_columns_fixed(const double* w, const double* pt, int64_t n,
                                                                   double* out) {
  // D independent vector sums: enough of them in flight to keep the FMA units busy
  Vec4 acc[D] = {};
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    const Vec4 wv = load4(w + j);
    for (int k = 0; k < D; ++k) acc[k] += wv * load4(pt + k * n + j);
  }
  for (int k = 0; k < D; ++k) {
    double s = (acc[k][0] + acc[k][1]) + (acc[k][2] + acc[k][3]);
    for (int64_t t = j; t < n; ++t) s += w[t] * pt[k * n + t];
    out[k] = s;
  }
}

}  // namespace

template <bool kAdd>
__attribute__((always_inline)) inline void sqdist_from_point_chunk(const double* p, int64_t n, int64_t d, int64_t i,
                                                                   int64_t j0, double* o) {
  switch (d) {
    case 1: return sqdist_from_point_fixed<1, kAdd>(p, n, i, j0, o);
    case 2: return sqdist_from_point_fixed<2, kAdd>(p, n, i, j0, o);
    case 3: return sqdist_from_point_fixed<3, kAdd>(p, n, i, j0, o);
    case 4: return sqdist_from_point_fixed<4, kAdd>(p, n, i, j0, o);
    case 5: return sqdist_from_point_fixed<5, kAdd>(p, n, i, j0, o);
    case 6: return sqdist_from_point_fixed<6, kAdd>(p, n, i, j0, o);
    case 7: return sqdist_from_point_fixed<7, kAdd>(p, n, i, j0, o);
    default: return sqdist_from_point_fixed<8, kAdd>(p, n, i, j0, o);
  }
}

KIVI_FAST_ISA_CLONES void sqdist_from_point(const double* pt, int64_t n, int64_t d, int64_t i, int64_t j0, double* o) {
  sqdist_from_point_chunk<false>(pt, n, std::min<int64_t>(8, d), i, j0, o);
  for (int64_t k0 = 8; k0 < d; k0 += 8) {
    sqdist_from_point_chunk<true>(pt + k0 * n, n, std::min<int64_t>(8, d - k0), i, j0, o);
  }
}

KIVI_FAST_ISA_CLONES void dots_with_columns(const double* w, const double* pt, int64_t n, int64_t d, double* out) {
  for (int64_t k0 = 0; k0 < d; k0 += 8) {
    const double* p = pt + k0 * n;
    switch (std::min<int64_t>(8, d - k0)) {
      case 1: dots_with_columns_fixed<1>(w, p, n, out + k0); break;
      case 2: dots_with_columns_fixed<2>(w, p, n, out + k0); break;
      case 3: dots_with_columns_fixed<3>(w, p, n, out + k0); break;
      case 4: dots_with_columns_fixed<4>(w, p, n, out + k0); break;
      case 5: dots_with_columns_fixed<5>(w, p, n, out + k0); break;
      case 6: dots_with_columns_fixed<6>(w, p, n, out + k0); break;
      case 7: dots_with_columns_fixed<7>(w, p, n, out + k0); break;
      default: dots_with_columns_fixed<8>(w, p, n, out + k0); break;
    }
  }
}

KIVI_FAST_ISA_CLONES void scaled_exp(double* x, double s, int64_t n) {
  // exp(y) = 2^m e^r with m = round(y / ln 2) and |r| <= ln(2) / 2, e^r by its Taylor series to
  // degree 12 (truncation < 2e-16 relative). m is rounded by adding 1.5 * 2^52, which leaves it in the
  // low bits of the sum; 2^m is then built from its bits. Plain arithmetic, so that it vectorizes.
  constexpr double kLog2e = 1.4426950408889634;
  constexpr double kLn2Hi = 0.6931471803691238;  // ln 2 in 32 leading bits: m * kLn2Hi is exact
  constexpr double kLn2Lo = 1.9082149292705877e-10;
  constexpr double kShifter = 6755399441055744.0;  // 1.5 * 2^52
  constexpr double kMin = -708.0;                  // below: under DBL_MIN, returned as 0
  const int64_t shifter_bits = std::bit_cast<int64_t>(kShifter);
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    const double y0 = s * x[j];
    const double y = y0 < kMin ? kMin : y0;
    const double shifted = y * kLog2e + kShifter;
    const double m = shifted - kShifter;
    const double r = (y - m * kLn2Hi) - m * kLn2Lo;
    double p = 1.0 / 479001600.0;  // 1/12!
    p = p * r + 1.0 / 39916800.0;
    p = p * r + 1.0 / 3628800.0;
    p = p * r + 1.0 / 362880.0;
    p = p * r + 1.0 / 40320.0;
    p = p * r + 1.0 / 5040.0;
    p = p * r + 1.0 / 720.0;
    p = p * r + 1.0 / 120.0;
    p = p * r + 1.0 / 24.0;
    p = p * r + 1.0 / 6.0;
    p = p * r + 0.5;
    p = p * r + 1.0;
    p = p * r + 1.0;
    const int64_t mi = std::bit_cast<int64_t>(shifted) - shifter_bits;
    const double two_m = std::bit_cast<double>((mi + 1023) << 52);
    x[j] = y0 < kMin ? 0.0 : p * two_m;
  }
}

KIVI_FAST_ISA_CLONES bool cholesky_upper(double* a, int64_t n) {
  // Right-looking, four rows at a time: factor the panel of rows k0..k0+3, then subtract its rank-4
  // product from the trailing rows in one pass (four multiply-adds per element loaded and stored).
  constexpr int64_t kPanel = 4;
  for (int64_t k0 = 0; k0 < n; k0 += kPanel) {
    const int64_t k1 = std::min(n, k0 + kPanel);
    for (int64_t k = k0; k < k1; ++k) {
      double* rk = a + k * n;
      if (!(rk[k] > 0.0)) return false;  // also catches NaN
      const double ukk = std::sqrt(rk[k]), inv = 1.0 / ukk;
      rk[k] = ukk;
      for (int64_t j = k + 1; j < n; ++j) rk[j] *= inv;
      for (int64_t i = k + 1; i < k1; ++i) {
        double* ri = a + i * n;
        const double c = rk[i];
        for (int64_t j = i; j < n; ++j) ri[j] -= c * rk[j];
      }
    }
    const int64_t p = k1 - k0;
    const double* r0 = a + k0 * n;
    for (int64_t i = k1; i < n; ++i) {
      double* ri = a + i * n;
      if (p == kPanel) {
        const double* r1 = r0 + n;
        const double* r2 = r1 + n;
        const double* r3 = r2 + n;
        const double c0 = r0[i], c1 = r1[i], c2 = r2[i], c3 = r3[i];
        for (int64_t j = i; j < n; ++j) ri[j] -= (c0 * r0[j] + c1 * r1[j]) + (c2 * r2[j] + c3 * r3[j]);
      } else {
        for (int64_t t = 0; t < p; ++t) {
          const double* rt = r0 + t * n;
          const double c = rt[i];
          for (int64_t j = i; j < n; ++j) ri[j] -= c * rt[j];
        }
      }
    }
  }
  return true;
}

KIVI_FAST_ISA_CLONES void cholesky_solve_upper(const double* u, int64_t n, double* b) {
  // U^T y = b, forward, by rows of U; then U x = y, backward, by dot products with rows of U.
  for (int64_t k = 0; k < n; ++k) {
    const double* rk = u + k * n;
    const double y = b[k] / rk[k];
    b[k] = y;
    for (int64_t j = k + 1; j < n; ++j) b[j] -= y * rk[j];
  }
  for (int64_t i = n - 1; i >= 0; --i) {
    const double* ri = u + i * n;
    double s = 0.0;
#pragma omp simd reduction(+ : s)
    for (int64_t j = i + 1; j < n; ++j) s += ri[j] * b[j];
    b[i] = (b[i] - s) / ri[i];
  }
}

KIVI_FAST_ISA_CLONES void scale(double* row, double s, int64_t n) {
  for (int64_t j = 0; j < n; ++j) row[j] *= s;
}

KIVI_FAST_ISA_CLONES void scale_copy(const double* x, double s, double* out, int64_t n) {
  for (int64_t j = 0; j < n; ++j) out[j] = s * x[j];
}

// Sums with four vector partials (16 products in flight): one accumulator would make each vector
// add wait for the previous one.
KIVI_FAST_ISA_CLONES double dot(const double* a, const double* b, int64_t n) {
  Vec4 acc[4] = {};
  int64_t j = 0;
  for (; j + 16 <= n; j += 16)
    for (int t = 0; t < 4; ++t) acc[t] += load4(a + j + 4 * t) * load4(b + j + 4 * t);
  const Vec4 v = (acc[0] + acc[1]) + (acc[2] + acc[3]);
  double sum = (v[0] + v[1]) + (v[2] + v[3]);
  for (; j < n; ++j) sum += a[j] * b[j];
  return sum;
}

KIVI_FAST_ISA_CLONES double sum(const double* x, int64_t n) {
  Vec4 acc[4] = {};
  int64_t j = 0;
  for (; j + 16 <= n; j += 16)
    for (int t = 0; t < 4; ++t) acc[t] += load4(x + j + 4 * t);
  const Vec4 v = (acc[0] + acc[1]) + (acc[2] + acc[3]);
  double total = (v[0] + v[1]) + (v[2] + v[3]);
  for (; j < n; ++j) total += x[j];
  return total;
}

KIVI_FAST_ISA_CLONES void mul_scale(const double* c, const double* k, double s, double* w, int64_t n) {
  for (int64_t j = 0; j < n; ++j) w[j] = (c[j] * k[j]) * s;
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

KIVI_FAST_ISA_CLONES void histogram(const double* x, int64_t n, double lo, double inv_width, int32_t bins,
                                    int32_t* hist) {
  // The bin indices of a chunk first (vector arithmetic stored to an array, read back by plain loads
  // instead of lane extracts), then the increments. Over many values a bin, they alternate between
  // hist and a second table, so that fewer increments wait on an earlier one to the same count; the
  // tables are summed at the end (19900 values in 2487 bins: 1.2x faster than one table).
  constexpr int64_t kChunk = 256;
  thread_local std::vector<int32_t> second;
  const bool two = n >= 4 * static_cast<int64_t>(bins);
  if (two) second.assign(bins, 0);
  int32_t* const other = two ? second.data() : hist;
  int32_t idx[kChunk];
  for (int64_t j0 = 0; j0 < n; j0 += kChunk) {
    const int64_t len = std::min(kChunk, n - j0);
    const double* xs = x + j0;
#pragma omp simd
    for (int64_t t = 0; t < len; ++t) idx[t] = bin_of(xs[t], lo, inv_width, bins);
    int64_t t = 0;
    for (; t + 2 <= len; t += 2) {
      ++hist[idx[t]];
      ++other[idx[t + 1]];
    }
    if (t < len) ++hist[idx[t]];
  }
  if (two) {
#pragma omp simd
    for (int32_t b = 0; b < bins; ++b) hist[b] += other[b];
  }
}

KIVI_FAST_ISA_CLONES int64_t gather_bins(const double* x, int64_t n, double lo, double inv_width, int32_t bins,
                                         int32_t first, int32_t last, double* out) {
  // Few values fall in the bins sought: test 8 at a time against value bounds half a bin wider than
  // those bins (vector compares), and compute the exact bin only where one may hit.
  const double a = lo + (static_cast<double>(first) - 0.5) / inv_width;
  const double b = lo + (static_cast<double>(last) + 1.5) / inv_width;
  const Vec4 a4 = {a, a, a, a}, b4 = {b, b, b, b};
  int64_t count = 0, j = 0;
  for (; j + 8 <= n; j += 8) {
    const Vec4 v0 = load4(x + j), v1 = load4(x + j + 4);
    const auto hit = ((v0 >= a4) & (v0 <= b4)) | ((v1 >= a4) & (v1 <= b4));
    if ((hit[0] | hit[1] | hit[2] | hit[3]) == 0) continue;
    for (int t = 0; t < 8; ++t) {
      const int32_t bin = bin_of(x[j + t], lo, inv_width, bins);
      if (bin >= first && bin <= last) out[count++] = x[j + t];
    }
  }
  for (; j < n; ++j) {
    const int32_t bin = bin_of(x[j], lo, inv_width, bins);
    if (bin >= first && bin <= last) out[count++] = x[j];
  }
  return count;
}

}  // namespace rows
}  // namespace kivi_fast
