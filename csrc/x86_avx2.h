// What the hand-written x86 kernels (few_points.cpp, gram_tiles.cpp) share. Include only in x86-64
// GCC/Clang builds (their KIVI_FAST_*_SIMD branches).
#pragma once

#include <immintrin.h>

#include <cstdint>

#define KIVI_AVX2 __attribute__((target("avx2,fma")))

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

}  // namespace x86
}  // namespace kivi_fast
