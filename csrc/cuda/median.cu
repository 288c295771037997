// The median pairwise distance of many points on CUDA (cuda::median_of_pairs): an exact radix
// selection over their squared distances, packed one per pair ([B, P], the generic fit's layout, made
// by cuda::pair_sqdist). It replaces a sort of the pairs (at N = 10,000 points: the pairs' 400 MB
// again, and the sort's buffers) with passes that each read the pairs once and build a 2048-bin
// histogram of one 11-bit digit of the distances' bit patterns (non-negative doubles order as their
// bit patterns); the last block to finish a pass picks its digit. Once the digits found leave at most
// kGatherKeys keys (set_gathered_selection, the default; typically after the third digit at 10^5-10^7
// pairs), the next pass gathers them instead, with the least key above them, and its last block ranks
// them and writes the bandwidth; the launches left then return at once. Else the last digit's pass (or,
// for an even count, the second middle's) writes it. The host launches all 6 or 7 kernels after two
// fills (the workspace, the bandwidths), as it cannot know when the gather comes: nothing is read back
// to the host. NaN/Inf distances or a zero median give a NaN bandwidth.
#include <ATen/core/Tensor.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
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
constexpr unsigned kGatherKeys = kThreads;  // the gather's most keys: one a thread of the ranking block
using radix::key_of;
using radix::kMaxBins;
using radix::kNotFiniteKey;

// What the next launch does for a batch element (Selection::stage).
enum Stage : unsigned long long { kSelecting = 0, kGathering = 1, kDone = 2 };

// Per batch element, in device memory (one zeroed workspace with the histogram and the gathered
// keys): the selection's progress, the second middle's statistics (the gather: the least key above
// the gathered ones), and how many blocks of the current launch are done.
struct Selection {
  unsigned long long prefix, mask, rank;  // the digits found so far, and the rank left within them
  unsigned long long count_le, min_gt;    // even counts: keys <= the lower middle, least key above it
  unsigned long long not_finite;
  unsigned long long blocks_done;         // the launch's blocks that have added their counts
  unsigned long long stage;               // a Stage
  unsigned long long gathered;            // how many keys the gather has written
};
constexpr int64_t kSelectionWords = sizeof(Selection) / sizeof(int64_t);
static_assert(sizeof(Selection) == 9 * sizeof(int64_t));

// Whether this block is the last of its batch element's blocks to finish (block-wide result): the
// blocks' global atomics before it are then visible to it. Resets the count for the next launch.
__device__ bool last_block_of_element(Selection& sel) {
  __shared__ bool last;
  __threadfence();  // this block's atomics before its count
  __syncthreads();
  if (threadIdx.x == 0) {
    last = atomicAdd(&sel.blocks_done, 1ull) == gridDim.x - 1;
    if (last) sel.blocks_done = 0;
  }
  __syncthreads();
  if (last) __threadfence();  // and the other blocks' writes before its reads
  return last;
}

// The bandwidth from the selection: NaN for NaN/Inf distances or a zero median.
__device__ double bandwidth_of(uint64_t lo, int64_t P, unsigned long long count_le, unsigned long long min_gt,
                               unsigned long long not_finite) {
  const double s = radix::median_of_middles(lo, P, count_le, min_gt);
  return (not_finite || !(s > 0.0)) ? NAN : s;
}

// The gather (Selection::stage kGathering): the in_bin keys that match the digits found so far go to
// keys ([kGatherKeys], in the order the blocks reach them), and for an even count the least key above
// them to min_gt; the last block of the element ranks them (ties by position) and writes the
// bandwidth from the two middles: the lower one of rank sel.rank among them, the upper one the next,
// or the least key above them when the lower one is their last.
__device__ void gather_and_rank(const double* pairs, int64_t P, Selection& sel, unsigned long long* keys,
                                unsigned long long* ranked, double* sigma) {
  const int tid = threadIdx.x;
  const uint64_t prefix = sel.prefix, mask = sel.mask, bin_top = prefix | ~mask;
  const bool even = P % 2 == 0;
  unsigned long long above = ~0ull;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t p = static_cast<int64_t>(blockIdx.x) * kThreads + tid; p < P; p += stride) {
    const uint64_t k = key_of(pairs[p]);
    if ((k & mask) == prefix) keys[atomicAdd(&sel.gathered, 1ull)] = k;
    else if (k > bin_top && k < above) above = k;
  }
  if (even) {
    above = radix::warp_min(above);
    if ((tid & 31) == 0) atomicMin(&sel.min_gt, above);
  }
  if (!last_block_of_element(sel)) return;
  __shared__ unsigned long long middles[2];
  const unsigned long long n = __ldcg(&sel.gathered), rank = sel.rank;
  if (static_cast<unsigned long long>(tid) < n) ranked[tid] = __ldcg(keys + tid);
  __syncthreads();
  if (static_cast<unsigned long long>(tid) < n) {
    const unsigned long long key = ranked[tid];
    unsigned long long r = 0;
    for (unsigned long long j = 0; j < n; ++j) {
      r += ranked[j] < key || (ranked[j] == key && j < static_cast<unsigned long long>(tid));
    }
    if (r == rank || r == rank + 1) middles[r - rank] = key;
  }
  __syncthreads();
  if (tid == 0) {
    const uint64_t lo = middles[0], hi = !even ? lo : rank + 1 < n ? middles[1] : __ldcg(&sel.min_gt);
    const double s = radix::mean_of_roots(lo, hi);
    sigma[blockIdx.y] = (__ldcg(&sel.not_finite) || !(s > 0.0)) ? NAN : s;
    sel.stage = kDone;
  }
}

