// The diagonal Gaussian contrast on CUDA (cuda::standardize, cuda::standardize_grad): the forward and
// the backward of kivi_fast/contrast.py's _DiagonalContrast, each in one launch (two with more than 32
// dimensions: the sum of the blocks' parts of t), where ATen's composition takes 11 and 10 small ones
// with the float64 conversions. At the VAE's shapes (128 x 100 samples in 8 dimensions) each is a few
// microseconds of work, so the launches are the cost (bench/README.md, "GPU").
//
// A block takes one batch element's samples in up to 32 columns (dimensions): thread (c, r) of w
// columns and kThreads / w row groups sums its column's rows r, r + kThreads / w, ..., and a tree in
// shared memory adds the groups (group_sum). The passes over the samples: the means, then the centred
// squares (two passes, as std_mean's accuracy needs), then the output; the samples are read in their
// dtype and the sums are float64. The results are deterministic: no atomics.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/sum.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

#include "cuda/device.h"
#include "kivi.h"

namespace kivi_fast::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxColumns = 32;  // a block's columns: at least 8 rows a pass at once

// The columns of a block for d dimensions: a power of two, so that the row groups' tree pairs the
// threads of one column.
int block_columns(int64_t d) {
  int w = 1;
  while (w < kMaxColumns && w < d) w *= 2;
  return w;
}

// The sum of v over the threads of the block with the same threadIdx.x % w (w a power of two: the
// threads of one column), returned to each of them. part: kThreads doubles of shared memory. Called by
// every thread (barriers).
__device__ double group_sum(double v, double* part, int w) {
  part[threadIdx.x] = v;
  __syncthreads();
  for (int s = kThreads / 2; s >= w; s >>= 1) {
    if (static_cast<int>(threadIdx.x) < s) part[threadIdx.x] += part[threadIdx.x + s];
    __syncthreads();
  }
  const double total = part[threadIdx.x % w];
  __syncthreads();  // before part is written again
  return total;
}

// Block (blockIdx.x: columns [w x, w x + w), blockIdx.y: the batch element) of standardize: z = (x - m)
// / s per column, s the maximum-likelihood standard deviation, into z and s; and the block's part of t:
// sum over its columns of -log s, or (to_standard_normal) (s^2 + m^2) / 2 - log s, plus `offset` in the
// first block of each batch element, into t_part[b, blockIdx.x].
template <typename T>
__global__ void __launch_bounds__(kThreads)
    standardize_kernel(const T* __restrict__ x_all, int64_t n, int64_t d, int w, bool to_standard_normal,
                       double offset, double* __restrict__ z_all, double* __restrict__ std_all,
                       double* __restrict__ t_part) {
  __shared__ double part[kThreads];
  const int64_t b = blockIdx.y, groups = kThreads / w;
  const int64_t r = threadIdx.x / w, j = static_cast<int64_t>(blockIdx.x) * w + threadIdx.x % w;
  const bool in = j < d;
  const T* x = x_all + b * n * d + j;
  double* z = z_all + b * n * d + j;
  // The sums are of x - K, K the column's first sample: a column of equal samples then has exactly
  // zero deviations (NaN z and Inf t, as ATen's std_mean gives), where the rounded mean of float64
  // samples would leave deviations of an ulp, and a finite z of +-1.
  const double shift = in ? static_cast<double>(x[0]) : 0.0;
  double sum = 0.0;
  for (int64_t i = r; in && i < n; i += groups) sum += static_cast<double>(x[i * d]) - shift;
  const double offset_mean = group_sum(sum, part, w) / static_cast<double>(n);  // mean - K
  double squares = 0.0;
  for (int64_t i = r; in && i < n; i += groups) {
    const double e = (static_cast<double>(x[i * d]) - shift) - offset_mean;
    squares += e * e;
  }
  const double sd = sqrt(group_sum(squares, part, w) / static_cast<double>(n));
  for (int64_t i = r; in && i < n; i += groups) z[i * d] = ((static_cast<double>(x[i * d]) - shift) - offset_mean) / sd;
  const double mean = shift + offset_mean;
  double term = 0.0;
  if (in && r == 0) {
    std_all[b * d + j] = sd;
    term = to_standard_normal ? 0.5 * (sd * sd + mean * mean) - log(sd) : -log(sd);
  }
  const double block_t = group_sum(term, part, 1);
  if (threadIdx.x == 0) t_part[b * gridDim.x + blockIdx.x] = block_t + (blockIdx.x == 0 ? offset : 0.0);
}

