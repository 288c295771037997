#include "cpu/simd_rows.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>

#include "cpu/vec4.h"

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
  // the tail outside the loop over k: with a loop inside it, acc becomes a stack array zeroed by a rep
  // stos (8% of this function's time at 200 points)
  for (int k = 0; k < D; ++k) out[k] = (acc[k][0] + acc[k][1]) + (acc[k][2] + acc[k][3]);
  for (; j < n; ++j) {
    for (int k = 0; k < D; ++k) out[k] += w[j] * pt[k * n + j];
  }
}

// dots_with_columns_fixed for two rows w0 and w1 at once: each column's load serves both. Each sum
// runs as in dots_with_columns_fixed, to the last bit.
template <int D>
__attribute__((always_inline)) inline void dots_two_rows_fixed(const double* w0, const double* w1, const double* pt,
                                                               int64_t n, double* out0, double* out1) {
  Vec4 acc0[D] = {}, acc1[D] = {};
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    const Vec4 v0 = load4(w0 + j), v1 = load4(w1 + j);
    for (int k = 0; k < D; ++k) {
      const Vec4 c = load4(pt + k * n + j);
      acc0[k] += v0 * c;
      acc1[k] += v1 * c;
    }
  }
  for (int k = 0; k < D; ++k) {
    out0[k] = (acc0[k][0] + acc0[k][1]) + (acc0[k][2] + acc0[k][3]);
    out1[k] = (acc1[k][0] + acc1[k][1]) + (acc1[k][2] + acc1[k][3]);
  }
  for (; j < n; ++j) {
    for (int k = 0; k < D; ++k) {
      out0[k] += w0[j] * pt[k * n + j];
      out1[k] += w1[j] * pt[k * n + j];
    }
  }
}

}  // namespace

KIVI_FAST_ISA_CLONES void dots_with_columns_two_rows(const double* w0, const double* w1, const double* pt, int64_t n,
                                                    int64_t d, double* out0, double* out1) {
  constexpr int64_t kPerPass = 5;  // 10 sums in registers
  for (int64_t k0 = 0; k0 < d; k0 += kPerPass) {
    const double* p = pt + k0 * n;
    switch (std::min<int64_t>(kPerPass, d - k0)) {
      case 1: dots_two_rows_fixed<1>(w0, w1, p, n, out0 + k0, out1 + k0); break;
      case 2: dots_two_rows_fixed<2>(w0, w1, p, n, out0 + k0, out1 + k0); break;
      case 3: dots_two_rows_fixed<3>(w0, w1, p, n, out0 + k0, out1 + k0); break;
      case 4: dots_two_rows_fixed<4>(w0, w1, p, n, out0 + k0, out1 + k0); break;
      default: dots_two_rows_fixed<5>(w0, w1, p, n, out0 + k0, out1 + k0); break;
    }
  }
}

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
  for (int64_t k0 = 0; k0 < d; k0 += kDotsColumnsPerPass) {
    const double* p = pt + k0 * n;
    switch (std::min<int64_t>(kDotsColumnsPerPass, d - k0)) {
      case 1: dots_with_columns_fixed<1>(w, p, n, out + k0); break;
      case 2: dots_with_columns_fixed<2>(w, p, n, out + k0); break;
      case 3: dots_with_columns_fixed<3>(w, p, n, out + k0); break;
      case 4: dots_with_columns_fixed<4>(w, p, n, out + k0); break;
      case 5: dots_with_columns_fixed<5>(w, p, n, out + k0); break;
      case 6: dots_with_columns_fixed<6>(w, p, n, out + k0); break;
      case 7: dots_with_columns_fixed<7>(w, p, n, out + k0); break;
      case 8: dots_with_columns_fixed<8>(w, p, n, out + k0); break;
      default: dots_with_columns_fixed<9>(w, p, n, out + k0); break;
    }
  }
}

namespace {

// 2^(j / 64) for j < 64, each rounded once to double (computed in long double)
struct Exp2Table {
  double v[64];
  Exp2Table() {
    for (int j = 0; j < 64; ++j) v[j] = static_cast<double>(std::exp2(static_cast<long double>(j) / 64.0L));
  }
};
const Exp2Table kExp2Table;

}  // namespace