// One digit's histogram over the keys that match the digits found so far; the blocks of an element
// take kThreads consecutive pairs in turn. The last block of each batch element then picks the digit
// that holds the rank (and clears the histogram for the next digit); after the last digit of an odd
// pair count it writes the bandwidth. Where the digit leaves at most gather_keys keys (and digits are
// left), the next launch gathers them (gather_and_rank) and the ones after return at once. The first
// digit starts from prefix = mask = 0 and rank = first_rank.
__global__ void __launch_bounds__(kThreads)
    digit_histogram_kernel(const double* __restrict__ pairs_all, int64_t P, Selection* __restrict__ sel_all,
                           int lo_bit, unsigned bins, bool first, unsigned long long first_rank, bool last_digit,
                           unsigned gather_keys, unsigned long long* __restrict__ hist_all,
                           unsigned long long* __restrict__ keys_all, double* __restrict__ sigma) {
  // the block's counts (32-bit atomics), then in the last block the element's (up to P: 64-bit), or
  // the gathered keys
  __shared__ union {
    unsigned block[kMaxBins];
    unsigned long long element[kMaxBins];
  } hist;
  const int b = blockIdx.y, tid = threadIdx.x;
  const double* pairs = pairs_all + b * P;
  Selection& sel_b = sel_all[b];
  const unsigned long long stage = first ? kSelecting : sel_b.stage;  // (the previous launch's, for all blocks)
  if (stage == kDone) return;
  if (stage == kGathering) {
    gather_and_rank(pairs, P, sel_b, keys_all + static_cast<int64_t>(b) * kGatherKeys, hist.element, sigma);
    return;
  }
  const uint64_t prefix = first ? 0 : sel_b.prefix, mask = first ? 0 : sel_b.mask;
  const unsigned long long rank = first ? first_rank : sel_b.rank;
  for (unsigned i = tid; i < bins; i += kThreads) hist.block[i] = 0;
  __syncthreads();
  bool bad = false;
  // the whole warp walks together (base is uniform), so that equal bins can be counted once
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * kThreads; base < P; base += stride) {
    const int64_t p = base + tid;
    unsigned bin = ~0u;
    if (p < P) {
      const uint64_t k = key_of(pairs[p]);
      bad |= first && k >= kNotFiniteKey;
      if ((k & mask) == prefix) bin = static_cast<unsigned>((k >> lo_bit) & (bins - 1));
    }
    radix::add_to_histogram(hist.block, bin);
  }
  if (bad) sel_b.not_finite = 1;
  __syncthreads();
  unsigned long long* out = hist_all + static_cast<int64_t>(b) * kMaxBins;
  for (unsigned i = tid; i < bins; i += kThreads) {
    if (hist.block[i] != 0) atomicAdd(out + i, static_cast<unsigned long long>(hist.block[i]));
  }
  if (!last_block_of_element(sel_b)) return;  // (its barriers: every thread is past the reads above)
  // the element's whole histogram, read past L1 (the atomics were made in L2), then cleared
  for (unsigned i = tid; i < bins; i += kThreads) {
    hist.element[i] = __ldcg(out + i);
    out[i] = 0;
  }
  __syncthreads();
  if (tid >= 32) return;
  unsigned digit;
  unsigned long long left;
  if (radix::find_digit(hist.element, bins, rank, &digit, &left)) {  // one lane
    const uint64_t lo = prefix | static_cast<uint64_t>(digit) << lo_bit;
    sel_b.prefix = lo;
    sel_b.mask = mask | static_cast<uint64_t>(bins - 1) << lo_bit;
    sel_b.rank = left;
    if (first) sel_b.min_gt = ~0ull;  // for second_middle_kernel's (or the gather's) atomicMin
    if (!last_digit && hist.element[digit] <= gather_keys) sel_b.stage = kGathering;
    if (last_digit && P % 2 == 1) sigma[b] = bandwidth_of(lo, P, 0, 0, __ldcg(&sel_b.not_finite));
  }
}

