// The kl op and its backward on CUDA tensors (the cuda:: functions of kivi.h), for the shapes where a
// whole fit fits one thread block: few points (N = n_p + n_q <= 512) in few dimensions (N d <= 6144:
// the VAE's B x (100, 8)), or up to 256 points in at least as many dimensions (an MNIST layer,
// (10, 314000); with many posterior samples, (100, 50000)). Other shapes take the device-generic ATen
// path (csrc/generic.cpp); handles_kl says which.
//
// One block a batch element does the whole forward in one launch, in shared memory where it fits
// (kl_forward_kernel says what goes where; where it does not, as many blocks as the GPU holds take the
// elements in turn, each with its own slot of the global workspace): the points as float64, every
// pair's distance, the exact median by radix selection on the distances' bit patterns, the system K_dd
// / n_den + lam I, its elimination and solve, the evaluation of the ratio at q_z's points, the KL and
// the backward's grad state. With many dimensions a first launch splits the distances over dimension
// chunks (pair_sqdist_kernel; pair_tile_kernel above 64 points), so that the whole GPU reads the
// samples once. The backward is one elementwise launch (projection state) or one launch whose blocks
// each read the samples' columns for 8 rows of q_z (weight state up to kMaxWeightWork weights, the
// generic forward's too). The dimension-split distances are summed with atomics, so on that path
// results can differ in their last bits from run to run. For the generic path (csrc/generic.cpp, many
// points) the same tiles give the packed pairs of any number of points for its median (pair_sqdist,
// then cuda/median.cu) and its blocks of kernel values (kernel_block), and kl_finish ends its forward.
//
// Nothing here reads a value back to the host: bad values give NaN for their batch element instead
// of the CPU's errors (NaN/Inf samples, a median or a bandwidth below kMinBandwidth or not finite, a
// system that is not positive definite), so that a training step neither stalls nor breaks CUDA-graph capture.
//
// One block per element is latency-bound: a (100, 8) element's forward takes ~293k cycles (~0.15 ms)
// on an H200, mostly the elimination (41%) and the median's passes (21%) over shared memory, with
// 4 warps a scheduler to hide their latencies (bench/README.md, "GPU").
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/triu_indices.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cuda_runtime.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "cuda/device.h"
#include "cuda/radix.h"
#include "kivi.h"

