#include "few_points.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <type_traits>

#if defined(__GNUC__) && defined(__x86_64__) && !defined(KIVI_FAST_NO_MULTIVERSION)
#define KIVI_FAST_FEW_POINTS_SIMD 1
#include "x86_avx2.h"
// GCC 12's _mm512_cvtps_pd starts from an "undefined" register, which -Wmaybe-uninitialized reports.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace kivi_fast {
namespace few_points {

#ifdef KIVI_FAST_FEW_POINTS_SIMD

#define KIVI_AVX512 __attribute__((target("avx512f")))

namespace {

// The columns past the last full register of weighted_rows, [c0, w), one at a time.
template <class T>
void weighted_rows_tail(const double* weights, int m, int64_t n, const T* const* rows, const T* const* z,
                        const double* s, const double* t, T* const* out, int64_t c0, int64_t w) {
  for (int j = 0; j < m; ++j)
    for (int64_t c = c0; c < w; ++c) {
      double g = 0;
      for (int64_t i = 0; i < n; ++i) g += weights[j * n + i] * static_cast<double>(rows[i][c]);
      out[j][c] = static_cast<T>(s[j] * (g - t[j] * static_cast<double>(z[j][c])));
    }
}

// fn(std::integral_constant<int, m>{}) for 1 <= m <= M: the weighted_rows kernels keep one
// accumulator register per output row, so the count must be a compile-time constant.
template <int M, class Fn>
void with_out_rows(int64_t m, Fn fn) {
  if constexpr (M == 0) {
    TORCH_CHECK(false, "few_points: 1 to ", kMaxOutRows, " output rows, got ", m);
  } else if (m == M) {
    fn(std::integral_constant<int, M>{});
  } else {
    with_out_rows<M - 1>(m, fn);
  }
}

// Columns per pass of the Gram kernel: 32 rows of 2048 columns (256 KB as float32) stay in L2 while
// every register tile of the lower triangle reads them.
constexpr int64_t kChunk = 2048;

static_assert(kChunk <= x86::kZeroRowLength, "padding rows read from x86::zero_row");

KIVI_AVX512 inline __m512d load8(const float* p) { return _mm512_cvtps_pd(_mm256_loadu_ps(p)); }
KIVI_AVX512 inline __m512d load8(const double* p) { return _mm512_loadu_pd(p); }
KIVI_AVX512 inline void store8(float* p, __m512d v) { _mm256_storeu_ps(p, _mm512_cvtpd_ps(v)); }
KIVI_AVX512 inline void store8(double* p, __m512d v) { _mm512_storeu_pd(p, v); }

// A 4 x 4 tile of inner products of rows a[0..3] and b[0..3] over columns [0, len8), len8 % 8 == 0,
// added to acc where (i, j) is in the lower triangle of an n x n matrix.
template <class T>
KIVI_AVX512 void gram_tile(const T* const* a, const T* const* b, int64_t len8, int64_t i0, int64_t j0, int64_t n,
                           double* acc) {
  __m512d s[4][4];
  for (auto& row : s)
    for (auto& v : row) v = _mm512_setzero_pd();
  for (int64_t c = 0; c < len8; c += 8) {
    const __m512d a0 = load8(a[0] + c), a1 = load8(a[1] + c), a2 = load8(a[2] + c), a3 = load8(a[3] + c);
    const __m512d bs[4] = {load8(b[0] + c), load8(b[1] + c), load8(b[2] + c), load8(b[3] + c)};
    for (int l = 0; l < 4; ++l) {
      s[0][l] = _mm512_fmadd_pd(a0, bs[l], s[0][l]);
      s[1][l] = _mm512_fmadd_pd(a1, bs[l], s[1][l]);
      s[2][l] = _mm512_fmadd_pd(a2, bs[l], s[2][l]);
      s[3][l] = _mm512_fmadd_pd(a3, bs[l], s[3][l]);
    }
  }
  for (int k = 0; k < 4; ++k)
    for (int l = 0; l < 4; ++l) {
      const int64_t i = i0 + k, j = j0 + l;
      if (i < n && j <= i) acc[i * n + j] += _mm512_reduce_add_pd(s[k][l]);
    }
}

template <class T>
KIVI_AVX512 void add_gram_lower_impl(const T* const* rows, int64_t n, int64_t w, double* acc) {
  TORCH_CHECK(n <= kMaxRows, "few_points: at most ", kMaxRows, " rows, got ", n);
  const int64_t tiles = (n + 3) / 4;
  const T* p[kMaxRows];
  for (int64_t c0 = 0; c0 < w; c0 += kChunk) {
    const int64_t len = std::min(kChunk, w - c0), len8 = len & ~int64_t{7};
    // rows past n read zeros, so that every tile is a full 4 x 4 (their products are not stored)
    for (int64_t i = 0; i < tiles * 4; ++i) p[i] = i < n ? rows[i] + c0 : x86::zero_row(rows[0]);
    for (int64_t ib = 0; ib < tiles; ++ib)
      for (int64_t jb = 0; jb <= ib; ++jb) gram_tile(p + 4 * ib, p + 4 * jb, len8, 4 * ib, 4 * jb, n, acc);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j <= i; ++j) {
        double t = 0;
        for (int64_t c = len8; c < len; ++c) t += static_cast<double>(p[i][c]) * static_cast<double>(p[j][c]);
        acc[i * n + j] += t;
      }
  }
}

// float32 rows: converting every load inside gram_tile costs a conversion per 2 FMAs, and both compete
// for the same execution port. Instead each block of kBlock columns is converted to float64 once, into
// a buffer that stays in L1, and every tile of the lower triangle accumulates from it; the tiles'
// accumulators live in memory between blocks and are reduced once at the end.
constexpr int64_t kBlock = 128;

KIVI_AVX512 void tile_block(const double* a, const double* b, __m512d* sums) {
  __m512d s[16];
  for (int t = 0; t < 16; ++t) s[t] = sums[t];
  for (int64_t c = 0; c < kBlock; c += 8) {
    const __m512d a0 = _mm512_loadu_pd(a + c), a1 = _mm512_loadu_pd(a + kBlock + c),
                  a2 = _mm512_loadu_pd(a + 2 * kBlock + c), a3 = _mm512_loadu_pd(a + 3 * kBlock + c);
    for (int l = 0; l < 4; ++l) {
      const __m512d bl = _mm512_loadu_pd(b + l * kBlock + c);
      s[l] = _mm512_fmadd_pd(a0, bl, s[l]);
      s[4 + l] = _mm512_fmadd_pd(a1, bl, s[4 + l]);
      s[8 + l] = _mm512_fmadd_pd(a2, bl, s[8 + l]);
      s[12 + l] = _mm512_fmadd_pd(a3, bl, s[12 + l]);
    }
  }
  for (int t = 0; t < 16; ++t) sums[t] = s[t];
}

KIVI_AVX512 void add_gram_lower_blocked(const float* const* rows, int64_t n, int64_t w, double* acc) {
  TORCH_CHECK(n <= kMaxRows, "few_points: at most ", kMaxRows, " rows, got ", n);
  const int64_t tiles = (n + 3) / 4, w_main = w / kBlock * kBlock;
  alignas(64) double buf[kMaxRows * kBlock];
  std::fill(buf + n * kBlock, buf + tiles * 4 * kBlock, 0.0);  // padding rows: zeros, never stored
  constexpr int64_t kMaxTiles = (kMaxRows / 4) * (kMaxRows / 4 + 1) / 2;
  alignas(64) __m512d sums[kMaxTiles * 16];
  for (int64_t t = 0; t < tiles * (tiles + 1) / 2 * 16; ++t) sums[t] = _mm512_setzero_pd();
  for (int64_t c0 = 0; c0 < w_main; c0 += kBlock) {
    for (int64_t i = 0; i < n; ++i)
      for (int64_t c = 0; c < kBlock; c += 8) _mm512_store_pd(buf + i * kBlock + c, load8(rows[i] + c0 + c));
    __m512d* tile_sums = sums;
    for (int64_t ib = 0; ib < tiles; ++ib)
      for (int64_t jb = 0; jb <= ib; ++jb, tile_sums += 16)
        tile_block(buf + 4 * ib * kBlock, buf + 4 * jb * kBlock, tile_sums);
  }
  const __m512d* tile_sums = sums;
  for (int64_t ib = 0; ib < tiles; ++ib)
    for (int64_t jb = 0; jb <= ib; ++jb, tile_sums += 16)
      for (int k = 0; k < 4; ++k)
        for (int l = 0; l < 4; ++l) {
          const int64_t i = 4 * ib + k, j = 4 * jb + l;
          if (i < n && j <= i) acc[i * n + j] += _mm512_reduce_add_pd(tile_sums[4 * k + l]);
        }
  if (w_main < w) {
    const float* tail[kMaxRows];
    for (int64_t i = 0; i < n; ++i) tail[i] = rows[i] + w_main;
    add_gram_lower_impl(tail, n, w - w_main, acc);
  }
}

// One accumulator register per output row: M is a template argument so that they stay in registers.
template <int M, class T>
KIVI_AVX512 void weighted_rows_impl(const double* weights, int64_t n, const T* const* rows, const T* const* z,
                                    const double* s, const double* t, T* const* out, int64_t w) {
  const int64_t w8 = w & ~int64_t{7};
  for (int64_t c = 0; c < w8; c += 8) {
    __m512d acc[M];
    for (int j = 0; j < M; ++j) acc[j] = _mm512_setzero_pd();
    for (int64_t i = 0; i < n; ++i) {
      const __m512d x = load8(rows[i] + c);
      for (int j = 0; j < M; ++j) acc[j] = _mm512_fmadd_pd(_mm512_set1_pd(weights[j * n + i]), x, acc[j]);
    }
    for (int j = 0; j < M; ++j) {
      const __m512d g = _mm512_fnmadd_pd(_mm512_set1_pd(t[j]), load8(z[j] + c), acc[j]);
      store8(out[j] + c, _mm512_mul_pd(_mm512_set1_pd(s[j]), g));
    }
  }
  weighted_rows_tail(weights, M, n, rows, z, s, t, out, w8, w);
}

// The same kernels for AVX2 + FMA (4 doubles a register, 16 registers): 3 x 3 tiles, whose nine
// accumulators, six row loads and one broadcast fit in the register file without spilling.

namespace avx2 {

constexpr int64_t kTile = 3;

using x86::load4;
KIVI_AVX2 inline void store4(float* p, __m256d v) { _mm_storeu_ps(p, _mm256_cvtpd_ps(v)); }
KIVI_AVX2 inline void store4(double* p, __m256d v) { _mm256_storeu_pd(p, v); }
KIVI_AVX2 inline double reduce_add(__m256d v) {
  const __m128d s = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
  return _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
}

// sums[3 k + l] += a_k * b_l over a block of kBlock columns (a, b: kTile rows of the float64 buffer).
// Named accumulators: with an array of them, GCC copied all nine in and out with rep movsq, which
// cost as much as the block's FMAs.
KIVI_AVX2 void tile_block(const double* a, const double* b, __m256d* sums) {
  __m256d s0 = sums[0], s1 = sums[1], s2 = sums[2], s3 = sums[3], s4 = sums[4], s5 = sums[5], s6 = sums[6],
          s7 = sums[7], s8 = sums[8];
  for (int64_t c = 0; c < kBlock; c += 4) {
    const __m256d a0 = _mm256_loadu_pd(a + c), a1 = _mm256_loadu_pd(a + kBlock + c),
                  a2 = _mm256_loadu_pd(a + 2 * kBlock + c);
    __m256d bl = _mm256_loadu_pd(b + c);
    s0 = _mm256_fmadd_pd(a0, bl, s0);
    s3 = _mm256_fmadd_pd(a1, bl, s3);
    s6 = _mm256_fmadd_pd(a2, bl, s6);
    bl = _mm256_loadu_pd(b + kBlock + c);
    s1 = _mm256_fmadd_pd(a0, bl, s1);
    s4 = _mm256_fmadd_pd(a1, bl, s4);
    s7 = _mm256_fmadd_pd(a2, bl, s7);
    bl = _mm256_loadu_pd(b + 2 * kBlock + c);
    s2 = _mm256_fmadd_pd(a0, bl, s2);
    s5 = _mm256_fmadd_pd(a1, bl, s5);
    s8 = _mm256_fmadd_pd(a2, bl, s8);
  }
  sums[0] = s0, sums[1] = s1, sums[2] = s2, sums[3] = s3, sums[4] = s4, sums[5] = s5, sums[6] = s6, sums[7] = s7;
  sums[8] = s8;
}

// Blocks of kBlock columns converted to float64 in an L1 buffer (float32 or float64 rows alike),
// every 3 x 3 tile of the lower triangle accumulated from it; the tail columns one by one.
template <class T>
KIVI_AVX2 void add_gram_lower(const T* const* rows, int64_t n, int64_t w, double* acc) {
  TORCH_CHECK(n <= kMaxRows, "few_points: at most ", kMaxRows, " rows, got ", n);
  constexpr int64_t kLineElements = 64 / static_cast<int64_t>(sizeof(T));
  constexpr int64_t kLinesPerBlock = kBlock / kLineElements;
  const int64_t tiles = (n + kTile - 1) / kTile, tile_count = tiles * (tiles + 1) / 2, w_main = w / kBlock * kBlock;
  alignas(32) double buf[(kMaxRows + kTile) * kBlock];
  std::fill(buf + n * kBlock, buf + tiles * kTile * kBlock, 0.0);  // padding rows: zeros, never stored
  constexpr int64_t kMaxTiles = (kMaxRows / kTile + 1) * (kMaxRows / kTile + 2) / 2;
  alignas(32) __m256d sums[kMaxTiles * 9];
  for (int64_t t = 0; t < tile_count * 9; ++t) sums[t] = _mm256_setzero_pd();
  for (int64_t c0 = 0; c0 < w_main; c0 += kBlock) {
    for (int64_t i = 0; i < n; ++i)
      for (int64_t c = 0; c < kBlock; c += 4) _mm256_store_pd(buf + i * kBlock + c, load4(rows[i] + c0 + c));
    // The next block's rows start coming from memory while this block's tiles are multiplied, their
    // cache lines requested a few before each tile: all at once (20 rows x 8 lines) left the loads
    // above waiting on memory (spread, the forward at (10, 314000) is 1.10x faster: bench/ab.py).
    const int64_t next = c0 + kBlock;
    const int64_t lines = next + kBlock <= w_main ? n * kLinesPerBlock : 0;
    const int64_t per_tile = (lines + tile_count - 1) / tile_count;
    int64_t line = 0;
    __m256d* tile_sums = sums;
    for (int64_t ib = 0; ib < tiles; ++ib)
      for (int64_t jb = 0; jb <= ib; ++jb, tile_sums += 9) {
        for (const int64_t end = std::min(lines, line + per_tile); line < end; ++line)
          _mm_prefetch(reinterpret_cast<const char*>(rows[line / kLinesPerBlock] + next +
                                                     (line % kLinesPerBlock) * kLineElements),
                       _MM_HINT_T0);
        tile_block(buf + kTile * ib * kBlock, buf + kTile * jb * kBlock, tile_sums);
      }
  }
  const __m256d* tile_sums = sums;
  for (int64_t ib = 0; ib < tiles; ++ib)
    for (int64_t jb = 0; jb <= ib; ++jb, tile_sums += 9)
      for (int k = 0; k < kTile; ++k)
        for (int l = 0; l < kTile; ++l) {
          const int64_t i = kTile * ib + k, j = kTile * jb + l;
          if (i < n && j <= i) acc[i * n + j] += reduce_add(tile_sums[kTile * k + l]);
        }
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j <= i; ++j) {
      double t = 0;
      for (int64_t c = w_main; c < w; ++c) t += static_cast<double>(rows[i][c]) * static_cast<double>(rows[j][c]);
      acc[i * n + j] += t;
    }
}

template <int M, class T>
KIVI_AVX2 void weighted_rows_impl(const double* weights, int64_t n, const T* const* rows, const T* const* z,
                                  const double* s, const double* t, T* const* out, int64_t w) {
  const int64_t w4 = w & ~int64_t{3};
  constexpr int64_t kLine = 64 / static_cast<int64_t>(sizeof(T));  // elements per cache line
  for (int64_t c = 0; c < w4; c += 4) {
    // each row a few cache lines ahead: n input and M output streams are more than the hardware
    // prefetchers follow
    if (c % kLine == 0 && c + 8 * kLine < w4) {
      for (int64_t i = 0; i < n; ++i) _mm_prefetch(reinterpret_cast<const char*>(rows[i] + c + 8 * kLine), _MM_HINT_T0);
    }
    __m256d acc[M];
    for (int j = 0; j < M; ++j) acc[j] = _mm256_setzero_pd();
    for (int64_t i = 0; i < n; ++i) {
      const __m256d x = load4(rows[i] + c);
      for (int j = 0; j < M; ++j) acc[j] = _mm256_fmadd_pd(_mm256_broadcast_sd(weights + j * n + i), x, acc[j]);
    }
    for (int j = 0; j < M; ++j) {
      const __m256d g = _mm256_fnmadd_pd(_mm256_set1_pd(t[j]), load4(z[j] + c), acc[j]);
      store4(out[j] + c, _mm256_mul_pd(_mm256_set1_pd(s[j]), g));
    }
  }
  weighted_rows_tail(weights, M, n, rows, z, s, t, out, w4, w);
}

}  // namespace avx2

