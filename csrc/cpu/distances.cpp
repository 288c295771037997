#include "cpu/distances.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

#include "cpu/blas.h"
#include "cpu/few_points.h"
#include "cpu/gram_tiles.h"
#include "cpu/simd_rows.h"

namespace kivi_fast {
namespace cpu {
namespace {

// Rows [i0, i1) of the upper triangle from inner products to squared distances, in place:
// g_ii + g_jj - 2 g_ij (>= 0, exact 0 diagonal), with norms[j] = g_jj (j >= i0) taken before.
void gram_rows_to_sqdist(double* g, int64_t n, const double* norms, int64_t i0, int64_t i1) {
  for (int64_t i = i0; i < i1; ++i) {
    double* row = g + i * n;
    rows::gram_row_to_sqdist(row + i + 1, norms + i + 1, norms[i], n - i - 1);
    row[i] = 0.0;
  }
}

// Batch element b's stacked points into pt transposed ([d, N]: the differences' inner loops run over
// points), each point's squared distance from the centre (centre_point) into norms (they only check the
// values); returns the points as loaded ([N, d]).
std::vector<double> transposed_points(const Stack& s, int64_t b, double* pt, double* norms) {
  const int64_t n = s.rows, d = s.d;
  std::vector<double> rows(n * d), centre(d);
  s.load(b, 0, d, rows.data());
  centre_point(s, b, 0, d, centre.data());
  for (int64_t i = 0; i < n; ++i) {
    double sq = 0.0;
    for (int64_t k = 0; k < d; ++k) {
      pt[k * n + i] = rows[i * d + k];
      const double x = rows[i * d + k] - centre[k];
      sq += x * x;
    }
    norms[i] = sq;
  }
  return rows;
}

// Squared distances of batch element b by differences into the upper triangle of out ([N, N]), with
// a zero diagonal. Leaves the points transposed ([d, N]: the inner loops run over points) in work.points,
// which has room for one more row (kl's ratio column).
void direct_sqdist(const Stack& s, int64_t b, double* out, double* norms, bool parallel, Work& work,
                   Middle* middle) {
  const int64_t n = s.rows, d = s.d, pairs = n * (n - 1) / 2;
  double* const pt = work.points.get(n * (d + 1));
  std::optional<BracketTally> tally;
  {
    const std::vector<double> rows = transposed_points(s, b, pt, norms);
    // The median's bracket counts each row of distances while it is in L1, as gram_one's tiles do for
    // large matrices: at 128x(100, 8) the bins' passes over the finished triangle (copy, histogram,
    // gather) take ~2x their time on the same values in cache, ~20% of the call (counted here, the
    // call is ~1.09x faster there, 1.03x at (100, 8)).
    if (middle != nullptr && !parallel && pairs >= kMinSampledPairs) {
      const double* x = rows.data();
      start_tally_from_points(tally, n, d, [&](int64_t i) { return x + i * d; });
    }
  }
  for_triangle_rows(n, parallel, 8, [&](int64_t i) {
    rows::sqdist_from_point(pt, n, d, i, i + 1, out + i * n);
    out[i * n + i] = 0.0;
    if (tally) tally->add(0, out + i * n + i + 1, n - 1 - i);
  });
  finish_tally(tally, middle);
}

// The upper triangle (with the diagonal) of a a^T into g, the rows split in halves: the off-diagonal
// block 12 by one GEMM, the diagonal blocks 11 and 22 the same way in turn, down to blocks of fewer
// than 2 kSplitGramRows rows, which are multiplied whole. About half the flops of the full product
// (BLAS's syrk is not exported by every torch build); the lower triangle is left as it was.
constexpr int64_t kSplitGramRows = 64;

void add_gram_upper(double* g, int64_t ldg, const double* a, int64_t n, int64_t w, bool assign) {
  if (n < 2 * kSplitGramRows) {
    gemm(false, true, n, n, w, a, w, a, w, !assign, g, ldg);
    return;
  }
  const int64_t h = n / 2;
  const double* a2 = a + h * w;
  add_gram_upper(g, ldg, a, h, w, assign);
  gemm(false, true, h, n - h, w, a, w, a2, w, !assign, g + h, ldg);
  add_gram_upper(g + h * ldg + h, ldg, a2, n - h, w, assign);
}

// Rows x_i of the [n, w] block x of batch element b's columns [c0, c0 + w) to x_i - k, k the
// centre's columns (centre_point). The Gram paths multiply centred points (the kernels of
// few_points.h and gram_tiles::pack centre while converting): far from the origin the norms of
// uncentred points, of which g_ii + g_jj - 2 g_ij keeps only the difference, would cancel to the
// distances' rounding (at (100, 64), 1e6 standard deviations out, 2e-2 of kernel_kl's value).
void centre_block(const Stack& s, int64_t b, int64_t c0, double* x, int64_t w) {
  thread_local std::vector<double> centre;
  centre.resize(w);
  centre_point(s, b, c0, w, centre.data());
  for (int64_t i = 0; i < s.rows; ++i)
    for (int64_t c = 0; c < w; ++c) x[i * w + c] -= centre[c];
}

// Columns [c0, c0 + w) of batch element b in gram_tiles' packed layout (packed_size(rows, w) doubles).
void pack_block(const Stack& s, int64_t b, int64_t c0, int64_t w, double* dst) {
  with_row_pointers(s, b, c0, [&](auto rows) { gram_tiles::pack(rows, s.rows, w, dst); });
}

void few_points_gram(const Stack& s, int64_t b, double* out, bool parallel) {
  const int64_t n = s.rows;
  std::fill(out, out + n * n, 0.0);
  AT_DISPATCH_FLOATING_TYPES(s.parts[0].scalar_type(), "kivi_fast_few_points_gram", [&] {
    auto add_columns = [&](int64_t c0, int64_t c1, double* acc) {
      const scalar_t* rows[few_points::kMaxRows];
      row_pointers(s, b, c0, rows);
      few_points::add_gram_lower(rows, n, c1 - c0, acc);
    };
    if (!parallel || s.d < 2 * kFewPointsGrain || at::get_num_threads() == 1) {
      add_columns(0, s.d, out);
      return;
    }
    sum_of_thread_partials(n, s.d, kFewPointsGrain, wrap(out, {n, n}), [&](int64_t c0, int64_t c1, Tensor part) {
      add_columns(c0, c1, part.data_ptr<double>());
    });
  });
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < i; ++j) out[j * n + i] = out[i * n + j];
}

// Inner products of the stacked points of batch element b, centred (kivi.h, centre_coordinate), into
// the upper triangle of out ([N, N]).
// Parallel over column blocks (thread-local partial sums) when asked and there is more than one block;
// one block's tiles are shared by the threads. Where norms is given and the Gram is one block of tiles
// on one thread, of a matrix larger than this machine's L3, out gets the squared distances instead
// (what the whole-matrix pass makes of it, bit for bit) and norms the squared norms, and the call returns
// true: the row tiles run from the last, so that each tile's rows turn into distances while they are
// in cache, every norm they need (g_jj, j >= i) already computed. A separate pass reads and writes the
// triangle again: ~2% of the call at (2000, 32) (64 MB); at (1000, 32) (32 MB) the two orders are
// even, and at (100, 51) (320 KB, in L2) this one is ~1.5% slower, hence the size gate.
constexpr int64_t kFusedSqdistBytes = int64_t{32} << 20;
bool gram_one(const Stack& s, int64_t b, double* out, bool parallel, double* norms, Middle* middle) {
  if (use_few_points(s.rows)) {
    few_points_gram(s, b, out, parallel);
    return false;
  }
  const int64_t workers = parallel ? at::get_num_threads() : 1;
  const int64_t n = s.rows;
  const Stack::Blocks split = s.column_blocks(workers);  // not a structured binding: lambdas capture these
  const int64_t width = split.width, blocks = split.count;
  // Several blocks over the threads sum into per-thread n x n partials, where those fit (loops.h);
  // otherwise the blocks go one after another through BLAS's GEMMs, which use the threads (the
  // register tiles would run on one).
  const bool partials = parallel && blocks > 1 && buffer_per_thread_fits(n);
  const bool tiles = gram_tiles::enabled() && width <= gram_tiles::kMaxPackColumns &&
                     (!parallel || blocks == 1 || partials);
  const int64_t row_tiles = gram_tiles::row_tiles(n);
  if (tiles && parallel && blocks == 1) {
    double* buf = thread_work().block.get(gram_tiles::packed_size(n, width));
    pack_block(s, b, 0, s.d, buf);
    // row tile t costs ~n - 4 t: the pairs (t, row_tiles - 1 - t) cost the same
    at::parallel_for(0, (row_tiles + 1) / 2, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        gram_tiles::gram_upper(buf, n, s.d, out, n, false, t, t + 1);
        const int64_t u = row_tiles - 1 - t;
        if (u != t) gram_tiles::gram_upper(buf, n, s.d, out, n, false, u, u + 1);
      }
    });
    return false;
  }
  if (tiles && !parallel && blocks == 1 && norms != nullptr &&
      n * n * static_cast<int64_t>(sizeof(double)) > kFusedSqdistBytes) {
    double* buf = thread_work().block.get(gram_tiles::packed_size(n, width));
    pack_block(s, b, 0, s.d, buf);
    // The median's counting pass (select_two_sampled) on each tile's distances while they are in cache,
    // against a bracket from a sample of distances summed from the input rows: a separate pass would
    // read the triangle (64 MB at (2000, 32)) once more.
    std::optional<BracketTally> tally;
    if (middle != nullptr && n * (n - 1) / 2 > kPackedPairs) {
      // from the input rows (contiguous; the packed panels put each coordinate on another line)
      with_row_pointers(s, b, 0, [&](auto x) {
        start_tally_from_points(tally, n, s.d, [&](int64_t i) { return x[i]; });
      });
    }
    constexpr int64_t R = gram_tiles::kTileRows;
    for (int64_t t = row_tiles - 1; t >= 0; --t) {
      gram_tiles::gram_upper(buf, n, s.d, out, n, false, t, t + 1);
      const int64_t i0 = t * R, i1 = std::min(n, i0 + R);
      for (int64_t i = i0; i < i1; ++i) norms[i] = out[i * n + i];
      gram_rows_to_sqdist(out, n, norms, i0, i1);
      if (tally)
        for (int64_t i = i0; i < i1; ++i) tally->add(0, out + i * n + i + 1, n - 1 - i);
    }
    finish_tally(tally, middle);
    return true;
  }
  auto add_blocks = [&](int64_t k0, int64_t k1, double* target, bool first_assigns) {
    double* buf = thread_work().block.get(tiles ? gram_tiles::packed_size(n, width) : n * width);
    for (int64_t k = k0; k < k1; ++k) {
      const int64_t c0 = k * width, w = std::min(width, s.d - c0);
      const bool assign = first_assigns && k == k0;
      if (tiles) {
        pack_block(s, b, c0, w, buf);
        gram_tiles::gram_upper(buf, n, w, target, n, !assign, 0, row_tiles);
      } else {
        s.load(b, c0, w, buf);
        centre_block(s, b, c0, buf, w);
        add_gram_upper(target, n, buf, n, w, assign);
      }
    }
  };
  if (!partials) {
    add_blocks(0, blocks, out, true);  // one thread, or GEMMs one block at a time (BLAS uses the threads)
  } else {
    sum_of_thread_partials(n, blocks, 1, wrap(out, {n, n}), [&](int64_t k0, int64_t k1, Tensor part) {
      add_blocks(k0, k1, part.data_ptr<double>(), false);
    });
  }
  return false;
}

}  // namespace