namespace kivi_fast::cuda {
namespace {

// The forward's block: 16 warps, so that its latency-bound stages (the selection's passes, the
// elimination's rows, the evaluation's points) have enough loads in flight on one multiprocessor.
constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kPairThreads = 256;  // pair_sqdist_kernel
constexpr int kPairWarps = kPairThreads / 32;
constexpr int64_t kMaxPoints = 512;       // N: the fused path's limit
constexpr int64_t kSmallWork = 6144;      // N * d: the points fit in shared memory (48 KB of float64)
constexpr int64_t kMaxWidePoints = 256;   // N with many dimensions (weight state only: d + 1 >= N)
constexpr int64_t kMaxWarpPairPoints = 64;  // up to here pair_sqdist_kernel, above pair_tile_kernel
constexpr int kTile = 64;                 // tile_sqdist (pair_tile_kernel, kernel_block_kernel): points a tile side
constexpr int kTileDims = 32;             // and dimensions per staged slab
constexpr int kTileThreads = 256;         // 16 x 16 threads, each 4 x 4 pairs
// The 16 x 16 sub-blocks of a tile side that hold a point, of `points` from the tile's first on
// (tile_sqdist computes those; the balanced ranges weigh tile pairs by them)
__host__ __device__ __forceinline__ int tile_subblocks_holding(int points) { return min(4, (points + 15) / 16); }

// Offset of pair (i, j), i < j, in the packed upper triangle of N points (rows i = 0, 1, ...).
__host__ __device__ __forceinline__ int64_t pair_index(int64_t i, int64_t j, int64_t n) {
  return i * (2 * n - i - 1) / 2 + (j - i - 1);
}

// (row, column) of entry p of the upper triangle of an n x n matrix stored row by row, from the
// diagonal on (offset 0) or from the first entry right of it (offset 1). Row i starts at entry
// S(i) = i m - i (i - 1) / 2 (m = n - offset, the first row's length): i is the root of that quadratic
// rounded down, then corrected by whole rows for the double's rounding (pair_sqdist's tiles: up to
// ~1,600 rows, where walking the rows would cost more than a tile's work).
__device__ __forceinline__ int2 triangle_entry(int64_t p, int n, int offset) {
  const int64_t m = n - offset;
  const auto start = [m](int64_t i) { return i * m - i * (i - 1) / 2; };
  const double b = static_cast<double>(m) + 0.5;
  int64_t i = static_cast<int64_t>(b - sqrt(b * b - 2.0 * static_cast<double>(p)));
  i = max(int64_t{0}, min(i, m - 1));
  while (i > 0 && start(i) > p) --i;
  while (i + 1 < m && start(i + 1) <= p) ++i;
  return make_int2(static_cast<int>(i), static_cast<int>(i + offset + (p - start(i))));
}

__device__ __forceinline__ double packed_sqdist(const double* dist, int i, int j, int n) {
  if (i == j) return 0.0;
  return i < j ? dist[pair_index(i, j, n)] : dist[pair_index(j, i, n)];
}

// The stacked points [denom; numer] of one batch element.
template <typename T>
struct Stacked {
  const T* den;
  const T* num;
  int n_den;
  int64_t d;
  __device__ __forceinline__ const T* row(int c) const { return c < n_den ? den + c * d : num + (c - n_den) * d; }
};

// Tells the compiler that p points into shared memory, so that the accesses through it compile to
// shared-memory instructions (LDS/STS on 32-bit addresses). A pointer that may point to either shared
// or global memory compiles to generic loads and stores, whose window is resolved at run time. (A
// false assumption is undefined behaviour; the CPU emulation checks each.)
__device__ __forceinline__ void assume_shared(const void* p) { __builtin_assume(__isShared(p)); }

// f(p), compiled twice where kTwice: for p in shared memory (taken when in_shared) and for p anywhere.
// kl_forward_kernel's one-block variant writes the distances, reads them in the median's passes, and
// reads and writes the system in its elimination, each thousands of times, through such calls. (The
// two-blocks variant, within 64 registers, would spill 140 bytes of stores and 288 of loads where it
// spills 56 and 80 with the second copies: it keeps one, through generic loads and stores.)
template <bool kTwice, typename F>
__device__ __forceinline__ auto in_shared_or_not(bool in_shared, double* p, F&& f) {
  if constexpr (kTwice) {
    if (in_shared) {
      assume_shared(p);
      return f(p);
    }
  }
  return f(p);
}

__device__ __forceinline__ double warp_sum(double v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

using radix::key_of;
using radix::kNotFiniteKey;

// The median's gather (set_gathered_selection): the radix selection stops once the digits found so
// far leave at most this many keys (a warp's worth; at 128 x (100, 8) typically ~10 of the 19,900
// after two digits), which one pass gathers and one warp ranks, instead of a pass for each digit
// left and, for an even count, one more for the upper middle.
constexpr unsigned kGatherKeys = 32;
static_assert(kGatherKeys <= 32, "median_distance ranks the gathered keys in one warp");

struct SelectShared {
  union {
    unsigned hist[radix::kMaxBins];
    unsigned long long gathered[kGatherKeys];  // (the histograms are done with by then)
  };
  int64_t rank;
  unsigned digit;
  unsigned in_bin;            // how many keys match the digits found so far
  unsigned n_gathered;
  unsigned long long count;   // second middle: how many keys are <= the first
  unsigned long long min_gt;  // and the least key above it (the gather: above the gathered keys' bin)
  unsigned long long middles[2];  // the gather's lower and upper middle keys
};

// Whether every distance is finite (block-wide). A NaN/Inf coordinate, or one too large to square,
// makes every distance of its point NaN or Inf; without this check an Inf point would only drop out
// of the fit (its kernel values are 0). (median_distance checks it in its first pass instead.)
__device__ bool all_finite(const double* dist, int64_t P) {
  int bad = 0;
  for (int64_t p = threadIdx.x; p < P; p += kThreads) bad |= key_of(dist[p]) >= kNotFiniteKey;
  return !__syncthreads_or(bad);
}

// The median pairwise distance of P distances (numpy's convention for an even count: the mean of the
// two middle ones), or NaN where one is NaN or Inf (all_finite's check, made in the first pass rather
// than in a pass of its own). The lower middle's key by radix selection, digit by digit from the top,
// each digit a pass that builds the histogram of the keys matching the digits found so far. Once at
// most gather_keys keys match (kGatherKeys, or 0: never), one pass gathers them, and the least key
// above them, and one warp ranks them: both middles. Else, with every digit found, one more pass for
// the upper middle's statistics (an even count).
__device__ double median_distance(const double* dist, int64_t P, unsigned gather_keys, SelectShared& s) {
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const bool even = P % 2 == 0;
  int64_t rank = radix::lower_middle_rank(P);
  uint64_t prefix = 0, mask = 0;
  unsigned in_bin = ~0u;
  bool finite = true;  // (block-wide)
  const auto median = [&finite](double m) { return finite ? m : NAN; };
  for (int shift = radix::kFirstShift; shift > radix::kEndShift && in_bin > gather_keys; shift -= radix::kBits) {
    const int lo_bit = radix::digit_low_bit(shift);
    const unsigned bins = radix::digit_bins(shift);
    for (unsigned i = tid; i < bins; i += kThreads) s.hist[i] = 0;
    if (tid == 0) s.rank = rank;
    __syncthreads();
    int bad = 0;
    for (int64_t base = 0; base < P; base += kThreads) {  // (whole warps: add_to_histogram)
      const int64_t p = base + tid;
      unsigned bin = ~0u;
      if (p < P) {
        const uint64_t k = key_of(dist[p]);
        bad |= k >= kNotFiniteKey;
        if ((k & mask) == prefix) bin = static_cast<unsigned>((k >> lo_bit) & (bins - 1));
      }
      radix::add_to_histogram(s.hist, bin);
    }
    if (__syncthreads_or(bad)) finite = false;
    if (warp == 0) {
      unsigned digit;
      unsigned long long left;
      if (radix::find_digit(s.hist, bins, static_cast<unsigned long long>(rank), &digit, &left)) {
        s.digit = digit;
        s.rank = static_cast<int64_t>(left);
        s.in_bin = s.hist[digit];
      }
    }
    __syncthreads();
    prefix |= static_cast<uint64_t>(s.digit) << lo_bit;
    mask |= static_cast<uint64_t>(bins - 1) << lo_bit;
    rank = s.rank;
    in_bin = s.in_bin;
    __syncthreads();  // s.digit, s.rank and s.in_bin are rewritten by the next pass
  }

  if (tid == 0) {
    s.n_gathered = 0;
    s.count = 0;
    s.min_gt = ~0ull;
  }
  __syncthreads();
  if (in_bin > gather_keys) {  // every digit found: prefix is the lower middle's key
    if (!even) return median(radix::median_of_middles(prefix, P, 0, 0));
    unsigned long long count = 0, min_gt = ~0ull;
    for (int64_t p = tid; p < P; p += kThreads) {
      const uint64_t k = key_of(dist[p]);
      if (k <= prefix) ++count;
      else if (k < min_gt) min_gt = k;
    }
    atomicAdd(&s.count, count);
    atomicMin(&s.min_gt, min_gt);
    __syncthreads();
    return median(radix::median_of_middles(prefix, P, s.count, s.min_gt));
  }

  // The gather: the in_bin keys of the bin [prefix, bin_top], and the least key above it
  const uint64_t bin_top = prefix | ~mask;
  unsigned long long above = ~0ull;
  for (int64_t p = tid; p < P; p += kThreads) {
    const uint64_t k = key_of(dist[p]);
    if ((k & mask) == prefix) s.gathered[atomicAdd(&s.n_gathered, 1u)] = k;
    else if (k > bin_top && k < above) above = k;
  }
  if (even) {
    above = radix::warp_min(above);
    if (lane == 0) atomicMin(&s.min_gt, above);
  }
  __syncthreads();
  if (warp == 0) {  // each lane's key's rank among them (ties by lane): the middles' lanes write them
    const unsigned long long key = static_cast<unsigned>(lane) < in_bin ? s.gathered[lane] : ~0ull;
    int64_t r = 0;
    for (int j = 0; j < 32; ++j) {
      const unsigned long long other = __shfl_sync(0xffffffffu, key, j);
      r += other < key || (other == key && j < lane);
    }
    if (static_cast<unsigned>(lane) < in_bin && (r == rank || r == rank + 1)) s.middles[r - rank] = key;
  }
  __syncthreads();
  const uint64_t lo = s.middles[0];
  // the upper middle: the next key in the bin, else the least above it
  const uint64_t hi = !even ? lo : rank + 1 < static_cast<int64_t>(in_bin) ? s.middles[1] : s.min_gt;
  return median(radix::mean_of_roots(lo, hi));
}

// The element's bandwidth: the given one (sigma_in[b]) or the median distance; NaN where a distance is.
__device__ __forceinline__ double bandwidth(const double* dist, int64_t P, const double* sigma_in, int b,
                                            unsigned gather_keys, SelectShared& sel) {
  if (sigma_in == nullptr) return median_distance(dist, P, gather_keys, sel);
  return all_finite(dist, P) ? sigma_in[b] : NAN;
}

// dst[0, n) = src[0, n) (block-wide, then a barrier): dst in shared memory, src in global memory, each
// thread's kCopyLoads loads issued before the first store, so that a block of 16 warps waits out a
// load latency per kCopyLoads x kThreads values, not per kThreads.
constexpr int kCopyLoads = 8;
__device__ void copy_to_shared(double* dst, const double* src, int64_t n) {
  assume_shared(dst);
  for (int64_t base = 0; base < n; base += int64_t{kCopyLoads} * kThreads) {
    double v[kCopyLoads];
#pragma unroll
    for (int s = 0; s < kCopyLoads; ++s) {
      const int64_t i = base + s * kThreads + threadIdx.x;
      v[s] = i < n ? src[i] : 0.0;
    }
#pragma unroll
    for (int s = 0; s < kCopyLoads; ++s) {
      const int64_t i = base + s * kThreads + threadIdx.x;
      if (i < n) dst[i] = v[s];
    }
  }
  __syncthreads();
}

struct KlArgs {
  int n_den, n_num, n_q, row0;  // q_z's points are the stacked rows [row0, row0 + n_q)
  int64_t d;
  double lam, clip;
  bool reverse;
  int state_width;          // 0 (no grad state), d + 1 (projection) or N (weights)
  bool projection;          // grad_state_is_projection (the widths d + 1 and N may coincide)
  bool compute_dist;        // distances computed here from the points staged in shared memory, or given
  int ldx;                  // the staged points' row stride (odd: lanes reading one coordinate of
                            // consecutive points hit distinct banks)
  bool dist_in_shared;      // the distances in shared memory (else in the global workspace)
  bool median_staged;       // else copied into the work region for the median (it fits them alone)
  bool system_in_shared;    // the n_den x n_den system in shared memory, else in sys_ws
  int batch;                // B: the blocks take the batch elements b = blockIdx.x + k gridDim.x in turn
  bool paired_elimination;  // solve_spd's two columns a step (set_paired_elimination)
  unsigned gather_keys;     // the median's gather: kGatherKeys, or 0 (set_gathered_selection)
  long long* clocks;        // benches: block 0's clock64() at the stage boundaries (kForwardStages), or null
};

// Where kl_forward_kernel is in batch element 0 when it reads the clock (a bench's per-stage latency):
// 0 start, 1 distances, 2 median, 3 system made, 4 solved, 5 evaluated (the end).
__device__ __forceinline__ void stage_clock(const KlArgs& a, int b, int stage) {
  if (a.clocks != nullptr && b == 0 && threadIdx.x == 0) a.clocks[stage] = clock64();
}

// Back substitution of the eliminated system by one warp (warp 0; S's upper triangle holds U, with
// the pivots on its diagonal), then a block-wide barrier. Up to kRegisterSolveRows rows, column by
// column from the last: lane l holds b_j (then x_j) for j = l + 32 m in registers, each x_i goes from
// its lane to the others in one shuffle, and they subtract U_ji x_i from their b_j, so that a row's
// latency is a multiply, a shuffle and a multiply-add (each lane's pivot reciprocals are taken
// beforehand, in parallel, into registers). The column reads U_ji are strided by n (bank conflicts for
// even n: 4-way at n = 100; an odd leading dimension would remove them). Above 128 rows, and in the
// forward kernel's 64-register variant (whose other stages would spill more), row by row:
// x_i = (b_i - sum_{j > i} U_ij x_j) / U_ii, a 32-lane reduction and a division a row.
constexpr int kRegisterSolveRows = 128;
template <bool kInRegisters>
__device__ void back_substitute(const double* S, double* x, int n) {
  const int tid = threadIdx.x, lane = tid & 31;
  if (kInRegisters && (tid >> 5) == 0 && n <= kRegisterSolveRows) {
    constexpr int kSlots = kRegisterSolveRows / 32;
    double y[kSlots], pivot_inv[kSlots];
#pragma unroll
    for (int m = 0; m < kSlots; ++m) {
      const int j = lane + 32 * m;
      y[m] = j < n ? x[j] : 0.0;
      pivot_inv[m] = j < n ? 1.0 / S[j * n + j] : 0.0;
    }
#pragma unroll
    for (int m = kSlots - 1; m >= 0; --m) {
      for (int l = 31; l >= 0; --l) {
        const int i = 32 * m + l;
        if (i >= n) continue;
        const double xi = __shfl_sync(0xffffffffu, y[m] * pivot_inv[m], l);
        if (lane == l) y[m] = xi;
#pragma unroll
        for (int mm = 0; mm <= m; ++mm) {  // column i of U above the diagonal: rows j < i
          const int j = lane + 32 * mm;
          if (j < i) y[mm] -= S[j * n + i] * xi;
        }
      }
    }
#pragma unroll
    for (int m = 0; m < kSlots; ++m) {
      if (lane + 32 * m < n) x[lane + 32 * m] = y[m];
    }
  } else if ((tid >> 5) == 0) {
    for (int i = n - 1; i >= 0; --i) {
      double s = 0.0;
      for (int j = i + 1 + lane; j < n; j += 32) s += S[i * n + j] * x[j];
      s = warp_sum(s);
      if (lane == 0) x[i] = (x[i] - s) / S[i * n + i];
      __syncwarp();
    }
  }
  __syncthreads();
}

// Subtracts kPivots rank-one updates from the trailing triangle of S (rows i >= first, columns
// j >= i): S_ij -= sum_p factor_p(i) row_p(j). Each thread stages its columns of the pivot rows in
// registers once a round of 128 columns (4 a lane); with kTwoRows it loads two rows before storing
// either, so that a step's loads overlap (one block an SM: 16 warps to hide latency), else one row at
// a time (two blocks an SM, within 64 registers). (No barrier: the caller's step ends with one.)
template <int kPivots, bool kTwoRows, typename Row, typename Factors>
__device__ __forceinline__ void update_trailing(double* S, int n, int first, Row row, Factors factors) {
  constexpr int kRows = kTwoRows ? 2 : 1;
  const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
  for (int j0 = first; j0 < n; j0 += 128) {
    double r[kPivots][4];
#pragma unroll
    for (int p = 0; p < kPivots; ++p) {
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int j = j0 + tx + 32 * u;
        r[p][u] = j < n ? row(p, j) : 0.0;
      }
    }
    // rows that have columns j >= i in this round, kRows per iteration (rows i + h kWarps)
    for (int i0 = first + ty; i0 < n && i0 < j0 + 128; i0 += kRows * kWarps) {
      double f[kRows][kPivots], v[kRows][4];
#pragma unroll
      for (int h = 0; h < kRows; ++h) {
        const int i = i0 + h * kWarps;
        if (i < n) {
          factors(i, f[h]);
        } else {
#pragma unroll
          for (int p = 0; p < kPivots; ++p) f[h][p] = 0.0;
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const int j = j0 + tx + 32 * u;
          v[h][u] = (i < n && j >= i && j < n) ? S[i * n + j] : 0.0;
        }
      }
#pragma unroll
      for (int h = 0; h < kRows; ++h) {
        const int i = i0 + h * kWarps;
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const int j = j0 + tx + 32 * u;
#pragma unroll
          for (int p = 0; p < kPivots; ++p) v[h][u] -= f[h][p] * r[p][u];
          if (i < n && j >= i && j < n) S[i * n + j] = v[h][u];
        }
      }
    }
  }
}

// Solves the symmetric positive definite n x n system S x = b (S row-major, b in x; S's upper
// triangle is read and overwritten) by Gaussian elimination of the upper triangle (symmetric, so row
// k right of the diagonal is also column k below it), then back substitution. Column k's pivot is the
// one Cholesky would take (squared); a pivot <= 0 (or NaN) sets *not_pd. The elimination is bound by
// barriers (one a step) and shared-memory traffic (each step rewrites the trailing triangle), so it
// eliminates two columns a step (paired, the default): the rows below take both updates at once,
// S_ij -= S_ki S_kj / a + S'_k+1,i S'_k+1,j / c' with row k+1 after column k's update (S') formed
// where it is needed, which halves both the barriers and the triangle's loads and stores. Row k+1
// itself is rewritten in the next step (this step's threads still read its old values).
// set_paired_elimination(false): one column a step. kOneBlockPerSm: the forward kernel's variant
// (update_trailing's and back_substitute's register use).
template <bool kOneBlockPerSm>
__device__ void solve_spd(double* S, double* x, int n, int* not_pd, bool paired) {
  const int tid = threadIdx.x;
  int k = 0;
  double f_prev = 0.0, x1_prev = 0.0;  // the previous pair's row-k+1 factor and right-hand side
  for (; paired && k + 1 < n; k += 2) {
    if (k > 0) {  // the previous pair's second row, now that no thread reads its old values
      for (int j = k - 1 + tid; j < n; j += kThreads) S[(k - 1) * n + j] -= f_prev * S[(k - 2) * n + j];
      if (tid == 0) x[k - 1] = x1_prev;
    }
    const double a = S[k * n + k], b = S[k * n + k + 1];
    const double ia = 1.0 / a, f = b * ia, c1 = S[(k + 1) * n + k + 1] - f * b, ic1 = 1.0 / c1;
    if (tid == 0 && !(a > 0.0 && c1 > 0.0)) *not_pd = 1;
    const double xk = x[k], x1 = x[k + 1] - f * xk;
    // rows k and k+1 (the latter after column k's update)
    const auto row = [&](int p, int j) { return p == 0 ? S[k * n + j] : S[(k + 1) * n + j] - f * S[k * n + j]; };
    const auto factors = [&](int i, double* fi) {
      const double ki = S[k * n + i];
      fi[0] = ki * ia;
      fi[1] = (S[(k + 1) * n + i] - f * ki) * ic1;
    };
    update_trailing<2, kOneBlockPerSm>(S, n, k + 2, row, factors);
    for (int i = k + 2 + tid; i < n; i += kThreads) {
      double fi[2];
      factors(i, fi);
      x[i] -= fi[0] * xk + fi[1] * x1;
    }
    f_prev = f;
    x1_prev = x1;
    __syncthreads();
  }
  if (k > 0 && paired) {  // the last pair's second row
    for (int j = k - 1 + tid; j < n; j += kThreads) S[(k - 1) * n + j] -= f_prev * S[(k - 2) * n + j];
    if (tid == 0) x[k - 1] = x1_prev;
    __syncthreads();
  }
  for (; k < n; ++k) {  // one column a step (the last column of an odd n when paired)
    const double piv = S[k * n + k];
    if (tid == 0 && !(piv > 0.0)) *not_pd = 1;
    const double inv = 1.0 / piv, xk = x[k];
    update_trailing<1, kOneBlockPerSm>(S, n, k + 1, [&](int, int j) { return S[k * n + j]; },
                       [&](int i, double* fi) { fi[0] = S[k * n + i] * inv; });
    for (int i = k + 1 + tid; i < n; i += kThreads) x[i] -= S[k * n + i] * inv * xk;
    __syncthreads();
  }
  back_substitute<kOneBlockPerSm>(S, x, n);
}

// The whole forward of one batch element (blockIdx.x). Shared memory: coef [N]; the points as float64
// [N, ldx] (compute_dist); then the distances (dist_in_shared) and a work region for the system (when
// it fits) and the weights per warp. With compute_dist the later stages recompute distances from the
// staged points (d <= a few dozen: cheaper than reading them back), so the distances share the work
// region; otherwise (the wide path) they stay and the work region follows them, or, in global memory,
// are copied into the work region for the median where it holds them (median_staged). kBlocksPerSm: 2 caps
// the registers (64 a thread, some spilled) so that two blocks can share a multiprocessor, for
// batches of more than one wave of blocks (see kl()).
template <typename T, int kBlocksPerSm>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
    kl_forward_kernel(const T* __restrict__ den_all, const T* __restrict__ num_all, const double* __restrict__ sigma_in,
                      double* __restrict__ dist_all, double* __restrict__ sys_all, T* __restrict__ kl_out,
                      double* __restrict__ state_all, double* __restrict__ sigma_out, double* __restrict__ clipped_out,
                      KlArgs a) {
  extern __shared__ double smem[];
  __shared__ SelectShared sel;
  __shared__ double red_kl[kWarps];
  __shared__ int red_clipped[kWarps];
  __shared__ double scratch[kWarps][32];  // the projection's sums
  __shared__ int not_pd;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, slot = blockIdx.x;
  const int N = a.n_den + a.n_num, n = a.n_den, ldx = a.ldx;
  const int64_t d = a.d, P = static_cast<int64_t>(N) * (N - 1) / 2;
  // The batch elements in turn: with a grid of as many blocks as the GPU holds at once (kl()), the
  // global workspaces (the distances computed here, the system) need one slot a block, not one an
  // element.
  for (int b = blockIdx.x; b < a.batch; b += gridDim.x) {
    const Stacked<T> pts{den_all + static_cast<int64_t>(b) * a.n_den * d,
                        num_all + static_cast<int64_t>(b) * a.n_num * d, a.n_den, d};
    double* coef = smem;
    double* X = smem + N;  // [N, ldx] when compute_dist
    double* region = X + (a.compute_dist ? N * ldx : 0);
    // (given distances, the wide path's, are per element)
    double* dist = a.dist_in_shared ? region : dist_all + (a.compute_dist ? slot : b) * P;
    double* work = (a.dist_in_shared && !a.compute_dist) ? region + P : region;
    // squared distance of stacked points i and j, from the staged points or the stored distances
    auto sqdist = [&](int i, int j) -> double {
      if (!a.compute_dist) return packed_sqdist(dist, i, j, N);
      const double* xi = X + i * ldx;
      const double* xj = X + j * ldx;
      double s = 0.0;
      for (int64_t t = 0; t < d; ++t) {
        const double diff = xi[t] - xj[t];
        s += diff * diff;
      }
      return s;
    };

    stage_clock(a, b, 0);
    if (a.compute_dist) {  // the points as float64 in shared memory, then every pair's squared distance
      for (int64_t e = tid; e < N * d; e += kThreads) {
        const int c = static_cast<int>(e / d);
        X[c * ldx + (e - c * d)] = static_cast<double>(pts.row(c)[e - c * d]);
      }
      __syncthreads();
      in_shared_or_not<kBlocksPerSm == 1>(a.dist_in_shared, dist, [&](double* dd) {
        for (int i = warp; i < N; i += kWarps) {
          for (int j = i + 1 + lane; j < N; j += 32) dd[pair_index(i, j, N)] = sqdist(i, j);
        }
      });
      __syncthreads();
    } else if (a.dist_in_shared) {  // pair_sqdist_kernel's sums, staged
      for (int64_t p = tid; p < P; p += kThreads) dist[p] = dist_all[b * P + p];
      __syncthreads();
    }
    stage_clock(a, b, 1);

    // NaN for the whole element: bad samples, a median or bandwidth below kMinBandwidth or not finite
    double sigma;
    if constexpr (kBlocksPerSm == 1) {
      // The median's passes (four or five over the distances, each load waited out before its
      // histogram's collectives) read distances that are in global memory from a copy in the work
      // region where they fit it (median_staged): the system, which takes that region next, is made
      // after the median's last barrier.
      const bool staged = a.median_staged && sigma_in == nullptr;
      if (staged) copy_to_shared(work, dist, P);
      sigma = in_shared_or_not<true>(staged || a.dist_in_shared, staged ? work : dist, [&](const double* dd) {
        return bandwidth(dd, P, sigma_in, b, a.gather_keys, sel);
      });
    } else {  // (through a lambda this variant spills 64 bytes where it spills 56; kl() stages nothing for it)
      sigma = bandwidth(dist, P, sigma_in, b, a.gather_keys, sel);
    }
    if (!(sigma >= kMinBandwidth) || isinf(sigma)) sigma = NAN;
    stage_clock(a, b, 2);
    const double gamma = -0.5 / (sigma * sigma);

    // The system S = K_dd / n + lam I (its upper triangle, row-major) and the right-hand side
    // K_dn 1 / (lam n n_num) in coef[0, n), then its solution in coef.
    const double inv_n = 1.0 / n;
    const auto make_and_solve = [&](double* S) {
      for (int i = warp; i < n; i += kWarps) {
        for (int j = i + lane; j < n; j += 32) {
          S[i * n + j] = exp(gamma * sqdist(i, j)) * inv_n + (i == j ? a.lam : 0.0);
        }
        double r = 0.0;
        for (int c = n + lane; c < N; c += 32) r += exp(gamma * sqdist(i, c));
        r = warp_sum(r);
        if (lane == 0) coef[i] = r / (a.lam * n * static_cast<double>(a.n_num));
      }
      if (tid == 0) not_pd = 0;
      __syncthreads();
      stage_clock(a, b, 3);
      solve_spd<kBlocksPerSm == 1>(S, coef, n, &not_pd, a.paired_elimination);
    };
    double* S = a.system_in_shared ? work : sys_all + static_cast<int64_t>(slot) * n * n;
    in_shared_or_not<kBlocksPerSm == 1>(a.system_in_shared, S, make_and_solve);
    stage_clock(a, b, 4);
    const bool bad = not_pd || isnan(sigma);
    const double beta = 1.0 / (a.lam * a.n_num);
    for (int c = tid; c < N; c += kThreads) coef[c] = bad ? NAN : (c < n ? -coef[c] : beta);
    __syncthreads();

    // The ratio at q_z's points (one warp per point), the KL's terms and the grad state.
    const double inv_s2 = 1.0 / (sigma * sigma);
    double* wbuf = work + warp * N;  // this warp's terms coef_c k(c, z_j)
    const int groups = d <= 32 ? 32 / static_cast<int>(d) : 1;  // projection: lanes per dimension
    double kl_sum = 0.0;
    int clipped = 0;
    for (int jq = warp; jq < a.n_q; jq += kWarps) {
      const int j = a.row0 + jq;
      double r = 0.0;
      for (int c = lane; c < N; c += 32) {
        const double t = coef[c] * exp(gamma * sqdist(c, j));
        r += t;
        if (a.state_width > 0) wbuf[c] = t;
      }
      r = warp_sum(r);
      const bool cut = r <= a.clip;
      if (lane == 0) {
        kl_sum += cut ? log(a.clip) : log(r);
        clipped += cut;
      }
      if (a.state_width == 0) continue;
      // W_jc = coef_c k(c, z_j) / (sigma^2 r_j), 0 where r_j is clipped
      const double scale = cut ? 0.0 : inv_s2 / r;
      double* state = state_all + (static_cast<int64_t>(b) * a.n_q + jq) * a.state_width;
      if (!a.projection) {
        for (int c = lane; c < N; c += 32) state[c] = wbuf[c] * scale;
        __syncwarp();
        continue;
      }
      __syncwarp();
      double wsum = 0.0;
      for (int c = lane; c < N; c += 32) wsum += wbuf[c];
      wsum = warp_sum(wsum);
      // [sum_c W_jc x_c, sum_c W_jc]: with d <= 32, lane (t, g) sums dimension t over the points
      // c = g mod groups, then the groups are added. The points are in shared memory: a projection
      // state means d + 1 < N, so N d <= kSmallWork (handles_kl), so compute_dist.
      if (d <= 32) {
        const int t = lane % static_cast<int>(d), g = lane / static_cast<int>(d);
        double acc = 0.0;
        if (g < groups) {
          for (int c = g; c < N; c += groups) acc += wbuf[c] * X[c * ldx + t];
        }
        scratch[warp][lane] = acc;
        __syncwarp();
        if (lane < d) {
          double sum = 0.0;
          for (int h = 0; h < groups; ++h) sum += scratch[warp][h * d + lane];
          state[lane] = sum * scale;
        }
      } else {
        for (int64_t t = lane; t < d; t += 32) {
          double acc = 0.0;
          for (int c = 0; c < N; ++c) acc += wbuf[c] * X[c * ldx + t];
          state[t] = acc * scale;
        }
      }
      if (lane == 0) state[d] = wsum * scale;
      __syncwarp();
    }
    if (lane == 0) {
      red_kl[warp] = kl_sum;
      red_clipped[warp] = clipped;
    }
    __syncthreads();
    if (tid == 0) {
      double s = 0.0;
      int c = 0;
      for (int w = 0; w < kWarps; ++w) {
        s += red_kl[w];
        c += red_clipped[w];
      }
      kl_out[b] = static_cast<T>((a.reverse ? -s : s) / a.n_q);  // (the op's output dtype: no conversion after)
      clipped_out[b] = static_cast<double>(c) / a.n_q;
      sigma_out[b] = sigma;
    }
    stage_clock(a, b, 5);
    __syncthreads();  // the next element rewrites shared memory
  }
}

// Squared distances of every pair of N <= kMaxWarpPairPoints points in many dimensions, summed over
// dimension chunks: each block takes chunks in turn (grid-stride), stages a chunk of all N rows in
// shared memory, lets each warp own a fixed set of pairs, and adds its partial sums into dist once.
template <typename T>
__global__ void __launch_bounds__(kPairThreads)
    pair_sqdist_kernel(const T* __restrict__ den_all, const T* __restrict__ num_all, int n_den, int n_num, int64_t d,
                       int64_t chunk, double* __restrict__ dist_all) {
  extern __shared__ double smem[];
  const int N = n_den + n_num, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int b = blockIdx.y;
  const int64_t P = static_cast<int64_t>(N) * (N - 1) / 2;
  const Stacked<T> pts{den_all + static_cast<int64_t>(b) * n_den * d, num_all + static_cast<int64_t>(b) * n_num * d,
                      n_den, d};
  double* tile = smem;                 // [N, chunk]
  double* part = smem + N * chunk;     // [P]
  for (int64_t p = tid; p < P; p += kPairThreads) part[p] = 0.0;
  for (int64_t t0 = blockIdx.x * chunk; t0 < d; t0 += static_cast<int64_t>(gridDim.x) * chunk) {
    const int64_t len = min(chunk, d - t0);
    __syncthreads();  // the previous chunk's reads are done
    for (int c = warp; c < N; c += kPairWarps) {
      const T* row = pts.row(c) + t0;
      for (int64_t t = lane; t < len; t += 32) tile[c * chunk + t] = static_cast<double>(row[t]);
    }
    __syncthreads();
    for (int64_t p = warp; p < P; p += kPairWarps) {
      const int2 ij = triangle_entry(p, N, 1);  // N <= 64
      const int i = ij.x, j = ij.y;
      double s = 0.0;
      for (int64_t t = lane; t < len; t += 32) {
        const double diff = tile[i * chunk + t] - tile[j * chunk + t];
        s += diff * diff;
      }
      s = warp_sum(s);
      if (lane == 0) part[p] += s;
    }
  }
  __syncthreads();
  double* dist = dist_all + b * P;
  for (int64_t p = tid; p < P; p += kPairThreads) atomicAdd(dist + p, part[p]);
}

// Squared distances in kTile x kTile tiles of points, for pair_tile_kernel and kernel_block_kernel:
// acc[u][v] += sum_t (x_a[t] - x_b[t])^2 over the dimensions [t_begin, t_end), for the points
// a = a0 + ty + 16 u (< a_end) and b = b0 + tx + 16 v (< b_end) of the stacked points, thread (tx, ty)
// of 16 x 16. The two tiles' points are staged kTileDims dimensions at a time as float64 (one tile
// when `same`: a tile against itself), so that eight shared-memory loads serve 16 differences (one
// warp per pair, as pair_sqdist_kernel, would load two values per difference). Differences, not the
// GEMM's norms minus products: the same rounding as the other paths' distances, and exact zeros for a
// point against itself. Called by every thread of the block (barriers).
//
// kProducts (set_product_tile_distances, off by default): the GEMM's form instead,
// |x_a|^2 + |x_b|^2 - 2 x_a . x_b over the range, clamped at 0: one multiply-add a pair and dimension
// where the differences take a subtraction too, half the float64 work. A point's norm over the range
// is summed by one thread, in the order of the products (points with the same coordinates: a distance
// of exactly 0). Its rounding error is relative to the norms, so the points are staged relative to a
// reference point: the norms are then the squared distances to it, whatever the points' common offset
// from 0, and a kernel value's error relative to the bandwidth stays at the differences' where the
// reference is a typical point. An outlying reference, at R from the others, would make that error
// grow as R^2 / sigma^2, as the plain norms' does with the offset, so in each dimension it is the
// middle of three points' coordinates (bench/distance_schemes.py measures the forms against the
// contract, samples far from 0 and an outlying first point among its problems). Timed on an H200,
// forward + backward: at (100, 50000) it saved 8% with the same ranges of dimensions for all, but with
// the ranges by cost (the default, below) it cost 7% (0.87 against 0.81 ms); within 2% at (100, 700),
// (300, 3), (1000, 32), (2000, 32), (5000, 64) and (10, 314000).
//
// Only the 16 x 16 sub-blocks (u, v) that hold a point on both sides are computed (a tile past the
// last point has fewer), and with kUpperOnly (pair_tile_kernel, which keeps the pairs a < b) of a tile
// against itself only those with u <= v: the others' acc stay 0 (`subblocks`, set_tile_subblocks;
// false: all 16, for the benches' A/B). At (100, 50000) (200 points, tiles of 64: 10 tile pairs, the
// last tile holding 8 points) that is 91 sub-blocks of the 160 a full computation takes, for 19,900
// pairs in 23,296 computed. The choice is the same for the whole block, so each slab's loop is one of
// the variants below, whose loads and multiply-adds are all unrolled.
template <bool kProducts>
struct TileStage {
  double a[kTileDims][kTile + 1];  // +1: the staging stores (a point's dimensions by consecutive
  double b[kTileDims][kTile + 1];  // threads) fall in distinct banks
};
template <>
struct TileStage<true> : TileStage<false> {
  double norm_a[kTile], norm_b[kTile];  // the points' norms over the range
};

// tile_sqdist's norms of tile a (side 0) or b (1); null without them (the differences' stage)
__device__ __forceinline__ double* st_norm(TileStage<false>&, int) { return nullptr; }
__device__ __forceinline__ double* st_norm(TileStage<true>& st, int side) { return side == 0 ? st.norm_a : st.norm_b; }

template <int kU, int kV, bool kUpper, bool kProducts>
__device__ __forceinline__ void slab_sqdist(const double (*ta)[kTile + 1], const double (*tb)[kTile + 1], int len,
                                            int tx, int ty, double (&acc)[4][4]) {
  for (int k = 0; k < len; ++k) {
    double xa[kU], xb[kV];
#pragma unroll
    for (int u = 0; u < kU; ++u) xa[u] = ta[k][ty + 16 * u];
#pragma unroll
    for (int v = 0; v < kV; ++v) xb[v] = tb[k][tx + 16 * v];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
#pragma unroll
      for (int v = kUpper ? u : 0; v < kV; ++v) {
        if constexpr (kProducts) {
          acc[u][v] = fma(xa[u], xb[v], acc[u][v]);
        } else {
          const double diff = xa[u] - xb[v];
          acc[u][v] = fma(diff, diff, acc[u][v]);
        }
      }
    }
  }
}