// Block of standardize_grad (the layout of standardize_kernel): the gradient w.r.t. x of
// sum g_z z + g_t t per column,
//   ((g - mean g) - z (mean (g z) + g_t / n)) / s  [+ x g_t / n with to_standard_normal],
// with g_z (grad_z_all) or g_t (grad_t) absent as nullptr; into out in x's dtype.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    standardize_grad_kernel(const double* __restrict__ grad_z_all, const double* __restrict__ grad_t,
                            const double* __restrict__ z_all, const double* __restrict__ std_all,
                            const T* __restrict__ x_all, int64_t n, int64_t d, int w, bool to_standard_normal,
                            T* __restrict__ out_all) {
  __shared__ double part[kThreads];
  const int64_t b = blockIdx.y, groups = kThreads / w;
  const int64_t r = threadIdx.x / w, j = static_cast<int64_t>(blockIdx.x) * w + threadIdx.x % w;
  const bool in = j < d;
  const int64_t at = b * n * d + j;
  const double* z = z_all + at;
  const double t_scale = grad_t != nullptr ? grad_t[b] / static_cast<double>(n) : 0.0;
  const double sd = in ? std_all[b * d + j] : 1.0;
  double g_mean = 0.0, scale = t_scale;
  if (grad_z_all != nullptr) {  // (uniform over the block: the barriers inside are reached by all)
    const double* g = grad_z_all + at;
    double g_sum = 0.0, gz_sum = 0.0;
    for (int64_t i = r; in && i < n; i += groups) {
      g_sum += g[i * d];
      gz_sum += g[i * d] * z[i * d];
    }
    g_mean = group_sum(g_sum, part, w) / static_cast<double>(n);
    scale += group_sum(gz_sum, part, w) / static_cast<double>(n);
  }
  const T* x = x_all + at;
  T* out = out_all + at;
  for (int64_t i = r; in && i < n; i += groups) {
    const double g = grad_z_all != nullptr ? grad_z_all[at + i * d] : 0.0;
    double v = ((g - g_mean) - z[i * d] * scale) / sd;
    if (to_standard_normal) v += static_cast<double>(x[i * d]) * t_scale;
    out[i * d] = static_cast<T>(v);
  }
}

void check_samples(const Tensor& x, const char* op) {
  TORCH_CHECK(x.dim() == 3 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble) && x.size(1) > 0 &&
                  x.size(2) > 0,
              "kivi_fast: ", op, " expects float32 or float64 samples [B, n > 0, d > 0], got ", x.scalar_type(), " ",
              x.sizes());
}

// The launches' grid for [B, n, d] samples, the batch in chunks of kMaxGridYZ: fn(grid, b0) for each
// chunk (b0: its first batch element).
template <typename Fn>
void for_batch_chunks(int64_t B, int64_t d, int w, Fn fn) {
  const int64_t blocks = (d + w - 1) / w;
  TORCH_CHECK(blocks <= std::numeric_limits<int>::max(), "kivi_fast: standardize of ", d, " dimensions is too large");
  for (int64_t b0 = 0; b0 < B; b0 += kMaxGridYZ) {
    const int64_t nb = std::min(kMaxGridYZ, B - b0);
    fn(dim3(static_cast<unsigned>(blocks), static_cast<unsigned>(nb)), b0);
  }
}

}  // namespace