bool use_direct_distances(int64_t rows, int64_t d) {
  const bool tiles = gram_tiles::enabled() && !use_few_points(rows);
  return d <= (tiles ? kMaxDirectDimTiles : kMaxDirectDimGemm);
}

void centre_point(const Stack& s, int64_t b, int64_t c0, int64_t w, double* out) {
  if (s.rows == 0) return;  // (no distances to centre)
  const auto r = centre_rows(s.rows);
  with_row_pointers(s, b, c0, [&](auto rows) {
    for (int64_t k = 0; k < w; ++k) {
      out[k] = centre_coordinate(static_cast<double>(rows[r[0]][k]), static_cast<double>(rows[r[1]][k]),
                                 static_cast<double>(rows[r[2]][k]));
    }
  });
}

bool use_few_points(int64_t rows) { return rows <= few_points::kMaxRows && few_points::available(); }

void distances_one(const Stack& s, int64_t b, double* sq, double* norms, bool parallel, Work& work, Middle* middle) {
  if (use_direct_distances(s.rows, s.d)) {
    direct_sqdist(s, b, sq, norms, parallel, work, middle);
    return;
  }
  if (gram_one(s, b, sq, parallel, norms, middle)) return;
  const int64_t n = s.rows;
  for (int64_t i = 0; i < n; ++i) norms[i] = sq[i * n + i];
  gram_rows_to_sqdist(sq, n, norms, 0, n);
}

