// The kl op's CPU kernels. The forward fits the ratio per batch element (fit.h) and evaluates it at
// q_z, whose kernel rows the fit already holds (q_z is one of the fitted sets); it returns the KL, the
// grad state for the backward (kivi.h, grad_state_width), the bandwidth and the fraction of clipped
// points. With few dimensions (d + 1 < N) the grad state is the projection of the weights on the points,
// so that the backward (kl_grad) is one elementwise pass; otherwise the weights themselves, and the
// backward reads the samples once more (weighted_grad, grad.cpp).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <optional>
#include <vector>

#include "cpu/blas.h"
#include "cpu/buffers.h"
#include "cpu/distances.h"
#include "cpu/fit.h"
#include "cpu/gram_tiles.h"
#include "cpu/kept_outputs.h"
#include "cpu/loops.h"
#include "cpu/median.h"
#include "cpu/simd_rows.h"
#include "kivi.h"

namespace kivi_fast {
namespace cpu {
namespace {

// The points of batch element b scaled by their coefficients, Y = coef * X, in gram_tiles' panels of
// columns for rows_times_panels: [panels(d)][N][kPanel], zero past column d.
void scaled_point_panels(const Stack& s, int64_t b, const double* coef, double* y) {
  constexpr int64_t P = gram_tiles::kPanel;
  const int64_t n = s.rows, d = s.d;
  with_row_pointers(s, b, 0, [&](auto rows) {
    for (int64_t t0 = 0; t0 < d; t0 += P) {
      const int64_t width = std::min(P, d - t0);
      double* panel = y + t0 * n;
      for (int64_t c = 0; c < n; ++c) {
        const auto* x = rows[c] + t0;
        double* o = panel + c * P;
        for (int64_t t = 0; t < width; ++t) o[t] = coef[c] * static_cast<double>(x[t]);
        std::fill(o + width, o + P, 0.0);
      }
    }
  });
}

}  // namespace

static_assert(rows::kRowDotsMaxDim <= kMaxDirectDimTiles && rows::kRowDotsMaxDim <= kMaxDirectDimGemm,
              "the row dots read the transposed points that direct_sqdist leaves");

std::tuple<Tensor, Tensor, Tensor, Tensor> kl(const Tensor& prior_z, const Tensor& q_z, double lam, double clip,
                                              const std::optional<Tensor>& sigma, bool reverse, bool grad_state) {
  const KlRoles roles = kl_roles(prior_z, q_z, reverse);
  Stack s({roles.denom, roles.numer});
  const int64_t n = s.rows, n_den = roles.denom.size(1), m = q_z.size(1), d = s.d;
  if (!sigma.has_value()) check_median_points(n);
  const bool projection = grad_state && grad_state_is_projection(n, d);
  const int64_t width = grad_state ? grad_state_width(n, d) : 0;
  auto kl_out = at::empty({s.batch}, at::kDouble);
  auto state = kept_outputs::empty({s.batch, m, width}, at::TensorOptions(at::kDouble));
  auto used = at::empty({s.batch}, at::kDouble);
  auto clipped_out = at::empty({s.batch}, at::kDouble);
  const bool direct = d <= rows::kRowDotsMaxDim;
  // Where the projection takes gram_tiles' row tiles, r_j comes from the same pass over the kernel
  // rows (with grad_state or not, so that the value does not depend on it). Row-wise, it is a column
  // d of Y = coef in the row dots' pass (rows::dots_with_columns sums each column alike, with
  // grad_state or not; each kernel row is read once); elsewhere from rows::dot.
  const bool tiled_rows = grad_state_is_projection(n, d) && !direct && gram_tiles::enabled();
  // The row tiles read the kernel's lower part from its upper part above kPanelOrderMaxRows points,
  // where mirroring it would be a pass over memory ((2000, 32): 16 MB written, read again by the tiles).
  const bool tiles_read_upper = tiled_rows && n > gram_tiles::kPanelOrderMaxRows;
  for_each_element(s, [&](int64_t b, bool parallel, Work& work) {
    // the evaluation reads the kernel rows of q_z: the denominator's own (reverse) or all of them
    const double sg = fit_one(s, b, n_den, roles.row0 + m, !tiles_read_upper, lam, sigma_data(sigma), roles.names,
                              parallel, work);
    used.data_ptr<double>()[b] = sg;
    // The evaluation points q_z are fitted samples too: their kernel rows are already in work.sq
    // (where tiles_read_upper, their upper part and the three entries left of the diagonal).
    // r_j = sum_c coef_c k(c, z_j); W_jc = coef_c k(c, z_j) / (sigma^2 r_j), zero where r_j <= clip.
    const double* coef = work.coef.get(n);
    const double* kernel_rows = work.sq.get(n * n) + roles.row0 * n;
    double* out = state.data_ptr<double>() + b * m * width;
    // The projection: sum_c W_jc c = row_scale_j sum_c k(c, z_j) (coef_c c), so the kernel rows times
    // the points scaled by their coefficients, Y = coef * X (no W needed). Up to rows::kRowDotsMaxDim
    // dimensions Y is kept transposed ([d + 1, N] with coef in row d, from the points direct_sqdist left,
    // asked for at the size it asked for, so that Scratch::get hands them back as they are) for row-wise dot
    // products (d sums in registers). Above, Y goes in gram_tiles' panels for its register tiles
    // (forward+backward 1.04-1.11x faster than MKL's GEMM from (100, 16) to (2000, 32), float32, which
    // spends as much time copying its operands and in its edge cases as in its kernel); where the tiles
    // are off (isa::prefer_512_bit(), or no AVX2), [N, d] for one GEMM.
    static_assert(rows::kRowDotsMaxDim + 1 <= rows::kDotsColumnsPerPass, "the row dots and the ratio in one pass");
    const bool tiles = projection && tiled_rows;
    double* const y = !projection ? nullptr
                      : tiles     ? work.points.get(gram_tiles::panels(d) * gram_tiles::kPanel * n)
                      : direct    ? work.points.get(n * (d + 1))  // direct_sqdist's, with its spare row
                                  : work.points.get(n * d);
    if (projection && direct) {
      for (int64_t k = 0; k < d; ++k)
        for (int64_t c = 0; c < n; ++c) y[k * n + c] *= coef[c];
      std::copy_n(coef, n, y + d * n);
    } else if (tiles) {
      scaled_point_panels(s, b, coef, y);
    } else if (projection) {
      s.load(b, 0, d, y);
      for (int64_t c = 0; c < n; ++c) rows::scale(y + c * d, coef[c], d);
    }
    std::vector<double> log_r(m), row_scale(m), ratio(tiled_rows ? m : 0);
    std::vector<char> clipped(m);  // r_j <= clip
    if (tiled_rows) {
      // Up to kPanelOrderMaxRows points on one thread even when the element is split: d < N - 1 makes
      // it at most ~16 M multiply-adds ((100, 100): 2 M, ~50 us). Above, rows of the kernel per thread.
      // split over threads at whole row tiles: where the tiles read the upper part, a row's sums depend
      // on where its tile starts
      constexpr int64_t T = gram_tiles::kTileRows;
      auto kernel_times_y = [&](int64_t t0, int64_t t1) {
        const int64_t j0 = t0 * T, j1 = std::min(m, t1 * T);
        gram_tiles::rows_times_panels(kernel_rows + j0 * n, j1 - j0, n, y, tiles ? d : 0, n, out + j0 * width, width,
                                      coef, ratio.data() + j0, tiles_read_upper ? roles.row0 + j0 : -1);
      };
      if (parallel && n > gram_tiles::kPanelOrderMaxRows) {
        at::parallel_for(0, gram_tiles::row_tiles(m), 64 / T, kernel_times_y);
      } else {
        kernel_times_y(0, gram_tiles::row_tiles(m));
      }
    }
    auto rows_body = [&](int64_t j0, int64_t j1) {
      if (projection && direct) {  // two rows a pass: each load of Y serves both
        int64_t j = j0;
        for (; j + 2 <= j1; j += 2)
          rows::dots_with_columns_two_rows(kernel_rows + j * n, kernel_rows + (j + 1) * n, y, n, d + 1,
                                           out + j * width, out + (j + 1) * width);
        if (j < j1) rows::dots_with_columns(kernel_rows + j * n, y, n, d + 1, out + j * width);
      }
      for (int64_t j = j0; j < j1; ++j) {
        const double* k = kernel_rows + j * n;
        double* const p = grad_state ? out + j * width : nullptr;
        double r;
        if (tiled_rows) {
          r = ratio[j];
        } else if (projection && direct) {
          r = p[d];
        } else if (direct) {
          rows::dots_with_columns(k, coef, n, 1, &r);
        } else {
          r = rows::dot(coef, k, n);
        }
        log_r[j] = std::log(std::max(r, clip));
        clipped[j] = r <= clip;
        row_scale[j] = r > clip ? 1.0 / (sg * sg * r) : 0.0;
        if (!grad_state) continue;
        if (!projection) {  // the weights W_j = row_scale_j coef * k
          rows::mul_scale(coef, k, row_scale[j], out + j * n, n);
          continue;
        }
        out[j * width + d] = row_scale[j] * r;  // sum_c W_jc
        if (tiles) {
          rows::scale(out + j * width, row_scale[j], d);
        } else if (direct) {
          for (int64_t t = 0; t < d; ++t) p[t] *= row_scale[j];
        }
      }
    };
    if (parallel) {
      at::parallel_for(0, m, 16, rows_body);
    } else {
      rows_body(0, m);
    }
    if (projection && !direct && !tiles) {
      // as P^T = Y^T K^T: MKL runs this orientation of the thin product ~1.8x faster than K Y
      // ([1000, 2000] x [2000, 32]: 4.5 against 7.9 ms on this project's AMD EPYC core)
      double* const ptp = work.product.get(d * m);  // [d, m]
      gemm(true, true, d, m, n, y, d, kernel_rows, n, false, ptp, m);
      for (int64_t j = 0; j < m; ++j)
        for (int64_t t = 0; t < d; ++t) out[j * width + t] = ptp[t * m + j] * row_scale[j];
    }
    const double mean = std::accumulate(log_r.begin(), log_r.end(), 0.0) / static_cast<double>(m);
    kl_out.data_ptr<double>()[b] = reverse ? -mean : mean;
    const auto clipped_count = std::count(clipped.begin(), clipped.end(), char{1});
    clipped_out.data_ptr<double>()[b] = static_cast<double>(clipped_count) / static_cast<double>(m);
  });
  return {kl_out, state, used, clipped_out};
}

Tensor kl_grad(const Tensor& grad_kl, const Tensor& state, const Tensor& q_z, const Tensor& prior_z, bool reverse) {
  const int64_t batch = q_z.size(0), m = q_z.size(1), d = q_z.size(2);
  if (!grad_state_is_projection(prior_z.size(1) + m, d)) {
    const KlRoles roles = kl_roles(prior_z, q_z, reverse);
    auto scale = kl_row_scale(grad_kl, m, reverse).contiguous();
    return weighted_grad(scale.unsqueeze(1).expand({batch, m}), state.contiguous(), q_z, roles.numer, roles.denom);
  }
  // grad_j = scale (sum_c W_jc c - (sum_c W_jc) z_j), from the projection [sum_c W_jc c, sum_c W_jc].
  // The scale is read here rather than made by kl_row_scale's tensor ops: at (100, 8) the backward's
  // arithmetic takes less time than three small ATen calls.
  std::vector<double> sp(batch);
  const double factor = kl_row_factor(m, reverse);
  const auto g = grad_kl.reshape({-1});  // a view for the [] or expanded [B] grads autograd passes
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, g.scalar_type(), "kivi_fast_kl_grad_scale", [&] {
    const auto acc = g.accessor<scalar_t, 1>();
    for (int64_t b = 0; b < batch; ++b) sp[b] = static_cast<double>(acc[b]) * factor;
  });
  return projection_grad(sp.data(), 1, 0, state, q_z);
}

}  // namespace cpu
}  // namespace kivi_fast
