// What the hand-written AVX2 kernels (few_points.cpp, gram_tiles.cpp) share. Include only where
// KIVI_FAST_X86_SIMD is defined (isa.h).
#pragma once

#include "cpu/isa.h"

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

// The sum of a register's four values, (v0 + v2) + (v1 + v3).
KIVI_AVX2 inline double reduce_add(__m256d v) {
  const __m128d s = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
  return _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
}

}  // namespace x86
}  // namespace kivi_fast
