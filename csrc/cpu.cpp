// CPU kernels. What they do differently from the device-generic path (generic.cpp):
//  - samples are read in column blocks converted to float64 in a per-thread buffer, so float32
//    inputs never pay for a full float64 copy (d = 314000 for an MNIST layer), and each block's
//    GEMM runs while the block is in cache;
//  - one parallel region per stage: over the batch when it has at least as many elements as there
//    are threads, otherwise over column blocks (thread-local partial Gram matrices). Many small
//    parallel regions stall when a thread is descheduled on a busy machine;
//  - distances, the median (std::nth_element, a selection), the kernel exponent and the evaluation
//    of the ratio are fused loops over each batch element instead of chains of tensor ops;
//  - the backward reads the samples once more, block by block, and writes the gradient once.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "kivi.h"

namespace kivi_fast {
namespace cpu {
namespace {

// A [N, w] float64 block of about 2 MB: fits in this machine's 2 MB-per-core L2 with its GEMM.
constexpr int64_t kBlockDoubles = int64_t{1} << 18;

// Row-wise concatenation of sample tensors ([B, n_i, d], contiguous, one dtype), read block by block.
struct Stack {
  std::vector<Tensor> parts;
  std::vector<int64_t> offsets;
  int64_t batch = 0, rows = 0, d = 0;

  explicit Stack(std::initializer_list<Tensor> ts) {
    for (const auto& t : ts) {
      parts.push_back(t.contiguous());
      offsets.push_back(rows);
      rows += t.size(1);
    }
    batch = parts[0].size(0);
    d = parts[0].size(2);
  }
  int64_t block_width() const { return std::min(d, std::max<int64_t>(64, kBlockDoubles / rows)); }
  int64_t n_blocks() const { return (d + block_width() - 1) / block_width(); }