void cross_distances_one(const Stack& s, int64_t b, int64_t nx, double* out, double* norms, bool parallel,
                         Work& work) {
  const int64_t n = s.rows, d = s.d, ny = n - nx;
  if (use_direct_distances(n, d)) {
    double* const pt = work.points.get(n * d);
    transposed_points(s, b, pt, norms);
    auto x_rows = [&](int64_t i0, int64_t i1) {
      std::vector<double> row(n);  // (sqdist_from_point writes entries [nx, n))
      for (int64_t i = i0; i < i1; ++i) {
        rows::sqdist_from_point(pt, n, d, i, nx, row.data());
        std::copy_n(row.data() + nx, ny, out + i * ny);
      }
    };
    if (parallel) {
      at::parallel_for(0, nx, std::max<int64_t>(1, 4096 / std::max<int64_t>(1, ny * d)), x_rows);
    } else {
      x_rows(0, nx);
    }
    return;
  }
  if (use_few_points(n)) {
    // Its Gram reads the input rows once, with no float64 copy: at (10, 314000) the ratio op's 10 x 20
    // distances took 2.1x as long through the converted blocks' GEMM. Its square is small.
    double* sq = work.sq.get(n * n);
    distances_one(s, b, sq, norms, parallel, work);
    for (int64_t i = 0; i < nx; ++i) std::copy_n(sq + i * n + nx, ny, out + i * ny);
    return;
  }
  std::fill(norms, norms + n, 0.0);
  const Stack::Blocks split = s.column_blocks();
  double* buf = work.block.get(n * split.width);
  for (int64_t k = 0; k < split.count; ++k) {
    const int64_t c0 = k * split.width, w = std::min(split.width, d - c0);
    s.load(b, c0, w, buf);
    centre_block(s, b, c0, buf, w);
    for (int64_t i = 0; i < n; ++i) {
      double sq = 0.0;
      for (int64_t c = 0; c < w; ++c) sq += buf[i * w + c] * buf[i * w + c];
      norms[i] += sq;
    }
    if (nx > 0 && ny > 0) gemm(false, true, nx, ny, w, buf, w, buf + nx * w, w, k > 0, out, ny);
  }
  for (int64_t i = 0; i < nx; ++i) rows::gram_row_to_sqdist(out + i * ny, norms + nx, norms[i], ny);
}

void check_finite(const double* norms, int64_t n_den, int64_t n, Names names) {
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK_VALUE(squarable(norms[i]), i < n_den ? names.denom : names.numer, kNotFiniteMessage);
  }
}

}  // namespace cpu
}  // namespace kivi_fast
