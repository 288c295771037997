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
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "kivi.h"
#include "simd_rows.h"

// LAPACK as linked into torch (MKL or OpenBLAS export these Fortran names). Weak: where a build of
// torch does not export them, they are null and the ATen calls (one more copy each) are used instead.
extern "C" {
void dpotrf_(const char* uplo, const int* n, double* a, const int* lda, int* info) __attribute__((weak));
void dpotrs_(const char* uplo, const int* n, const int* nrhs, const double* a, const int* lda, double* b,
             const int* ldb, int* info) __attribute__((weak));
}

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
          rows::to_double(src + r * d, out + r * w, w);
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
    rows::gram_row_to_sqdist(row, norms.data(), norms[i], n);
    row[i] = 0.0;
  }
}

// Median distance over the n (n - 1) / 2 distinct pairs (numpy's convention for an even count: the
// mean of the two middle distances), from squared distances. Exact: a selection, not an estimate.
// Selection by bins: one pass for the range, one for a histogram of equal-width bins over it (the
// bin index is monotone in the value), then std::nth_element only on the values in the one or two
// bins that hold the middle ranks. Three streaming passes instead of nth_element's data-dependent
// branches over all pairs.
constexpr int64_t kMinBinnedPairs = 512;

// Visits the upper triangle of an n x n matrix as fn(pointer to row i from column i + 1, count).
// Rows go in pairs (t, n - 1 - t), so that parallel chunks of t carry equal work.
template <class Fn>
void for_upper_rows(const double* m, int64_t n, bool parallel, Fn fn) {
  auto body = [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      fn(m + t * n + t + 1, n - 1 - t);
      const int64_t u = n - 1 - t;
      if (u != t) fn(m + u * n + u + 1, n - 1 - u);
    }
  };
  const int64_t half = (n + 1) / 2;
  if (parallel) {
    at::parallel_for(0, half, 16, body);
  } else {
    body(0, half);
  }
}

// The values of rank k and k + 1 (0-based; k + 1 clamped to the last) among the upper-triangle
// entries of sq.
std::pair<double, double> select_two(const double* sq, int64_t n, int64_t k, bool parallel) {
  const int64_t pairs = n * (n - 1) / 2;
  const int threads = parallel ? at::get_num_threads() : 1;
  auto tid = [&] { return parallel ? at::get_thread_num() : 0; };
  std::vector<double> cand;
  int64_t below = 0;
  std::vector<double> lo_v(threads, std::numeric_limits<double>::infinity()), hi_v(threads, -lo_v[0]);
  for_upper_rows(sq, n, parallel, [&](const double* row, int64_t count) {
    const int t = tid();
    rows::min_max(row, count, lo_v[t], hi_v[t]);
  });
  const double lo = *std::min_element(lo_v.begin(), lo_v.end());
  const double hi = *std::max_element(hi_v.begin(), hi_v.end());
  if (pairs < kMinBinnedPairs || !(hi > lo)) {
    cand.reserve(pairs);
    for_upper_rows(sq, n, false, [&](const double* row, int64_t count) { cand.insert(cand.end(), row, row + count); });
  } else {
    const int64_t bins = std::clamp<int64_t>(pairs / 4, 64, int64_t{1} << 16);
    const double inv_width = static_cast<double>(bins) / (hi - lo);
    std::vector<int64_t> hist(threads * bins, 0);
    for_upper_rows(sq, n, parallel, [&](const double* row, int64_t count) {
      rows::histogram(row, count, lo, inv_width, bins, hist.data() + tid() * bins);
    });
    for (int t = 1; t < threads; ++t)
      for (int64_t b = 0; b < bins; ++b) hist[b] += hist[t * bins + b];
    int64_t lo_bin = 0;
    while (below + hist[lo_bin] <= k) below += hist[lo_bin++];
    int64_t hi_bin = lo_bin;
    for (int64_t seen = below + hist[lo_bin]; seen <= k + 1 && hi_bin + 1 < bins;) seen += hist[++hi_bin];
    cand.resize(static_cast<size_t>(std::accumulate(hist.begin() + lo_bin, hist.begin() + hi_bin + 1, int64_t{0})));
    int64_t filled = 0;
    for_upper_rows(sq, n, false, [&](const double* row, int64_t count) {
      filled += rows::gather_bins(row, count, lo, inv_width, bins, lo_bin, hi_bin, cand.data() + filled);
    });
  }
  const int64_t r = k - below;
  std::nth_element(cand.begin(), cand.begin() + r, cand.end());
  const double first = cand[r];
  const double second =
      r + 1 < static_cast<int64_t>(cand.size()) ? *std::min_element(cand.begin() + r + 1, cand.end()) : first;
  return {first, second};
}