// slab_sqdist for kU row and nv column sub-blocks (1..4), upper: only u <= v (a tile against itself)
template <int kU, bool kProducts>
__device__ __forceinline__ void slab_sqdist_rows(int nv, bool upper, const double (*ta)[kTile + 1],
                                                 const double (*tb)[kTile + 1], int len, int tx, int ty,
                                                 double (&acc)[4][4]) {
  if (upper && nv == kU) return slab_sqdist<kU, kU, true, kProducts>(ta, tb, len, tx, ty, acc);
  switch (nv) {
    case 1: return slab_sqdist<kU, 1, false, kProducts>(ta, tb, len, tx, ty, acc);
    case 2: return slab_sqdist<kU, 2, false, kProducts>(ta, tb, len, tx, ty, acc);
    case 3: return slab_sqdist<kU, 3, false, kProducts>(ta, tb, len, tx, ty, acc);
    default: return slab_sqdist<kU, 4, false, kProducts>(ta, tb, len, tx, ty, acc);
  }
}

template <bool kUpperOnly, typename T, bool kProducts = false>
__device__ __forceinline__ void tile_sqdist(const Stacked<T>& pts, int a0, int a_end, int b0, int b_end, bool same,
                                            int64_t t_begin, int64_t t_end, bool subblocks, TileStage<kProducts>& st,
                                            double (&acc)[4][4]) {
  const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
  const double (*tb)[kTile + 1] = same ? st.a : st.b;
  // the sub-blocks that hold a point: rows 16 u .. 16 u + 15 of the tile (a0 < a_end, b0 < b_end)
  const int nu = subblocks ? tile_subblocks_holding(a_end - a0) : 4;
  const int nv = subblocks ? tile_subblocks_holding(b_end - b0) : 4;
  const bool upper = kUpperOnly && same && subblocks;
  // A slab's element for thread tid: dimension k = tid % kTileDims of the points r = tid / kTileDims +
  // s kRowsAStep, s < kStaged (a point's dimensions by consecutive threads: coalesced). A tile's loads
  // are all issued before the first is stored, and (float samples: both tiles'; double ones, which
  // take twice the registers: the first tile's) before the barrier that waits for the previous slab's
  // reads: one or two load latencies a slab, where a load, its conversion and its store one after the
  // other waited out sixteen.
  constexpr int kStaged = kTile * kTileDims / kTileThreads, kRowsAStep = kTileThreads / kTileDims;
  static_assert(kTileThreads % kTileDims == 0 && kStaged * kRowsAStep == kTile, "tile_sqdist's staging");
  constexpr bool kBothFirst = sizeof(T) <= 4;
  const int k = tid % kTileDims, r0 = tid / kTileDims;
  // kProducts: threads 0 .. 63 sum the norms of tile a's points, 64 .. 127 tile b's, each its point's
  // over the slab's dimensions in order, as acc sums the products: two points with the same
  // coordinates then have |x_a|^2 = |x_b|^2 = x_a . x_b to the last bit, and a distance of exactly 0
  static_assert(kTileThreads >= 2 * kTile, "tile_sqdist's norms: a thread a point");
  double* const my_norm = !kProducts || tid >= 2 * kTile ? nullptr
                          : tid < kTile                  ? st_norm(st, 0) + tid
                                                         : st_norm(st, 1) + (tid - kTile);
  if (my_norm != nullptr) *my_norm = 0.0;
  for (int64_t t0 = t_begin; t0 < t_end; t0 += kTileDims) {
    const bool in_range = k < t_end - t0;  // zeros past the range and past the tiles' points (they add nothing)
    T va[kStaged], vb[kStaged];
    const auto load = [&](int first, int end, T (&v)[kStaged]) {
#pragma unroll
      for (int s = 0; s < kStaged; ++s) {
        const int i = first + r0 + s * kRowsAStep;
        v[s] = in_range && i < end ? pts.row(i)[t0 + k] : T(0);
      }
    };
    // kProducts: the points relative to a reference (a difference, as exact as the differences'), so
    // that the norms are of the points' spread, not of their offset from 0: in each dimension the
    // middle of three points' coordinates (tile a's first, the one midway from it to a_end, the last
    // before b_end), so that one outlying point among them does not become the reference
    T ref = T(0);
    if (kProducts && in_range) {
      const T r1 = pts.row(a0)[t0 + k], r2 = pts.row(a0 + (a_end - a0) / 2)[t0 + k], r3 = pts.row(b_end - 1)[t0 + k];
      ref = max(min(r1, r2), min(max(r1, r2), r3));
    }
    const auto store = [&](const T (&v)[kStaged], int first, int end, double (*tile)[kTile + 1]) {
#pragma unroll
      for (int s = 0; s < kStaged; ++s) {
        const bool point = first + r0 + s * kRowsAStep < end;
        tile[k][r0 + s * kRowsAStep] =
            kProducts && point ? static_cast<double>(v[s]) - static_cast<double>(ref) : static_cast<double>(v[s]);
      }
    };
    load(a0, a_end, va);
    if (kBothFirst && !same) load(b0, b_end, vb);
    __syncthreads();  // the previous slab's reads are done
    store(va, a0, a_end, st.a);
    if (!same) {
      if (!kBothFirst) load(b0, b_end, vb);
      store(vb, b0, b_end, st.b);
    }
    __syncthreads();
    const int len = static_cast<int>(min(static_cast<int64_t>(kTileDims), t_end - t0));
    if (my_norm != nullptr && (tid < kTile || !same)) {  // (in shared memory, not in registers)
      const double(*tile)[kTile + 1] = tid < kTile ? st.a : st.b;
      const int point = tid % kTile;
      double norm = *my_norm;
      for (int e = 0; e < len; ++e) norm = fma(tile[e][point], tile[e][point], norm);
      *my_norm = norm;
    }
    switch (nu) {
      case 1: slab_sqdist_rows<1, kProducts>(nv, upper, st.a, tb, len, tx, ty, acc); break;
      case 2: slab_sqdist_rows<2, kProducts>(nv, upper, st.a, tb, len, tx, ty, acc); break;
      case 3: slab_sqdist_rows<3, kProducts>(nv, upper, st.a, tb, len, tx, ty, acc); break;
      default: slab_sqdist_rows<4, kProducts>(nv, upper, st.a, tb, len, tx, ty, acc); break;
    }
  }
  if constexpr (kProducts) {
    // acc = |x_a|^2 + |x_b|^2 - 2 x_a . x_b, 0 for a point against itself (no rounding left over) or
    // below 0 (rounding; NaN stays NaN)
    __syncthreads();
    const double* norm_b = same ? st_norm(st, 0) : st_norm(st, 1);
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int ia = ty + 16 * u;
      const double na = st_norm(st, 0)[ia];
#pragma unroll
      for (int v = 0; v < 4; ++v) {
        const int ib = tx + 16 * v;
        const double dd = na + norm_b[ib] - 2.0 * acc[u][v];
        acc[u][v] = a0 + ia == b0 + ib || dd < 0.0 ? 0.0 : dd;
      }
    }
    __syncthreads();  // (a caller's next tile rewrites st)
  }
}

