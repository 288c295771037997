// The Gram matrix's upper triangle of a column block of the stacked points, by register tiles (the
// GEMM path of the distances: more than 32 points in more than 32 dimensions).
//
// BLAS exports no SYRK in every torch build, and the GEMMs of a split triangle (add_gram_upper in
// cpu.cpp) still multiply 3/4 of the full product at 200 points; their operands are also copied
// twice, once to float64 and once more into BLAS's packed panels. Here one pass converts a block of
// float32 (or float64) rows straight into the panel layout the tiles read, and only tiles that touch
// the upper triangle are multiplied (about half the product). Measured on this project's AVX2 CPU
// (AMD EPYC, 1 thread) against the split GEMMs of MKL, conversion included: 1.2x faster at 200 points
// x 51 dimensions, 1.3-1.4x at 200 x 700 and 200 x 50000, 1.5-2.9x at 41-73 points.
//
// Written for AVX2 + FMA (4 doubles a register). On an AVX-512 CPU, MKL's 8-wide GEMM beats these
// 4-wide tiles even with its 3/4 of the product, so callers keep the GEMMs there (enabled()).
#pragma once

#include <cstdint>

namespace kivi_fast {
namespace gram_tiles {

// Rows of one panel of the packed layout (the width of a tile's output).
inline constexpr int64_t kPanel = 8;

// Whether the CPU can run the tiles (AVX2 + FMA on x86-64).
bool available();
// Whether callers should use them: available() and no AVX-512, unless a test switched them on or off.
bool enabled();
// Tests: use the tiles where available (true) or the split GEMMs (false); returns the old setting.
bool set_enabled(bool flag);

// The most columns pack() takes at once (rows past n read from a zero row of this length).
inline constexpr int64_t kMaxPackColumns = 2048;
// Doubles the packed copy of n rows of w columns takes.
inline int64_t packed_size(int64_t n, int64_t w) { return (n + kPanel - 1) / kPanel * kPanel * w; }
// x_i[0, w) for i < n (rows[i] = x_i) as float64 into packed: panels of kPanel rows, each stored by
// column ([w][kPanel]); the rows past n of the last panel are zeros.
void pack(const float* const* rows, int64_t n, int64_t w, double* packed);
void pack(const double* const* rows, int64_t n, int64_t w, double* packed);
// Panels of n rows.
inline int64_t panels(int64_t n) { return (n + kPanel - 1) / kPanel; }
// g[i ldg + j] = sum_{c < w} x_i[c] x_j[c] (accumulate: +=) for i <= j < n and the columns j of panels
// [p0, p1) (j in [p0 kPanel, p1 kPanel): threads can share one block), from pack()'s layout. The rest
// of g is not written. Panel p costs about p + 1 tiles.
void gram_upper(const double* packed, int64_t n, int64_t w, double* g, int64_t ldg, bool accumulate, int64_t p0,
                int64_t p1);

}  // namespace gram_tiles
}  // namespace kivi_fast
