#include "cpu/gram_tiles.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <vector>

#include "cpu/isa.h"

#ifdef KIVI_FAST_X86_SIMD
#include "cpu/x86_avx2.h"
#endif

namespace kivi_fast {
namespace gram_tiles {

#ifdef KIVI_FAST_X86_SIMD

namespace {

constexpr int64_t P = kPanel;

using x86::load4;
static_assert(kMaxPackColumns <= x86::kZeroRowLength, "rows past n read from x86::zero_row");

// Rows r0..r3 (4 columns each) stored as 4 columns of a panel: o[c P + r] = r_r[c].
KIVI_AVX2 inline void store_transposed(__m256d r0, __m256d r1, __m256d r2, __m256d r3, double* o) {
  const __m256d t0 = _mm256_unpacklo_pd(r0, r1), t1 = _mm256_unpackhi_pd(r0, r1);
  const __m256d t2 = _mm256_unpacklo_pd(r2, r3), t3 = _mm256_unpackhi_pd(r2, r3);
  _mm256_storeu_pd(o, _mm256_permute2f128_pd(t0, t2, 0x20));
  _mm256_storeu_pd(o + P, _mm256_permute2f128_pd(t1, t3, 0x20));
  _mm256_storeu_pd(o + 2 * P, _mm256_permute2f128_pd(t0, t2, 0x31));
  _mm256_storeu_pd(o + 3 * P, _mm256_permute2f128_pd(t1, t3, 0x31));
}

template <class T>
KIVI_AVX2 inline __m256d centred4(const T* row, const double* centre, int64_t c) {
  return _mm256_sub_pd(load4(row + c), _mm256_load_pd(centre + c));
}

template <class T>
KIVI_AVX2 void pack_impl(const T* const* rows, int64_t n, int64_t w, double* packed) {
  TORCH_CHECK(w <= kMaxPackColumns, "gram_tiles::pack: at most ", kMaxPackColumns, " columns, got ", w);
  const int64_t w4 = w & ~int64_t{3};
  const T* const zero = x86::zero_row(rows[0]);
  alignas(32) double centre[kMaxPackColumns];
  if (n > 0) x86::centre_of_columns(rows, n, 0, w4, w, centre);
  for (int64_t p0 = 0; p0 < n; p0 += P) {
    double* o = packed + p0 * w;
    const T* r[P];
    const double* k[P];  // the rows and their centres (the rows past n: zeros less zeros)
    for (int64_t i = 0; i < P; ++i) {
      r[i] = p0 + i < n ? rows[p0 + i] : zero;
      k[i] = p0 + i < n ? centre : x86::kZeroDoubles;
    }
    for (int64_t c = 0; c < w4; c += 4) {
      store_transposed(centred4(r[0], k[0], c), centred4(r[1], k[1], c), centred4(r[2], k[2], c),
                       centred4(r[3], k[3], c), o + c * P);
      store_transposed(centred4(r[4], k[4], c), centred4(r[5], k[5], c), centred4(r[6], k[6], c),
                       centred4(r[7], k[7], c), o + c * P + 4);
    }
    for (int64_t c = w4; c < w; ++c)
      for (int64_t i = 0; i < P; ++i) o[c * P + i] = static_cast<double>(r[i][c]) - k[i][c];
  }
}

KIVI_AVX2 inline void add_to(double* p, __m256d v) { _mm256_storeu_pd(p, _mm256_add_pd(_mm256_loadu_pd(p), v)); }

static_assert(kTileRows == 4, "tile() is written for 4 rows");

// The 4 x 8 tile c[r ldc + j] (+)= sum_k a_r[k kStep] b[k P + j] for rows a_0..a_3 of A read with
// step kStep (P: 4 rows of one packed panel, a_r = a_0 + r; 1: row-major rows; 0: the runtime `step`,
// columns of a row-major matrix read as rows) and b a whole panel.
// Eight accumulators (two registers a row) cover the FMA latency at two FMAs a cycle; named ones,
// since GCC kept an array of them in memory. Inlined into each caller, so that the packed panel's
// rows are addressed from one pointer (four pointers and a runtime step cost 4-13% of the Gram).
template <int64_t kStep, bool accumulate>
KIVI_AVX2 __attribute__((always_inline)) inline void tile(const double* a0, const double* a1, const double* a2,
                                                          const double* a3, const double* b, int64_t w, double* c,
                                                          int64_t ldc, int64_t step = kStep) {
  __m256d c00 = _mm256_setzero_pd(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00;
  for (int64_t k = 0, o = 0; k < w; ++k, o += kStep != 0 ? kStep : step, b += P) {
    const __m256d b0 = _mm256_loadu_pd(b), b1 = _mm256_loadu_pd(b + 4);
    __m256d x = _mm256_broadcast_sd(a0 + o);
    c00 = _mm256_fmadd_pd(x, b0, c00);
    c01 = _mm256_fmadd_pd(x, b1, c01);
    x = _mm256_broadcast_sd(a1 + o);
    c10 = _mm256_fmadd_pd(x, b0, c10);
    c11 = _mm256_fmadd_pd(x, b1, c11);
    x = _mm256_broadcast_sd(a2 + o);
    c20 = _mm256_fmadd_pd(x, b0, c20);
    c21 = _mm256_fmadd_pd(x, b1, c21);
    x = _mm256_broadcast_sd(a3 + o);
    c30 = _mm256_fmadd_pd(x, b0, c30);
    c31 = _mm256_fmadd_pd(x, b1, c31);
  }
  if constexpr (accumulate) {
    add_to(c, c00), add_to(c + 4, c01), c += ldc;
    add_to(c, c10), add_to(c + 4, c11), c += ldc;
    add_to(c, c20), add_to(c + 4, c21), c += ldc;
    add_to(c, c30), add_to(c + 4, c31);
  } else {
    _mm256_storeu_pd(c, c00), _mm256_storeu_pd(c + 4, c01), c += ldc;
    _mm256_storeu_pd(c, c10), _mm256_storeu_pd(c + 4, c11), c += ldc;
    _mm256_storeu_pd(c, c20), _mm256_storeu_pd(c + 4, c21), c += ldc;
    _mm256_storeu_pd(c, c30), _mm256_storeu_pd(c + 4, c31);
  }
}

// tile() over 4 rows of one packed panel, and over 4 row-major rows.
template <bool accumulate>
KIVI_AVX2 void panel_tile(const double* a, const double* b, int64_t w, double* c, int64_t ldc) {
  tile<P, accumulate>(a, a + 1, a + 2, a + 3, b, w, c, ldc);
}
template <bool accumulate>
KIVI_AVX2 void row_tile(const double* a0, const double* a1, const double* a2, const double* a3, const double* b,
                        int64_t w, double* c, int64_t ldc) {
  tile<1, accumulate>(a0, a1, a2, a3, b, w, c, ldc);
}
// ... and over 4 columns of a row-major matrix (a_r[k lda]): the rows of a symmetric matrix's lower part
// read from its upper part.
template <bool accumulate>
KIVI_AVX2 void column_tile(const double* a0, const double* a1, const double* a2, const double* a3, int64_t lda,
                           const double* b, int64_t w, double* c, int64_t ldc) {
  tile<0, accumulate>(a0, a1, a2, a3, b, w, c, ldc, lda);
}

// Columns of the inner dimension per pass above kPanelOrderMaxRows: a row tile's 4 x 1024 values (32 KB)
// stay in L1 or close while every panel multiplies them, and the panels' 1024 rows (256 KB at 32
// columns) in L2. At (2000, 32): 512 columns are 1.5% slower, 256 3.4%, 2048 even.
constexpr int64_t kInnerChunk = 1024;

// s[r] = sum_{k < w} a_r[k] v[k] for the rows a_0..a_3, 8 values a step (two accumulators a row to
// cover the multiply-add latency), the tail in scalars. The order depends on w alone.
KIVI_AVX2 void row_tile_dots(const double* a0, const double* a1, const double* a2, const double* a3,
                             const double* v, int64_t w, double* s) {
  __m256d s00 = _mm256_setzero_pd(), s01 = s00, s10 = s00, s11 = s00, s20 = s00, s21 = s00, s30 = s00, s31 = s00;
  const int64_t w8 = w & ~int64_t{7};
  for (int64_t k = 0; k < w8; k += 8) {
    const __m256d v0 = _mm256_loadu_pd(v + k), v1 = _mm256_loadu_pd(v + k + 4);
    s00 = _mm256_fmadd_pd(_mm256_loadu_pd(a0 + k), v0, s00);
    s01 = _mm256_fmadd_pd(_mm256_loadu_pd(a0 + k + 4), v1, s01);
    s10 = _mm256_fmadd_pd(_mm256_loadu_pd(a1 + k), v0, s10);
    s11 = _mm256_fmadd_pd(_mm256_loadu_pd(a1 + k + 4), v1, s11);
    s20 = _mm256_fmadd_pd(_mm256_loadu_pd(a2 + k), v0, s20);
    s21 = _mm256_fmadd_pd(_mm256_loadu_pd(a2 + k + 4), v1, s21);
    s30 = _mm256_fmadd_pd(_mm256_loadu_pd(a3 + k), v0, s30);
    s31 = _mm256_fmadd_pd(_mm256_loadu_pd(a3 + k + 4), v1, s31);
  }
  s[0] = x86::reduce_add(_mm256_add_pd(s00, s01));
  s[1] = x86::reduce_add(_mm256_add_pd(s10, s11));
  s[2] = x86::reduce_add(_mm256_add_pd(s20, s21));
  s[3] = x86::reduce_add(_mm256_add_pd(s30, s31));
  for (int64_t k = w8; k < w; ++k) {
    s[0] += a0[k] * v[k];
    s[1] += a1[k] * v[k];
    s[2] += a2[k] * v[k];
    s[3] += a3[k] * v[k];
  }
}

// The rows of A that rows_times_panels reads, rows past m repeating the last one. Where first_row >= 0,
// row i of A is row first_row + i of a symmetric matrix (row 0 at a - first_row lda) that holds only
// the entries from three left of its diagonal on: the columns k < first_row + i0 of a row tile i0
// (4 rows) are read from column first_row + i0 + r of rows k, the upper part.
struct RowsOfA {
  const double* a;
  int64_t m, lda, first_row;
  int64_t clamped(int64_t i0, int64_t r) const { return std::min(i0 + r, m - 1); }
  const double* row(int64_t i0, int64_t r, int64_t k) const { return a + clamped(i0, r) * lda + k; }
  // column first_row + i of the symmetric matrix, from its row k on
  const double* column(int64_t i0, int64_t r, int64_t k) const {
    return a + (k - first_row) * lda + first_row + clamped(i0, r);
  }
  // of the columns [k0, k0 + kw), how many come first from the upper part
  int64_t lower_columns(int64_t i0, int64_t k0, int64_t kw) const {
    return first_row < 0 ? 0 : std::clamp(first_row + i0 - k0, int64_t{0}, kw);
  }
};

// s[r] += sum_{k < w} a_r[k lda] v[k] for the columns a_0..a_3 of a row-major matrix: where they are
// adjacent (a_r = a_0 + r), one load of four a step; four accumulators over k mod 4 cover the latency.
// The order depends on w alone.
KIVI_AVX2 void column_tile_dots(const double* a0, const double* a1, const double* a2, const double* a3, int64_t lda,
                                const double* v, int64_t w, double* s) {
  const bool adjacent = a1 == a0 + 1 && a2 == a0 + 2 && a3 == a0 + 3;
  __m256d acc[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd()};
  for (int64_t k = 0; k < w; ++k) {
    const int64_t o = k * lda;
    const __m256d a = adjacent ? _mm256_loadu_pd(a0 + o) : _mm256_setr_pd(a0[o], a1[o], a2[o], a3[o]);
    acc[k & 3] = _mm256_fmadd_pd(a, _mm256_broadcast_sd(v + k), acc[k & 3]);
  }
  alignas(32) double out[4];
  _mm256_store_pd(out, _mm256_add_pd(_mm256_add_pd(acc[0], acc[1]), _mm256_add_pd(acc[2], acc[3])));
  for (int r = 0; r < 4; ++r) s[r] += out[r];
}

// Columns per pass where a row tile reads its lower part down the upper part's columns: each k there
// is a cache line of its own (of which the tile uses half and the next tile the other half), so
// the lines of a pass, 128 x 64 bytes, stay in L1 while all the panels multiply them. In one pass of
// a whole chunk (1024) they would come from L2 once per panel, and the kl op would be no faster than
// with the lower part mirrored (forward+backward, float32, at (2000, 32)); with passes of 128 it is
// 1.02-1.05x faster there, 1.035-1.08x at (1000, 32). Passes of 32, 64 or 256: within 1.5% of 128.
constexpr int64_t kColumnPass = 128;

KIVI_AVX2 void rows_times_panels_impl(const double* a, int64_t m, int64_t lda, const double* b, int64_t n_b,
                                      int64_t w, double* c, int64_t ldc, const double* v, double* av,
                                      int64_t first_row) {
  alignas(32) double buf[kTileRows * P];
  const RowsOfA rows{a, m, lda, first_row};
  // Up to kPanelOrderMaxRows, A stays in L2 and each panel of B in L1: panels outer, no chunks. Above,
  // a panel's pass over A would read it from memory once per panel (the projection at (2000, 32):
  // four passes over 64 MB), so the inner dimension goes in chunks, row tiles inside.
  const bool small = first_row < 0 && m <= kPanelOrderMaxRows && w <= kPanelOrderMaxRows;
  const int64_t chunk = small ? w : kInnerChunk;
  // a row tile's outputs for all panels where they cannot be written in place (rows past m, columns
  // past n_b)
  const int64_t ld_edge = panels(n_b) * P;
  std::vector<double> edge(small ? 0 : kTileRows * ld_edge);
  for (int64_t k0 = 0; k0 < w; k0 += chunk) {
    const int64_t kw = std::min(chunk, w - k0);
    const bool first = k0 == 0;
    // small: tiles past row m or column n_b go through buf
    auto one_tile = [&](int64_t i0, int64_t j0) {
      const double* panel = b + j0 * w + k0 * P;
      auto row = [&](int64_t r) { return rows.row(i0, r, k0); };
      if (i0 + kTileRows <= m && j0 + P <= n_b) {
        if (first) {
          row_tile<false>(row(0), row(1), row(2), row(3), panel, kw, c + i0 * ldc + j0, ldc);
        } else {
          row_tile<true>(row(0), row(1), row(2), row(3), panel, kw, c + i0 * ldc + j0, ldc);
        }
        return;
      }
      row_tile<false>(row(0), row(1), row(2), row(3), panel, kw, buf, P);
      for (int64_t r = 0; r < kTileRows && i0 + r < m; ++r) {
        double* out = c + (i0 + r) * ldc + j0;
        for (int64_t j = 0; j < std::min(P, n_b - j0); ++j) out[j] = (first ? 0.0 : out[j]) + buf[r * P + j];
      }
    };
    // chunked: the row tile i0 times all panels, its lower part (first_row) in passes of kColumnPass
    // columns, then its row part
    auto tile_row = [&](int64_t i0) {
      if (n_b == 0) return;
      const int64_t t = rows.lower_columns(i0, k0, kw);
      const bool in_place = i0 + kTileRows <= m && n_b % P == 0;
      double* const out = in_place ? c + i0 * ldc : edge.data();
      const int64_t ldo = in_place ? ldc : ld_edge;
      bool add = in_place && !first;
      for (int64_t p0 = 0; p0 < t; p0 += kColumnPass) {
        const int64_t pw = std::min(kColumnPass, t - p0), k = k0 + p0;
        auto col = [&](int64_t r) { return rows.column(i0, r, k); };
        for (int64_t j0 = 0; j0 < n_b; j0 += P) {
          const double* panel = b + j0 * w + k * P;
          if (add) {
            column_tile<true>(col(0), col(1), col(2), col(3), lda, panel, pw, out + j0, ldo);
          } else {
            column_tile<false>(col(0), col(1), col(2), col(3), lda, panel, pw, out + j0, ldo);
          }
        }
        add = true;
      }
      if (t < kw) {
        auto row = [&](int64_t r) { return rows.row(i0, r, k0 + t); };
        for (int64_t j0 = 0; j0 < n_b; j0 += P) {
          const double* panel = b + j0 * w + (k0 + t) * P;
          if (add) {
            row_tile<true>(row(0), row(1), row(2), row(3), panel, kw - t, out + j0, ldo);
          } else {
            row_tile<false>(row(0), row(1), row(2), row(3), panel, kw - t, out + j0, ldo);
          }
        }
      }
      if (in_place) return;
      for (int64_t r = 0; r < kTileRows && i0 + r < m; ++r) {
        double* o = c + (i0 + r) * ldc;
        for (int64_t j = 0; j < n_b; ++j) o[j] = (first ? 0.0 : o[j]) + edge[r * ld_edge + j];
      }
    };
    // the rows' products with v, per chunk (the same chunks whatever n_b), while the tile's rows are in cache
    auto dots = [&](int64_t i0) {
      if (v == nullptr) return;
      double s[kTileRows];
      const int64_t t = rows.lower_columns(i0, k0, kw);
      auto row = [&](int64_t r) { return rows.row(i0, r, k0 + t); };
      row_tile_dots(row(0), row(1), row(2), row(3), v + k0 + t, kw - t, s);
      if (t > 0) {
        column_tile_dots(rows.column(i0, 0, k0), rows.column(i0, 1, k0), rows.column(i0, 2, k0),
                         rows.column(i0, 3, k0), lda, v + k0, t, s);
      }
      for (int64_t r = 0; r < kTileRows && i0 + r < m; ++r) av[i0 + r] = (first ? 0.0 : av[i0 + r]) + s[r];
    };
    if (small) {
      for (int64_t j0 = 0; j0 < n_b; j0 += P)
        for (int64_t i0 = 0; i0 < m; i0 += kTileRows) one_tile(i0, j0);
      for (int64_t i0 = 0; i0 < m; i0 += kTileRows) dots(i0);
    } else {
      for (int64_t i0 = 0; i0 < m; i0 += kTileRows) {
        tile_row(i0);
        dots(i0);
      }
    }
  }
}

// The tile of rows [i0, i0 + 4) and columns [j0, j0 + P) of g. Tiles on the diagonal or past row or
// column n go through a small buffer and write only i <= j < n.
KIVI_AVX2 void gram_tile(const double* packed, int64_t n, int64_t w, double* g, int64_t ldg, bool accumulate,
                         int64_t i0, int64_t j0) {
  const double* a = packed + (i0 / P) * P * w + i0 % P;
  const double* b = packed + j0 * w;
  if (i0 + kTileRows <= j0 && j0 + P <= n) {
    if (accumulate) {
      panel_tile<true>(a, b, w, g + i0 * ldg + j0, ldg);
    } else {
      panel_tile<false>(a, b, w, g + i0 * ldg + j0, ldg);
    }
    return;
  }
  alignas(32) double buf[kTileRows * P];
  panel_tile<false>(a, b, w, buf, P);
  for (int64_t r = 0; r < kTileRows && i0 + r < n; ++r) {
    double* row = g + (i0 + r) * ldg;
    for (int64_t j = std::max(j0, i0 + r); j < std::min(n, j0 + P); ++j)
      row[j] = (accumulate ? row[j] : 0.0) + buf[r * P + (j - j0)];
  }
}

// Up to kPanelOrderMaxRows points, g (at most 512 KB) stays in L2 and the tiles go panel by panel of
// columns: the panel stays in L1 while the row tiles stream from L2. Above, row tile by row tile, so
// that the rows of g are written in order: walking down the columns of a 32 MB g (2000 points) is 2.3x
// slower where it sits on 4 KB pages (buffers.h puts large buffers on 2 MB pages only where the kernel
// offers them), and row tiles first are 2.6% slower at 200 points x 51 dimensions.

KIVI_AVX2 void gram_upper_impl(const double* packed, int64_t n, int64_t w, double* g, int64_t ldg, bool accumulate,
                               int64_t t0, int64_t t1) {
  const int64_t i_begin = t0 * kTileRows, i_end = std::min(n, t1 * kTileRows);
  if (n <= kPanelOrderMaxRows) {
    for (int64_t j0 = i_begin / P * P; j0 < n; j0 += P)
      for (int64_t i0 = i_begin; i0 < std::min(i_end, j0 + P); i0 += kTileRows)
        gram_tile(packed, n, w, g, ldg, accumulate, i0, j0);
  } else {
    for (int64_t i0 = i_begin; i0 < i_end; i0 += kTileRows)
      for (int64_t j0 = i0 / P * P; j0 < n; j0 += P) gram_tile(packed, n, w, g, ldg, accumulate, i0, j0);
  }
}

// Set on first use (isa's answers are not known during the library's static initialization).
std::atomic<bool>& use_tiles() {
  static std::atomic<bool> flag{isa::cpu_has(isa::Level::kAvx2) && !isa::prefer_512_bit()};
  return flag;
}

}  // namespace

bool available() { return isa::cpu_has(isa::Level::kAvx2); }
bool enabled() { return use_tiles().load() && available(); }
bool set_enabled(bool flag) { return use_tiles().exchange(flag); }

void pack(const float* const* rows, int64_t n, int64_t w, double* packed) { pack_impl(rows, n, w, packed); }
void pack(const double* const* rows, int64_t n, int64_t w, double* packed) { pack_impl(rows, n, w, packed); }
void gram_upper(const double* packed, int64_t n, int64_t w, double* g, int64_t ldg, bool accumulate, int64_t t0,
                int64_t t1) {
  gram_upper_impl(packed, n, w, g, ldg, accumulate, t0, t1);
}
void rows_times_panels(const double* a, int64_t m, int64_t lda, const double* b, int64_t n_b, int64_t w, double* c,
                       int64_t ldc, const double* v, double* av, int64_t first_row) {
  rows_times_panels_impl(a, m, lda, b, n_b, w, c, ldc, v, av, first_row);
}

#else  // not an x86-64 GCC/Clang build: callers keep the GEMMs

bool available() { return false; }
bool enabled() { return false; }
bool set_enabled(bool flag) { return false; }
void pack(const float* const*, int64_t, int64_t, double*) { TORCH_CHECK(false, "gram_tiles unavailable"); }
void pack(const double* const*, int64_t, int64_t, double*) { TORCH_CHECK(false, "gram_tiles unavailable"); }
void gram_upper(const double*, int64_t, int64_t, double*, int64_t, bool, int64_t, int64_t) {
  TORCH_CHECK(false, "gram_tiles unavailable");
}
void rows_times_panels(const double*, int64_t, int64_t, const double*, int64_t, int64_t, double*, int64_t, const double*,
                       double*, int64_t) {
  TORCH_CHECK(false, "gram_tiles unavailable");
}

#endif

}  // namespace gram_tiles
}  // namespace kivi_fast
