#include "cpu/few_points.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <type_traits>

#include "cpu/isa.h"

#ifdef KIVI_FAST_X86_SIMD
#include "cpu/x86_avx2.h"
// GCC 12's _mm512_cvtps_pd starts from an "undefined" register, which -Wmaybe-uninitialized reports.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace kivi_fast {
namespace few_points {

#ifdef KIVI_FAST_X86_SIMD

namespace {

// The columns past the last full register of weighted_rows, [c0, w), one at a time.
template <class T>
void weighted_rows_tail(const double* weights, int m, int64_t n, const T* const* rows, const T* const* z,
                        const double* t, T* const* out, int64_t c0, int64_t w) {
  for (int j = 0; j < m; ++j)
    for (int64_t c = c0; c < w; ++c) {
      double g = 0;
      for (int64_t i = 0; i < n; ++i) g += weights[j * n + i] * static_cast<double>(rows[i][c]);
      if (z != nullptr) g -= t[j] * static_cast<double>(z[j][c]);
      out[j][c] = static_cast<T>(g);
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

KIVI_AVX512 inline __m512d load8(const float* p) { return _mm512_cvtps_pd(_mm256_loadu_ps(p)); }
KIVI_AVX512 inline __m512d load8(const double* p) { return _mm512_loadu_pd(p); }
KIVI_AVX512 inline void store8(float* p, __m512d v) { _mm256_storeu_ps(p, _mm512_cvtpd_ps(v)); }
KIVI_AVX512 inline void store8(double* p, __m512d v) { _mm512_storeu_pd(p, v); }

// The Gram kernel for AVX-512: each block of kBlock columns is converted to float64 once, centred
// (centre_of_columns), into a buffer that stays in L1, and every 4 x 4 tile of the lower triangle
// accumulates from it; the tiles' accumulators live in memory between blocks and are reduced once at the end.
// Converting float32 inside the tiles instead costs a conversion per 2 FMAs, on the same execution port;
// float64 rows take the same buffer for the centring. The last, partial block is padded with zeros.
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

using x86::centre_of_columns;

template <class T>
KIVI_AVX512 void add_gram_lower_blocked(const T* const* rows, int64_t n, int64_t w, double* acc) {
  TORCH_CHECK(n <= kMaxRows, "few_points: at most ", kMaxRows, " rows, got ", n);
  const int64_t tiles = (n + 3) / 4, w_main = w / kBlock * kBlock;
  alignas(64) double buf[kMaxRows * kBlock];
  std::fill(buf + n * kBlock, buf + tiles * 4 * kBlock, 0.0);  // padding rows: zeros, never stored
  constexpr int64_t kMaxTiles = (kMaxRows / 4) * (kMaxRows / 4 + 1) / 2;
  alignas(64) __m512d sums[kMaxTiles * 16];
  for (int64_t t = 0; t < tiles * (tiles + 1) / 2 * 16; ++t) sums[t] = _mm512_setzero_pd();
  alignas(64) double centre[kBlock];
  for (int64_t c0 = 0; c0 < w; c0 += kBlock) {
    if (c0 < w_main) {
      centre_of_columns(rows, n, c0, kBlock, kBlock, centre);
      for (int64_t i = 0; i < n; ++i)
        for (int64_t c = 0; c < kBlock; c += 8)
          _mm512_store_pd(buf + i * kBlock + c, _mm512_sub_pd(load8(rows[i] + c0 + c), _mm512_load_pd(centre + c)));
    } else {
      centre_of_columns(rows, n, c0, 0, w - c0, centre);
      for (int64_t i = 0; i < n; ++i)
        for (int64_t c = 0; c < kBlock; ++c)
          buf[i * kBlock + c] = c0 + c < w ? static_cast<double>(rows[i][c0 + c]) - centre[c] : 0.0;
    }
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
}

// One accumulator register per output row: M is a template argument so that they stay in registers.
template <int M, class T>
KIVI_AVX512 void weighted_rows_impl(const double* weights, int64_t n, const T* const* rows, const T* const* z,
                                    const double* t, T* const* out, int64_t w) {
  const int64_t w8 = w & ~int64_t{7};
  for (int64_t c = 0; c < w8; c += 8) {
    __m512d acc[M];
    for (int j = 0; j < M; ++j) acc[j] = _mm512_setzero_pd();
    for (int64_t i = 0; i < n; ++i) {
      const __m512d x = load8(rows[i] + c);
      for (int j = 0; j < M; ++j) acc[j] = _mm512_fmadd_pd(_mm512_set1_pd(weights[j * n + i]), x, acc[j]);
    }
    if (z != nullptr)
      for (int j = 0; j < M; ++j) acc[j] = _mm512_fnmadd_pd(_mm512_set1_pd(t[j]), load8(z[j] + c), acc[j]);
    for (int j = 0; j < M; ++j) store8(out[j] + c, acc[j]);
  }
  weighted_rows_tail(weights, M, n, rows, z, t, out, w8, w);
}

// The same kernels for AVX2 + FMA (4 doubles a register, 16 registers).

namespace avx2 {

// Columns per block: the two float64 buffers of 20 rows and the accumulators (26 KB) stay in L1
// (forward at (10, 314000): 64 columns 1.04x faster than 128, 32 columns 0.89x).
constexpr int64_t kBlock = 64;

using x86::load4;
using x86::reduce_add;
KIVI_AVX2 inline void store4(float* p, __m256d v) { _mm_storeu_ps(p, _mm256_cvtpd_ps(v)); }
KIVI_AVX2 inline void store4(double* p, __m256d v) { _mm256_storeu_pd(p, v); }

// The lower triangle is covered without padded products: the rows go in groups of four (the last
// group padded with zero rows); each group's own 4 x 4 triangle is one tile of ten accumulators, and
// the rectangle of a group against every earlier row is cut into tiles of 4 x 3 and 4 x 2. At 20 rows
// that is 210 products a column, where 3 x 3 tiles over 21 rows made 252 (the diagonal tiles' upper
// halves and the padding row): the kernel is bound by its multiply-adds, in L3 as from memory (the
// forward at (10, 314000): 1.08x faster than 3 x 3 tiles; with the conversion below 1.19x).
enum class TileKind : int8_t { kTriangle, kRect3, kRect2 };
struct Tile {
  TileKind kind;
  int8_t a, b;  // first row of the group (a) and of the earlier rows it meets (b)
  int16_t sums;  // offset of its accumulators
};
constexpr int accumulators(TileKind kind) {
  return kind == TileKind::kTriangle ? 10 : kind == TileKind::kRect3 ? 12 : 8;
}
// (k, l) of accumulator t of a tile: the triangle's run (0,0) (1,0) (1,1) (2,0) ... (3,3); a
// rectangle's row by row.
inline void pair_of(TileKind kind, int t, int* k, int* l) {
  if (kind == TileKind::kTriangle) {
    *k = t < 1 ? 0 : t < 3 ? 1 : t < 6 ? 2 : 3;
    *l = t - *k * (*k + 1) / 2;
  } else {
    const int width = kind == TileKind::kRect3 ? 3 : 2;
    *k = t / width;
    *l = t % width;
  }
}
constexpr int64_t kMaxTileCount = 64;
constexpr int64_t kMaxSums = kMaxRows * (kMaxRows + 1) / 2;

// Tiles of the lower triangle of `rows` rows (a multiple of 4); returns their count.
int tile_triangle(int64_t rows, Tile* tiles) {
  int count = 0, sums = 0;
  auto add = [&](TileKind kind, int64_t a, int64_t b) {
    tiles[count++] = {kind, static_cast<int8_t>(a), static_cast<int8_t>(b), static_cast<int16_t>(sums)};
    sums += accumulators(kind);
  };
  for (int64_t a = 0; a < rows; a += 4) {
    add(TileKind::kTriangle, a, a);
    // a columns before the group: 3s, with the rest (a % 3 = 1: 4, a % 3 = 2: 2) in 2s
    int64_t b = 0;
    for (; a - b >= 3 && (a - b) % 3 != 1; b += 3) add(TileKind::kRect3, a, b);
    for (; a - b > 0 && (a - b) % 3 != 0; b += 2) add(TileKind::kRect2, a, b);
    for (; b < a; b += 3) add(TileKind::kRect3, a, b);
  }
  return count;
}

// The kernels below: a block of kBlock columns of the float64 buffer, accumulators in named registers
// (with an array of them, GCC copies them in and out with rep movsq, which costs as much as the
// block's multiply-adds). Each also converts one row of the next block, src to dst (kBlock columns),
// a vector an iteration: alone, that pass would be a fifth of the Gram's time with the multiply-add
// units idle, bound by its stores and conversions, which use other ports.

// sums[k (k + 1) / 2 + l] += x_k x_l, l <= k < 4, over rows x[0..3].
template <class T>
KIVI_AVX2 void triangle_block(const double* x, __m256d* sums, const T* src, const double* centre, double* dst) {
  __m256d s0 = sums[0], s1 = sums[1], s2 = sums[2], s3 = sums[3], s4 = sums[4], s5 = sums[5], s6 = sums[6],
          s7 = sums[7], s8 = sums[8], s9 = sums[9];
  for (int64_t c = 0; c < kBlock; c += 4) {
    const __m256d x0 = _mm256_load_pd(x + c), x1 = _mm256_load_pd(x + kBlock + c),
                  x2 = _mm256_load_pd(x + 2 * kBlock + c), x3 = _mm256_load_pd(x + 3 * kBlock + c);
    s0 = _mm256_fmadd_pd(x0, x0, s0);
    s1 = _mm256_fmadd_pd(x1, x0, s1);
    s2 = _mm256_fmadd_pd(x1, x1, s2);
    s3 = _mm256_fmadd_pd(x2, x0, s3);
    s4 = _mm256_fmadd_pd(x2, x1, s4);
    _mm256_store_pd(dst + c, _mm256_sub_pd(load4(src + c), _mm256_load_pd(centre + c)));
    s5 = _mm256_fmadd_pd(x2, x2, s5);
    s6 = _mm256_fmadd_pd(x3, x0, s6);
    s7 = _mm256_fmadd_pd(x3, x1, s7);
    s8 = _mm256_fmadd_pd(x3, x2, s8);
    s9 = _mm256_fmadd_pd(x3, x3, s9);
  }
  sums[0] = s0, sums[1] = s1, sums[2] = s2, sums[3] = s3, sums[4] = s4, sums[5] = s5, sums[6] = s6, sums[7] = s7;
  sums[8] = s8, sums[9] = s9;
}

// sums[3 k + l] += a_k b_l, k < 4, l < 3: twelve accumulators, three rows of b and one of a at a time
// fill the sixteen registers.
template <class T>
KIVI_AVX2 void rect3_block(const double* a, const double* b, __m256d* sums, const T* src, const double* centre,
                           double* dst) {
  __m256d s0 = sums[0], s1 = sums[1], s2 = sums[2], s3 = sums[3], s4 = sums[4], s5 = sums[5], s6 = sums[6],
          s7 = sums[7], s8 = sums[8], s9 = sums[9], s10 = sums[10], s11 = sums[11];
  for (int64_t c = 0; c < kBlock; c += 4) {
    const __m256d b0 = _mm256_load_pd(b + c), b1 = _mm256_load_pd(b + kBlock + c),
                  b2 = _mm256_load_pd(b + 2 * kBlock + c);
    __m256d ak = _mm256_load_pd(a + c);
    s0 = _mm256_fmadd_pd(ak, b0, s0);
    s1 = _mm256_fmadd_pd(ak, b1, s1);
    s2 = _mm256_fmadd_pd(ak, b2, s2);
    ak = _mm256_load_pd(a + kBlock + c);
    s3 = _mm256_fmadd_pd(ak, b0, s3);
    s4 = _mm256_fmadd_pd(ak, b1, s4);
    s5 = _mm256_fmadd_pd(ak, b2, s5);
    _mm256_store_pd(dst + c, _mm256_sub_pd(load4(src + c), _mm256_load_pd(centre + c)));
    ak = _mm256_load_pd(a + 2 * kBlock + c);
    s6 = _mm256_fmadd_pd(ak, b0, s6);
    s7 = _mm256_fmadd_pd(ak, b1, s7);
    s8 = _mm256_fmadd_pd(ak, b2, s8);
    ak = _mm256_load_pd(a + 3 * kBlock + c);
    s9 = _mm256_fmadd_pd(ak, b0, s9);
    s10 = _mm256_fmadd_pd(ak, b1, s10);
    s11 = _mm256_fmadd_pd(ak, b2, s11);
  }
  sums[0] = s0, sums[1] = s1, sums[2] = s2, sums[3] = s3, sums[4] = s4, sums[5] = s5, sums[6] = s6, sums[7] = s7;
  sums[8] = s8, sums[9] = s9, sums[10] = s10, sums[11] = s11;
}

// sums[2 k + l] += a_k b_l, k < 4, l < 2.
template <class T>
KIVI_AVX2 void rect2_block(const double* a, const double* b, __m256d* sums, const T* src, const double* centre,
                           double* dst) {
  __m256d s0 = sums[0], s1 = sums[1], s2 = sums[2], s3 = sums[3], s4 = sums[4], s5 = sums[5], s6 = sums[6],
          s7 = sums[7];
  for (int64_t c = 0; c < kBlock; c += 4) {
    const __m256d b0 = _mm256_load_pd(b + c), b1 = _mm256_load_pd(b + kBlock + c);
    const __m256d a0 = _mm256_load_pd(a + c), a1 = _mm256_load_pd(a + kBlock + c),
                  a2 = _mm256_load_pd(a + 2 * kBlock + c), a3 = _mm256_load_pd(a + 3 * kBlock + c);
    s0 = _mm256_fmadd_pd(a0, b0, s0);
    s1 = _mm256_fmadd_pd(a0, b1, s1);
    s2 = _mm256_fmadd_pd(a1, b0, s2);
    s3 = _mm256_fmadd_pd(a1, b1, s3);
    _mm256_store_pd(dst + c, _mm256_sub_pd(load4(src + c), _mm256_load_pd(centre + c)));
    s4 = _mm256_fmadd_pd(a2, b0, s4);
    s5 = _mm256_fmadd_pd(a2, b1, s5);
    s6 = _mm256_fmadd_pd(a3, b0, s6);
    s7 = _mm256_fmadd_pd(a3, b1, s7);
  }
  sums[0] = s0, sums[1] = s1, sums[2] = s2, sums[3] = s3, sums[4] = s4, sums[5] = s5, sums[6] = s6, sums[7] = s7;
}

// kBlock columns of a row in float64, less those of the centre (its block, in float64).
template <class T>
KIVI_AVX2 void convert_row(const T* src, const double* centre, double* dst) {
  for (int64_t c = 0; c < kBlock; c += 4)
    _mm256_store_pd(dst + c, _mm256_sub_pd(load4(src + c), _mm256_load_pd(centre + c)));
}

// Blocks of kBlock columns in float64, centred (centre_of_columns; float32 or float64 rows alike), in
// two buffers: the tiles of the lower triangle multiply one block while they convert the next into the
// other, tile t row t (rows past the tile count on their own; tiles past the row count convert a zero
// row into a spare buffer). The tail columns one by one.
template <class T>
KIVI_AVX2 void add_gram_lower(const T* const* rows, int64_t n, int64_t w, double* acc) {
  TORCH_CHECK(n <= kMaxRows, "few_points: at most ", kMaxRows, " rows, got ", n);
  constexpr int64_t kLineElements = 64 / static_cast<int64_t>(sizeof(T));
  constexpr int64_t kLinesPerBlock = kBlock / kLineElements;
  const int64_t padded = (n + 3) / 4 * 4, w_main = w / kBlock * kBlock;
  Tile tiles[kMaxTileCount];
  const int64_t tile_count = tile_triangle(padded, tiles);
  alignas(32) double bufs[2][kMaxRows * kBlock];
  alignas(32) double spare[kBlock];
  for (double* buf : bufs) std::fill(buf + n * kBlock, buf + padded * kBlock, 0.0);  // padding: never stored
  alignas(32) __m256d sums[kMaxSums];
  for (int64_t t = 0; t < padded * (padded + 1) / 2; ++t) sums[t] = _mm256_setzero_pd();
  // the centre's block in float64, once a block (taken again in each row's conversion, the centring
  // made the forward at (10, 314000) float32 9% slower than without it; 5% this way)
  alignas(32) double centre[kBlock];
  if (w_main > 0) {
    centre_of_columns(rows, n, 0, kBlock, kBlock, centre);
    for (int64_t i = 0; i < n; ++i) convert_row(rows[i], centre, bufs[0] + i * kBlock);
  }
  for (int64_t c0 = 0, cur = 0; c0 < w_main; c0 += kBlock, cur ^= 1) {
    const double* const buf = bufs[cur];
    double* const next_buf = bufs[cur ^ 1];
    const int64_t next = c0 + kBlock;
    const bool has_next = next < w_main;
    // The block after next starts coming from memory while this one is multiplied: each row's lines
    // requested by the tile that will convert it (all at once, 20 rows x 4 lines, left the conversions
    // waiting on memory).
    const int64_t ahead = next + kBlock;
    const bool fetch = ahead + kBlock <= w_main;
    auto prefetch_row = [&](int64_t i) {
      for (int64_t line = 0; line < kLinesPerBlock; ++line)
        _mm_prefetch(reinterpret_cast<const char*>(rows[i] + ahead + line * kLineElements), _MM_HINT_T0);
    };
    if (has_next) centre_of_columns(rows, n, next, kBlock, kBlock, centre);  // (this block's are converted)
    for (int64_t i = tile_count; i < n; ++i) {
      if (fetch) prefetch_row(i);
      if (has_next) convert_row(rows[i] + next, centre, next_buf + i * kBlock);
    }
    for (int64_t t = 0; t < tile_count; ++t) {
      if (fetch && t < n) prefetch_row(t);
      const bool converts = has_next && t < n;
      const T* const src = converts ? rows[t] + next : x86::zero_row(rows[0]);
      const double* const mid = converts ? centre : x86::kZeroDoubles;
      double* const dst = converts ? next_buf + t * kBlock : spare;
      const Tile& tile = tiles[t];
      const double* a = buf + tile.a * kBlock;
      const double* b = buf + tile.b * kBlock;
      switch (tile.kind) {
        case TileKind::kTriangle: triangle_block(a, sums + tile.sums, src, mid, dst); break;
        case TileKind::kRect3: rect3_block(a, b, sums + tile.sums, src, mid, dst); break;
        case TileKind::kRect2: rect2_block(a, b, sums + tile.sums, src, mid, dst); break;
      }
    }
  }
  for (int64_t t = 0; t < tile_count; ++t) {
    const Tile& tile = tiles[t];
    for (int s = 0; s < accumulators(tile.kind); ++s) {
      int k, l;
      pair_of(tile.kind, s, &k, &l);
      const int64_t i = tile.a + k, j = tile.b + l;
      if (i < n) acc[i * n + j] += reduce_add(sums[tile.sums + s]);
    }
  }
  centre_of_columns(rows, n, w_main, 0, w - w_main, centre);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j <= i; ++j) {
      double t = 0;
      for (int64_t c = w_main; c < w; ++c) {
        const double k = centre[c - w_main];
        t += (static_cast<double>(rows[i][c]) - k) * (static_cast<double>(rows[j][c]) - k);
      }
      acc[i * n + j] += t;
    }
}

// Output rows j0 to j0 + G - 1, columns c to c + 7: 2 G accumulators, in two arrays whose loops are
// unrolled by pragma (with one [G][2] array, or without the pragmas, GCC kept them on the stack: a
// store per multiply-add).
template <int G, class T>
KIVI_AVX2 __attribute__((always_inline)) inline void weighted_eight_rows(const double* weights, int64_t n,
                                                                         const T* const* rows, const T* const* z,
                                                                         const double* t, int64_t j0, int64_t c,
                                                                         T* const* out) {
  __m256d lo[G], hi[G];
#pragma GCC unroll 8
  for (int j = 0; j < G; ++j) lo[j] = hi[j] = _mm256_setzero_pd();
  for (int64_t i = 0; i < n; ++i) {
    const __m256d x0 = load4(rows[i] + c), x1 = load4(rows[i] + c + 4);
#pragma GCC unroll 8
    for (int j = 0; j < G; ++j) {
      const __m256d wj = _mm256_broadcast_sd(weights + (j0 + j) * n + i);
      lo[j] = _mm256_fmadd_pd(wj, x0, lo[j]);
      hi[j] = _mm256_fmadd_pd(wj, x1, hi[j]);
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < G; ++j) {
    if (z != nullptr) {
      const __m256d tj = _mm256_set1_pd(t[j0 + j]);
      lo[j] = _mm256_fnmadd_pd(tj, load4(z[j0 + j] + c), lo[j]);
      hi[j] = _mm256_fnmadd_pd(tj, load4(z[j0 + j] + c + 4), hi[j]);
    }
    store4(out[j0 + j] + c, lo[j]);
    store4(out[j0 + j] + c + 4, hi[j]);
  }
}

// Columns c to c + 3 of every output row j < M.
template <int M, class T>
KIVI_AVX2 inline void weighted_four(const double* weights, int64_t n, const T* const* rows, const T* const* z,
                                    const double* t, int64_t c, T* const* out) {
  __m256d acc[M];
  for (int j = 0; j < M; ++j) acc[j] = _mm256_setzero_pd();
  for (int64_t i = 0; i < n; ++i) {
    const __m256d x = load4(rows[i] + c);
    for (int j = 0; j < M; ++j) acc[j] = _mm256_fmadd_pd(_mm256_broadcast_sd(weights + j * n + i), x, acc[j]);
  }
  for (int j = 0; j < M; ++j) {
    if (z != nullptr) acc[j] = _mm256_fnmadd_pd(_mm256_set1_pd(t[j]), load4(z[j] + c), acc[j]);
    store4(out[j] + c, acc[j]);
  }
}

// Columns c to c + 7 of output rows J0 to M - 1, in tiles of five rows by two registers: ten
// accumulators, each broadcast weight used twice. One row by four columns at a time (a broadcast per
// multiply-add) takes 13.0 ns a column of (10, 314000)'s kl_grad op alone, these tiles 11.8 (in L3, d =
// 31,400: 13.4 and 12.1). Inlined: called once per tile, they are slower than that from memory
// (14.2 ns).
template <int M, int J0, class T>
KIVI_AVX2 __attribute__((always_inline)) inline void weighted_eight(const double* weights, int64_t n,
                                                                    const T* const* rows, const T* const* z,
                                                                    const double* t, int64_t c, T* const* out) {
  if constexpr (J0 < M) {
    constexpr int G = M - J0 < 5 ? M - J0 : 5;
    weighted_eight_rows<G>(weights, n, rows, z, t, J0, c, out);
    weighted_eight<M, J0 + G>(weights, n, rows, z, t, c, out);
  }
}

template <int M, class T>
KIVI_AVX2 void weighted_rows_impl(const double* weights, int64_t n, const T* const* rows, const T* const* z,
                                  const double* t, T* const* out, int64_t w) {
  constexpr int64_t kLine = 64 / static_cast<int64_t>(sizeof(T));  // elements per cache line
  const int64_t w8 = w & ~int64_t{7}, w4 = w & ~int64_t{3};
  for (int64_t c = 0; c < w8; c += 8) {
    // each row a few cache lines ahead: n input and M output streams are more than the hardware
    // prefetchers follow
    if (c % kLine == 0 && c + 8 * kLine < w8) {
      for (int64_t i = 0; i < n; ++i) _mm_prefetch(reinterpret_cast<const char*>(rows[i] + c + 8 * kLine), _MM_HINT_T0);
    }
    weighted_eight<M, 0>(weights, n, rows, z, t, c, out);
  }
  if (w8 < w4) weighted_four<M>(weights, n, rows, z, t, w8, out);
  weighted_rows_tail(weights, M, n, rows, z, t, out, w4, w);
}

}  // namespace avx2

// Set on first use (isa's answers are not known during the library's static initialization).
std::atomic<bool>& use_avx512() {
  static std::atomic<bool> flag{isa::prefer_512_bit()};
  return flag;
}

}  // namespace

bool available() { return isa::cpu_has(isa::Level::kAvx2); }
bool avx512_available() { return isa::cpu_has(isa::Level::kAvx512); }

namespace {
bool has_avx512() { return use_avx512().load() && avx512_available(); }
}  // namespace

bool set_avx512(bool flag) { return use_avx512().exchange(flag); }

void add_gram_lower(const float* const* rows, int64_t n, int64_t w, double* acc) {
  if (has_avx512()) return add_gram_lower_blocked(rows, n, w, acc);
  avx2::add_gram_lower(rows, n, w, acc);
}
void add_gram_lower(const double* const* rows, int64_t n, int64_t w, double* acc) {
  if (has_avx512()) return add_gram_lower_blocked(rows, n, w, acc);
  avx2::add_gram_lower(rows, n, w, acc);
}
namespace {

template <class T>
void weighted_rows_any(const double* weights, int64_t m, int64_t n, const T* const* rows, const T* const* z,
                       const double* t, T* const* out, int64_t w) {
  with_out_rows<kMaxOutRows>(m, [&](auto rows_count) {
    constexpr int M = decltype(rows_count)::value;
    if (has_avx512()) {
      weighted_rows_impl<M>(weights, n, rows, z, t, out, w);
    } else {
      avx2::weighted_rows_impl<M>(weights, n, rows, z, t, out, w);
    }
  });
}

}  // namespace

void weighted_rows(const double* weights, int64_t m, int64_t n, const float* const* rows, const float* const* z,
                   const double* t, float* const* out, int64_t w) {
  weighted_rows_any(weights, m, n, rows, z, t, out, w);
}
void weighted_rows(const double* weights, int64_t m, int64_t n, const double* const* rows, const double* const* z,
                   const double* t, double* const* out, int64_t w) {
  weighted_rows_any(weights, m, n, rows, z, t, out, w);
}

#else  // not an x86-64 GCC/Clang build: the callers keep the GEMM path

bool available() { return false; }
bool avx512_available() { return false; }
bool set_avx512(bool flag) { return false; }
void add_gram_lower(const float* const*, int64_t, int64_t, double*) { TORCH_CHECK(false, "few_points unavailable"); }
void add_gram_lower(const double* const*, int64_t, int64_t, double*) { TORCH_CHECK(false, "few_points unavailable"); }
void weighted_rows(const double*, int64_t, int64_t, const float* const*, const float* const*, const double*,
                   float* const*, int64_t) {
  TORCH_CHECK(false, "few_points unavailable");
}
void weighted_rows(const double*, int64_t, int64_t, const double* const*, const double* const*, const double*,
                   double* const*, int64_t) {
  TORCH_CHECK(false, "few_points unavailable");
}

#endif

}  // namespace few_points
}  // namespace kivi_fast