// How pair_tile_kernel's blocks share out the work with set_balanced_tile_ranges (on by default) and
// few tile pairs (up to kMaxRangedPairs: 512 points): tile pair p takes blocks
// first[p] .. first[p + 1] - 1, each a range of dims[p] dimensions (a whole number of slabs) in turn,
// its share of the wave in proportion to its cost a slab, its sub-blocks (tile_sqdist) plus
// kStageCost for the slab's staging. With the same ranges for all, at (100, 50000) the blocks of the
// full tile pairs (16 sub-blocks a slab, against 10 for a tile against itself, 4 against the last
// tile of 8 points) end the one wave. In proportion to the sub-blocks alone the kernel was slower on
// an H200 (0.616 against 0.417 ms): the light pairs' blocks ran up to 18x the slabs, and a slab's
// staging, then sixteen load latencies one after the other, cost about 1.5 sub-blocks (tile_sqdist now
// overlaps them). With these ranges, on an H200, forward + backward at (100, 50000) took 0.80-0.82 ms
// against 0.88-0.91 with the same ranges for all (1.10x, two runs of 30 alternations); within 3% at
// (100, 700), (300, 3), (1000, 32), (2000, 32), (5000, 64) and (10, 314000), where no pair_tile_kernel
// runs or its pairs are even.
constexpr int kMaxRangedPairs = 36;
constexpr int64_t kStageCost = 1;
struct TileRanges {
  int pairs = 0;  // 0: a block is one tile pair (blockIdx.x) and one range of dims_per_split (blockIdx.y)
  int first[kMaxRangedPairs + 1] = {};
  int64_t dims[kMaxRangedPairs] = {};
};

// Squared distances of every pair of N > kMaxWarpPairPoints points, added into dist (zeroed): for the
// forward, up to kMaxWidePoints points in many dimensions (an MNIST layer with many posterior samples:
// (100, 50000)); for the generic path's median (pair_sqdist), any N (N = 10,000: 12,403 tiles). The
// pairs in tiles (I <= J), the dimensions split in ranges (TileRanges), the batch (blockIdx.z);
// tile_sqdist's scheme. A tile pair's only range stores its sums: dist need not be zeroed for it.
template <typename T, bool kProducts>
__global__ void __launch_bounds__(kTileThreads, 4)  // 4 blocks per SM: launch_pair_sqdist sizes the grid for that
    pair_tile_kernel(const T* __restrict__ den_all, const T* __restrict__ num_all, int n_den, int n_num, int64_t d,
                     const TileRanges ranges, int64_t dims_per_split, bool subblocks, double* __restrict__ dist_all) {
  __shared__ TileStage<kProducts> stage;
  const int N = n_den + n_num, tid = threadIdx.x, tx = tid % 16, ty = tid / 16, b = blockIdx.z;
  const int64_t P = static_cast<int64_t>(N) * (N - 1) / 2;
  const Stacked<T> pts{den_all + static_cast<int64_t>(b) * n_den * d, num_all + static_cast<int64_t>(b) * n_num * d,
                      n_den, d};
  int p = static_cast<int>(blockIdx.x);
  int64_t t_begin = blockIdx.y * dims_per_split, t_len = dims_per_split;
  bool alone = gridDim.y == 1;
  if (ranges.pairs > 0) {
    p = 0;
    while (ranges.first[p + 1] <= static_cast<int>(blockIdx.x)) ++p;
    t_len = ranges.dims[p];
    t_begin = (blockIdx.x - ranges.first[p]) * t_len;
    alone = ranges.first[p + 1] - ranges.first[p] == 1;
  }
  const int2 tile = triangle_entry(p, (N + kTile - 1) / kTile, 0);  // tile pair (I, J), I <= J
  const int I = tile.x, J = tile.y;
  double acc[4][4] = {};
  tile_sqdist<true, T, kProducts>(pts, I * kTile, N, J * kTile, N, I == J, t_begin, min(d, t_begin + t_len), subblocks,
                                  stage, acc);
  double* dist = dist_all + b * P;
  for (int u = 0; u < 4; ++u) {
    for (int v = 0; v < 4; ++v) {
      const int i = I * kTile + ty + 16 * u, j = J * kTile + tx + 16 * v;
      if (i < j && j < N) {
        if (alone) {
          dist[pair_index(i, j, N)] = acc[u][v];
        } else {
          atomicAdd(dist + pair_index(i, j, N), acc[u][v]);
        }
      }
    }
  }
}