std::tuple<Tensor, Tensor, Tensor> standardize(const Tensor& x_in, bool to_standard_normal, double bias) {
  const c10::cuda::CUDAGuard guard(x_in.device());
  check_samples(x_in, "standardize");
  const Tensor x = x_in.contiguous();
  const int64_t B = x.size(0), n = x.size(1), d = x.size(2);
  const int w = block_columns(d);
  const int64_t blocks = (d + w - 1) / w;
  const auto f64 = x.options().dtype(at::kDouble);
  auto z = at::empty({B, n, d}, f64), sd = at::empty({B, 1, d}, f64), t_part = at::empty({B, blocks}, f64);
  if (B == 0) return {z, sd, t_part.view({0})};
  const double offset = to_standard_normal ? bias - 0.5 * static_cast<double>(d) : 0.0;
  const auto stream = c10::cuda::getCurrentCUDAStream(x.get_device());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "kivi_fast_cuda_standardize", [&] {
    for_batch_chunks(B, d, w, [&](const dim3& grid, int64_t b0) {
      standardize_kernel<scalar_t><<<grid, kThreads, 0, stream>>>(
          x.data_ptr<scalar_t>() + b0 * n * d, n, d, w, to_standard_normal, offset,
          z.data_ptr<double>() + b0 * n * d, sd.data_ptr<double>() + b0 * d, t_part.data_ptr<double>() + b0 * blocks);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return {z, sd, blocks == 1 ? t_part.view({B}) : t_part.sum(1)};
}

Tensor standardize_grad(const std::optional<Tensor>& grad_z_in, const std::optional<Tensor>& grad_t_in, const Tensor& z_in,
                        const Tensor& sd_in, const Tensor& x_in, bool to_standard_normal) {
  const c10::cuda::CUDAGuard guard(x_in.device());
  check_samples(x_in, "standardize_grad");
  const Tensor x = x_in.contiguous(), z = z_in.contiguous(), sd = sd_in.contiguous();
  const int64_t B = x.size(0), n = x.size(1), d = x.size(2);
  const auto same = [&](const Tensor& t, at::IntArrayRef shape) {
    return t.scalar_type() == at::kDouble && t.sizes() == shape && t.device() == x.device();
  };
  const std::vector<int64_t> samples{B, n, d}, stds{B, 1, d}, batch{B};
  TORCH_CHECK(same(z, samples) && same(sd, stds) && (!grad_z_in.has_value() || same(*grad_z_in, samples)) &&
                  (!grad_t_in.has_value() || same(*grad_t_in, batch)),
              "kivi_fast: standardize_grad expects float64 z and grad_z like x ", x.sizes(), ", std [B, 1, d] and "
              "grad_t [B] on x's device");
  auto out = at::empty_like(x);
  if (out.numel() == 0) return out;
  const Tensor grad_z = grad_z_in.has_value() ? grad_z_in->contiguous() : Tensor();
  const Tensor grad_t = grad_t_in.has_value() ? grad_t_in->contiguous() : Tensor();
  const int w = block_columns(d);
  const auto stream = c10::cuda::getCurrentCUDAStream(x.get_device());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "kivi_fast_cuda_standardize_grad", [&] {
    for_batch_chunks(B, d, w, [&](const dim3& grid, int64_t b0) {
      standardize_grad_kernel<scalar_t><<<grid, kThreads, 0, stream>>>(
          grad_z.defined() ? grad_z.data_ptr<double>() + b0 * n * d : nullptr,
          grad_t.defined() ? grad_t.data_ptr<double>() + b0 : nullptr, z.data_ptr<double>() + b0 * n * d,
          sd.data_ptr<double>() + b0 * d, x.data_ptr<scalar_t>() + b0 * n * d, n, d, w, to_standard_normal,
          out.data_ptr<scalar_t>() + b0 * n * d);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return out;
}

}  // namespace kivi_fast::cuda
