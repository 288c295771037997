// The median pairwise distance of many points on CUDA (cuda::median_of_pairs): an exact radix
// selection over the upper triangle of the squared distances, read in place from the generic fit's two
// blocks (rows 0..n_top-1 of the N x N matrix, and the block of the other rows and columns). It
// replaces the generic path's copy of the N (N - 1) / 2 pairs and its sort (at N = 10,000 points: the
// pairs' 400 MB, their 800 MB of int64 indices and the sort's buffers) with 6 passes that each read the
// triangle once and build a 2048-bin histogram of one 11-bit digit of the distances' bit patterns
// (non-negative doubles order as their bit patterns). Nothing is read back to the host: NaN/Inf
// distances or a zero median give a NaN bandwidth.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/device.h"
#include "cuda/radix.h"
#include "kivi.h"

namespace kivi_fast::cuda {
namespace {

constexpr int kThreads = 256;
using radix::key_of;
using radix::kMaxBins;
using radix::kNotFiniteKey;

// Per batch element, in device memory: the selection's progress and the second middle's statistics.
struct Selection {
  unsigned long long prefix, mask, rank;  // the digits found so far, and the rank left within them
  unsigned long long count_le, min_gt;    // even counts: keys <= the lower middle, least key above it
  unsigned long long not_finite;
};

// Where row i of one batch element's N x N squared distances lies: rows below n_top in `top`
// ([B, n_top, N]), the others in `tail` ([B, N - n_top, N - n_top], its columns from n_top on).
struct Rows {
  const double* top;
  const double* tail;
  int64_t N, n_top;
  // row i's entries, indexed by the column j (j >= n_top for a tail row)
  __device__ __forceinline__ const double* row(int64_t b, int64_t i) const {
    if (i < n_top) return top + (b * n_top + i) * N;
    const int64_t n_tail = N - n_top;
    return tail + (b * n_tail + (i - n_top)) * n_tail - n_top;
  }
};

// One digit's histogram over the keys that match the digits found so far. Blocks take rows i in turn,
// threads the columns j > i.
__global__ void __launch_bounds__(kThreads)
    digit_histogram_kernel(Rows rows, const Selection* sel_all, int lo_bit, unsigned bins, bool first,
                           unsigned long long* __restrict__ hist_all,
                           Selection* sel_out) {  // sel_out: sel_all (its not_finite flag)
  __shared__ unsigned hist[kMaxBins];
  const int b = blockIdx.y, tid = threadIdx.x, lane = tid & 31;
  const int64_t N = rows.N;
  const Selection sel = sel_all[b];
  for (unsigned i = tid; i < bins; i += kThreads) hist[i] = 0;
  __syncthreads();
  bool bad = false;
  for (int64_t i = blockIdx.x; i < N - 1; i += gridDim.x) {
    const double* row = rows.row(b, i);
    // the whole warp walks together (base is uniform), so that equal bins can be counted once
    for (int64_t base = i + 1; base < N; base += kThreads) {
      const int64_t j = base + tid;
      unsigned bin = ~0u;
      if (j < N) {
        const uint64_t k = key_of(row[j]);
        bad |= first && k >= kNotFiniteKey;
        if ((k & sel.mask) == sel.prefix) bin = static_cast<unsigned>((k >> lo_bit) & (bins - 1));
      }
      const unsigned peers = __match_any_sync(0xffffffffu, bin);
      if (bin != ~0u && lane == __ffs(peers) - 1) atomicAdd(&hist[bin], static_cast<unsigned>(__popc(peers)));
    }
  }
  if (bad) sel_out[b].not_finite = 1;
  __syncthreads();
  unsigned long long* out = hist_all + static_cast<int64_t>(b) * kMaxBins;
  for (unsigned i = tid; i < bins; i += kThreads) {
    if (hist[i] != 0) atomicAdd(out + i, static_cast<unsigned long long>(hist[i]));
  }
}

// Which digit holds the rank (one warp per batch element); clears the histogram for the next digit.
__global__ void pick_digit_kernel(unsigned long long* __restrict__ hist_all, Selection* __restrict__ sel_all,
                                  int lo_bit, unsigned bins) {
  const int b = blockIdx.x, lane = threadIdx.x;
  unsigned long long* hist = hist_all + static_cast<int64_t>(b) * kMaxBins;
  Selection& sel = sel_all[b];
  const unsigned long long rank = sel.rank;  // read by every lane before one rewrites it
  unsigned digit;
  unsigned long long left;
  if (radix::find_digit(hist, bins, rank, &digit, &left)) {
    sel.prefix |= static_cast<unsigned long long>(digit) << lo_bit;
    sel.rank = left;
  }
  __syncwarp();
  if (lane == 0) sel.mask |= static_cast<unsigned long long>(bins - 1) << lo_bit;
  for (unsigned i = lane; i < bins; i += 32) hist[i] = 0;
}

// Even pair counts: how many keys are <= the lower middle, and the least key above it.
__global__ void __launch_bounds__(kThreads) second_middle_kernel(Rows rows, Selection* __restrict__ sel_all) {
  const int b = blockIdx.y;
  const int64_t N = rows.N;
  const unsigned long long lo = sel_all[b].prefix;
  unsigned long long count = 0, min_gt = ~0ull;
  for (int64_t i = blockIdx.x; i < N - 1; i += gridDim.x) {
    const double* row = rows.row(b, i);
    for (int64_t j = i + 1 + threadIdx.x; j < N; j += kThreads) {
      const uint64_t k = key_of(row[j]);
      if (k <= lo) ++count;
      else if (k < min_gt) min_gt = k;
    }
  }
  for (int o = 16; o > 0; o >>= 1) {
    count += __shfl_xor_sync(0xffffffffu, count, o);
    min_gt = min(min_gt, __shfl_xor_sync(0xffffffffu, min_gt, o));
  }
  if ((threadIdx.x & 31) == 0) {
    atomicAdd(&sel_all[b].count_le, count);
    atomicMin(&sel_all[b].min_gt, min_gt);
  }
}

__global__ void bandwidth_kernel(const Selection* __restrict__ sel_all, int64_t P, double* __restrict__ sigma) {
  const int b = blockIdx.x;
  const Selection& sel = sel_all[b];
  const double s = radix::median_of_middles(sel.prefix, P, sel.count_le, sel.min_gt);
  sigma[b] = (sel.not_finite || !(s > 0.0)) ? NAN : s;
}

}  // namespace

Tensor median_of_pairs(const Tensor& top_in, const Tensor& tail_in) {
  const c10::cuda::CUDAGuard guard(top_in.device());
  const Tensor top = top_in.contiguous(), tail = tail_in.contiguous();
  const int64_t B = top.size(0), n_top = top.size(1), N = top.size(2), P = N * (N - 1) / 2;
  TORCH_CHECK(top.scalar_type() == at::kDouble && tail.scalar_type() == at::kDouble && tail.size(0) == B &&
                  tail.size(1) == N - n_top && tail.size(2) == N - n_top,
              "kivi_fast: median_of_pairs expects float64 blocks [B, n, N] and [B, N - n, N - n], got ",
              top.sizes(), " and ", tail.sizes());
  auto sigma = at::empty({B}, top.options());
  if (B == 0) return sigma;
  static_assert(sizeof(Selection) == 6 * sizeof(int64_t));
  // prefix = mask = count_le = not_finite = 0, rank = the lower middle's, min_gt = all ones
  auto init = at::zeros({B, 6}, top.options().dtype(at::kLong));
  init.select(1, 2).fill_(radix::lower_middle_rank(P));
  init.select(1, 4).fill_(-1);
  auto hist = at::zeros({B, static_cast<int64_t>(kMaxBins)}, top.options().dtype(at::kLong));
  auto* sel = reinterpret_cast<Selection*>(init.data_ptr<int64_t>());
  auto* h = reinterpret_cast<unsigned long long*>(hist.data_ptr<int64_t>());
  const int device = top.get_device();
  const auto stream = c10::cuda::getCurrentCUDAStream(device);
  const int sms = device_attribute(device, cudaDevAttrMultiProcessorCount);
  // Batch elements in chunks of at most 65535 (the grids' y dimension), each chunk's grid with
  // enough blocks to fill the GPU, at most one per row.
  for (int64_t b0 = 0; b0 < B; b0 += 65535) {
    const int64_t nb = std::min<int64_t>(65535, B - b0);
    // the chunk's first element as element 0 (an empty tail has no storage: its pointer is never read)
    const double* tail_data = tail.numel() > 0 ? tail.data_ptr<double>() + b0 * (N - n_top) * (N - n_top) : nullptr;
    const Rows rows{top.data_ptr<double>() + b0 * n_top * N, tail_data, N, n_top};
    Selection* sel_b = sel + b0;
    unsigned long long* h_b = h + b0 * kMaxBins;
    const dim3 grid(static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(N - 1, (8 * sms + nb - 1) / nb))),
                    static_cast<unsigned>(nb));
    bool first = true;
    for (int shift = radix::kFirstShift; shift > radix::kEndShift; shift -= radix::kBits) {
      const int lo_bit = radix::digit_low_bit(shift);
      const unsigned bins = radix::digit_bins(shift);
      digit_histogram_kernel<<<grid, kThreads, 0, stream>>>(rows, sel_b, lo_bit, bins, first, h_b, sel_b);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      pick_digit_kernel<<<static_cast<unsigned>(nb), 32, 0, stream>>>(h_b, sel_b, lo_bit, bins);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      first = false;
    }
    if (P % 2 == 0) {
      second_middle_kernel<<<grid, kThreads, 0, stream>>>(rows, sel_b);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    bandwidth_kernel<<<static_cast<unsigned>(nb), 1, 0, stream>>>(sel_b, P, sigma.data_ptr<double>() + b0);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return sigma;
}

}  // namespace kivi_fast::cuda