double median_of_pairs(const double* sq, int64_t n, bool parallel) {
  const int64_t pairs = n * (n - 1) / 2;
  const auto [lo, hi] = select_two(sq, n, (pairs - 1) / 2, parallel);
  if (pairs % 2 == 1) return std::sqrt(lo);
  return 0.5 * (std::sqrt(lo) + std::sqrt(hi));
}

void check_median(const Tensor& sigma) {
  TORCH_CHECK_VALUE((sigma > 0).all().item<bool>(),
                    "the median pairwise distance of the samples is 0 (at least half of the pairs coincide); "
                    "pass an explicit bandwidth=...");
}

// Up to this many dimensions, distances are summed from coordinate differences (exact up to the
// last rounding, and faster than a GEMM with such a short inner dimension); above, from a Gram.
constexpr int64_t kDirectMaxDim = 8;

// Squared distances of batch element b by differences into out ([N, N]). The full matrix row by
// row (twice the arithmetic of a triangle, but contiguous vector loops and no transposed writes).
void direct_sqdist(const Stack& s, int64_t b, double* out, double* norms, bool parallel) {
  const int64_t n = s.rows, d = s.d;
  std::vector<double> pt(n * d);  // transposed points [d, n]: the inner loop runs over points
  {
    std::vector<double> rows(n * d);
    s.load(b, 0, d, rows.data());
    for (int64_t i = 0; i < n; ++i) {
      double sq = 0.0;
      for (int64_t k = 0; k < d; ++k) {
        pt[k * n + i] = rows[i * d + k];
        sq += rows[i * d + k] * rows[i * d + k];
      }
      norms[i] = sq;
    }
  }
  auto body = [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      double* o = out + i * n;
      rows::sq_diff(pt.data(), pt[i], o, n);
      for (int64_t k = 1; k < d; ++k) rows::add_sq_diff(pt.data() + k * n, pt[k * n + i], o, n);
      o[i] = 0.0;
    }
  };
  if (parallel) {
    at::parallel_for(0, n, 16, body);
  } else {
    body(0, n);
  }
}

// Squared distances [B, N, N] of the stacked points, and the squared norms [B, N] (whose
// finiteness tells whether the samples were).
std::pair<Tensor, Tensor> sqdists(const Stack& s) {
  const int64_t n = s.rows;
  if (s.d <= kDirectMaxDim) {
    auto out = at::empty({s.batch, n, n}, at::kDouble);
    auto norms = at::empty({s.batch, n}, at::kDouble);
    double* op = out.data_ptr<double>();
    double* np = norms.data_ptr<double>();
    if (s.batch >= at::get_num_threads()) {
      at::parallel_for(0, s.batch, 1, [&](int64_t b0, int64_t b1) {
        for (int64_t b = b0; b < b1; ++b) direct_sqdist(s, b, op + b * n * n, np + b * n, false);
      });
    } else {
      for (int64_t b = 0; b < s.batch; ++b) direct_sqdist(s, b, op + b * n * n, np + b * n, true);
    }
    return {out, norms};
  }
  auto g = gram(s);
  auto norms = g.diagonal(0, 1, 2).clone();
  double* gp = g.data_ptr<double>();
  at::parallel_for(0, s.batch, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) gram_to_sqdist(gp + b * n * n, n);
  });
  return {g, norms};
}

Tensor medians(const Tensor& sq) {
  const int64_t batch = sq.size(0), n = sq.size(1);
  auto sigma = at::empty({batch}, at::kDouble);
  const double* src = sq.data_ptr<double>();
  double* out = sigma.data_ptr<double>();
  if (batch >= at::get_num_threads()) {
    at::parallel_for(0, batch, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) out[b] = median_of_pairs(src + b * n * n, n, false);
    });
  } else {
    for (int64_t b = 0; b < batch; ++b) out[b] = median_of_pairs(src + b * n * n, n, true);
  }
  check_median(sigma);
  return sigma;
}

// Kernel matrix [B, N, N] of the stacked points, and the bandwidth used (given, or the median).
std::pair<Tensor, Tensor> kernel_matrix(const Stack& s, const std::optional<Tensor>& sigma, int64_t n_den,
                                        const Names& names) {
  auto [sq, norms] = sqdists(s);
  check_finite_rows(norms, n_den, names);
  auto used = sigma.has_value() ? *sigma : medians(sq);
  const int64_t n = s.rows;
  double* p = sq.data_ptr<double>();
  const double* sp = used.data_ptr<double>();
  at::parallel_for(0, s.batch * n, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const double scale = -0.5 / (sp[r / n] * sp[r / n]);
      double* row = p + r * n;
      rows::scale(row, scale, n);
    }
  });
  return {sq.exp_(), used};
}