std::atomic<bool> force_avx2{false};

bool has_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f");
  return yes && !force_avx2.load();
}

}  // namespace

bool available() {
  static const bool yes = __builtin_cpu_supports("avx512f") ||
                          (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"));
  return yes;
}

bool set_force_avx2(bool flag) { return force_avx2.exchange(flag); }

void add_gram_lower(const float* const* rows, int64_t n, int64_t w, double* acc) {
  if (has_avx512()) return add_gram_lower_blocked(rows, n, w, acc);
  avx2::add_gram_lower(rows, n, w, acc);
}
void add_gram_lower(const double* const* rows, int64_t n, int64_t w, double* acc) {
  if (has_avx512()) return add_gram_lower_impl(rows, n, w, acc);
  avx2::add_gram_lower(rows, n, w, acc);
}
namespace {

template <class T>
void weighted_rows_any(const double* weights, int64_t m, int64_t n, const T* const* rows, const T* const* z,
                       const double* s, const double* t, T* const* out, int64_t w) {
  with_out_rows<kMaxOutRows>(m, [&](auto rows_count) {
    constexpr int M = decltype(rows_count)::value;
    if (has_avx512()) {
      weighted_rows_impl<M>(weights, n, rows, z, s, t, out, w);
    } else {
      avx2::weighted_rows_impl<M>(weights, n, rows, z, s, t, out, w);
    }
  });
}

}  // namespace

void weighted_rows(const double* weights, int64_t m, int64_t n, const float* const* rows, const float* const* z,
                   const double* s, const double* t, float* const* out, int64_t w) {
  weighted_rows_any(weights, m, n, rows, z, s, t, out, w);
}
void weighted_rows(const double* weights, int64_t m, int64_t n, const double* const* rows, const double* const* z,
                   const double* s, const double* t, double* const* out, int64_t w) {
  weighted_rows_any(weights, m, n, rows, z, s, t, out, w);
}

#else  // not an x86-64 GCC/Clang build: the callers keep the GEMM path

bool available() { return false; }
bool set_force_avx2(bool flag) { return false; }
void add_gram_lower(const float* const*, int64_t, int64_t, double*) { TORCH_CHECK(false, "few_points unavailable"); }
void add_gram_lower(const double* const*, int64_t, int64_t, double*) { TORCH_CHECK(false, "few_points unavailable"); }
void weighted_rows(const double*, int64_t, int64_t, const float* const*, const float* const*, const double*,
                   const double*, float* const*, int64_t) {
  TORCH_CHECK(false, "few_points unavailable");
}
void weighted_rows(const double*, int64_t, int64_t, const double* const*, const double* const*, const double*,
                   const double*, double* const*, int64_t) {
  TORCH_CHECK(false, "few_points unavailable");
}

#endif

}  // namespace few_points
}  // namespace kivi_fast
