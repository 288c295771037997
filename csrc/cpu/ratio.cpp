// The ratio op's CPU kernel: a fitted ratio r(z) = sum_c coef_c k(c, z) at the points z [B, m, d], and
// the grad state its backward reads (kivi.h, grad_state_width), for the c over the stacked points
// [denom; numer]. Row by row (z_j): its squared distances to the N points, their kernel values by the
// row kernels' exp, r_j, and, where a gradient is to come, the state's row: the weights
// W_jc = coef_c k(c, z_j) / sigma^2, or with few dimensions their projection [sum_c W_jc c, sum_c W_jc],
// summed from the kernel row while it is in cache up to rows::kRowDotsMaxDim dimensions (the row never
// stored), by one GEMM an element above. Only the m N distances it needs are formed (an ATen
// composition forms those of the stacked [z; points] and makes a pass each for the division, the
// exponential, the coefficients, the sum and the state), and with few dimensions the state is small:
// 0.92 MB at 128 x 100 points against 200 in 8 dimensions (kivi_fast.kl's default on a VAE batch),
// where the weights would take 20.5 MB.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu/blas.h"
#include "cpu/buffers.h"
#include "cpu/distances.h"
#include "cpu/loops.h"
#include "cpu/simd_rows.h"
#include "kivi.h"

