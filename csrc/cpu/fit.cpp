#include "cpu/fit.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>

#include "cpu/distances.h"
#include "cpu/gram_tiles.h"
#include "cpu/median.h"
#include "cpu/simd_rows.h"
#include "cpu/solve.h"

namespace kivi_fast {
namespace cpu {
namespace {

// The kernel in the first `rows` rows of sq (n x n) from the squared distances in its upper triangle:
// exp of the upper part, the diagonal 1, and where `lower`, the lower part mirrored (the kernel is
// symmetric), else only the three entries left of the diagonal (what gram_tiles::rows_times_panels
// reads of it with first_row). The fit reads only the upper part; the evaluation reads whole rows, or
// the upper part through rows_times_panels. Mirroring only the evaluation's rows is no faster at
// (2000, 32) than mirroring all of them.
constexpr int64_t kL2Bytes = int64_t{512} << 10;  // this project's AMD EPYC core's
void kernel_rows_from_upper(double* sq, int64_t n, int64_t rows, double sigma, bool parallel, const SystemRows& sys,
                            bool lower) {
  const double scale = -0.5 / (sigma * sigma);
  auto exp_rows = [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      rows::scaled_exp(sq + i * n + i + 1, scale, n - i - 1);
      sq[i * n + i] = 1.0;
      if (i >= sys.n_den) continue;
      sys.numer_sums[i] = rows::sum(sq + i * n + sys.n_den, n - sys.n_den);
      if (sys.system32 != nullptr) fill_system_row(sq, n, sys.n_den, sys.lam, sys.system32, sys.n_den, i);
    }
  };
  // in strips of 8 columns: the 8 source rows are read along their length, a cache line of each at a
  // time, instead of a line per element down a column. Without `lower`, only the entries (i, j) with
  // i - j <= kNearDiagonal: a row tile's rows below its first read those along the rows.
  constexpr int64_t kStrip = 8, kNearDiagonal = gram_tiles::kTileRows - 1;
  auto mirror_strips = [&](int64_t s0, int64_t s1) {
    for (int64_t j0 = s0 * kStrip; j0 < std::min(rows, s1 * kStrip); j0 += kStrip) {
      const int64_t j1 = std::min(rows, j0 + kStrip);
      const int64_t i_end = lower ? rows : std::min(rows, j1 + kNearDiagonal);
      for (int64_t i = j0 + 1; i < i_end; ++i) {
        double* ri = sq + i * n;
        const int64_t j_begin = lower ? j0 : std::max(j0, i - kNearDiagonal);
        for (int64_t j = j_begin, end = std::min(j1, i); j < end; ++j) ri[j] = sq[j * n + i];
      }
    }
  };
  const int64_t strips = (rows + kStrip - 1) / kStrip;
  if (parallel) {  // a strip writes rows below it, which are another thread's: all exponentials first
    at::parallel_for(0, rows, 16, exp_rows);
    at::parallel_for(0, strips, 4, mirror_strips);
  } else if (rows * n * static_cast<int64_t>(sizeof(double)) > kL2Bytes) {
    // each strip's rows mirrored right after their exponentials, while they are in L2 ((2000, 32):
    // 1.5% faster; below L2 nothing to gain, and 128 x (100, 8) 1% slower)
    for (int64_t t = 0; t < strips; ++t) {
      exp_rows(t * kStrip, std::min(rows, (t + 1) * kStrip));
      mirror_strips(t, t + 1);
    }
  } else {
    exp_rows(0, rows);
    mirror_strips(0, strips);
  }
}

}  // namespace

double fit_one(const Stack& s, int64_t b, int64_t n_den, int64_t kernel_rows, bool lower, double lam,
               const double* sigma_given, Names names, bool parallel, Work& work) {
  TORCH_INTERNAL_ASSERT(kernel_rows >= n_den, "the solve reads the denominator's rows");
  const int64_t n = s.rows;
  double* sq = work.sq.get(n * n);
  double* norms = work.norms.get(n);
  double* coef = work.coef.get(n);
  Middle middle;
  distances_one(s, b, sq, norms, parallel, work, sigma_given == nullptr ? &middle : nullptr);
  check_finite(norms, n_den, n, names);
  const double sigma = sigma_given != nullptr ? sigma_given[b] : checked_median(sq, n, parallel, middle);
  TORCH_CHECK_VALUE(sigma_given != nullptr || sigma >= kMinBandwidth, kSmallMedianMessage);
  float* const system32 = uses_refined_solve(n_den) ? system32_buffer(work.system, n_den) : nullptr;
  kernel_rows_from_upper(sq, n, kernel_rows, sigma, parallel, {n_den, lam, coef, system32}, lower);
  solve_alpha_one(sq, n, n_den, lam, coef, work, parallel, system32 != nullptr);
  std::fill(coef + n_den, coef + n, 1.0 / (lam * static_cast<double>(n - n_den)));
  return sigma;
}

const double* sigma_data(const std::optional<Tensor>& sigma) {
  return sigma.has_value() ? sigma->data_ptr<double>() : nullptr;
}

Tensor sqdist(const Tensor& x, const Tensor& y) {
  Stack s({x, y});
  const int64_t nx = x.size(1), ny = y.size(1), n = s.rows;
  auto out = at::empty({s.batch, nx, ny}, at::kDouble);
  for_each_element(s, [&](int64_t b, bool parallel, Work& work) {
    double* norms = work.norms.get(n);
    cross_distances_one(s, b, nx, out.data_ptr<double>() + b * nx * ny, norms, parallel, work);
    check_finite(norms, nx, n, {"y", "x"});
  });
  return out;
}

Tensor median_bandwidth(const Tensor& x) {
  Stack s({x});
  const int64_t n = s.rows;
  check_median_points(n);
  auto sigma = at::empty({s.batch}, at::kDouble);
  for_each_element(s, [&](int64_t b, bool parallel, Work& work) {
    double* sq = work.sq.get(n * n);
    double* norms = work.norms.get(n);
    Middle middle;
    distances_one(s, b, sq, norms, parallel, work, &middle);
    check_finite(norms, n, n, {"x", "x"});
    sigma.data_ptr<double>()[b] = checked_median(sq, n, parallel, middle);
  });
  return sigma;
}

Fit fit(const Tensor& numer, const Tensor& denom, double lam, const std::optional<Tensor>& sigma, Names names) {
  Stack s({denom, numer});
  const int64_t n = s.rows;
  if (!sigma.has_value()) check_median_points(n);
  auto coef = at::empty({s.batch, n}, at::kDouble);
  auto used = at::empty({s.batch}, at::kDouble);
  for_each_element(s, [&](int64_t b, bool parallel, Work& work) {
    const int64_t n_den = denom.size(1);
    used.data_ptr<double>()[b] = fit_one(s, b, n_den, n_den, false, lam, sigma_data(sigma), names, parallel, work);
    std::copy_n(work.coef.get(n), n, coef.data_ptr<double>() + b * n);
  });
  return {coef, used};
}

}  // namespace cpu
}  // namespace kivi_fast