KIVI_FAST_ISA_CLONES void scaled_exp(double* x, double s, int64_t n) {
  // exp(y) = 2^(k / 64) e^r with k = round(64 y / ln 2) and |r| <= ln(2) / 128; 2^(k / 64) =
  // 2^floor(k / 64) 2^((k mod 64) / 64), the second factor from a table, and e^r by its Taylor series
  // to degree 5 (truncation < 4e-17 relative): half the multiply-adds of a degree-12 series over
  // |r| <= ln(2) / 2, which bound this loop's speed. k is rounded by adding 1.5 * 2^52, which leaves
  // it in the low bits of the sum; the power of two is added to the table value's exponent bits.
  constexpr double k64Log2e = 92.33248261689366;     // 64 / ln 2
  constexpr double kLn2Hi = 0.6931471803691238 / 64;  // ln 2 / 64 in 32 leading bits: k * kLn2Hi is exact
  constexpr double kLn2Lo = 1.9082149292705877e-10 / 64;
  constexpr double kShifter = 6755399441055744.0;  // 1.5 * 2^52
  constexpr double kMin = -708.0;                  // below: under DBL_MIN, returned as 0
  const int64_t shifter_bits = std::bit_cast<int64_t>(kShifter);
  const double* const table = kExp2Table.v;
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    const double y0 = s * x[j];
    const double y = y0 < kMin ? kMin : y0;
    const double shifted = y * k64Log2e + kShifter;
    const double k = shifted - kShifter;
    const double r = (y - k * kLn2Hi) - k * kLn2Lo;
    double p = 1.0 / 120.0;
    p = p * r + 1.0 / 24.0;
    p = p * r + 1.0 / 6.0;
    p = p * r + 0.5;
    p = p * r + 1.0;
    const int64_t ki = std::bit_cast<int64_t>(shifted) - shifter_bits;
    const int64_t scaled_bits = std::bit_cast<int64_t>(table[ki & 63]) + ((ki >> 6) << 52);
    const double t = std::bit_cast<double>(scaled_bits);
    const double e = t + t * (p * r);  // t e^r, the 1 of the series added last: one rounding fewer
    x[j] = y0 < kMin ? 0.0 : e;
  }
}

namespace {

// a[i + r][j + c] -= sum_t u[t][i + r] u[t][j + c] for r < 4, c < 8, t < p (u: the panel's rows, ld
// apart). The 4 x 8 block stays in eight vector registers over the p rank-1 steps; each step loads two
// vectors of a panel row and broadcasts four of its values: 6 loads for 8 multiply-adds, where the
// rank-4 row update it replaces made 6 loads and stores for 4.
__attribute__((always_inline)) inline void subtract_panel_product(double* a, const double* u, int64_t ld, int64_t p,
                                                                  int64_t i, int64_t j) {
  Vec4 c[4][2];
  for (int r = 0; r < 4; ++r) {
    c[r][0] = load4(a + (i + r) * ld + j);
    c[r][1] = load4(a + (i + r) * ld + j + 4);
  }
  for (int64_t t = 0; t < p; ++t) {
    const double* ut = u + t * ld;
    const Vec4 u0 = load4(ut + j), u1 = load4(ut + j + 4);
    for (int r = 0; r < 4; ++r) {
      const double b = ut[i + r];
      c[r][0] -= b * u0;
      c[r][1] -= b * u1;
    }
  }
  for (int r = 0; r < 4; ++r) {
    store4(a + (i + r) * ld + j, c[r][0]);
    store4(a + (i + r) * ld + j + 4, c[r][1]);
  }
}

}  // namespace

KIVI_FAST_ISA_CLONES bool cholesky_upper(double* a, int64_t n, int64_t ld) {
  // Right-looking by panels of kCholeskyPanel rows: factor the panel row by row (rank-1 updates inside
  // it), then subtract its product from the trailing matrix in 4 x 8 register blocks. The blocks start
  // on the diagonal and run past column n: they also write below the diagonal of their first 4
  // columns and into the padding, which no result reads (the padding holds only its own columns:
  // column j of the update reads column j of the panel).
  for (int64_t k0 = 0; k0 < n; k0 += kCholeskyPanel) {
    const int64_t k1 = std::min(n, k0 + kCholeskyPanel);
    for (int64_t k = k0; k < k1; ++k) {
      double* rk = a + k * ld;
      if (!(rk[k] > 0.0)) return false;  // also catches NaN
      const double ukk = std::sqrt(rk[k]), inv = 1.0 / ukk;
      rk[k] = ukk;
      for (int64_t j = k + 1; j < n; ++j) rk[j] *= inv;
      for (int64_t i = k + 1; i < k1; ++i) {
        double* ri = a + i * ld;
        const double c = rk[i];
        for (int64_t j = i; j < n; ++j) ri[j] -= c * rk[j];
      }
    }
    const double* u = a + k0 * ld;
    for (int64_t i = k1; i < n; i += 4)
      for (int64_t j = i; j < n; j += 8) subtract_panel_product(a, u, ld, k1 - k0, i, j);
  }
  return true;
}

