// CPU kernels. What differs from the generic path:
//  - float32 samples are converted to float64 a block of columns at a time, inside the GEMMs'
//    loop, so large d never pays for a full float64 copy (d = 314000 for an MNIST layer);
//  - the median is a selection (std::nth_element) over the upper triangle, in parallel over the batch;
//  - the backward's two GEMMs read the samples once, block by block, and write the gradient once.
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <vector>

#include "kivi.h"

namespace kivi_fast {
namespace cpu {
namespace {

// Columns per block: a [B, rows, block] float64 slab of about 2 MB stays in cache between its
// conversion and its GEMM.
int64_t block_columns(int64_t batch, int64_t rows, int64_t d) {
  const int64_t target = (int64_t{1} << 18) / std::max<int64_t>(1, batch * rows);
  return std::min(d, std::max<int64_t>(256, target));
}

// Calls fn(c0, width, slab) for consecutive column blocks, slab = float64 [B, rows, width] of the
// row-wise concatenation of the parts.
template <class Fn>
void for_each_block(std::initializer_list<Tensor> parts, Fn fn) {
  const auto& first = *parts.begin();
  const int64_t batch = first.size(0), d = first.size(2);
  int64_t rows = 0;
  for (const auto& p : parts) rows += p.size(1);
  const bool is_double = first.scalar_type() == at::kDouble;
  if (is_double && parts.size() == 1) {
    fn(0, d, first);
    return;
  }
  const int64_t block = is_double ? d : block_columns(batch, rows, d);
  auto slab = at::empty({batch, rows, block}, first.options().dtype(at::kDouble));
  for (int64_t c0 = 0; c0 < d; c0 += block) {
    const int64_t width = std::min(block, d - c0);
    auto view = slab.narrow(2, 0, width);
    int64_t r0 = 0;
    for (const auto& p : parts) {
      view.narrow(1, r0, p.size(1)).copy_(p.narrow(2, c0, width));
      r0 += p.size(1);
    }
    fn(c0, width, view);
  }
}

// Gram matrix of inner products [B, N, N] (float64) of the stacked parts.
Tensor inner_products(std::initializer_list<Tensor> parts) {
  Tensor gram;
  for_each_block(parts, [&](int64_t c0, int64_t, const Tensor& slab) {
    if (!gram.defined()) {
      gram = at::bmm(slab, slab.transpose(1, 2));
    } else {
      gram.baddbmm_(slab, slab.transpose(1, 2));
    }
  });
  return gram;
}

// Squared distances from a Gram matrix of inner products, in place: g_ii + g_jj - 2 g_ij.
Tensor sqdist_from_gram(Tensor gram) {
  auto norms = gram.diagonal(0, 1, 2).clone();
  gram.mul_(-2.0).add_(norms.unsqueeze(2)).add_(norms.unsqueeze(1)).clamp_min_(0);
  gram.diagonal(0, 1, 2).zero_();
  return gram;
}

}  // namespace

Tensor sqdist(const Tensor& x, const Tensor& y) {
  // One Gram of the stacked points gives every norm and inner product in the same rounding; the
  // off-diagonal block is the answer.
  auto sq = sqdist_from_gram(inner_products({x, y}));
  return sq.narrow(1, 0, x.size(1)).narrow(2, x.size(1), y.size(1)).contiguous();
}

Tensor median_bandwidth(const Tensor& x) { return median_from_sqdist_cpu(sqdist_from_gram(inner_products({x}))); }

Tensor median_from_sqdist_cpu(const Tensor& sq) {
  const int64_t batch = sq.size(0), n = sq.size(1);
  const int64_t pairs = n * (n - 1) / 2;
  auto sigma = at::empty({batch}, sq.options());
  auto sq_c = sq.contiguous();
  const double* src = sq_c.data_ptr<double>();
  double* out = sigma.data_ptr<double>();
  at::parallel_for(0, batch, 1, [&](int64_t b0, int64_t b1) {
    std::vector<double> values(pairs);
    for (int64_t b = b0; b < b1; ++b) {
      const double* m = src + b * n * n;
      int64_t k = 0;
      for (int64_t i = 0; i < n; ++i) {
        for (int64_t j = i + 1; j < n; ++j) values[k++] = m[i * n + j];
      }
      // numpy's convention: the mean of the two middle values for an even count.
      const int64_t mid = (pairs - 1) / 2;
      std::nth_element(values.begin(), values.begin() + mid, values.end());
      const double lo = std::sqrt(values[mid]);
      double hi = lo;
      if (pairs % 2 == 0) hi = std::sqrt(*std::min_element(values.begin() + mid + 1, values.end()));
      out[b] = 0.5 * (lo + hi);
    }
  });
  TORCH_CHECK_VALUE((sigma > 0).all().item<bool>(),
                    "the median pairwise distance of the samples is 0 (at least half of the pairs coincide); "
                    "pass an explicit bandwidth=...");
  return sigma;
}

Fit fit(const Tensor& numer, const Tensor& denom, double lam, const std::optional<Tensor>& sigma, Names names) {
  const int64_t n_den = denom.size(1);
  auto gram = inner_products({denom, numer});
  check_finite_rows(gram.diagonal(0, 1, 2), n_den, names);
  auto sq = sqdist_from_gram(gram);
  auto s = sigma.has_value() ? *sigma : median_from_sqdist_cpu(sq);
  auto kernel = sq.mul_((-0.5 / (s * s)).view({-1, 1, 1})).exp_();
  auto alpha = solve_alpha(kernel, n_den, lam);
  auto beta = at::full({alpha.size(0), numer.size(1)}, 1.0 / (lam * static_cast<double>(numer.size(1))),
                       alpha.options());
  return {at::cat({alpha, beta}, 1), s, kernel};
}

Tensor weighted_grad(const Tensor& row_scale, const Tensor& weights, const Tensor& z, const Tensor& numer,
                     const Tensor& denom) {
  const int64_t n_den = denom.size(1), n_num = numer.size(1), m = z.size(1);
  auto w_den = weights.narrow(2, 0, n_den);
  auto w_num = weights.narrow(2, n_den, n_num);
  auto shift = weights.sum(-1, true).neg_();  // - sum_c W_jc, multiplies z_j
  auto scale = row_scale.to(at::kDouble).unsqueeze(-1);
  auto grad = at::empty_like(z);
  // Slab rows: [denom; numer; z]; the gradient of each column block is finished and written at once.
  for_each_block({denom, numer, z}, [&](int64_t c0, int64_t width, const Tensor& slab) {
    auto g = at::bmm(w_den, slab.narrow(1, 0, n_den));
    g.baddbmm_(w_num, slab.narrow(1, n_den, n_num));
    g.addcmul_(shift, slab.narrow(1, n_den + n_num, m));
    g.mul_(scale);
    grad.narrow(2, c0, width).copy_(g);
  });
  return grad;
}

}  // namespace cpu
}  // namespace kivi_fast
