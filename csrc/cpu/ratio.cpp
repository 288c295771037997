// The ratio op's CPU kernel: a fitted ratio r(z) = sum_c coef_c k(c, z) at the points z [B, m, d], with
// the float64 weights W_jc = coef_c k(c, z_j) / sigma^2 that its backward (weighted_grad) reads, for
// the c over the stacked points [denom; numer]. Row by row (z_j): its squared distances to the N
// points, their kernel values by the row kernels' exp, r_j and the row of weights, written once, into
// the output. The ATen composition it replaces (still the other devices' path: ops.cpp) made the
// (m + N)^2 distances of the stacked [z; points] for the m N it needed, then a pass each for the
// division, the exponential, the coefficients, the sum and the weights: at 128 x 100 points against
// 200 (kivi_fast.kl's default on a VAE batch) most of a kl call's time.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>

#include "cpu/buffers.h"
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

// Every point's squared norm finite: no NaN or Inf coordinate, none too large to square (the CPU
// kernels' check of their samples, with the same message).
template <typename T>
void check_finite_rows(const T* x, int64_t rows, int64_t d, const char* name) {
  for (int64_t i = 0; i < rows; ++i) {
    double s = 0.0;
    for (int64_t k = 0; k < d; ++k) s += static_cast<double>(x[i * d + k]) * static_cast<double>(x[i * d + k]);
    TORCH_CHECK_VALUE(std::isfinite(s), name, kNotFiniteMessage);
  }
}

}  // namespace

std::tuple<Tensor, Tensor> ratio(const Tensor& z, const Tensor& numer, const Tensor& denom, const Tensor& coef,
                                 const Tensor& sigma) {
  const int64_t B = z.size(0), m = z.size(1), d = z.size(2), n_den = denom.size(1), N = n_den + numer.size(1);
  const double* s = sigma.data_ptr<double>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK_VALUE(s[b] > 0.0 && std::isfinite(s[b]), "kivi_fast::ratio: sigma must be positive and finite, got ",
                      s[b], " for batch element ", b);
  }
  const bool direct = (N + 1) * d * static_cast<int64_t>(sizeof(double)) <= kDirectPointBytes;
  Tensor weights;
  if (direct) {
    AT_DISPATCH_FLOATING_TYPES(z.scalar_type(), "kivi_fast_cpu_ratio_check", [&] {
      check_finite_rows(z.data_ptr<scalar_t>(), B * m, d, "z");
      check_finite_rows(denom.data_ptr<scalar_t>(), B * n_den, d, "denom");
      check_finite_rows(numer.data_ptr<scalar_t>(), B * (N - n_den), d, "numer");
    });
    weights = at::empty({B, m, N}, at::kDouble);
  } else {
    weights = sqdist(z, stack_points(denom, numer));  // (its own check of the samples' values)
  }
  auto r = at::empty({B, m}, at::kDouble);
  const double* c = coef.data_ptr<double>();
  double* r_out = r.data_ptr<double>();
  double* w_out = weights.data_ptr<double>();
  AT_DISPATCH_FLOATING_TYPES(z.scalar_type(), "kivi_fast_cpu_ratio", [&] {
    const scalar_t* zp = z.data_ptr<scalar_t>();
    const scalar_t* dp = denom.data_ptr<scalar_t>();
    const scalar_t* np = numer.data_ptr<scalar_t>();
    // rows (b, j) in chunks of at least ~4096 multiply-adds of distances a thread
    at::parallel_for(0, B * m, std::max<int64_t>(1, 4096 / std::max<int64_t>(N * (d + 1), 1)),
                     [&](int64_t begin, int64_t end) {
      Work& work = thread_work();
      // direct: [d, N + 1] by coordinate, column 0 the row's point z_j, columns 1.. the stacked points
      const int64_t ld = N + 1;
      double* pt = direct ? work.points.get(d * ld) : nullptr;
      double* row = direct ? work.sq.get(ld) : nullptr;
      int64_t loaded = -1;
      for (int64_t idx = begin; idx < end; ++idx) {
        const int64_t b = idx / m;
        double* w = w_out + idx * N;
        if (direct) {
          if (b != loaded) {
            for (int64_t i = 0; i < N; ++i) {
              const scalar_t* x = i < n_den ? dp + (b * n_den + i) * d : np + (b * (N - n_den) + i - n_den) * d;
              for (int64_t k = 0; k < d; ++k) pt[k * ld + 1 + i] = static_cast<double>(x[k]);
            }
            loaded = b;
          }
          for (int64_t k = 0; k < d; ++k) pt[k * ld] = static_cast<double>(zp[idx * d + k]);
          rows::sqdist_from_point(pt, ld, d, 0, 1, row);
          std::copy_n(row + 1, N, w);
        }
        rows::scaled_exp(w, -0.5 / (s[b] * s[b]), N);  // the kernel values
        const double* cb = c + b * N;
        r_out[idx] = rows::dot(cb, w, N);
        rows::mul_scale(cb, w, 1.0 / (s[b] * s[b]), w, N);
      }
    });
  });
  return {r.to(z.scalar_type()), weights};
}

}  // namespace cpu
}  // namespace kivi_fast