// Even pair counts: how many keys are <= the lower middle, and the least key above it; the last
// block of each batch element writes the bandwidth.
__global__ void __launch_bounds__(kThreads)
    second_middle_kernel(const double* __restrict__ pairs_all, int64_t P, Selection* __restrict__ sel_all,
                         double* __restrict__ sigma) {
  const int b = blockIdx.y;
  const double* pairs = pairs_all + b * P;
  Selection& sel_b = sel_all[b];
  if (sel_b.stage == kDone) return;  // the gather wrote the bandwidth
  const unsigned long long lo = sel_b.prefix;
  unsigned long long count = 0, min_gt = ~0ull;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t p = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; p < P; p += stride) {
    const uint64_t k = key_of(pairs[p]);
    if (k <= lo) ++count;
    else if (k < min_gt) min_gt = k;
  }
  for (int o = 16; o > 0; o >>= 1) {
    count += __shfl_xor_sync(0xffffffffu, count, o);
    min_gt = min(min_gt, __shfl_xor_sync(0xffffffffu, min_gt, o));
  }
  if ((threadIdx.x & 31) == 0) {
    atomicAdd(&sel_b.count_le, count);
    atomicMin(&sel_b.min_gt, min_gt);
  }
  if (!last_block_of_element(sel_b)) return;
  if (threadIdx.x == 0) {
    sigma[b] = bandwidth_of(lo, P, __ldcg(&sel_b.count_le), __ldcg(&sel_b.min_gt), __ldcg(&sel_b.not_finite));
  }
}

}  // namespace

int64_t median_blocks_per_element(int64_t P, int64_t nb, int64_t sms) {
  const int64_t filling = std::min<int64_t>((P + kThreads - 1) / kThreads, (8 * sms + nb - 1) / nb);
  // and enough that no block counts 2^32 keys in its 32-bit shared histogram (P >= 2^32: N >= 92,682)
  return std::max<int64_t>({filling, (P >> 31) + 1, 1});
}

Tensor median_of_pairs(const Tensor& pairs_in) {
  const c10::cuda::CUDAGuard guard(pairs_in.device());
  const Tensor pairs = pairs_in.contiguous();
  TORCH_CHECK(pairs.scalar_type() == at::kDouble && pairs.dim() == 2 && pairs.size(1) > 0,
              "kivi_fast: median_of_pairs expects float64 squared distances [B, P], P > 0, got ", pairs.sizes());
  const int64_t B = pairs.size(0), P = pairs.size(1);
  auto sigma = at::full({B}, NAN, pairs.options());  // written by the kernels' last blocks
  if (B == 0) return sigma;
  // one zeroed workspace (one launch): the elements' Selections, their histograms, their gathered keys
  auto ws = at::zeros({B * (kSelectionWords + static_cast<int64_t>(kMaxBins + kGatherKeys))},
                      pairs.options().dtype(at::kLong));
  auto* sel = reinterpret_cast<Selection*>(ws.data_ptr<int64_t>());
  auto* h = reinterpret_cast<unsigned long long*>(ws.data_ptr<int64_t>()) + B * kSelectionWords;
  auto* keys = h + B * kMaxBins;
  const unsigned gather_keys = use_gathered_selection() ? kGatherKeys : 0;
  const int device = pairs.get_device();
  const auto stream = c10::cuda::getCurrentCUDAStream(device);
  const int sms = device_attribute(device, cudaDevAttrMultiProcessorCount);
  // Batch elements in chunks of at most kMaxGridYZ (the grids' y dimension), each chunk's grid with
  // enough blocks to fill the GPU, at most one per kThreads pairs.
  for (int64_t b0 = 0; b0 < B; b0 += kMaxGridYZ) {
    const int64_t nb = std::min(kMaxGridYZ, B - b0);
    const double* pairs_b = pairs.data_ptr<double>() + b0 * P;  // the chunk's first element as element 0
    Selection* sel_b = sel + b0;
    unsigned long long* h_b = h + b0 * kMaxBins;
    unsigned long long* keys_b = keys + b0 * kGatherKeys;
    double* sigma_b = sigma.data_ptr<double>() + b0;
    const int64_t per_element = median_blocks_per_element(P, nb, sms);
    const dim3 grid(static_cast<unsigned>(per_element), static_cast<unsigned>(nb));
    for (int shift = radix::kFirstShift; shift > radix::kEndShift; shift -= radix::kBits) {
      const int lo_bit = radix::digit_low_bit(shift);
      const unsigned bins = radix::digit_bins(shift);
      const bool first = shift == radix::kFirstShift, last_digit = shift - radix::kBits <= radix::kEndShift;
      digit_histogram_kernel<<<grid, kThreads, 0, stream>>>(pairs_b, P, sel_b, lo_bit, bins, first,
                                                          radix::lower_middle_rank(P), last_digit, gather_keys,
                                                          h_b, keys_b, sigma_b);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    if (P % 2 == 0) {
      second_middle_kernel<<<grid, kThreads, 0, stream>>>(pairs_b, P, sel_b, sigma_b);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  }
  return sigma;
}

}  // namespace kivi_fast::cuda