// alpha for each batch element by LAPACK on the kernel's leading block:
// (K_dd / n_den + lam I) alpha = -K_dn 1 / (lam n_den n_num). False if LAPACK is not available.
bool solve_alpha_lapack(const Tensor& kernel, int64_t n_den, double lam, Tensor& alpha) {
  if (dpotrf_ == nullptr || dpotrs_ == nullptr) return false;
  const int64_t batch = kernel.size(0), n = kernel.size(1), n_num = n - n_den;
  alpha = at::empty({batch, n_den}, at::kDouble);
  const double* kp = kernel.data_ptr<double>();
  double* ap = alpha.data_ptr<double>();
  std::atomic<bool> failed{false};
  auto solve = [&](int64_t b, std::vector<double>& a) {
    const double* k = kp + b * n * n;
    double* x = ap + b * n_den;
    a.resize(n_den * n_den);
    const double inv_n = 1.0 / static_cast<double>(n_den);
    const double rhs_scale = -1.0 / (lam * static_cast<double>(n_den) * static_cast<double>(n_num));
    for (int64_t i = 0; i < n_den; ++i) {
      const double* row = k + i * n;
      for (int64_t j = 0; j < n_den; ++j) a[i * n_den + j] = row[j] * inv_n;
      a[i * n_den + i] += lam;
      double sum = 0.0;
      for (int64_t j = n_den; j < n; ++j) sum += row[j];
      x[i] = sum * rhs_scale;
    }
    // Symmetric, so the row-major buffer is also the column-major matrix.
    const int nn = static_cast<int>(n_den), one = 1;
    int info = 0;
    dpotrf_("L", &nn, a.data(), &nn, &info);
    if (info != 0) {
      failed = true;
      return;
    }
    dpotrs_("L", &nn, &one, a.data(), &nn, x, &nn, &info);
  };
  if (batch >= 2 && at::get_num_threads() > 1) {
    at::parallel_for(0, batch, 1, [&](int64_t b0, int64_t b1) {
      std::vector<double> a;
      for (int64_t b = b0; b < b1; ++b) solve(b, a);
    });
  } else {
    std::vector<double> a;  // one large system: LAPACK uses the threads itself
    for (int64_t b = 0; b < batch; ++b) solve(b, a);
  }
  TORCH_CHECK_VALUE(!failed.load(), "the kernel system K/n + lam I is not positive definite in float64 (lam = ", lam,
                    " is too small for these samples); increase lam");
  return true;
}

}  // namespace

Tensor sqdist(const Tensor& x, const Tensor& y) {
  auto [sq, norms] = sqdists(Stack({x, y}));
  check_finite_rows(norms, x.size(1), {"y", "x"});
  return sq.narrow(1, 0, x.size(1)).narrow(2, x.size(1), y.size(1)).contiguous();
}

Tensor median_bandwidth(const Tensor& x) {
  auto [sq, norms] = sqdists(Stack({x}));
  check_finite_rows(norms, x.size(1), {"x", "x"});
  return medians(sq);
}

Fit fit(const Tensor& numer, const Tensor& denom, double lam, const std::optional<Tensor>& sigma, Names names) {
  const int64_t n_den = denom.size(1), n_num = numer.size(1), batch = denom.size(0);
  auto [kernel, used] = kernel_matrix(Stack({denom, numer}), sigma, n_den, names);
  Tensor alpha;
  if (!solve_alpha_lapack(kernel, n_den, lam, alpha)) alpha = solve_alpha(kernel, n_den, lam);
  auto coef = at::empty({batch, n_den + n_num}, at::kDouble);
  coef.narrow(1, 0, n_den).copy_(alpha);
  coef.narrow(1, n_den, n_num).fill_(1.0 / (lam * static_cast<double>(n_num)));
  return {coef, used, kernel};
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
      const double r = rows::mul_sum(c, k, w, n);
      lp[i] = std::log(std::max(r, clip));
      const double scale = r > clip ? 1.0 / (sp[b] * sp[b] * r) : 0.0;
      rows::scale(w, scale, n);
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
      for (int64_t j = 0; j < m; ++j) rows::axpby_out(gp + j * w, zp + j * w, sc[j], ws[j], out + j * d, w);
    });
  });
  return grad;
}

}  // namespace cpu
}  // namespace kivi_fast