// Kernel values exp(||x_i - x_j||^2 / scale_b) / divisor (scale = -2 sigma^2), plus `diagonal` where
// i = j, of the stacked points' rows i in [r0, r0 + rows) against columns j in [c0, c0 + cols), into
// out [B, rows, cols] (the system K_dd / n + lam I: divisor n, diagonal lam): a kTile x kTile
// block of outputs a block (blockIdx.x: column tiles, blockIdx.y: row tiles, blockIdx.z: the batch),
// all the dimensions in turn (tile_sqdist), the exponential taken in registers. The generic path's
// kernel values on CUDA (cuda::kernel_block): one launch and one write of the block, where the ATen
// composition takes a GEMM onto the norms, a clamp, the diagonal's zeros, a division and an
// exponential, each a pass over it.
template <typename T, bool kProducts>
__global__ void __launch_bounds__(kTileThreads)
    kernel_block_kernel(const T* __restrict__ den_all, const T* __restrict__ num_all, int n_den, int n_num, int64_t d,
                        int r0, int rows, int c0, int cols, const double* __restrict__ scale, double divisor,
                        double diagonal, bool subblocks, double* __restrict__ out_all) {
  __shared__ TileStage<kProducts> stage;
  const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16, b = blockIdx.z;
  const Stacked<T> pts{den_all + static_cast<int64_t>(b) * n_den * d, num_all + static_cast<int64_t>(b) * n_num * d,
                      n_den, d};
  const int a0 = r0 + blockIdx.y * kTile, b0 = c0 + blockIdx.x * kTile;
  double acc[4][4] = {};
  tile_sqdist<false, T, kProducts>(pts, a0, r0 + rows, b0, c0 + cols, a0 == b0 && r0 + rows == c0 + cols, 0, d,
                                   subblocks, stage, acc);
  const double gamma = 1.0 / scale[b];
  double* out = out_all + static_cast<int64_t>(b) * rows * cols;
  for (int u = 0; u < 4; ++u) {
    const int i = blockIdx.y * kTile + ty + 16 * u;  // within the block
    for (int v = 0; v < 4; ++v) {
      const int j = blockIdx.x * kTile + tx + 16 * v;
      if (i < rows && j < cols) {
        // (divided, then the diagonal added: the ATen composition's rounding)
        const double k = exp(gamma * acc[u][v]) / divisor;
        out[static_cast<int64_t>(i) * cols + j] = r0 + i == c0 + j ? k + diagonal : k;
      }
    }
  }
}

// gram_kernel_block's pass (set_gemm_kernel_values): g [B, rows, cols] holds x_i . x_j of the
// centred points' rows i in [r0, r0 + rows) and columns j in [c0, c0 + cols); in place, the kernel
// values as kernel_block_kernel writes them, from D = |x_i|^2 + |x_j|^2 - 2 g (norms [B, N]) clamped at
// 0 (NaN stays NaN), exactly 0 where i = j. blockIdx.y: the batch.
constexpr int kGramThreads = 256;
__global__ void __launch_bounds__(kGramThreads)
    gram_kernel_kernel(double* __restrict__ g_all, const double* __restrict__ norms_all, int64_t N, int64_t r0,
                       int64_t rows, int64_t c0, int64_t cols, const double* __restrict__ scale, double divisor,
                       double diagonal) {
  const int64_t b = blockIdx.y, total = rows * cols;
  double* g = g_all + b * total;
  const double* norm = norms_all + b * N;
  const double gamma = 1.0 / scale[b];
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * kGramThreads + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * kGramThreads) {
    const int64_t i = e / cols, j = e - i * cols;
    const bool same = r0 + i == c0 + j;
    const double dd = norm[r0 + i] + norm[c0 + j] - 2.0 * g[e];
    const double k = exp(gamma * (same || dd < 0.0 ? 0.0 : dd)) / divisor;
    g[e] = same ? k + diagonal : k;
  }
}

// The generic fit's coefficients (cuda::fit_coef), one block a batch element: coef = [-x, beta 1]
// ([B, N]) from the solve's x ([B, n_den, 1]), with NaN for alpha where Cholesky failed (info != 0) or
// the bandwidth is NaN (the generic path's mark of non-finite samples).
constexpr int kCoefThreads = 256;
__global__ void __launch_bounds__(kCoefThreads)
    fit_coef_kernel(const double* __restrict__ x_all, const int* __restrict__ info, const double* __restrict__ sigma,
                    int64_t n_den, int64_t N, double beta, double* __restrict__ coef_all) {
  const int64_t b = blockIdx.x;
  const bool bad = info[b] != 0 || isnan(sigma[b]);
  const double* x = x_all + b * n_den;
  double* coef = coef_all + b * N;
  for (int64_t c = threadIdx.x; c < N; c += kCoefThreads) coef[c] = c >= n_den ? beta : bad ? NAN : -x[c];
}

// The end of the generic path's kl forward (cuda::kl_finish), one block a batch element: from the
// ratios r_j (column width - 1 of r_src [B, n_q, width]) the KL, -+ mean_j log max(r_j, clip) (reverse:
// minus), and the fraction of clipped r_j; then each row of state [B, n_q, state_width] (null: none; it
// may be r_src itself) scaled by 1 / (sigma_b^2 r_j), 0 where r_j is clipped, a warp a row (its lanes
// along the row: coalesced). For small states (kl_finish's caller): one block works through them.
constexpr int kFinishThreads = 256;
__global__ void __launch_bounds__(kFinishThreads)
    kl_finish_kernel(const double* r_src_all, int64_t n_q, int64_t width, double* state_all, int64_t state_width,
                     const double* __restrict__ sigma, double clip, bool reverse, double* __restrict__ kl_out,
                     double* __restrict__ clipped_out) {
  __shared__ double red_log[kFinishThreads / 32];
  __shared__ double red_cut[kFinishThreads / 32];
  const int64_t b = blockIdx.x;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const double* r_src = r_src_all + b * n_q * width + (width - 1);
  double logs = 0.0, cuts = 0.0;
  for (int64_t j = tid; j < n_q; j += kFinishThreads) {
    const double r = r_src[j * width];
    const bool cut = r <= clip;
    logs += log(cut ? clip : r);
    cuts += cut ? 1.0 : 0.0;
  }
  logs = warp_sum(logs);
  cuts = warp_sum(cuts);
  if (lane == 0) {
    red_log[warp] = logs;
    red_cut[warp] = cuts;
  }
  __syncthreads();  // (also: every r_j is read before the rows are scaled, state may be r_src)
  if (tid == 0) {
    double total = 0.0, cut_total = 0.0;
    for (int w = 0; w < kFinishThreads / 32; ++w) {
      total += red_log[w];
      cut_total += red_cut[w];
    }
    kl_out[b] = (reverse ? -total : total) / static_cast<double>(n_q);
    clipped_out[b] = cut_total / static_cast<double>(n_q);
  }
  if (state_all == nullptr) return;
  double* state = state_all + b * n_q * state_width;
  const double inv_s2 = 1.0 / (sigma[b] * sigma[b]);
  for (int64_t j = warp; j < n_q; j += kFinishThreads / 32) {
    const double r = r_src[j * width];
    __syncwarp();  // every lane has read r_j before one rewrites it (state may be r_src)
    const double scale = r <= clip ? 0.0 : inv_s2 / r;
    for (int64_t t = lane; t < state_width; t += 32) state[j * state_width + t] *= scale;
  }
}

// The backward's row scales, grad_kl[b] kl_row_factor (kivi.h's kl_row_scale), read by the kernels
// from grad_kl as autograd hands it over (float32 or float64, [B] with any stride: 0 where expanded
// from a sum's gradient), so that the backward is one launch, without a conversion's and a multiply's.
struct RowScale {
  const void* grad;
  int64_t stride;
  bool is_double;
  double factor;
  __device__ __forceinline__ double operator[](int64_t b) const {
    const double g = is_double ? static_cast<const double*>(grad)[b * stride]
                               : static_cast<double>(static_cast<const float*>(grad)[b * stride]);
    return g * factor;
  }
};

// grad[b, j, t] = row_scale_b (proj[b, j, t] - proj[b, j, d] z[b, j, t]) (projection state).
template <typename T>
__global__ void grad_from_projection_kernel(const RowScale row_scale, const double* __restrict__ proj,
                                            const T* __restrict__ z, T* __restrict__ grad, int64_t n_q, int64_t d,
                                            int64_t total) {
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = e / d, t = e - row * d;
    const double* pr = proj + row * (d + 1);
    const double g = row_scale[row / n_q] * (pr[t] - pr[d] * static_cast<double>(z[e]));
    grad[e] = static_cast<T>(g);
  }
}

// grad[b, j, t] = row_scale_b (sum_c W_jc x_c[t] - wsum_j z_j[t]) (weight state, wsum_j = sum_c W_jc):
// kDims dimensions a thread (t, t + kWeightThreads, ...) and kWeightRows rows j per block (grid:
// dimension ranges, row tiles, batch), W's tile staged in shared memory kWeightCols points at a time,
// so that each thread reads each point's coordinates once per row tile. Each weight read from shared
// memory (a broadcast) serves kDims multiply-adds (an SM's shared memory serves one warp's broadcast
// load a cycle, its float64 units two warps' multiply-adds). A thread loads kWeightLoads points'
// coordinates before it uses the first: with one point at a time each multiply-add round waited out
// a load's latency (L2: hundreds of cycles), which eight warps a scheduler could not hide; on an H200
// at (100, 50000) the kernel took 0.298 ms so, 0.216 ms with four loads in flight (0.063 -> 0.030 ms
// at (100, 700)). The coordinates stay in their own dtype until used (a float in one register), and
// three blocks an SM give ptxas (sm_90) the 80 registers to hold them: the float kernels and the
// double one-dimension kernel without spills (the double two-dimension one spills 12 bytes). No
// buffer besides the gradient, and the samples in their own dtype: float64 products without a
// float64 copy. Each sum runs over c in the same order whatever kDims: the same bits (kDims = 2, the
// default; 1 with set_paired_weight_dims(false), for the benches' A/B).
constexpr int kWeightThreads = 256, kWeightRows = 8, kWeightCols = 256, kWeightLoads = 4;
// Weights per batch element (n_q N) up to which the backward takes this kernel: each point coordinate
// it reads serves kWeightRows multiply-adds, so for many more weights cuBLAS's float64 GEMM (the generic
// path, which converts the samples in chunks) is assumed to win. (100, 50000), an MNIST-sized layer
// with many posterior samples, has 20,000. The crossover is not measured yet: set_weight_kernel(false)
// sends every weight state to the generic path, for the profile's A/B.
constexpr int64_t kMaxWeightWork = int64_t{1} << 16;

