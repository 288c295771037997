// The exact median of squared distances by radix selection, shared by the block-level selection of
// cuda/kl.cu and the multi-block one of cuda/median.cu: non-negative doubles order as their bit
// patterns ("keys"), so the key of a rank is found digit by digit from the top, each digit from a
// histogram of the keys that match the digits found so far.
#pragma once

#include <cstdint>

namespace kivi_fast::cuda::radix {

constexpr int kBits = 11;  // 6 digits cover 64 bits: 11 bits each, the last 9
constexpr unsigned kMaxBins = 1u << kBits;
constexpr uint64_t kNotFiniteKey = 0x7ff0000000000000ull;  // Inf and NaN keys lie at or above it

__device__ __forceinline__ uint64_t key_of(double v) { return static_cast<uint64_t>(__double_as_longlong(v)); }

// The digits from the top: for (int shift = kFirstShift; shift > kEndShift; shift -= kBits).
constexpr int kFirstShift = 64 - kBits;
constexpr int kEndShift = -kBits;
__host__ __device__ constexpr int digit_low_bit(int shift) { return shift < 0 ? 0 : shift; }
__host__ __device__ constexpr unsigned digit_bins(int shift) { return 1u << (shift < 0 ? kBits + shift : kBits); }

// Called by a whole warp: adds each lane's key to its bin of the shared-memory histogram (bin ~0u: the
// lane has no key). Most keys share their top digits (distances of one scale), so lanes with the same
// bin add their count once: one atomic per distinct bin in the warp, not per key. A warp with no key
// skips the match: most warps, once the digits found so far leave few keys (from the third digit on).
__device__ __forceinline__ void add_to_histogram(unsigned* hist, unsigned bin) {
  if (!__any_sync(0xffffffffu, bin != ~0u)) return;
  const unsigned peers = __match_any_sync(0xffffffffu, bin);
  if (bin != ~0u && (threadIdx.x & 31) == static_cast<unsigned>(__ffs(peers) - 1)) {
    atomicAdd(&hist[bin], static_cast<unsigned>(__popc(peers)));
  }
}

// Called by a whole warp over one digit's histogram of `bins` counts (512 or 2048): the lane that finds
// the bin holding the key of rank `rank` (0-based among the counted keys) sets *digit and *rank_left
// (the rank within that bin) and returns true; the other lanes return false. Each lane sums a slice of
// bins / 32 consecutive bins, starting at a lane-rotated bin of its slice: in order, the slices'
// starts (a multiple of 32 words apart) would put every lane's read in one shared-memory bank. Then the
// whole warp scans the slice that holds the rank, 32 bins at a time.
template <typename Count>
__device__ bool find_digit(const Count* hist, unsigned bins, unsigned long long rank, unsigned* digit,
                           unsigned long long* rank_left) {
  const unsigned lane = threadIdx.x & 31, per_lane = bins / 32;  // (a power of two)
  unsigned long long sum = 0;
  for (unsigned i = 0; i < per_lane; ++i) sum += hist[lane * per_lane + ((i + lane) & (per_lane - 1))];
  unsigned long long incl = sum;
  for (int o = 1; o < 32; o <<= 1) {
    const unsigned long long v = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= static_cast<unsigned>(o)) incl += v;
  }
  const unsigned holders = __ballot_sync(0xffffffffu, rank >= incl - sum && rank < incl);
  if (holders == 0) return false;  // (a rank beyond the counts)
  const unsigned owner = static_cast<unsigned>(__ffs(static_cast<int>(holders)) - 1);
  unsigned long long before = __shfl_sync(0xffffffffu, incl - sum, owner);  // the counts of the bins before
  for (unsigned base = owner * per_lane; base < (owner + 1) * per_lane; base += 32) {
    const unsigned bin = base + lane;
    const unsigned long long h = lane < per_lane ? static_cast<unsigned long long>(hist[bin]) : 0;
    unsigned long long upto = h;  // the chunk's counts up to this lane's bin
    for (int o = 1; o < 32; o <<= 1) {
      const unsigned long long v = __shfl_up_sync(0xffffffffu, upto, o);
      if (lane >= static_cast<unsigned>(o)) upto += v;
    }
    const bool here = rank >= before + upto - h && rank < before + upto;
    if (__any_sync(0xffffffffu, here)) {
      if (here) {
        *digit = bin;
        *rank_left = rank - (before + upto - h);
      }
      return here;
    }
    before += __shfl_sync(0xffffffffu, upto, 31);
  }
  return false;
}

// The least of a warp's keys, in every lane (the gathers' least key above the gathered ones).
__device__ __forceinline__ unsigned long long warp_min(unsigned long long v) {
  for (int o = 16; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// The lower middle's rank (0-based) among P pairs.
__host__ __device__ constexpr int64_t lower_middle_rank(int64_t P) { return (P + 1) / 2 - 1; }

// The mean of the square roots of two keys' distances: the median distance from its two middle keys.
__device__ __forceinline__ double mean_of_roots(uint64_t lo, uint64_t hi) {
  return 0.5 * (sqrt(__longlong_as_double(static_cast<long long>(lo))) +
                sqrt(__longlong_as_double(static_cast<long long>(hi))));
}

// The median distance from the lower middle key, for an even P also from how many keys are <= it and
// the least key above it (numpy's convention: the mean of the two middle distances; the upper middle
// is the lower one again when it occurs more than once).
__device__ __forceinline__ double median_of_middles(uint64_t lo, int64_t P, unsigned long long count_le,
                                                    unsigned long long min_gt) {
  const bool tied = count_le > static_cast<unsigned long long>(lower_middle_rank(P) + 1);
  return mean_of_roots(lo, (P % 2 == 1 || tied) ? lo : min_gt);
}

}  // namespace kivi_fast::cuda::radix
