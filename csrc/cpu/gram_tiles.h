// The Gram matrix's upper triangle of a column block of the stacked points, by register tiles (the
// distances of more than 32 points in more than a few dimensions: use_direct_distances in
// distances.h), and the same tiles for the kl op's projection of its weights on the points
// (rows_times_panels).
//
// BLAS exports no SYRK in every torch build, and the GEMMs of a split triangle (add_gram_upper in
// distances.cpp) still multiply 3/4 of the full product at 200 points; their operands are also copied
// twice, once to float64 and once more into BLAS's packed panels. Here one pass converts a block of
// float32 (or float64) rows straight into the panel layout the tiles read, and only tiles that touch
// the upper triangle are multiplied (about half the product). On an AVX2 CPU (AMD EPYC, 1 thread,
// against the split GEMMs of MKL): the kl op's forward 1.64x faster at (100, 50000), forward + backward
// 1.11-1.13x at (100, 51), 1.19x at (100, 700), 1.29x at (100, 50000); at 2000 points x 32 dimensions
// the Gram alone is about as fast as MKL's split GEMMs.
//
// Written for AVX2 + FMA (4 doubles a register). On an AMD EPYC with AVX-512 (Zen 4) they beat MKL's
// 8-wide GEMMs too (bench/README.md, "Instruction sets"); on other AVX-512 CPUs (Intel's), where
// 512-bit instructions may run at full width, the GEMMs' twice the work per instruction may win (not
// measured), so callers keep the GEMMs there (enabled(), isa::prefer_512_bit()).
#pragma once

#include <cstdint>

namespace kivi_fast {
namespace gram_tiles {

// Rows of one panel of the packed layout (the width of a tile's output).
inline constexpr int64_t kPanel = 8;

// Whether the CPU can run the tiles (AVX2 + FMA on x86-64).
bool available();
// Whether callers should use them: available() and not isa::prefer_512_bit(), unless a test switched
// them on or off.
bool enabled();
// Tests: use the tiles where available (true) or the split GEMMs (false); returns the old setting.
bool set_enabled(bool flag);

// The most columns pack() takes at once (rows past n read from a zero row of this length).
inline constexpr int64_t kMaxPackColumns = 2048;
// Doubles the packed copy of n rows of w columns takes.
inline int64_t packed_size(int64_t n, int64_t w) { return (n + kPanel - 1) / kPanel * kPanel * w; }
// x_i[0, w) - k[0, w) for i < n (rows[i] = x_i, k the centre: kivi.h's centre_coordinate of rows
// centre_rows(n)) as float64 into packed: the centred points, whose norms stay near the distances (far
// from the origin, uncentred norms would cancel to the distances' rounding). Panels of kPanel rows,
// each stored by column ([w][kPanel]); the rows past n of the last panel are zeros.
void pack(const float* const* rows, int64_t n, int64_t w, double* packed);
void pack(const double* const* rows, int64_t n, int64_t w, double* packed);
// Row tiles (of kTileRows rows) of n rows.
inline constexpr int64_t kTileRows = 4;
inline int64_t row_tiles(int64_t n) { return (n + kTileRows - 1) / kTileRows; }
// g[i ldg + j] = sum_{c < w} x_i[c] x_j[c] (accumulate: +=) for i <= j < n and the rows i of row tiles
// [t0, t1) (i in [t0 kTileRows, t1 kTileRows): threads can share one block), from pack()'s layout.
// The rest of g is not written. Row tile t costs about n - t kTileRows products of rows.
void gram_upper(const double* packed, int64_t n, int64_t w, double* g, int64_t ldg, bool accumulate, int64_t t0,
                int64_t t1);

// The same tiles for a general product, C = A B with A row-major and B in panels: c[i ldc + j] =
// sum_{k < w} a[i lda + k] b_j[k] for i < m, j < n_b, with b's columns in panels of kPanel columns,
// each stored by row ([w][kPanel], panel p at b + p kPanel w; columns past n_b zero). The kl op's
// projection of its weights on the points (A = the kernel rows, B = the points scaled by their
// coefficients): at 200 points x 51 dimensions MKL's GEMM spends as much time copying its operands and
// in its edge cases as in its kernel; at 2000 x 32 a third of its time packing the 64 MB of kernel
// rows (with these tiles the kl op is 1.04-1.06x faster forward+backward at (1000, 32) and (2000, 32),
// 1 and 2 threads). A of at most kPanelOrderMaxRows x kPanelOrderMaxRows stays in L2 while each
// panel of B stays in L1; a larger A is read once, in chunks of its columns. The rest of c is not
// written. Where v is given, also av[i] = sum_{k < w} a[i lda + k] v[k] for i < m, summed while the
// rows are in cache (the kl op's ratio at its evaluation points: at (2000, 32) a separate pass would
// read the 64 MB of kernel rows once more), in an order that depends on w alone: n_b may be 0 (no panels, b
// unread), and splitting the rows over calls changes nothing.
// Where first_row >= 0, A's rows are rows first_row.. of a symmetric w x w matrix (row 0 at
// a - first_row lda) of which only the entries from three left of the diagonal on are filled: a row tile
// starting at row i0 reads its columns below first_row + i0 down the columns of the rows above it (the
// upper part) and the rest along its rows, so the lower part need not be mirrored. Then the sums of a
// row depend on where its tile starts: split the rows over calls at multiples of kTileRows.
inline constexpr int64_t kPanelOrderMaxRows = 256;
inline int64_t panels(int64_t columns) { return (columns + kPanel - 1) / kPanel; }
void rows_times_panels(const double* a, int64_t m, int64_t lda, const double* b, int64_t n_b, int64_t w, double* c,
                       int64_t ldc, const double* v = nullptr, double* av = nullptr, int64_t first_row = -1);

}  // namespace gram_tiles
}  // namespace kivi_fast