  // Rows [0, rows) x columns [c0, c0 + w) of batch element b, as float64 into dst ([rows, w]).
  void load(int64_t b, int64_t c0, int64_t w, double* dst) const {
    AT_DISPATCH_FLOATING_TYPES(parts[0].scalar_type(), "kivi_fast_load", [&] {
      for (size_t i = 0; i < parts.size(); ++i) {
        const int64_t n = parts[i].size(1);
        const scalar_t* src = parts[i].data_ptr<scalar_t>() + b * n * d + c0;
        double* out = dst + offsets[i] * w;
        for (int64_t r = 0; r < n; ++r) {
          for (int64_t c = 0; c < w; ++c) out[r * w + c] = static_cast<double>(src[r * d + c]);
        }
      }
    });
  }
};

Tensor wrap(double* data, at::IntArrayRef sizes) {
  return at::from_blob(data, sizes, at::TensorOptions().dtype(at::kDouble));
}

// Calls fn(b, c0, w, block) for every batch element and column block, block = float64 [rows, w]
// tensor on a per-thread buffer. Parallel over the batch when it is large enough to occupy the
// threads (one element per task), else over the column blocks.
template <class Fn>
void for_each_block(const Stack& s, bool by_batch, Fn fn) {
  const int64_t width = s.block_width(), blocks = s.n_blocks();
  auto run = [&](int64_t b, int64_t k, std::vector<double>& buf) {
    const int64_t c0 = k * width, w = std::min(width, s.d - c0);
    s.load(b, c0, w, buf.data());
    fn(b, c0, w, wrap(buf.data(), {s.rows, w}));
  };
  if (by_batch) {
    at::parallel_for(0, s.batch, 1, [&](int64_t b0, int64_t b1) {
      std::vector<double> buf(s.rows * width);
      for (int64_t b = b0; b < b1; ++b)
        for (int64_t k = 0; k < blocks; ++k) run(b, k, buf);
    });
  } else {
    at::parallel_for(0, blocks, 1, [&](int64_t k0, int64_t k1) {
      std::vector<double> buf(s.rows * width);
      for (int64_t k = k0; k < k1; ++k)
        for (int64_t b = 0; b < s.batch; ++b) run(b, k, buf);
    });
  }
}

bool parallel_over_batch(const Stack& s) { return s.batch >= at::get_num_threads() || s.n_blocks() == 1; }

// Inner products of the stacked points, [B, N, N] float64.
Tensor gram(const Stack& s) {
  if (parallel_over_batch(s)) {
    auto out = at::empty({s.batch, s.rows, s.rows}, at::kDouble);
    for_each_block(s, true, [&](int64_t b, int64_t c0, int64_t, const Tensor& block) {
      auto g = out[b];
      if (c0 == 0) {
        at::mm_out(g, block, block.t());
      } else {
        g.addmm_(block, block.t());
      }
    });
    return out;
  }
  // Thread-local partial sums over column blocks, added up at the end.
  auto partial = at::zeros({at::get_num_threads(), s.batch, s.rows, s.rows}, at::kDouble);
  for_each_block(s, false, [&](int64_t b, int64_t, int64_t, const Tensor& block) {
    partial[at::get_thread_num()][b].addmm_(block, block.t());
  });
  return partial.sum(0);
}

// Squared distances from inner products, in place: g_ii + g_jj - 2 g_ij (>= 0, exact 0 diagonal).
void gram_to_sqdist(double* g, int64_t n) {
  std::vector<double> norms(n);
  for (int64_t i = 0; i < n; ++i) norms[i] = g[i * n + i];
  for (int64_t i = 0; i < n; ++i) {
    double* row = g + i * n;
    for (int64_t j = 0; j < n; ++j) row[j] = std::max(0.0, norms[i] + norms[j] - 2.0 * row[j]);
    row[i] = 0.0;
  }
}

// Median distance over the n (n - 1) / 2 distinct pairs (numpy's convention for an even count).
double median_of_pairs(const double* sq, int64_t n, std::vector<double>& values) {
  const int64_t pairs = n * (n - 1) / 2;
  values.resize(pairs);
  int64_t k = 0;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = i + 1; j < n; ++j) values[k++] = sq[i * n + j];
  const int64_t mid = (pairs - 1) / 2;
  std::nth_element(values.begin(), values.begin() + mid, values.end());
  const double lo = std::sqrt(values[mid]);
  if (pairs % 2 == 1) return lo;
  return 0.5 * (lo + std::sqrt(*std::min_element(values.begin() + mid + 1, values.end())));
}

void check_median(const Tensor& sigma) {
  TORCH_CHECK_VALUE((sigma > 0).all().item<bool>(),
                    "the median pairwise distance of the samples is 0 (at least half of the pairs coincide); "
                    "pass an explicit bandwidth=...");
}

// Kernel matrix [B, N, N] of the stacked points, and the bandwidth used (given, or the median).
std::pair<Tensor, Tensor> kernel_matrix(const Stack& s, const std::optional<Tensor>& sigma, int64_t n_den,
                                        const Names* names) {
  auto g = gram(s);
  if (names != nullptr) check_finite_rows(g.diagonal(0, 1, 2), n_den, *names);
  auto out_sigma = sigma.has_value() ? *sigma : at::empty({s.batch}, at::kDouble);
  const int64_t n = s.rows;
  double* gp = g.data_ptr<double>();
  double* sp = out_sigma.data_ptr<double>();
  const bool median = !sigma.has_value();
  at::parallel_for(0, s.batch, 1, [&](int64_t b0, int64_t b1) {
    std::vector<double> values;
    for (int64_t b = b0; b < b1; ++b) {
      double* m = gp + b * n * n;
      gram_to_sqdist(m, n);
      if (median) sp[b] = median_of_pairs(m, n, values);
      const double scale = -0.5 / (sp[b] * sp[b]);
      for (int64_t i = 0; i < n * n; ++i) m[i] *= scale;
    }
  });
  if (median) check_median(out_sigma);
  return {g.exp_(), out_sigma};
}

}  // namespace

Tensor sqdist(const Tensor& x, const Tensor& y) {
  // One Gram of the stacked points gives every norm and inner product in the same rounding.
  Stack s({x, y});
  auto g = gram(s);
  const int64_t n = s.rows;
  double* gp = g.data_ptr<double>();
  at::parallel_for(0, s.batch, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) gram_to_sqdist(gp + b * n * n, n);
  });
  return g.narrow(1, 0, x.size(1)).narrow(2, x.size(1), y.size(1)).contiguous();
}

Tensor median_from_sqdist_cpu(const Tensor& sq) {
  const int64_t n = sq.size(1);
  auto sigma = at::empty({sq.size(0)}, at::kDouble);
  auto sq_c = sq.contiguous();
  const double* src = sq_c.data_ptr<double>();
  double* out = sigma.data_ptr<double>();
  at::parallel_for(0, sq.size(0), 1, [&](int64_t b0, int64_t b1) {
    std::vector<double> values;
    for (int64_t b = b0; b < b1; ++b) out[b] = median_of_pairs(src + b * n * n, n, values);
  });
  check_median(sigma);
  return sigma;
}

Tensor median_bandwidth(const Tensor& x) {
  Stack s({x});
  auto g = gram(s);
  const int64_t n = s.rows;
  double* gp = g.data_ptr<double>();
  at::parallel_for(0, s.batch, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) gram_to_sqdist(gp + b * n * n, n);
  });
  return median_from_sqdist_cpu(g);
}

