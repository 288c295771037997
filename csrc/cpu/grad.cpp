// The backward of the ratio and kl ops from their grad state (kivi.h, grad_state_width):
// grad_j = row_scale_j (sum_c W_jc c - (sum_c W_jc) z_j). From the weights W themselves (weighted_grad),
// reading the samples once more, block by block, and writing the gradient once; from their projection
// (projection_grad), one elementwise pass.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <vector>

#include "cpu/blas.h"
#include "cpu/buffers.h"
#include "cpu/distances.h"
#include "cpu/few_points.h"
#include "cpu/gram_tiles.h"
#include "cpu/kept_outputs.h"
#include "cpu/loops.h"
#include "cpu/simd_rows.h"
#include "kivi.h"

namespace kivi_fast {
namespace cpu {
namespace {

// weighted_grad by few_points' register tiles: grad_j = scale_j (sum_c W_jc c - w_sum_j z_j) straight
// from the input rows (the first n stacked rows are the fitted points; z's m rows start at stacked row
// z_row), in float64 registers, with the weights V = scale W folded per chunk of outputs: where z's rows
// are among the fitted ones (the kl op's q_z), V_jc = scale_j (W_jc - [c = z_row + j] w_sum_j) and the
// tiles store their sums as they are, with no pass over z's rows and no scaling per column
// ((10, 314000) forward+backward 1.05x faster than a term per column, float32); other z (the ratio at
// new points) keeps its own term, scale_j w_sum_j z_j, per column. Up to kMaxOutRows evaluation points
// in one pass over the rows; more in chunks of 15 (three tiles of 5 rows) over column blocks whose n
// input rows stay in L2 for all the chunks (each chunk's V, 15 n doubles, is folded again per block:
// 1/64 of the block's multiply-adds at most). MKL's GEMM on the rows copied to float64
// (for_each_block), which packs both operands again, is slower from 200 to 1000 points (forward +
// backward, float32, 1 thread: the tiles 1.07x faster at (100, 700), (100, 50000), (150, 1000) and
// (300, 2000), 1.2x at (500, 1000)); blocks of 64 KB or chunks of 10 rows are 1-2.5% slower at
// (100, 50000). Where gram_tiles are off (no AVX2, or isa::prefer_512_bit(): AVX-512 CPUs but AMD's
// Zen 4, where MKL's 8-wide GEMMs may well do better; not measured), the GEMM stays.
constexpr int64_t kTiledGradChunk = 15;
constexpr int64_t kTiledGradBlockBytes = int64_t{256} << 10;
void tiled_weighted_grad(const Stack& s, int64_t n, int64_t z_row, const Tensor& weights, const Tensor& scale,
                         const Tensor& w_sum, Tensor& grad) {
  const int64_t m = grad.size(1), d = s.d;
  const bool z_folded = z_row + m <= n;
  auto w = weights.contiguous();
  const bool chunked = m > few_points::kMaxOutRows;
  const int64_t chunk = chunked ? kTiledGradChunk : m;
  AT_DISPATCH_FLOATING_TYPES(grad.scalar_type(), "kivi_fast_tiled_grad", [&] {
    const int64_t row_bytes = n * static_cast<int64_t>(sizeof(scalar_t));
    const int64_t block = chunked ? std::max<int64_t>(64, kTiledGradBlockBytes / row_bytes / 64 * 64) : d;
    auto columns = [&](int64_t b, int64_t c0, int64_t c1) {
      std::vector<const scalar_t*> rows(s.rows);
      std::vector<scalar_t*> out(m);
      const double* const scale_b = scale.data_ptr<double>() + b * m;
      const double* const w_sum_b = w_sum.data_ptr<double>() + b * m;
      double* const v = thread_work().product.get(chunk * n);
      double t[few_points::kMaxOutRows];  // scale_j w_sum_j of the chunk, where z keeps its own term
      // V of outputs [j0, j0 + mj)
      auto fold = [&](int64_t j0, int64_t mj) {
        for (int64_t j = 0; j < mj; ++j) {
          const double* w_j = w.data_ptr<double>() + (b * m + j0 + j) * n;
          const double scale_j = scale_b[j0 + j];
          double* v_j = v + j * n;
          for (int64_t c = 0; c < n; ++c) v_j[c] = scale_j * w_j[c];
          if (z_folded) {
            const int64_t zc = z_row + j0 + j;
            v_j[zc] = scale_j * (w_j[zc] - w_sum_b[j0 + j]);
          } else {
            t[j] = scale_j * w_sum_b[j0 + j];
          }
        }
      };
      for (int64_t cb = c0; cb < c1; cb += block) {
        row_pointers(s, b, cb, rows.data());
        for (int64_t j = 0; j < m; ++j) out[j] = grad.data_ptr<scalar_t>() + (b * m + j) * d + cb;
        for (int64_t j0 = 0; j0 < m; j0 += chunk) {
          const int64_t mj = std::min(chunk, m - j0);
          fold(j0, mj);
          few_points::weighted_rows(v, mj, n, rows.data(), z_folded ? nullptr : rows.data() + z_row + j0, t,
                                    out.data() + j0, std::min(block, c1 - cb));
        }
      }
    };
    // an element's columns are split over threads from two blocks (chunked) or 2 x kFewPointsGrain
    const int64_t grain = chunked ? block : kFewPointsGrain;
    if (s.batch >= at::get_num_threads() || d < 2 * grain) {
      at::parallel_for(0, s.batch, 1, [&](int64_t b0, int64_t b1) {
        for (int64_t b = b0; b < b1; ++b) columns(b, 0, d);
      });
    } else {
      for (int64_t b = 0; b < s.batch; ++b)
        at::parallel_for(0, d, grain, [&](int64_t c0, int64_t c1) { columns(b, c0, c1); });
    }
  });
}

}  // namespace

Tensor weighted_grad(const Tensor& row_scale, const Tensor& state, const Tensor& z, const Tensor& numer,
                     const Tensor& denom) {
  // grad_j = row_scale_j (sum_c W_jc c - (sum_c W_jc) z_j), c over the stacked [denom; numer].
  const int64_t n_den = denom.size(1), m = z.size(1);
  if (grad_state_is_projection(n_den + numer.size(1), z.size(2))) {  // the state holds the sums themselves
    const auto scale = row_scale.to(at::kDouble).contiguous();
    return projection_grad(scale.data_ptr<double>(), m, 1, state, z);
  }
  const Tensor& weights = state;
  // z is usually one of the fitted sets (kl evaluates at q_z): then its rows are already stacked.
  auto same = [&](const Tensor& t) {
    return t.data_ptr() == z.data_ptr() && t.sizes() == z.sizes() && t.strides() == z.strides();
  };
  const bool z_is_denom = same(denom), z_is_numer = !z_is_denom && same(numer);
  Stack s = (z_is_denom || z_is_numer) ? Stack({denom, numer}) : Stack({denom, numer, z});
  const int64_t z_row = z_is_denom ? 0 : z_is_numer ? n_den : s.offsets[2];
  const int64_t n = n_den + numer.size(1);
  TORCH_INTERNAL_ASSERT(weights.is_contiguous(), "kivi_fast: weighted_grad reads weights as [B, m, N] rows");
  auto w_sum = weights.sum(-1).contiguous();
  auto scale = row_scale.to(at::kDouble).contiguous();
  auto grad = kept_outputs::empty_like(z);
  const int64_t d = s.d;
  const bool few = use_few_points(n) && m <= few_points::kMaxOutRows;  // with the tiles off too
  if (m > 0 && few_points::available() && (few || gram_tiles::enabled())) {
    tiled_weighted_grad(s, n, z_row, weights, scale, w_sum, grad);
    return grad;
  }
  for_each_block(s, parallel_over_batch(s), [&](int64_t b, int64_t c0, int64_t w, const Tensor& block) {
    double* gp = thread_work().product.get(m * w);  // [m, w], kept between calls like the other buffers
    gemm(false, false, m, w, n, weights.data_ptr<double>() + b * m * n, n, block.data_ptr<double>(), w, false, gp, w);
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

Tensor projection_grad(const double* row_scale, int64_t stride_b, int64_t stride_j, const Tensor& state,
                       const Tensor& z_in) {
  const auto z = z_in.contiguous();
  const auto p = state.contiguous();
  const int64_t batch = z.size(0), m = z.size(1), d = z.size(2);
  auto grad = kept_outputs::empty_like(z);
  AT_DISPATCH_FLOATING_TYPES(z.scalar_type(), "kivi_fast_projection_grad", [&] {
    const scalar_t* zp = z.data_ptr<scalar_t>();
    const double* pp = p.data_ptr<double>();
    scalar_t* gp = grad.data_ptr<scalar_t>();
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t j = 0; j < m; ++j) {
        const int64_t row = b * m + j;
        const double s = row_scale[b * stride_b + j * stride_j];
        const double* pr = pp + row * (d + 1);
        for (int64_t k = 0; k < d; ++k)
          gp[row * d + k] = static_cast<scalar_t>(s * (pr[k] - pr[d] * static_cast<double>(zp[row * d + k])));
      }
  });
  return grad;
}

}  // namespace cpu
}  // namespace kivi_fast