namespace kivi_fast {
namespace cpu {

namespace {

// Up to this many bytes of float64 points a batch element, a row's distances come from differences
// over the points held by coordinate (simd_rows' sqdist_from_point: the fit's own distances), which
// then stay in cache from row to row; above, from sqdist's Gram (fit.cpp: the points read once, by
// BLAS), since the differences would read every point again for each row (3x slower at (10, 314000)).
constexpr int64_t kDirectPointBytes = int64_t{8} << 20;

// Every point's squared distance from the centre of the stacked [z; denom; numer] (sqdist's, on its
// Gram path: distances.h) finite and squarable: no NaN or Inf coordinate, no distance that could
// overflow (the CPU kernels' check of their samples, with the same message). x: [B, rows, d];
// centres: [B, d].
template <typename T>
void check_finite_rows(const T* x, int64_t B, int64_t rows, int64_t d, const double* centres, const char* name) {
  for (int64_t b = 0; b < B; ++b) {
    const double* c = centres + b * d;
    for (int64_t i = 0; i < rows; ++i) {
      const T* p = x + (b * rows + i) * d;
      double s = 0.0;
      for (int64_t k = 0; k < d; ++k) {
        const double v = static_cast<double>(p[k]) - c[k];
        s += v * v;
      }
      TORCH_CHECK_VALUE(squarable(s), name, kNotFiniteMessage);
    }
  }
}

}  // namespace

std::tuple<Tensor, Tensor> ratio(const Tensor& z, const Tensor& numer, const Tensor& denom, const Tensor& coef,
                                 const Tensor& sigma, bool grad_state) {
  const int64_t B = z.size(0), m = z.size(1), d = z.size(2), n_den = denom.size(1), N = n_den + numer.size(1);
  const double* s = sigma.data_ptr<double>();  // (checked by the op: ops.cpp, check_sigma)
  const bool projection = grad_state && grad_state_is_projection(N, d);
  const bool weights = grad_state && !projection;
  const bool row_dots = projection && d <= rows::kRowDotsMaxDim;  // else a GEMM an element
  const int64_t width = grad_state ? grad_state_width(N, d) : 0;
  const bool direct = (N + 1) * d * static_cast<int64_t>(sizeof(double)) <= kDirectPointBytes;
  // The kernel values k(c, z_j) [B, m, N], where they are kept: in the state (as the weights, in
  // place), or for the projection's GEMM; elsewhere each row in a per-thread buffer (or the Gram's row).
  Tensor state, kernel;
  auto check_values = [&] {
    const Stack all({z, denom, numer});  // sqdist's stacked points below, and so its centres
    std::vector<double> centres(B * d);
    for (int64_t b = 0; b < B; ++b) centre_point(all, b, 0, d, centres.data() + b * d);
    AT_DISPATCH_FLOATING_TYPES(z.scalar_type(), "kivi_fast_cpu_ratio_check", [&] {
      const scalar_t *zp = z.data_ptr<scalar_t>(), *dp = denom.data_ptr<scalar_t>(), *np = numer.data_ptr<scalar_t>();
      check_finite_rows(zp, B, m, d, centres.data(), "z");
      check_finite_rows(dp, B, n_den, d, centres.data(), "denom");
      check_finite_rows(np, B, N - n_den, d, centres.data(), "numer");
    });
  };
  if (direct) {
    check_values();
    state = at::empty({B, m, width}, at::kDouble);
    if (weights) kernel = state;
    if (projection && !row_dots) kernel = at::empty({B, m, N}, at::kDouble);
  } else {
    try {
      kernel = sqdist(z, stack_points(denom, numer));  // (its own check of the samples' values)
    } catch (const c10::ValueError&) {
      check_values();  // (on the error path only: names the argument, which sqdist calls x or y)
      throw;
    }
    state = weights ? kernel : at::empty({B, m, width}, at::kDouble);
  }
  auto r = at::empty({B, m}, at::kDouble);
  const double* c = coef.data_ptr<double>();
  double* r_out = r.data_ptr<double>();
  double* state_out = state.data_ptr<double>();
  double* kernel_out = kernel.defined() ? kernel.data_ptr<double>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES(z.scalar_type(), "kivi_fast_cpu_ratio", [&] {
    const scalar_t* zp = z.data_ptr<scalar_t>();
    const scalar_t* dp = denom.data_ptr<scalar_t>();
    const scalar_t* np = numer.data_ptr<scalar_t>();
    auto point = [&](int64_t b, int64_t i) {
      return i < n_den ? dp + (b * n_den + i) * d : np + (b * (N - n_den) + i - n_den) * d;
    };
    // rows (b, j) in chunks of at least ~4096 multiply-adds of distances a thread
    at::parallel_for(0, B * m, std::max<int64_t>(1, 4096 / std::max<int64_t>(N * (d + 1), 1)),
                     [&](int64_t begin, int64_t end) {
      Work& work = thread_work();
      // direct: [d, N + 1] by coordinate, column 0 the row's point z_j, columns 1.. the stacked points
      const int64_t ld = N + 1;
      double* pt = direct ? work.points.get(d * ld) : nullptr;
      double* row = direct ? work.sq.get(ld) : nullptr;
      double* y = row_dots ? work.block.get(d * N) : nullptr;  // coef_c c by coordinate, [d, N]
      int64_t loaded = -1;
      for (int64_t idx = begin; idx < end; ++idx) {
        const int64_t b = idx / m;
        const double* cb = c + b * N;
        if (b != loaded) {
          if (direct) {
            for (int64_t i = 0; i < N; ++i)
              for (int64_t k = 0; k < d; ++k) pt[k * ld + 1 + i] = static_cast<double>(point(b, i)[k]);
          }
          if (row_dots) {
            for (int64_t i = 0; i < N; ++i)
              for (int64_t k = 0; k < d; ++k) y[k * N + i] = cb[i] * static_cast<double>(point(b, i)[k]);
          }
          loaded = b;
        }
        double* k = kernel_out ? kernel_out + idx * N : row + 1;
        if (direct) {
          for (int64_t t = 0; t < d; ++t) pt[t * ld] = static_cast<double>(zp[idx * d + t]);
          rows::sqdist_from_point(pt, ld, d, 0, 1, row);
          if (k != row + 1) std::copy_n(row + 1, N, k);
        }
        const double inv_var = 1.0 / (s[b] * s[b]);
        rows::scaled_exp(k, -0.5 * inv_var, N);  // the kernel values
        // r_j by the same sum whatever the state, so that its bits do not depend on grad_state
        r_out[idx] = rows::dot(cb, k, N);
        if (weights) {
          rows::mul_scale(cb, k, inv_var, k, N);
        } else if (row_dots) {
          double* p = state_out + idx * width;
          rows::dots_with_columns(k, y, N, d, p);
          rows::scale(p, inv_var, d);
          p[d] = r_out[idx] * inv_var;
        }
      }
    });
    if (projection && !row_dots) {
      // sum_c k(c, z_j) coef_c c = K_b Y_b, Y_b = coef * X ([N, d]), into the state's rows; over the
      // batch in parallel (one element: BLAS's own threads)
      const Stack points({denom, numer});
      at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
        Work& work = thread_work();
        double* y = work.block.get(N * d);
        for (int64_t b = b0; b < b1; ++b) {
          const double* cb = c + b * N;
          points.load(b, 0, d, y);
          for (int64_t i = 0; i < N; ++i) rows::scale(y + i * d, cb[i], d);
          double* p = state_out + b * m * width;
          gemm(false, false, m, d, N, kernel_out + b * m * N, N, y, d, false, p, width);
          const double inv_var = 1.0 / (s[b] * s[b]);
          for (int64_t j = 0; j < m; ++j) {
            rows::scale(p + j * width, inv_var, d);
            p[j * width + d] = r_out[b * m + j] * inv_var;
          }
        }
        work.trim();  // Y is N d doubles: on the Gram path, up to hundreds of MB
      });
    }
  });
  return {r.to(z.scalar_type()), state};
}

}  // namespace cpu
}  // namespace kivi_fast
