// What the hand-written AVX2 kernels (few_points.cpp, gram_tiles.cpp) share. Include only where
// KIVI_FAST_X86_SIMD is defined (isa.h).
#pragma once

#include "cpu/isa.h"
#include "kivi.h"

#include <cstdint>

namespace kivi_fast {
namespace x86 {

// Zero rows that stand in for the rows past the last one, so that a tile of rows needs no row tail.
// Callers read at most kZeroRowLength columns of them.
inline constexpr int64_t kZeroRowLength = 2048;
alignas(64) inline const float kZeroFloats[kZeroRowLength] = {};
alignas(64) inline const double kZeroDoubles[kZeroRowLength] = {};
inline const float* zero_row(const float*) { return kZeroFloats; }
inline const double* zero_row(const double*) { return kZeroDoubles; }

// Four values as float64.
KIVI_AVX2 inline __m256d load4(const float* p) { return _mm256_cvtps_pd(_mm_loadu_ps(p)); }
KIVI_AVX2 inline __m256d load4(const double* p) { return _mm256_loadu_pd(p); }

// out[k - c0] = the centre of columns k in [c0, c0 + w) of the n rows (rows[i] = x_i): kivi.h's
// centre_coordinate of rows centre_rows(n). The Gram kernels take it a block of columns at a time,
// while the three rows' lines are in cache for the block's conversion (a separate pass over 314000
// columns made the few-points forward 1.5x slower). Four columns at a time by min and max up to w4 (a
// multiple of 4), a group with a non-finite value and the columns from w4 by the scalar.
template <class T>
KIVI_AVX2 inline void centre_of_columns(const T* const* rows, int64_t n, int64_t c0, int64_t w4, int64_t w,
                                        double* out) {
  const auto r = centre_rows(n);
  const T *a = rows[r[0]] + c0, *b = rows[r[1]] + c0, *c = rows[r[2]] + c0;
  auto scalar = [&](int64_t k) {
    out[k] = centre_coordinate(static_cast<double>(a[k]), static_cast<double>(b[k]), static_cast<double>(c[k]));
  };
  for (int64_t k = 0; k < w4; k += 4) {
    const __m256d x = load4(a + k), y = load4(b + k), z = load4(c + k);
    const __m256d zeros = _mm256_mul_pd(_mm256_add_pd(_mm256_add_pd(x, y), z), _mm256_setzero_pd());  // NaN: non-finite
    if (_mm256_movemask_pd(_mm256_cmp_pd(zeros, zeros, _CMP_UNORD_Q)) != 0) {
      for (int64_t j = k; j < k + 4; ++j) scalar(j);
      continue;
    }
    _mm256_storeu_pd(out + k, _mm256_max_pd(_mm256_min_pd(x, y), _mm256_min_pd(_mm256_max_pd(x, y), z)));
  }
  for (int64_t k = w4; k < w; ++k) scalar(k);
}

// The sum of a register's four values, (v0 + v2) + (v1 + v3).
KIVI_AVX2 inline double reduce_add(__m256d v) {
  const __m128d s = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
  return _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
}

}  // namespace x86
}  // namespace kivi_fast
