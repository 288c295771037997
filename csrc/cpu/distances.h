// Squared distances of the stacked points of one batch element (the upper triangle: the median, the
// fit and the evaluation read nothing else), by one of three paths:
//  - few dimensions: summed from coordinate differences (exact up to the last rounding), the points
//    transposed so that the inner loops run over points (rows::sqdist_from_point);
//  - few points in many dimensions (N <= 32, an MNIST layer): a Gram from the input rows in float64
//    registers (few_points.h), with no float64 copy of the samples;
//  - otherwise a Gram by column blocks converted to float64 while in cache: gram_tiles' register tiles
//    on AVX2 CPUs, GEMMs of the split triangle elsewhere; then g_ii + g_jj - 2 g_ij.
// The Gram paths multiply the points less a centre (centre_point: kivi.h's centre_coordinate), so
// that the norms stay near the distances at any distance from the origin.
// The median's counting pass (median.h, BracketTally) runs on the rows as they are computed where that
// saves a pass over the triangle.
#pragma once

#include <ATen/ATen.h>
#include <cstdint>

#include "cpu/buffers.h"
#include "cpu/loops.h"
#include "cpu/median.h"
#include "kivi.h"

namespace kivi_fast {
namespace cpu {

// Whether distances are summed from coordinate differences rather than taken from a Gram: up to
// kMaxDirectDimTiles dimensions where the Gram would take gram_tiles' register tiles, up to
// kMaxDirectDimGemm elsewhere. Forward + backward, float32, 1 thread: the differences are slower than
// the register tiles from 16 dimensions ((100, 16) 5%, (100, 32) 14%, (1000, 32) 10%) and even at 8
// ((100, 8) and 128 x (100, 8) within +-4%); faster than the split GEMMs up to 32 ((100, 16) and
// (1000, 32) forward 15% and 20%), slower from ~48. Few points (the few-points Gram, not the tiles)
// keep the differences up to 32 dimensions.
constexpr int64_t kMaxDirectDimTiles = 8, kMaxDirectDimGemm = 32;
bool use_direct_distances(int64_t rows, int64_t d);

// Whether the few-points kernels (few_points.h) take N stacked points.
bool use_few_points(int64_t rows);
// Columns per task when the few-points kernels split one element over threads.
constexpr int64_t kFewPointsGrain = 16384;

// Columns [c0, c0 + w) of the centre of batch element b's stacked points into out (w values, each an
// input coordinate): kivi.h's centre_coordinate of stacked rows centre_rows(N). (The Gram kernels
// take it a block of columns at a time, from the same three rows: x86::centre_of_columns.)
void centre_point(const Stack& s, int64_t b, int64_t c0, int64_t w, double* out);

// Squared distances of the stacked points of batch element b into sq ([N, N]; the upper triangle and
// the diagonal: callers read nothing else) and each point's squared distance from the centre
// (centre_point) into norms ([N]: the squared norms of the centred points the Gram paths multiply). Where summed from
// differences (use_direct_distances), the points are left transposed in work.points ([d, N], with room
// for one more row: kl's ratio column). Where middle is given, the median's counting pass may run on
// the distances as they are computed, and leaves its findings there.
void distances_one(const Stack& s, int64_t b, double* sq, double* norms, bool parallel, Work& work,
                   Middle* middle = nullptr);

// The squared distances between the first nx stacked points of batch element b and the other ny into
// out ([nx, ny]), and every stacked point's squared distance from the centre into norms ([N]), as
// distances_one takes them: summed from differences where it would, and by the few-points Gram (the
// same values, bit for bit), else by one GEMM of the centred points a column block. distances_one's
// triangle would cost (nx + ny)^2 / 2 pairs where nx ny are asked for: rbf_gram's, and the ratio's many
// evaluation points against a fit's few centres ((N, m) = (300, 40000): a 13 GB square, 96 MB here).
void cross_distances_one(const Stack& s, int64_t b, int64_t nx, double* out, double* norms, bool parallel,
                         Work& work);

// NaN/Inf in a sample makes its norm (distances_one's) NaN/Inf, and so does a point so far from the
// centre that distances could overflow (squarable): rows [0, n_den) are denom, then numer.
void check_finite(const double* norms, int64_t n_den, int64_t n, Names names);

}  // namespace cpu
}  // namespace kivi_fast