template <typename T, int kDims>
__global__ void __launch_bounds__(kWeightThreads, 3)
    grad_from_weights_kernel(const RowScale row_scale, const double* __restrict__ W_all,
                             const double* __restrict__ wsum_all, const T* __restrict__ den_all,
                             const T* __restrict__ num_all, int n_den, int n_num, int n_q, int row0, int64_t d,
                             T* __restrict__ grad_all) {
  __shared__ double w_tile[kWeightRows][kWeightCols];
  const int b = blockIdx.z, j0 = blockIdx.y * kWeightRows, N = n_den + n_num;
  int64_t t[kDims];
  bool active[kDims];  // (the inactive threads still stage W's tiles)
#pragma unroll
  for (int u = 0; u < kDims; ++u) {
    t[u] = (static_cast<int64_t>(blockIdx.x) * kDims + u) * kWeightThreads + threadIdx.x;
    active[u] = t[u] < d;
  }
  const Stacked<T> pts{den_all + static_cast<int64_t>(b) * n_den * d, num_all + static_cast<int64_t>(b) * n_num * d,
                      n_den, d};
  const double* W = W_all + static_cast<int64_t>(b) * n_q * N;
  double acc[kDims][kWeightRows];
#pragma unroll
  for (int u = 0; u < kDims; ++u) {
#pragma unroll
    for (int k = 0; k < kWeightRows; ++k) acc[u][k] = 0.0;
  }
  for (int c0 = 0; c0 < N; c0 += kWeightCols) {
    const int cols = min(kWeightCols, N - c0);
    __syncthreads();  // the previous tile is read by every thread
    for (int e = threadIdx.x; e < kWeightRows * kWeightCols; e += kWeightThreads) {
      const int k = e / kWeightCols, c = e - k * kWeightCols;
      w_tile[k][c] = (j0 + k < n_q && c < cols) ? W[static_cast<int64_t>(j0 + k) * N + c0 + c] : 0.0;
    }
    __syncthreads();
    if (active[0]) {  // (t[0] is the smallest)
      // (the coordinates held in their own dtype until used: a float in one register, not two)
      const auto load = [&](int c, T (&x)[kDims]) {
        const T* row = pts.row(c0 + c);
#pragma unroll
        for (int u = 0; u < kDims; ++u) x[u] = active[u] ? row[t[u]] : T(0);
      };
      const auto add = [&](int c, const T (&x)[kDims]) {
#pragma unroll
        for (int k = 0; k < kWeightRows; ++k) {
          const double w = w_tile[k][c];
#pragma unroll
          for (int u = 0; u < kDims; ++u) acc[u][k] += w * static_cast<double>(x[u]);
        }
      };
      int c = 0;
      for (; c + kWeightLoads <= cols; c += kWeightLoads) {
        T x[kWeightLoads][kDims];
#pragma unroll
        for (int l = 0; l < kWeightLoads; ++l) load(c + l, x[l]);
#pragma unroll
        for (int l = 0; l < kWeightLoads; ++l) add(c + l, x[l]);
      }
      for (; c < cols; ++c) {
        T x[kDims];
        load(c, x);
        add(c, x);
      }
    }
  }
  const double s = row_scale[b];
#pragma unroll
  for (int u = 0; u < kDims; ++u) {
    if (!active[u]) continue;
#pragma unroll
    for (int k = 0; k < kWeightRows; ++k) {
      const int j = j0 + k;
      if (j < n_q) {
        const int64_t row = static_cast<int64_t>(b) * n_q + j;
        const double zt = static_cast<double>(pts.row(row0 + j)[t[u]]);
        grad_all[row * d + t[u]] = static_cast<T>(s * (acc[u][k] - wsum_all[row] * zt));
      }
    }
  }
}

int max_shared_bytes(int device) { return device_attribute(device, cudaDevAttrMaxSharedMemoryPerBlockOptin); }

// set_two_blocks_per_sm's switch (benches: the one-block variant against the two-block one).
std::atomic<bool> two_blocks_per_sm{true};
// set_paired_elimination's switch (benches: solve_spd's one column a step against two).
std::atomic<bool> paired_elimination{true};
// set_gathered_selection's switch (benches: the median's gather against a pass for every digit).
std::atomic<bool> gathered_selection{true};
// set_gemm_kernel_values's switch (benches: the generic path's kernel values by gram_kernel_block, a
// GEMM and one pass, against kernel_block's tiles; generic.cpp's StackedDistances reads it once a fit).
std::atomic<bool> gemm_kernel_values{false};
// set_generic_kernels's switch (benches: the generic path's CUDA kernels against its ATen composition).
std::atomic<bool> generic_kernels{true};
// set_tile_subblocks's switch (benches: tile_sqdist's needed sub-blocks against all 16).
std::atomic<bool> tile_subblocks{true};
// set_paired_weight_dims's switch (benches: grad_from_weights_kernel's two dimensions a thread against one).
std::atomic<bool> paired_weight_dims{true};
// set_weight_kernel's switch (benches: the weight state's backward by grad_from_weights_kernel, or by the
// generic path's GEMM).
std::atomic<bool> weight_kernel{true};
// set_balanced_tile_ranges's switch (benches: pair_tile_kernel's ranges by each tile pair's cost, TileRanges,
// the default, against the same ranges for all).
std::atomic<bool> balanced_tile_ranges{true};
// set_product_tile_distances's switch (benches: the tiled distances, pair_tile_kernel's and kernel_block's,
// from norms and products, the GEMM's form, against differences).
std::atomic<bool> product_tile_distances{false};
// set_gemm_pair_distances's switch (benches: kl's many-dimension distances by gemm_pair_sqdist, against
// the pair kernels).
std::atomic<bool> gemm_pair_distances{false};

// set_stage_clocks's buffer (benches only), and the device it lives on.
std::atomic<long long*> stage_clocks{nullptr};
std::atomic<int> stage_clocks_device{-1};

// Static shared memory of kl_forward_kernel (the selection's histogram, the reductions, the
// projection's scratch), which counts against the same per-block limit.
constexpr int kStaticShared = static_cast<int>(sizeof(SelectShared)) + kWarps * (12 + 8 * 32) + 16;

// The forward's dynamic shared memory in doubles, for a layout (see kl_forward_kernel).
int64_t forward_shared_doubles(int64_t N, int64_t n_den, int64_t d, bool compute_dist, int64_t ldx,
                               bool dist_in_shared, bool system_in_shared, bool median_staged = false) {
  const int64_t P = N * (N - 1) / 2;
  const int64_t work =
      std::max({kWarps * N, system_in_shared ? n_den * n_den : int64_t{0}, median_staged ? P : int64_t{0}});
  const int64_t base = N + (compute_dist ? N * ldx : 0);
  if (compute_dist) return base + std::max(work, dist_in_shared ? P : 0);  // the distances share the work region
  return base + (dist_in_shared ? P : 0) + work;
}

// The squared distances of every pair of each batch element's stacked points into dist_t ([B, P]
// float64, contiguous; zeroed here where the kernels add partial sums), from the samples in their own
// dtype: pair_sqdist_kernel up to kMaxWarpPairPoints points, pair_tile_kernel above, with the
// dimensions split in ranges where the tiles alone would not fill the GPU. limit: the shared memory a
// block may have.
template <typename scalar_t>
void launch_pair_sqdist(const scalar_t* den, const scalar_t* num, int64_t B, int n_den, int n_num, int64_t d,
                        Tensor& dist_t, int sms, int limit, const c10::cuda::CUDAStream& stream) {
  const int64_t N = n_den + n_num, P = N * (N - 1) / 2;
  double* dist = dist_t.data_ptr<double>();
  for (int64_t b0 = 0; b0 < B; b0 += kMaxGridYZ) {  // the batch on the grids' y or z
    const int64_t nb = std::min(kMaxGridYZ, B - b0);
    // before a launch that adds: this chunk's rows only (an earlier chunk's launch may have stored its
    // sums, with one range a pair)
    const auto zero = [&] { dist_t.narrow(0, b0, nb).zero_(); };
    const scalar_t* den_b = den + b0 * n_den * d;
    const scalar_t* num_b = num + b0 * n_num * d;
    double* dist_b = dist + b0 * P;
    if (N > kMaxWarpPairPoints) {
      const int64_t tiles = (N + kTile - 1) / kTile, tile_pairs = tiles * (tiles + 1) / 2;
      TORCH_CHECK(tile_pairs <= std::numeric_limits<int>::max(), "kivi_fast: ", N,
                  " points are too many for pair_sqdist");
      // at most one wave of 4 blocks per SM (rounded down: a partial second wave would run its ranges
      // alone), each range a whole number of slabs
      const int64_t slabs = (d + kTileDims - 1) / kTileDims, wave = 4 * sms / nb;
      TileRanges ranges;
      int64_t dims_per_split = d, blocks = tile_pairs, splits = 1;
      if (balanced_tile_ranges.load() && tile_pairs <= kMaxRangedPairs) {
        // tile pair p's cost a slab: its needed sub-blocks (tile_sqdist's count, whatever
        // `subblocks`) and the staging
        std::vector<int64_t> cost(tile_pairs);
        int64_t all = 0;
        for (int64_t p = 0, I = 0; I < tiles; ++I) {
          for (int64_t J = I; J < tiles; ++J, ++p) {
            const int64_t nu = tile_subblocks_holding(static_cast<int>(N - I * kTile));
            const int64_t nv = tile_subblocks_holding(static_cast<int>(N - J * kTile));
            cost[p] = (I == J ? nu * (nu + 1) / 2 : nu * nv) + kStageCost;
            all += cost[p];
          }
        }
        ranges.pairs = static_cast<int>(tile_pairs);
        for (int64_t p = 0; p < tile_pairs; ++p) {
          const int64_t share = std::max<int64_t>(1, std::min<int64_t>(slabs, wave * cost[p] / all));
          const int64_t per_range = (slabs + share - 1) / share;  // slabs
          ranges.dims[p] = per_range * kTileDims;
          ranges.first[p + 1] = ranges.first[p] + static_cast<int>((slabs + per_range - 1) / per_range);
        }
        blocks = ranges.first[tile_pairs];
        if (blocks > tile_pairs) zero();
      } else {
        splits = std::max<int64_t>(1, std::min<int64_t>(slabs, wave / tile_pairs));
        dims_per_split = (slabs + splits - 1) / splits * kTileDims;
        splits = std::max<int64_t>(1, (d + dims_per_split - 1) / dims_per_split);
        if (splits > 1) zero();
      }
      const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(splits), static_cast<unsigned>(nb));
      if (product_tile_distances.load()) {
        pair_tile_kernel<scalar_t, true><<<grid, kTileThreads, 0, stream>>>(den_b, num_b, n_den, n_num, d, ranges,
                                                                          dims_per_split, tile_subblocks.load(), dist_b);
      } else {
        pair_tile_kernel<scalar_t, false><<<grid, kTileThreads, 0, stream>>>(den_b, num_b, n_den, n_num, d, ranges,
                                                                           dims_per_split, tile_subblocks.load(), dist_b);
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    } else {
      // chunks of dimensions staged as float64 next to the pairs' partial sums, within 48 KB (no opt-in)
      const int64_t chunk = std::max<int64_t>(32, ((6144 - P) / N) / 32 * 32);
      const int64_t bytes = 8 * (N * chunk + P);
      TORCH_CHECK(bytes <= limit, "kivi_fast: pair_sqdist_kernel needs ", bytes, " bytes of shared memory");
      const int64_t chunks = (d + chunk - 1) / chunk;
      const int64_t per_element = std::max<int64_t>(1, std::min<int64_t>(chunks, (4 * sms + nb - 1) / nb));
      zero();  // (its blocks add their chunks' sums)
      const dim3 grid(static_cast<unsigned>(per_element), static_cast<unsigned>(nb));
      pair_sqdist_kernel<scalar_t><<<grid, kPairThreads, bytes, stream>>>(den_b, num_b, n_den, n_num, d, chunk, dist_b);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  }
}

// The squared distances of kl's many-dimension path by cuBLAS (set_gemm_pair_distances, off by default;
// the benches' A/B, where d >= N and the Gram takes at most 16 MB): into dist [B, P] float64, packed as
// pair_index. The stacked points less their centre (generic::centre_point, the middle of three points'
// coordinates, as the CPU kernels' Gram and the product-form tiles), as float64 in chunks of dimensions
// of at most 16 MB, each added into their Gram G [B, N, N] by a float64 GEMM (Hopper's float64 tensor
// cores); then D_ij = G_ii + G_jj - 2 G_ij. The pure sides take their distances this way (in float32
// for the fast one); pair_tile_kernel's float64 differences cost ~0.36 ms at (100, 50000) on an H200.
// - Centred on a middle point, norms and products keep the differences' accuracy
//   (bench/distance_schemes.py's "the same from a middle point"), except where most points sit in a
//   cluster far tighter than its distance from the centre (two of the three rows the centre comes
//   from far out): their distances are then below the GEMM's resolution, and the element's median
//   is 0, NaN, where the differences give its value (the CPU kernels' Gram says the system is not
//   positive definite there).
// - G's own diagonal as the norms: a point against itself is exactly 0. For two distinct points with
//   the same coordinates cuBLAS need not sum G_ij in G_ii's order, so a distance below the GEMM's
//   rounding bound, (d + 2) 2^-52 (G_ii + G_jj), is set to 0 (generic::zero_below_gram_rounding, as
//   the generic path's pairs from its Gram): such points are the same to the GEMM, and a sample most
//   of whose points coincide keeps a median of 0 (NaN for its element), as by differences. NaN and
//   Inf coordinates give NaN or Inf distances for their points' pairs (strict comparisons leave them;
//   all of the element's where the three centre rows are all non-finite in a coordinate, whose
//   element is NaN anyway).
// Memory: a chunk and the Gram, each at most 16 MB (kl takes this path only where B N^2 <= 2^21),
// beside dist; and two temporaries the Gram's size (the norms' sums, the mask).
void gemm_pair_sqdist(const Tensor& denom, const Tensor& numer, Tensor& dist) {
  const int64_t B = denom.size(0), n_den = denom.size(1), n_num = numer.size(1), d = denom.size(2);
  const int64_t N = n_den + n_num;
  const auto f64 = denom.options().dtype(at::kDouble);
  const Tensor centre = generic::centre_point(denom, numer);  // [B, 1, d]
  const int64_t chunk = std::max<int64_t>(1, std::min<int64_t>(d, (int64_t{1} << 21) / std::max<int64_t>(1, B * N)));
  Tensor x = at::empty({B, N, chunk}, f64);
  Tensor gram = at::zeros({B, N, N}, f64);
  for (int64_t s = 0; s < d; s += chunk) {
    const int64_t c = std::min(chunk, d - s);
    Tensor xc = generic::stacked_chunk(denom, numer, s, c, x).sub_(centre.narrow(2, s, c));
    gram.baddbmm_(xc, xc.transpose(1, 2));
  }
  const Tensor norms = gram.diagonal(0, 1, 2).clone();
  gram.mul_(-2.0).add_(norms.unsqueeze(2)).add_(norms.unsqueeze(1));
  generic::zero_below_gram_rounding(gram, norms, norms, d);
  const Tensor upper = at::triu_indices(N, N, 1, f64.dtype(at::kLong));  // [2, P], row by row
  at::index_select_out(dist, gram.view({B, N * N}), 1, upper.select(0, 0).mul(N).add_(upper.select(0, 1)));
}
}  // namespace