KIVI_FAST_ISA_CLONES void cholesky_solve_upper(const double* u, int64_t n, int64_t ld, double* b) {
  // U^T y = b, forward, by rows of U; then U x = y, backward, by dot products with rows of U.
  for (int64_t k = 0; k < n; ++k) {
    const double* rk = u + k * ld;
    const double y = b[k] / rk[k];
    b[k] = y;
    for (int64_t j = k + 1; j < n; ++j) b[j] -= y * rk[j];
  }
  for (int64_t i = n - 1; i >= 0; --i) {
    const double* ri = u + i * ld;
    b[i] = (b[i] - dot(ri + i + 1, b + i + 1, n - i - 1)) / ri[i];
  }
}

KIVI_FAST_ISA_CLONES void scale(double* row, double s, int64_t n) {
  for (int64_t j = 0; j < n; ++j) row[j] *= s;
}

KIVI_FAST_ISA_CLONES void scale_copy(const double* x, double s, double* out, int64_t n) {
  for (int64_t j = 0; j < n; ++j) out[j] = s * x[j];
}

// Values below float32's smallest normal become 0, as the float64 kernel flushes its own (scaled_exp):
// subnormal operands would slow the float32 factorization down on CPUs that handle them in microcode.
KIVI_FAST_ISA_CLONES void scale_copy(const double* x, double s, float* out, int64_t n) {
  constexpr double kMinNormal = std::numeric_limits<float>::min();
  for (int64_t j = 0; j < n; ++j) {
    const double v = s * x[j];
    out[j] = std::fabs(v) < kMinNormal ? 0.0f : static_cast<float>(v);
  }
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

KIVI_FAST_ISA_CLONES void dots4_axpy(const double* k, int64_t ld, const double* x, const double* s, double* y,
                                     int64_t n, double* out) {
  const double *k0 = k, *k1 = k + ld, *k2 = k + 2 * ld, *k3 = k + 3 * ld;
  Vec4 a0 = {}, a1 = {}, a2 = {}, a3 = {};
  const Vec4 s0 = {s[0], s[0], s[0], s[0]}, s1 = {s[1], s[1], s[1], s[1]}, s2 = {s[2], s[2], s[2], s[2]},
             s3 = {s[3], s[3], s[3], s[3]};
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    const Vec4 xv = load4(x + j), v0 = load4(k0 + j), v1 = load4(k1 + j), v2 = load4(k2 + j), v3 = load4(k3 + j);
    a0 += v0 * xv;
    a1 += v1 * xv;
    a2 += v2 * xv;
    a3 += v3 * xv;
    store4(y + j, load4(y + j) + ((s0 * v0 + s1 * v1) + (s2 * v2 + s3 * v3)));
  }
  double o[4] = {(a0[0] + a0[1]) + (a0[2] + a0[3]), (a1[0] + a1[1]) + (a1[2] + a1[3]),
                 (a2[0] + a2[1]) + (a2[2] + a2[3]), (a3[0] + a3[1]) + (a3[2] + a3[3])};
  for (; j < n; ++j) {
    o[0] += k0[j] * x[j];
    o[1] += k1[j] * x[j];
    o[2] += k2[j] * x[j];
    o[3] += k3[j] * x[j];
    y[j] += (s[0] * k0[j] + s[1] * k1[j]) + (s[2] * k2[j] + s[3] * k3[j]);
  }
  for (int r = 0; r < 4; ++r) out[r] = o[r];
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

double max_abs(const double* x, int64_t n) {
  double m = 0.0;
  for (int64_t j = 0; j < n; ++j) {
    const double a = std::fabs(x[j]);
    if (std::isnan(a)) return a;
    m = std::max(m, a);
  }
  return m;
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

}  // namespace rows
}  // namespace kivi_fast