Fit fit(const Tensor& numer, const Tensor& denom, double lam, const std::optional<Tensor>& sigma, Names names) {
  const int64_t n_den = denom.size(1), n_num = numer.size(1), batch = denom.size(0);
  Stack s({denom, numer});
  auto [kernel, s_used] = kernel_matrix(s, sigma, n_den, &names);
  Tensor alpha;
  if (batch >= 2 && at::get_num_threads() > 1) {
    // LAPACK on small matrices is serial per matrix: spread the batch over the threads instead.
    alpha = at::empty({batch, n_den}, at::kDouble);
    at::parallel_for(0, batch, 1, [&](int64_t b0, int64_t b1) {
      alpha.narrow(0, b0, b1 - b0).copy_(solve_alpha(kernel.narrow(0, b0, b1 - b0), n_den, lam));
    });
  } else {
    alpha = solve_alpha(kernel, n_den, lam);
  }
  auto coef = at::empty({batch, n_den + n_num}, at::kDouble);
  coef.narrow(1, 0, n_den).copy_(alpha);
  coef.narrow(1, n_den, n_num).fill_(1.0 / (lam * static_cast<double>(n_num)));
  return {coef, s_used, kernel};
}

std::tuple<Tensor, Tensor> evaluate_log_ratio(const Tensor& kernel, int64_t row0, int64_t m, const Tensor& coef,
                                              const Tensor& sigma, double clip) {
  // For rows [row0, row0 + m) of the kernel (the evaluation points): log max(r_j, clip) and the
  // weights W_jc = coef_c k(c, z_j) / (sigma^2 r_j) of grad log r (zero rows where clipped).
  const int64_t batch = kernel.size(0), n = kernel.size(2);
  auto log_r = at::empty({batch, m}, at::kDouble);
  auto weights = at::empty({batch, m, n}, at::kDouble);
  const double* kp = kernel.data_ptr<double>();
  const double* cp = coef.data_ptr<double>();
  const double* sp = sigma.data_ptr<double>();
  double* lp = log_r.data_ptr<double>();
  double* wp = weights.data_ptr<double>();
  at::parallel_for(0, batch * m, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / m, j = i % m;
      const double* k = kp + (b * kernel.size(1) + row0 + j) * n;
      const double* c = cp + b * n;
      double* w = wp + i * n;
      double r = 0.0;
      for (int64_t t = 0; t < n; ++t) {
        w[t] = c[t] * k[t];
        r += w[t];
      }
      lp[i] = std::log(std::max(r, clip));
      const double scale = r > clip ? 1.0 / (sp[b] * sp[b] * r) : 0.0;
      for (int64_t t = 0; t < n; ++t) w[t] *= scale;
    }
  });
  return {log_r, weights};
}

Tensor weighted_grad(const Tensor& row_scale, const Tensor& weights, const Tensor& z, const Tensor& numer,
                     const Tensor& denom) {
  // grad_j = row_scale_j (sum_c W_jc c - (sum_c W_jc) z_j), c over the stacked [denom; numer].
  const int64_t n_den = denom.size(1), m = z.size(1);
  // z is usually one of the fitted sets (kl evaluates at q_z): then its rows are already stacked.
  auto same = [&](const Tensor& t) {
    return t.data_ptr() == z.data_ptr() && t.sizes() == z.sizes() && t.strides() == z.strides();
  };
  const bool z_is_denom = same(denom), z_is_numer = !z_is_denom && same(numer);
  Stack s = (z_is_denom || z_is_numer) ? Stack({denom, numer}) : Stack({denom, numer, z});
  const int64_t z_row = z_is_denom ? 0 : z_is_numer ? n_den : s.offsets[2];
  const int64_t n = n_den + numer.size(1);
  auto w_sum = weights.sum(-1).contiguous();
  auto scale = row_scale.to(at::kDouble).contiguous();
  auto grad = at::empty_like(z, z.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t d = s.d;
  for_each_block(s, parallel_over_batch(s), [&](int64_t b, int64_t c0, int64_t w, const Tensor& block) {
    auto g = at::mm(weights[b], block.narrow(0, 0, n));  // [m, w]
    const double* gp = g.data_ptr<double>();
    const double* zp = block.data_ptr<double>() + z_row * w;
    const double* ws = w_sum.data_ptr<double>() + b * m;
    const double* sc = scale.data_ptr<double>() + b * m;
    AT_DISPATCH_FLOATING_TYPES(grad.scalar_type(), "kivi_fast_grad", [&] {
      scalar_t* out = grad.data_ptr<scalar_t>() + b * m * d + c0;
      for (int64_t j = 0; j < m; ++j) {
        for (int64_t c = 0; c < w; ++c) {
          out[j * d + c] = static_cast<scalar_t>(sc[j] * (gp[j * w + c] - ws[j] * zp[j * w + c]));
        }
      }
    });
  });
  return grad;
}

}  // namespace cpu
}  // namespace kivi_fast