bool handles_kl(int64_t n_total, int64_t d, int64_t batch, int device) {
  // (the forward's blocks step through the elements by an int, b += gridDim.x, with up to one block an
  // element: b + gridDim.x <= 2 batch - 1, within int's range up to 2^30 elements)
  if (n_total > kMaxPoints || batch > (int64_t{1} << 30)) return false;
  const bool small = n_total * d <= kSmallWork;
  // many dimensions: the distances by pair_sqdist_kernel or pair_tile_kernel (batch on the grid's y
  // or z), and the points are not staged in shared memory, which a projection state reads
  if (!small && (n_total > kMaxWidePoints || batch > kMaxGridYZ || grad_state_is_projection(n_total, d))) return false;
  // the leanest layout (distances and system in global memory) must fit this device's blocks
  const int64_t least = forward_shared_doubles(n_total, 0, d, small, small ? (d | 1) : 0, false, false);
  return 8 * least + kStaticShared <= max_shared_bytes(device);
}

std::tuple<Tensor, Tensor, Tensor, Tensor> kl(const Tensor& prior_z_in, const Tensor& q_z_in, double lam, double clip,
                                              const std::optional<Tensor>& sigma, bool reverse, bool grad_state) {
  const c10::cuda::CUDAGuard guard(q_z_in.device());
  const Tensor prior_z = prior_z_in.contiguous(), q_z = q_z_in.contiguous();
  const KlRoles roles = kl_roles(prior_z, q_z, reverse);
  const int64_t B = q_z.size(0), n_den = roles.denom.size(1), n_num = roles.numer.size(1), d = q_z.size(2);
  const int64_t N = n_den + n_num, P = N * (N - 1) / 2, n_q = q_z.size(1);
  const auto f64 = q_z.options().dtype(at::kDouble);
  const int device = q_z.get_device();
  const int limit = max_shared_bytes(device) - kStaticShared;
  const int sms = device_attribute(device, cudaDevAttrMultiProcessorCount);

  KlArgs a{};
  a.n_den = static_cast<int>(n_den);
  a.n_num = static_cast<int>(n_num);
  a.n_q = static_cast<int>(n_q);
  a.row0 = static_cast<int>(roles.row0);
  a.d = d;
  a.lam = lam;
  a.clip = clip;
  a.reverse = reverse;
  a.state_width = grad_state ? static_cast<int>(grad_state_width(N, d)) : 0;
  a.projection = grad_state_is_projection(N, d);
  a.compute_dist = N * d <= kSmallWork;
  a.ldx = a.compute_dist ? static_cast<int>(d | 1) : 0;
  a.clocks = stage_clocks_device.load() == device ? stage_clocks.load() : nullptr;
  a.paired_elimination = paired_elimination.load();
  a.gather_keys = gathered_selection.load() ? kGatherKeys : 0;
  // the projection state reads the points staged in shared memory (handles_kl keeps the others out)
  TORCH_CHECK(a.compute_dist || !a.projection, "kivi_fast::kl (CUDA): a projection state needs N d <= ", kSmallWork);
  // In shared memory what fits: both the distances (the median's passes) and the system (the
  // elimination), else the system, else the distances, else neither.
  const auto doubles = [&](bool dist_sh, bool sys_sh, bool median_staged = false) {
    return forward_shared_doubles(N, n_den, d, a.compute_dist, a.ldx, dist_sh, sys_sh, median_staged);
  };
  const bool layouts[4][2] = {{true, true}, {false, true}, {true, false}, {false, false}};
  // More than one wave of blocks (B > SMs, one block per SM): the first layout with which two blocks
  // share an SM, if any (kl_forward_kernel<T, 2>: half the waves, each block slower), e.g. the
  // distances in global memory (L2) at 1024 x (100, 8). Else the first that fits one block.
  const auto first_fitting = [&](int64_t bytes) {  // the first layout within bytes, else -1
    for (int l = 0; l < 4; ++l) {
      if (8 * doubles(layouts[l][0], layouts[l][1]) <= bytes) return l;
    }
    return -1;
  };
  int layout = -1;
  if (B > sms && two_blocks_per_sm.load()) {
    layout = first_fitting(device_attribute(device, cudaDevAttrMaxSharedMemoryPerMultiprocessor) / 2 -
                           device_attribute(device, cudaDevAttrReservedSharedMemoryPerBlock) - kStaticShared);
  }
  const bool two_per_sm = layout >= 0;
  if (!two_per_sm) layout = first_fitting(limit);
  if (layout < 0) layout = 3;  // the leanest: too large for this device, which the check below says
  a.dist_in_shared = layouts[layout][0];
  a.system_in_shared = layouts[layout][1];
  // Distances given in global memory (the wide path's) that fit the work region alone: a copy there
  // for the median (at (100, 50000) on an H100: 159 KB, beside which the 80 KB system does not fit)
  a.median_staged = !a.compute_dist && !a.dist_in_shared && !sigma.has_value() && !two_per_sm &&
                    8 * doubles(false, a.system_in_shared, true) <= limit;
  const int64_t shared_bytes = 8 * doubles(a.dist_in_shared, a.system_in_shared, a.median_staged);
  TORCH_CHECK(shared_bytes <= limit, "kivi_fast::kl (CUDA): ", shared_bytes, " bytes of shared memory needed, ",
              limit, " available");

  auto kl_out = at::empty({B}, q_z.options()), sigma_out = at::empty({B}, f64), clipped = at::empty({B}, f64);
  auto state = at::empty({B, n_q, a.state_width}, f64);
  if (B == 0) return {kl_out, state, sigma_out, clipped};
  // the distances' workspace: the wide path's sums, or distances that do not fit in shared memory
  // Blocks: one an element, or, where the forward keeps a workspace in global memory (the distances
  // it computes, the system), as many as the GPU holds at once, each taking elements in turn, so that
  // the workspaces are one slot a block (1024 x (100, 8): 264 slots of distances, 42 MB, not 163).
  const bool slots = (a.compute_dist && !a.dist_in_shared) || !a.system_in_shared;
  const int64_t blocks = slots ? std::min<int64_t>(B, (two_per_sm ? 2 : 1) * int64_t{sms}) : B;
  a.batch = static_cast<int>(B);
  // the distances: given (the pair kernels' sums, one row an element) or a workspace (one a block)
  auto dist = at::empty({!a.compute_dist ? B : !a.dist_in_shared ? blocks : 0, P}, f64);
  Tensor sys = a.system_in_shared ? Tensor() : at::empty({blocks, n_den * n_den}, f64);
  const auto sigma_given = sigma.has_value() ? sigma->to(at::kDouble).contiguous() : Tensor();
  const auto stream = c10::cuda::getCurrentCUDAStream(device);

  AT_DISPATCH_FLOATING_TYPES(q_z.scalar_type(), "kivi_fast_cuda_kl", [&] {
    const scalar_t* den = roles.denom.data_ptr<scalar_t>();
    const scalar_t* num = roles.numer.data_ptr<scalar_t>();
    if (!a.compute_dist && gemm_pair_distances.load() && d >= N && B * N * N <= (int64_t{1} << 21)) {
      gemm_pair_sqdist(roles.denom, roles.numer, dist);
    } else if (!a.compute_dist) {
      launch_pair_sqdist(den, num, B, a.n_den, a.n_num, d, dist, sms, limit, stream);
    }
    const auto forward = two_per_sm ? kl_forward_kernel<scalar_t, 2> : kl_forward_kernel<scalar_t, 1>;
    if (shared_bytes + kStaticShared > 48 * 1024) {
      allow_all_shared_memory(reinterpret_cast<const void*>(forward), device, kStaticShared);
    }
    forward<<<static_cast<unsigned>(blocks), kThreads, shared_bytes, stream>>>(
        den, num, sigma_given.defined() ? sigma_given.data_ptr<double>() : nullptr, dist.data_ptr<double>(),
        sys.defined() ? sys.data_ptr<double>() : nullptr, kl_out.data_ptr<scalar_t>(), state.data_ptr<double>(),
        sigma_out.data_ptr<double>(), clipped.data_ptr<double>(), a);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {kl_out, state, sigma_out, clipped};
}

bool set_two_blocks_per_sm(bool flag) { return two_blocks_per_sm.exchange(flag); }

bool set_paired_elimination(bool flag) { return paired_elimination.exchange(flag); }

bool set_gathered_selection(bool flag) { return gathered_selection.exchange(flag); }

bool use_gathered_selection() { return gathered_selection.load(); }

bool set_gemm_kernel_values(bool flag) { return gemm_kernel_values.exchange(flag); }
bool use_gemm_kernel_values() { return gemm_kernel_values.load(); }

bool set_generic_kernels(bool flag) { return generic_kernels.exchange(flag); }

bool use_generic_kernels() { return generic_kernels.load(); }

bool set_tile_subblocks(bool flag) { return tile_subblocks.exchange(flag); }
bool set_balanced_tile_ranges(bool flag) { return balanced_tile_ranges.exchange(flag); }
bool set_product_tile_distances(bool flag) { return product_tile_distances.exchange(flag); }
bool set_gemm_pair_distances(bool flag) { return gemm_pair_distances.exchange(flag); }

bool set_paired_weight_dims(bool flag) { return paired_weight_dims.exchange(flag); }
bool set_weight_kernel(bool flag) { return weight_kernel.exchange(flag); }

void set_stage_clocks(const std::optional<Tensor>& buffer) {
  if (!buffer.has_value()) {
    stage_clocks_device.store(-1);
    stage_clocks.store(nullptr);
    return;
  }
  TORCH_CHECK_VALUE(buffer->is_cuda() && buffer->scalar_type() == at::kLong && buffer->is_contiguous() &&
                        buffer->numel() >= kForwardStages,
                    "set_forward_stage_clocks: buffer must be a contiguous int64 CUDA tensor of at least ",
                    kForwardStages, " elements");
  stage_clocks.store(reinterpret_cast<long long*>(buffer->data_ptr<int64_t>()));
  stage_clocks_device.store(buffer->get_device());
}

Tensor pair_sqdist(const Tensor& denom_in, const Tensor& numer_in) {
  const c10::cuda::CUDAGuard guard(denom_in.device());
  const Tensor denom = denom_in.contiguous(), numer = numer_in.contiguous();
  const int64_t B = denom.size(0), n_den = denom.size(1), n_num = numer.size(1), d = denom.size(2);
  const int64_t N = n_den + n_num;
  TORCH_CHECK(numer.scalar_type() == denom.scalar_type() && numer.size(0) == B && numer.size(2) == d &&
                  N <= std::numeric_limits<int>::max(),
              "kivi_fast: pair_sqdist expects samples [B, n, d] and [B, m, d] of one dtype, got ", denom.sizes(),
              " and ", numer.sizes());
  auto dist = at::empty({B, N * (N - 1) / 2}, denom.options().dtype(at::kDouble));
  if (dist.numel() == 0) return dist;
  if (d == 0) return dist.zero_();
  const int device = denom.get_device();
  const int sms = device_attribute(device, cudaDevAttrMultiProcessorCount);
  const int limit = max_shared_bytes(device);
  const auto stream = c10::cuda::getCurrentCUDAStream(device);
  AT_DISPATCH_FLOATING_TYPES(denom.scalar_type(), "kivi_fast_cuda_pair_sqdist", [&] {
    // an empty side has no storage: its pointer is never read
    const scalar_t* den = denom.data_ptr<scalar_t>();
    const scalar_t* num = n_num > 0 ? numer.data_ptr<scalar_t>() : nullptr;
    launch_pair_sqdist(den, num, B, static_cast<int>(n_den), static_cast<int>(n_num), d, dist, sms, limit, stream);
  });
  return dist;
}

Tensor kernel_block(const Tensor& denom_in, const Tensor& numer_in, int64_t r0, int64_t rows, int64_t c0,
                    int64_t cols, const Tensor& scale_in, double divisor, double diagonal) {
  const c10::cuda::CUDAGuard guard(denom_in.device());
  const Tensor denom = denom_in.contiguous(), numer = numer_in.contiguous(), scale = scale_in.contiguous();
  const int64_t B = denom.size(0), n_den = denom.size(1), n_num = numer.size(1), d = denom.size(2);
  const int64_t N = n_den + n_num;
  TORCH_CHECK(numer.scalar_type() == denom.scalar_type() && numer.size(0) == B && numer.size(2) == d &&
                  scale.scalar_type() == at::kDouble && scale.numel() == B && N <= std::numeric_limits<int>::max() &&
                  r0 >= 0 && rows >= 0 && r0 + rows <= N && c0 >= 0 && cols >= 0 && c0 + cols <= N,
              "kivi_fast: kernel_block expects samples [B, n, d] and [B, m, d] of one dtype, a float64 scale [B] "
              "and a block within the n + m points, got ", denom.sizes(), ", ", numer.sizes(), ", ", scale.sizes(),
              ", rows [", r0, ", ", r0 + rows, "), columns [", c0, ", ", c0 + cols, ")");
  auto out = at::empty({B, rows, cols}, denom.options().dtype(at::kDouble));
  if (out.numel() == 0) return out;
  const auto stream = c10::cuda::getCurrentCUDAStream(denom.get_device());
  const int64_t tiles_r = (rows + kTile - 1) / kTile, tiles_c = (cols + kTile - 1) / kTile;
  TORCH_CHECK(tiles_r <= kMaxGridYZ && tiles_c <= std::numeric_limits<int>::max(), "kivi_fast: kernel_block of ", rows,
              " x ", cols, " is too large");
  AT_DISPATCH_FLOATING_TYPES(denom.scalar_type(), "kivi_fast_cuda_kernel_block", [&] {
    const scalar_t* den = denom.data_ptr<scalar_t>();
    const scalar_t* num = n_num > 0 ? numer.data_ptr<scalar_t>() : nullptr;  // (never read when empty)
    for (int64_t b0 = 0; b0 < B; b0 += kMaxGridYZ) {  // the batch on the grid's z
      const int64_t nb = std::min(kMaxGridYZ, B - b0);
      const dim3 grid(static_cast<unsigned>(tiles_c), static_cast<unsigned>(tiles_r), static_cast<unsigned>(nb));
      const scalar_t *den_b = den + b0 * n_den * d, *num_b = num == nullptr ? nullptr : num + b0 * n_num * d;
      const int nd = static_cast<int>(n_den), nn = static_cast<int>(n_num), i0 = static_cast<int>(r0),
                ni = static_cast<int>(rows), j0 = static_cast<int>(c0), nj = static_cast<int>(cols);
      const double* scale_b = scale.data_ptr<double>() + b0;
      double* out_b = out.data_ptr<double>() + b0 * rows * cols;
      if (product_tile_distances.load()) {
        kernel_block_kernel<scalar_t, true><<<grid, kTileThreads, 0, stream>>>(
            den_b, num_b, nd, nn, d, i0, ni, j0, nj, scale_b, divisor, diagonal, tile_subblocks.load(), out_b);
      } else {
        kernel_block_kernel<scalar_t, false><<<grid, kTileThreads, 0, stream>>>(
            den_b, num_b, nd, nn, d, i0, ni, j0, nj, scale_b, divisor, diagonal, tile_subblocks.load(), out_b);
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
  return out;
}

Tensor gram_kernel_block(const Tensor& points, const Tensor& norms_in, int64_t r0, int64_t rows, int64_t c0,
                         int64_t cols, const Tensor& scale_in, double divisor, double diagonal) {
  const c10::cuda::CUDAGuard guard(points.device());
  TORCH_CHECK(points.dim() == 3, "kivi_fast: gram_kernel_block expects points [B, N, d], got ", points.sizes());
  const Tensor norms = norms_in.contiguous(), scale = scale_in.contiguous();
  const int64_t B = points.size(0), N = points.size(1);
  TORCH_CHECK(points.scalar_type() == at::kDouble && norms.scalar_type() == at::kDouble && norms.numel() == B * N &&
                  scale.scalar_type() == at::kDouble && scale.numel() == B && norms.device() == points.device() &&
                  scale.device() == points.device() && r0 >= 0 && rows >= 0 && r0 + rows <= N && c0 >= 0 &&
                  cols >= 0 && c0 + cols <= N,
              "kivi_fast: gram_kernel_block expects float64 points [B, N, d], norms [B, N], scale [B] on one device "
              "and a block within the N points, got ", points.sizes(), ", ", norms.sizes(), ", ", scale.sizes(), ", rows [", r0,
              ", ", r0 + rows, "), columns [", c0, ", ", c0 + cols, ")");
  auto out = at::empty({B, rows, cols}, points.options());
  if (out.numel() == 0) return out;
  // x_i . x_j by cuBLAS (float64 tensor cores from sm_80) into out, then one pass
  at::bmm_out(out, points.narrow(1, r0, rows), points.narrow(1, c0, cols).transpose(1, 2));
  const auto stream = c10::cuda::getCurrentCUDAStream(points.get_device());
  const int64_t blocks = std::min<int64_t>((rows * cols + kGramThreads - 1) / kGramThreads, 65535);
  for (int64_t b0 = 0; b0 < B; b0 += kMaxGridYZ) {  // the batch on the grid's y
    const int64_t nb = std::min(kMaxGridYZ, B - b0);
    const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(nb));
    gram_kernel_kernel<<<grid, kGramThreads, 0, stream>>>(out.data_ptr<double>() + b0 * rows * cols,
                                                          norms.data_ptr<double>() + b0 * N, N, r0, rows, c0, cols,
                                                          scale.data_ptr<double>() + b0, divisor, diagonal);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return out;
}

Tensor fit_coef(const Tensor& x_in, const Tensor& info_in, const Tensor& sigma_in, int64_t N, double beta) {
  const c10::cuda::CUDAGuard guard(x_in.device());
  const Tensor x = x_in.contiguous(), info = info_in.contiguous(), sigma = sigma_in.contiguous();
  const int64_t B = x.size(0), n_den = x.size(1);
  TORCH_CHECK(x.scalar_type() == at::kDouble && x.numel() == B * n_den && info.scalar_type() == at::kInt &&
                  info.numel() == B && sigma.scalar_type() == at::kDouble && sigma.numel() == B && N >= n_den,
              "kivi_fast: fit_coef expects x [B, n_den, 1] float64, info [B] int32, sigma [B] float64, N >= n_den");
  auto coef = at::empty({B, N}, x.options());
  if (coef.numel() == 0) return coef;
  TORCH_CHECK(B <= std::numeric_limits<int>::max(), "kivi_fast: fit_coef takes at most 2^31 - 1 batch elements");
  const auto stream = c10::cuda::getCurrentCUDAStream(x.get_device());
  fit_coef_kernel<<<static_cast<unsigned>(B), kCoefThreads, 0, stream>>>(
      x.data_ptr<double>(), info.data_ptr<int>(), sigma.data_ptr<double>(), n_den, N, beta, coef.data_ptr<double>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return coef;
}

std::tuple<Tensor, Tensor> kl_finish(const Tensor& r_src, const std::optional<Tensor>& state, const Tensor& sigma_in,
                                     double clip, bool reverse) {
  const c10::cuda::CUDAGuard guard(r_src.device());
  const Tensor sigma = sigma_in.contiguous();
  const int64_t B = r_src.size(0), n_q = r_src.size(1), width = r_src.size(2);
  TORCH_CHECK(r_src.scalar_type() == at::kDouble && r_src.is_contiguous() && width > 0 && sigma.numel() == B &&
                  sigma.scalar_type() == at::kDouble &&
                  (!state.has_value() || (state->scalar_type() == at::kDouble && state->is_contiguous() &&
                                          state->size(0) == B && state->size(1) == n_q)),
              "kivi_fast: kl_finish expects contiguous float64 [B, n_q, w > 0] ratios, state [B, n_q, *] and "
              "sigma [B]");
  auto kl = at::empty({B}, r_src.options()), clipped = at::empty({B}, r_src.options());
  if (B == 0) return {kl, clipped};
  TORCH_CHECK(n_q > 0 && B <= std::numeric_limits<int>::max(),
              "kivi_fast: kl_finish needs at least one ratio a batch element, and at most 2^31 - 1 elements");
  const auto stream = c10::cuda::getCurrentCUDAStream(r_src.get_device());
  kl_finish_kernel<<<static_cast<unsigned>(B), kFinishThreads, 0, stream>>>(
      r_src.data_ptr<double>(), n_q, width, state.has_value() ? state->data_ptr<double>() : nullptr,
      state.has_value() ? state->size(2) : 0, sigma.data_ptr<double>(), clip, reverse, kl.data_ptr<double>(),
      clipped.data_ptr<double>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {kl, clipped};
}

bool handles_kl_grad(int64_t n_total, int64_t n_q, int64_t d, int64_t batch) {
  // the weight state's kernel: grid.z = batch (grid.y = row tiles: within limits below kMaxWeightWork)
  return grad_state_is_projection(n_total, d) ||
         (weight_kernel.load() && batch <= kMaxGridYZ && n_q * n_total <= kMaxWeightWork);
}

Tensor kl_grad(const Tensor& grad_kl, const Tensor& state_in, const Tensor& q_z_in, const Tensor& prior_z_in,
               bool reverse) {
  const c10::cuda::CUDAGuard guard(q_z_in.device());
  const Tensor q_z = q_z_in.contiguous(), prior_z = prior_z_in.contiguous(), state = state_in.contiguous();
  const int64_t B = q_z.size(0), n_q = q_z.size(1), d = q_z.size(2), N = prior_z.size(1) + n_q;
  // (a negated view's sign is in its flag, which RowScale's raw reads would miss)
  Tensor g = grad_kl.reshape({-1}).resolve_neg();
  if (g.scalar_type() != at::kFloat && g.scalar_type() != at::kDouble) g = g.to(at::kDouble);
  const RowScale row_scale{g.data_ptr(), g.numel() > 1 ? g.stride(0) : 0, g.scalar_type() == at::kDouble,
                           kl_row_factor(n_q, reverse)};
  auto grad = at::empty_like(q_z);
  if (B == 0 || n_q == 0 || d == 0) return grad;
  const auto stream = c10::cuda::getCurrentCUDAStream(q_z.get_device());
  AT_DISPATCH_FLOATING_TYPES(q_z.scalar_type(), "kivi_fast_cuda_kl_grad", [&] {
    if (grad_state_is_projection(N, d)) {
      const int64_t total = B * n_q * d;
      const int64_t blocks = std::min<int64_t>((total + 255) / 256, 4096);
      if (total > 0) {
        grad_from_projection_kernel<scalar_t><<<static_cast<unsigned>(blocks), 256, 0, stream>>>(
            row_scale, state.data_ptr<double>(), q_z.data_ptr<scalar_t>(),
            grad.data_ptr<scalar_t>(), n_q, d, total);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
    } else {
      const KlRoles roles = kl_roles(prior_z, q_z, reverse);
      const auto wsum = state.sum(-1);  // [B, n_q]
      // two dimensions a thread, or one (set_paired_weight_dims): the launch names the pointer
      const bool paired = paired_weight_dims.load();
      const auto grad_from_weights =
          paired ? grad_from_weights_kernel<scalar_t, 2> : grad_from_weights_kernel<scalar_t, 1>;
      const int64_t dims_per_block = int64_t{kWeightThreads} * (paired ? 2 : 1);
      const dim3 grid(static_cast<unsigned>((d + dims_per_block - 1) / dims_per_block),
                      static_cast<unsigned>((n_q + kWeightRows - 1) / kWeightRows), static_cast<unsigned>(B));
      grad_from_weights<<<grid, kWeightThreads, 0, stream>>>(
          row_scale, state.data_ptr<double>(), wsum.data_ptr<double>(),
          roles.denom.data_ptr<scalar_t>(), roles.numer.data_ptr<scalar_t>(), static_cast<int>(roles.denom.size(1)),
          static_cast<int>(roles.numer.size(1)), static_cast<int>(n_q), static_cast<int>(roles.row0), d,
          grad.data_ptr<scalar_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
  return grad;
}

}  // namespace kivi_fast::cuda
