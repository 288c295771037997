// CPU kernels. What they do differently from the device-generic path (generic.cpp):
//  - one batch element at a time, fused: distances, median, kernel, Cholesky solve and evaluation of
//    the ratio run on per-thread buffers (an N x N matrix of 320 KB at n_p = n_q = 100 stays in L2),
//    in parallel over the batch when it has at least as many elements as there are threads, and
//    inside each stage otherwise (one large element);
//  - samples are read in column blocks converted to float64 in a per-thread buffer, so float32
//    inputs never pay for a full float64 copy (d = 314000 for an MNIST layer), and each block's
//    Gram runs while the block is in cache (register tiles on AVX2 CPUs, gram_tiles.h; GEMMs of
//    the split triangle elsewhere); with few dimensions, distances come from differences;
//  - only the upper triangle of the distances is computed (the median reads nothing else), and the
//    fit reads only the kernel's upper triangle (the refinement's residuals too: symmetric_times);
//    the evaluation reads whole kernel rows: where its projection takes gram_tiles' row tiles
//    (d > 8, AVX2) above 256 points, they read the lower part down the upper part's columns
//    (rows_times_panels' first_row); elsewhere the lower part is mirrored;
//  - few points in many dimensions (N <= 32, an MNIST layer) skip the buffer and the GEMM: the Gram and
//    the backward's weighted sums read the input rows directly with float64 register tiles (few_points.h);
//  - the median is an exact selection, not a sort: over binned values (select_two), and above 2^20
//    pairs over the pairs inside a bracket that a sample of them sets (select_two_sampled; on one
//    thread above 32 MB counted inside the Gram's row tiles, gram_one);
//  - systems up to 256 x 256 are factored by our own Cholesky (rows::cholesky_upper), larger ones by
//    LAPACK's float32 Cholesky refined in float64 to float64's backward error (solve_refined);
//  - with few dimensions (d + 1 < N) the forward leaves the backward the projection of its weights on
//    the points (kl_state_width in kivi.h), so the backward is one elementwise pass; otherwise the
//    backward reads the samples once more, block by block, and writes the gradient once.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <optional>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "few_points.h"
#include "gram_tiles.h"
#include "huge_pages.h"
#include "kept_outputs.h"
#include "kivi.h"
#include "simd_rows.h"

// LAPACK as linked into torch (MKL or OpenBLAS export these Fortran names). Weak: where a build of
// torch does not export them, they are null and the ATen calls (one more copy each) are used instead.
extern "C" {
void dpotrf_(const char* uplo, const int* n, double* a, const int* lda, int* info) __attribute__((weak));
void dpotrs_(const char* uplo, const int* n, const int* nrhs, const double* a, const int* lda, double* b,
             const int* ldb, int* info) __attribute__((weak));
void spotrf_(const char* uplo, const int* n, float* a, const int* lda, int* info) __attribute__((weak));
void spotrs_(const char* uplo, const int* n, const int* nrhs, const float* a, const int* lda, float* b,
             const int* ldb, int* info) __attribute__((weak));
void dgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k, const double* alpha,
            const double* a, const int* lda, const double* b, const int* ldb, const double* beta, double* c,
            const int* ldc) __attribute__((weak));
}

namespace kivi_fast {
namespace cpu {
namespace {

// Whether to call the BLAS/LAPACK symbols above where torch exports them; off, the ATen calls that
// builds without them use, and no float32 factor of large systems (a test switch: _set_external_blas).
std::atomic<bool> use_external_blas{true};

// A [N, w] float64 block of about 512 KB, this machine's L2 per core: as fast here as the
// 2 MB blocks used before (one block for d = 700 at N = 200), and a smaller buffer to keep.
constexpr int64_t kBlockDoubles = int64_t{1} << 16;

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
  // The column blocks' width and count, taken together so that no caller pairs a width with another
  // split's count. Split over `workers` threads, more than one block becomes about a multiple of
  // workers blocks of about equal width (whole vectors of 8 columns): d = 700 at N = 200 made 3 blocks,
  // and 2 threads split them 654 : 46 columns.
  struct Blocks {
    int64_t width, count;
  };
  Blocks column_blocks(int64_t workers = 1) const {
    int64_t width = std::min(d, std::max<int64_t>(64, kBlockDoubles / rows));
    const int64_t count = (d + width - 1) / width;
    if (workers > 1 && count > 1) {
      const int64_t even = (count + workers - 1) / workers * workers;
      width = std::min(width, ((d + even - 1) / even + 7) / 8 * 8);
    }
    return {width, (d + width - 1) / width};
  }

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

// Row-major C [m, n] = op(A) op(B) (accumulate: C += op(A) op(B)), op(X) = X^T where trans_x, with
// leading dimensions lda, ldb, ldc. BLAS's dgemm directly where torch exports it: the ATen call costs
// ~5 us of dispatch and tensor set-up, as much as a 100 x 100 x 51 product's arithmetic.
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const double* a, int64_t lda, const double* b,
          int64_t ldb, bool accumulate, double* c, int64_t ldc) {
  if (dgemm_ != nullptr && use_external_blas) {
    // the row-major C is the column-major C^T = op(B)^T op(A)^T, and each row-major operand read
    // column-major is its transpose
    const int mm = static_cast<int>(n), nn = static_cast<int>(m), kk = static_cast<int>(k);
    const int la = static_cast<int>(lda), lb = static_cast<int>(ldb), lc = static_cast<int>(ldc);
    const double one = 1.0, beta = accumulate ? 1.0 : 0.0;
    dgemm_(trans_b ? "T" : "N", trans_a ? "T" : "N", &mm, &nn, &kk, &one, b, &lb, a, &la, &beta, c, &lc);
    return;
  }
  auto view = [](const double* x, int64_t rows, int64_t cols, int64_t ld, bool trans) {
    auto t = at::from_blob(const_cast<double*>(x), {rows, cols}, {ld, 1}, at::TensorOptions().dtype(at::kDouble));
    return trans ? t.t() : t;
  };
  auto out = view(c, m, n, ldc, false);
  auto op_a = trans_a ? view(a, k, m, lda, true) : view(a, m, k, lda, false);
  auto op_b = trans_b ? view(b, n, k, ldb, true) : view(b, k, n, ldb, false);
  if (accumulate) {
    out.addmm_(op_a, op_b);
  } else {
    at::mm_out(out, op_a, op_b);
  }
}

// A growable scratch buffer whose contents start uninitialized (a std::vector would zero them).
// Large ones sit on 2 MB pages where the kernel offers transparent huge pages (huge_pages.h): a fresh
// 128 MB kernel matrix ((2000, 32)) otherwise takes ~32k page faults, measured at a quarter of the call.
class Scratch {
 public:
  // buffers of at least this many bytes are 2 MB aligned (huge pages; release_if_above's madvise)
  static constexpr size_t kAlignedFrom = 2 * huge_pages::kSize;

  double* get(int64_t n) {
    if (n > capacity_) {
      data_.reset();  // the old buffer goes first: the new one may be large
      capacity_ = 0;
      data_.reset(allocate(n));
      capacity_ = n;
    }
    return data_.get();
  }
  // Above keep doubles the buffer is handed back: up to lazy_keep, lazily (MADV_FREE: still mapped,
  // its pages the kernel's to take under memory pressure; until it does, the next call finds them
  // without page faults or zeroing; the allocation is 2 MB aligned), above that, freed.
  void release_if_above(int64_t keep, int64_t lazy_keep) {
    if (capacity_ <= keep) return;
#ifdef MADV_FREE
    if (capacity_ <= lazy_keep && madvise(data_.get(), rounded_bytes(capacity_), MADV_FREE) == 0) return;
#endif
    data_.reset();
    capacity_ = 0;
  }

 private:
  struct Free {
    void operator()(double* p) const { std::free(p); }
  };
  static size_t rounded_bytes(int64_t n) { return huge_pages::rounded(static_cast<size_t>(n) * sizeof(double)); }
  static double* allocate(int64_t n) {
    const size_t bytes = static_cast<size_t>(n) * sizeof(double);
    void* p = bytes >= kAlignedFrom ? huge_pages::allocate(rounded_bytes(n)) : std::malloc(bytes);
    TORCH_CHECK(p != nullptr, "kivi_fast: could not allocate ", bytes, " bytes of scratch memory");
    return static_cast<double*>(p);
  }
  std::unique_ptr<double[], Free> data_;
  int64_t capacity_ = 0;
};

// Per-thread buffers of one batch element, kept between calls (training calls the op with the same
// shapes at every step: no allocation, no page faults). Buffers above 32 MB are handed back after a
// call, lazily up to 256 MB each: the 128 MB kernel matrix of (2000, 32) was faulted in and zeroed
// again at every call (~10 ms of ~115: bench/ab.py 1.10x in session 12); the 256 MB bound is per
// buffer (a thread's Work has seven), on what stays mapped (RSS) between calls until the kernel needs
// the memory.
constexpr int64_t kKeptDoubles = huge_pages::kKeptBytes / sizeof(double);  // per-thread buffers up to this size are kept
struct Work {
  Scratch sq, norms, system, coef;
  Scratch block;   // samples converted to float64, a column block ([N, w], or gram_tiles' packed panels)
  Scratch points;   // the stacked samples in float64: [d, N] (transposed, room for [d + 1, N]) after
                    // direct_sqdist, else [N, d] (kl's projection: scaled, or in gram_tiles' panels)
  Scratch product;  // the backward's weights times a column block
  void trim() {
    constexpr int64_t kLazyKeep = int64_t{1} << 25;
    static_assert(kKeptDoubles * sizeof(double) >= Scratch::kAlignedFrom, "lazily released buffers must be 2 MB aligned");
    for (Scratch* b : {&sq, &norms, &system, &coef, &block, &points, &product})
      b->release_if_above(kKeptDoubles, kLazyKeep);
  }
};

Work& thread_work() {
  thread_local Work work;
  return work;
}

// Calls fn(b, c0, w, block) for every batch element and column block, block = float64 [rows, w]
// tensor on a per-thread buffer. Parallel over the batch when it is large enough to occupy the
// threads (one element per task), else over the column blocks.
template <class Fn>
void for_each_block(const Stack& s, bool by_batch, Fn fn) {
  const int64_t workers = by_batch ? 1 : at::get_num_threads();
  const Stack::Blocks split = s.column_blocks(workers);  // not a structured binding: lambdas capture these
  const int64_t width = split.width, blocks = split.count;
  auto run = [&](int64_t b, int64_t k, double* buf) {
    const int64_t c0 = k * width, w = std::min(width, s.d - c0);
    s.load(b, c0, w, buf);
    fn(b, c0, w, wrap(buf, {s.rows, w}));
  };
  if (by_batch) {
    at::parallel_for(0, s.batch, 1, [&](int64_t b0, int64_t b1) {
      double* buf = thread_work().block.get(s.rows * width);
      for (int64_t b = b0; b < b1; ++b)
        for (int64_t k = 0; k < blocks; ++k) run(b, k, buf);
    });
  } else {
    at::parallel_for(0, blocks, 1, [&](int64_t k0, int64_t k1) {
      double* buf = thread_work().block.get(s.rows * width);
      for (int64_t k = k0; k < k1; ++k)
        for (int64_t b = 0; b < s.batch; ++b) run(b, k, buf);
    });
  }
}

bool parallel_over_batch(const Stack& s) { return s.batch >= at::get_num_threads() || s.column_blocks().count == 1; }

// Rows [i0, i1) of the upper triangle from inner products to squared distances, in place:
// g_ii + g_jj - 2 g_ij (>= 0, exact 0 diagonal), with norms[j] = g_jj (j >= i0) taken before.
void gram_rows_to_sqdist(double* g, int64_t n, const double* norms, int64_t i0, int64_t i1) {
  for (int64_t i = i0; i < i1; ++i) {
    double* row = g + i * n;
    rows::gram_row_to_sqdist(row + i + 1, norms + i + 1, norms[i], n - i - 1);
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

// fn(i) for every row i < n of an upper triangle (row i has n - 1 - i entries past the diagonal).
// Rows go in pairs (t, n - 1 - t), so that parallel chunks of t (at least grain pairs) carry equal work.
template <class Fn>
void for_triangle_rows(int64_t n, bool parallel, int64_t grain, Fn fn) {
  auto body = [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      fn(t);
      if (n - 1 - t != t) fn(n - 1 - t);
    }
  };
  const int64_t half = (n + 1) / 2;
  if (parallel) {
    at::parallel_for(0, half, grain, body);
  } else {
    body(0, half);
  }
}

// Visits the upper triangle of an n x n matrix as fn(pointer to row i from column i + 1, count).
template <class Fn>
void for_upper_rows(const double* m, int64_t n, bool parallel, Fn fn) {
  for_triangle_rows(n, parallel, 16, [&](int64_t i) { fn(m + i * n + i + 1, n - 1 - i); });
}

// Up to this many pairs, one thread packs the upper triangle into one array first: three passes
// over one array instead of three calls per row (rows of 100 values at n = 200 spend as much time
// in call overhead and loop tails as in the vector loops).
constexpr int64_t kPackedPairs = int64_t{1} << 20;

// From 4096 pairs a sample of the pairs brackets the middle ranks first: one pass counts the pairs
// below the bracket and gathers those inside it, and the selection goes on among those alone, by
// another bracket of their own while more than 4096 are inside (select_two_of: Floyd and Rivest's
// step), then by the bins. The bins over all pairs take three passes, one of them a histogram at
// ~1.5 cycles a value; the bracket's pass is a compare and a compacting store, and it runs where the
// distances are computed, while they are in cache (direct_sqdist's rows, gram_one's tiles), else over
// the finished triangle (select_two_sampled). The result is exact whatever the sample: a bracket that
// misses a rank (odds ~0.3% a bracket at 3 standard deviations each side, as far as the sample's
// ranks are binomial) hands the selection to the bins.
//
// The sample: above kPackedPairs (8 M pairs at (2000, 32)) 2^15 pseudo-random pairs, the same at every
// call; up to kPackedPairs 0.2 count^(2/3) (the order of Floyd and Rivest's, the sample's cost against
// that of the values left inside its bracket: 147 of 128x(100, 8)'s 19900 pairs an element). The sample
// size (0: the bins only) and the bracket's half-width in standard deviations are settable, and each
// bracket's outcome counted, for tests.
constexpr int64_t kMinSampledPairs = 4096;
int64_t small_sample_size(int64_t count) {
  return std::max<int64_t>(2, std::llround(0.2 * std::pow(static_cast<double>(count), 2.0 / 3.0)));
}

std::atomic<int64_t> median_sample_size{int64_t{1} << 15};
std::atomic<double> median_bracket_sds{3.0};
std::atomic<int64_t> median_bracket_held{0}, median_bracket_missed{0};

// A growable buffer of doubles, kept by each thread between calls like Work's (no page faults).
struct Found {
  std::unique_ptr<double[]> data;
  int64_t size = 0, capacity = 0;
  double* room(int64_t m) {
    if (size + m > capacity) {
      const int64_t grown = std::max(size + m, 2 * capacity);
      std::unique_ptr<double[]> bigger(new double[grown]);
      std::copy(data.get(), data.get() + size, bigger.get());
      data = std::move(bigger);
      capacity = grown;
    }
    return data.get() + size;
  }
};

// The squared distances of the sample's pairs, pair_sq(i, j) for the same pseudo-random pairs i < j at
// every call (splitmix64: i != j uniform, so {i, j} uniform over the pairs), into sample.
template <class PairSq>
void sample_pairs(int64_t n, std::vector<double>& sample, PairSq pair_sq) {
  uint64_t state = 0x9E3779B97F4A7C15ull;
  for (double& v : sample) {
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    const auto i = static_cast<int64_t>(((z >> 32) * static_cast<uint64_t>(n)) >> 32);
    auto j = static_cast<int64_t>(((z & 0xffffffffu) * static_cast<uint64_t>(n - 1)) >> 32);
    j += j >= i;
    v = pair_sq(std::min(i, j), std::max(i, j));
  }
}

std::pair<double, double> select_two_of(const double* values, int64_t count, int64_t k);

// The squared distance of two rows of d values, in float64, for a sample: four sums, since one chain
// of dependent additions took 1.5% of (2000, 32)'s call.
template <class T>
double pair_sqdist(const T* a, const T* b, int64_t d) {
  double sum[4] = {};
  int64_t c = 0;
  for (; c + 4 <= d; c += 4)
    for (int64_t u = 0; u < 4; ++u) {
      const double diff = static_cast<double>(a[c + u]) - static_cast<double>(b[c + u]);
      sum[u] += diff * diff;
    }
  for (; c < d; ++c) {
    const double diff = static_cast<double>(a[c]) - static_cast<double>(b[c]);
    sum[0] += diff * diff;
  }
  return (sum[0] + sum[1]) + (sum[2] + sum[3]);
}

// Bounds [lo, hi] for ranks k and k + 1 of `total` values, from a sample of s of them (reordered):
// ranks k and k + 1 sit at ~f s in the sample, with a binomial spread; the bracket reaches
// median_bracket_sds standard deviations (+ 2 ranks) each side. An end past the sample is infinite.
struct Bracket {
  double lo = -std::numeric_limits<double>::infinity(), hi = std::numeric_limits<double>::infinity();
};

Bracket bracket_from(double* sample, int64_t s, int64_t k, int64_t total) {
  const double f = (static_cast<double>(k) + 1.0) / static_cast<double>(total);
  const double mid = f * static_cast<double>(s);
  const double spread = median_bracket_sds.load() * std::sqrt(static_cast<double>(s) * f * (1.0 - f)) + 2.0;
  const auto r_lo = static_cast<int64_t>(std::floor(mid - spread)), r_hi = static_cast<int64_t>(std::ceil(mid + spread));
  Bracket b;
  double* first = sample;
  if (r_lo >= 0) {
    std::nth_element(sample, sample + r_lo, sample + s);
    b.lo = sample[r_lo];
    first = sample + r_lo + 1;
  }
  if (r_hi < s) {
    std::nth_element(first, sample + r_hi, sample + s);
    b.hi = sample[r_hi];
  }
  return b;
}

// Whether ranks k and k + 1 (clamped to the last) of `total` values lie inside a bracket with `below`
// values under it and `inside` in it.
bool bracket_held(int64_t below, int64_t inside, int64_t k, int64_t total) {
  return below <= k && below + inside > std::min(k + 1, total - 1);
}

// One pass over the pairs against a bracket [lo, hi] of ranks k and k + 1 that a sample set: how many
// pairs lie below it, and the pairs inside it, per task (add(t, ...) from task t). finish() selects the
// two ranks among those inside where the bracket held them, and counts both outcomes.
class BracketTally {
 public:
  // The bracket from the sample's values (reordered), for ranks k, k + 1 of `pairs` values.
  BracketTally(std::vector<double>& sample, int64_t k, int64_t pairs, int tasks)
      : k_(k), pairs_(pairs), bracket_(bracket_from(sample.data(), static_cast<int64_t>(sample.size()), k, pairs)),
        found_(buffers()), below_(tasks, 0) {
    if (static_cast<int>(found_.size()) < tasks) found_.resize(tasks);
    for (int t = 0; t < tasks; ++t) found_[t].size = 0;
  }
  void add(int t, const double* row, int64_t count) {
    Found& f_t = found_[t];
    f_t.size += rows::count_below_gather(row, count, bracket_.lo, bracket_.hi, f_t.room(count), below_[t]);
  }
  std::optional<std::pair<double, double>> finish() {
    const auto tasks = static_cast<int>(below_.size());
    int64_t under = 0, inside = 0;
    for (int t = 0; t < tasks; ++t) {
      under += below_[t];
      inside += found_[t].size;
    }
    const bool held = bracket_held(under, inside, k_, pairs_);
    std::optional<std::pair<double, double>> result;
    if (held) {
      Found& all = found_[0];  // the other tasks' values appended to the first's
      for (int t = 1; t < tasks; ++t) {
        std::copy(found_[t].data.get(), found_[t].data.get() + found_[t].size, all.room(found_[t].size));
        all.size += found_[t].size;
      }
      // by more brackets, then bins (~1.7% of the pairs at (2000, 32); nth_element over the ~3% that 5
      // standard deviations left took 2.5% of its call)
      result = select_two_of(all.data.get(), all.size, k_ - under);
    }
    ++(held ? median_bracket_held : median_bracket_missed);
    // like Work's buffers, none kept above 32 MB (many tied distances put most pairs in the bracket)
    for (Found& f_t : found_)
      if (f_t.capacity > kKeptDoubles) f_t = Found();
    return result;
  }

 private:
  // one buffer per task of a parallel loop, owned by the calling thread: a task id is not an OS
  // thread (ATen's native pool may run two tasks of one loop on one thread)
  static std::vector<Found>& buffers() {
    thread_local std::vector<Found> mine;
    return mine;
  }
  int64_t k_, pairs_;
  Bracket bracket_;
  std::vector<Found>& found_;
  std::vector<int64_t> below_;
};

// How many values the sample of a bracket over `count` values takes (0: none, the bins only).
int64_t bracket_sample_size(int64_t count) {
  const int64_t set = median_sample_size.load();
  if (set < 2) return 0;
  return count > kPackedPairs ? set : std::min(set, small_sample_size(count));
}

// A thread-local buffer for the sample of a bracket over `pairs` values (null: none, the bins only).
std::vector<double>* median_sample(int64_t pairs) {
  const int64_t s = bracket_sample_size(pairs);
  if (s == 0) return nullptr;
  thread_local std::vector<double> sample;
  sample.resize(s);
  return &sample;
}

std::optional<std::pair<double, double>> select_two_sampled(const double* sq, int64_t n, int64_t k, bool parallel) {
  std::vector<double>* sample = median_sample(n * (n - 1) / 2);
  if (sample == nullptr) return std::nullopt;
  sample_pairs(n, *sample, [&](int64_t i, int64_t j) { return sq[i * n + j]; });
  const int tasks = parallel ? at::get_num_threads() : 1;
  BracketTally tally(*sample, k, n * (n - 1) / 2, tasks);
  for_upper_rows(sq, n, parallel,
                 [&](const double* row, int64_t count) { tally.add(parallel ? at::get_thread_num() : 0, row, count); });
  return tally.finish();
}

// What a pass that computed the distances may leave for the median: whether it already counted the
// pairs against the sampled bracket (select_two_sampled's work), and the two middle values if that held.
struct Middle {
  bool counted = false;
  std::optional<std::pair<double, double>> values;
};

// Ranks k and k + 1 (k + 1 clamped to the last) among `total` values in [lo, hi] that
// for_values(in_parallel, fn) hands to fn(values, count) in pieces: by bins as described above, or a
// plain selection over all where the range is unfit for bin arithmetic.
template <class ForValues>
std::pair<double, double> select_two_binned(ForValues for_values, int64_t total, int64_t k, double lo, double hi,
                                            bool parallel) {
  const int threads = parallel ? at::get_num_threads() : 1;
  auto tid = [&] { return parallel ? at::get_thread_num() : 0; };
  std::vector<double> cand;
  int64_t below = 0;
  // a range too narrow or too wide for finite bin arithmetic (subnormal or overflowing distances):
  // a plain selection over all values
  const double inv_width_all = static_cast<double>(total) / (hi - lo);
  if (total < kMinBinnedPairs || !(hi > lo) || !std::isfinite(hi) || !std::isfinite(inv_width_all)) {
    cand.reserve(total);
    for_values(false, [&](const double* v, int64_t count) { cand.insert(cand.end(), v, v + count); });
  } else {
    // ~8 values a bin: the counts stay in L1 and the one or two bins selected hold few values
    const auto bins = static_cast<int32_t>(std::clamp<int64_t>(total / 8, 64, int64_t{1} << 16));
    const double inv_width = static_cast<double>(bins) / (hi - lo);
    std::vector<int32_t> hist(threads * bins, 0);
    for_values(parallel, [&](const double* v, int64_t count) {
      rows::histogram(v, count, lo, inv_width, bins, hist.data() + tid() * bins);
    });
    for (int t = 1; t < threads; ++t)
      for (int32_t b = 0; b < bins; ++b) hist[b] += hist[t * bins + b];
    int32_t lo_bin = 0;
    while (below + hist[lo_bin] <= k) below += hist[lo_bin++];
    int32_t hi_bin = lo_bin;
    for (int64_t seen = below + hist[lo_bin]; seen <= k + 1 && hi_bin + 1 < bins;) seen += hist[++hi_bin];
    cand.resize(static_cast<size_t>(std::accumulate(hist.begin() + lo_bin, hist.begin() + hi_bin + 1, int64_t{0})));
    int64_t filled = 0;
    for_values(false, [&](const double* v, int64_t count) {
      filled += rows::gather_bins(v, count, lo, inv_width, bins, lo_bin, hi_bin, cand.data() + filled);
    });
  }
  const int64_t r = k - below;
  std::nth_element(cand.begin(), cand.begin() + r, cand.end());
  const double first = cand[r];
  const double second =
      r + 1 < static_cast<int64_t>(cand.size()) ? *std::min_element(cand.begin() + r + 1, cand.end()) : first;
  return {first, second};
}

// Ranks k and k + 1 of values[0, count) (one thread). From kMinSampledPairs values, Floyd and Rivest's
// step first, as often as it holds and shrinks the set: a bracket from a sample of the values (every
// (count / s)-th), one pass that counts those below it and gathers those inside, and the ranks sought
// among those alone. Then the bins.
std::pair<double, double> select_two_of(const double* values, int64_t count, int64_t k) {
  thread_local std::vector<double> sample, gathered[2];
  for (int level = 0; count >= kMinSampledPairs; ++level) {
    const int64_t s = bracket_sample_size(count);
    if (s == 0) break;
    sample.resize(s);
    for (int64_t t = 0; t < s; ++t) sample[t] = values[t * count / s];
    const Bracket bracket = bracket_from(sample.data(), s, k, count);
    std::vector<double>& out = gathered[level % 2];  // the one values does not point into
    out.resize(count);
    int64_t below = 0;
    const int64_t inside = rows::count_below_gather(values, count, bracket.lo, bracket.hi, out.data(), below);
    const bool held = bracket_held(below, inside, k, count);
    ++(held ? median_bracket_held : median_bracket_missed);
    if (!held) break;
    values = out.data();
    k -= below;
    // ties can keep most values inside: the bins from here
    const bool shrank = 2 * inside < count;
    count = inside;
    if (!shrank) break;
  }
  double lo = std::numeric_limits<double>::infinity(), hi = -lo;
  rows::min_max(values, count, lo, hi);
  const auto result =
      select_two_binned([&](bool, auto fn) { fn(values, count); }, count, k, lo, hi, false);
  // like Work's buffers, none kept above 32 MB (ties can leave most values inside a bracket)
  for (std::vector<double>& g : gathered)
    if (g.capacity() > static_cast<size_t>(kKeptDoubles)) std::vector<double>().swap(g);
  return result;
}

// The values of rank k and k + 1 (0-based; k + 1 clamped to the last) among the upper-triangle
// entries of sq (middle: what the distances' pass already found of them).
std::pair<double, double> select_two(const double* sq, int64_t n, int64_t k, bool parallel, const Middle& middle) {
  const int64_t pairs = n * (n - 1) / 2;
  TORCH_CHECK(pairs < (int64_t{1} << 31), "kivi_fast: the median takes at most 65536 points, got ", n);
  if (middle.values) return *middle.values;
  if (pairs >= kMinSampledPairs && !middle.counted) {
    if (auto found = select_two_sampled(sq, n, k, parallel)) return *found;
  }
  thread_local std::vector<double> packed;
  const bool pack = !parallel && pairs <= kPackedPairs;
  const int threads = parallel ? at::get_num_threads() : 1;
  std::vector<double> lo_v(threads, std::numeric_limits<double>::infinity()), hi_v(threads, -lo_v[0]);
  if (pack) {  // the range in the same pass
    packed.resize(pairs);
    int64_t at = 0;
    for_upper_rows(sq, n, false, [&](const double* row, int64_t count) {
      rows::copy_min_max(row, packed.data() + at, count, lo_v[0], hi_v[0]);
      at += count;
    });
  } else {
    for_upper_rows(sq, n, parallel, [&](const double* row, int64_t count) {
      const int t = parallel ? at::get_thread_num() : 0;
      rows::min_max(row, count, lo_v[t], hi_v[t]);
    });
  }
  // fn(values, count) over all pairs: the packed array at once, or row by row (in parallel if asked)
  auto for_pairs = [&](bool in_parallel, auto fn) {
    if (pack) {
      fn(static_cast<const double*>(packed.data()), pairs);
    } else {
      for_upper_rows(sq, n, in_parallel, fn);
    }
  };
  return select_two_binned(for_pairs, pairs, k, *std::min_element(lo_v.begin(), lo_v.end()),
                           *std::max_element(hi_v.begin(), hi_v.end()), parallel);
}

int64_t median_rank(int64_t n) { return (n * (n - 1) / 2 - 1) / 2; }

double median_of_pairs(const double* sq, int64_t n, bool parallel, const Middle& middle = {}) {
  const int64_t pairs = n * (n - 1) / 2;
  const auto [lo, hi] = select_two(sq, n, median_rank(n), parallel, middle);
  if (pairs % 2 == 1) return std::sqrt(lo);
  return 0.5 * (std::sqrt(lo) + std::sqrt(hi));
}

// Whether distances are summed from coordinate differences (exact up to the last rounding) rather than
// taken from a Gram. Forward + backward, float32, 1 thread, bench/ab.py: the differences lose to the
// Gram's register tiles from 16 dimensions ((100, 16) 5%, (100, 32) 14%, (1000, 32) 10% slower) and
// are even at 8 ((100, 8) and 128 x (100, 8) within +-4%); against the split GEMMs they win up to 32
// ((100, 16) and (1000, 32) forward 15% and 20% faster), and from ~48 the GEMMs win. Few points (the
// few-points Gram, not the tiles) keep the differences up to 32 dimensions.
constexpr int64_t kMaxDirectDimTiles = 8, kMaxDirectDimGemm = 32;
bool use_few_points(int64_t rows);
bool use_direct_distances(int64_t rows, int64_t d) {
  const bool tiles = gram_tiles::enabled() && !use_few_points(rows);
  return d <= (tiles ? kMaxDirectDimTiles : kMaxDirectDimGemm);
}

// For a pass that computes the distances of n points: a tally of their pairs against a bracket from a
// sample of distances summed from the points themselves (row(i): point i's d coordinates), emplaced in
// tally, so that each row of distances is counted while it is in cache; none where no sample is set.
template <class Row>
void start_tally_from_points(std::optional<BracketTally>& tally, int64_t n, int64_t d, Row row) {
  const int64_t pairs = n * (n - 1) / 2;
  std::vector<double>* sample = median_sample(pairs);
  if (sample == nullptr) return;
  sample_pairs(n, *sample, [&](int64_t i, int64_t j) { return pair_sqdist(row(i), row(j), d); });
  tally.emplace(*sample, median_rank(n), pairs, 1);
}

// What that pass leaves the median, where a tally ran.
void finish_tally(std::optional<BracketTally>& tally, Middle* middle) {
  if (!tally) return;
  middle->counted = true;
  middle->values = tally->finish();
}

// Squared distances of batch element b by differences into the upper triangle of out ([N, N]), with
// a zero diagonal. Leaves the points transposed ([d, N]: the inner loops run over points) in work.points,
// which has room for one more row (kl's ratio column).
void direct_sqdist(const Stack& s, int64_t b, double* out, double* norms, bool parallel, Work& work,
                   Middle* middle) {
  const int64_t n = s.rows, d = s.d, pairs = n * (n - 1) / 2;
  double* const pt = work.points.get(n * (d + 1));
  std::optional<BracketTally> tally;
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
    // The median's bracket counts each row of distances while it is in L1, as gram_one's tiles do for
    // large matrices. At 128x(100, 8) the bins' passes over the finished triangle (copy, histogram,
    // gather) took ~2x their time on the same values in cache (perf against a C++ harness), ~20% of
    // the call; bench/ab.py 1.088 (IQR 1.065-1.111) against them, 100x8 1.032.
    if (middle != nullptr && !parallel && pairs >= kMinSampledPairs) {
      const double* x = rows.data();
      start_tally_from_points(tally, n, d, [&](int64_t i) { return x + i * d; });
    }
  }
  for_triangle_rows(n, parallel, 8, [&](int64_t i) {
    rows::sqdist_from_point(pt, n, d, i, i + 1, out + i * n);
    out[i * n + i] = 0.0;
    if (tally) tally->add(0, out + i * n + i + 1, n - 1 - i);
  });
  finish_tally(tally, middle);
}

// The upper triangle (with the diagonal) of a a^T into g, the rows split in halves: the off-diagonal
// block 12 by one GEMM, the diagonal blocks 11 and 22 the same way in turn, down to blocks of fewer
// than 2 kSplitGramRows rows, which are multiplied whole. About half the flops of the full product
// (BLAS's syrk is not exported by every torch build); the lower triangle is left as it was.
constexpr int64_t kSplitGramRows = 64;

void add_gram_upper(double* g, int64_t ldg, const double* a, int64_t n, int64_t w, bool assign) {
  if (n < 2 * kSplitGramRows) {
    gemm(false, true, n, n, w, a, w, a, w, !assign, g, ldg);
    return;
  }
  const int64_t h = n / 2;
  const double* a2 = a + h * w;
  add_gram_upper(g, ldg, a, h, w, assign);
  gemm(false, true, h, n - h, w, a, w, a2, w, !assign, g + h, ldg);
  add_gram_upper(g + h * ldg + h, ldg, a2, n - h, w, assign);
}

// Splits [0, end) over the threads in chunks of at least grain, each chunk adding into its thread's
// zeroed n x n float64 partial sum (fn(begin, end, partial)); out = the sum of the partials.
template <class Fn>
void sum_of_thread_partials(int64_t n, int64_t end, int64_t grain, Tensor out, Fn fn) {
  auto partial = at::zeros({at::get_num_threads(), n, n}, at::kDouble);
  at::parallel_for(0, end, grain, [&](int64_t begin, int64_t stop) { fn(begin, stop, partial[at::get_thread_num()]); });
  at::sum_out(out, partial, 0);
}

// The few-points kernels take the stacked rows as pointers.
bool use_few_points(int64_t rows) { return rows <= few_points::kMaxRows && few_points::available(); }

template <class T>
void row_pointers(const Stack& s, int64_t b, int64_t c0, const T** out) {
  for (size_t i = 0; i < s.parts.size(); ++i) {
    const int64_t n = s.parts[i].size(1);
    const T* base = s.parts[i].data_ptr<T>() + b * n * s.d + c0;
    for (int64_t r = 0; r < n; ++r) out[s.offsets[i] + r] = base + r * s.d;
  }
}

// fn(rows) with rows[i] pointing at column c0 of stacked row i of batch element b, in the input dtype
// (a per-thread array).
template <class Fn>
void with_row_pointers(const Stack& s, int64_t b, int64_t c0, Fn fn) {
  AT_DISPATCH_FLOATING_TYPES(s.parts[0].scalar_type(), "kivi_fast_rows", [&] {
    thread_local std::vector<const scalar_t*> rows;
    rows.resize(s.rows);
    row_pointers(s, b, c0, rows.data());
    fn(static_cast<const scalar_t* const*>(rows.data()));
  });
}

// Columns [c0, c0 + w) of batch element b in gram_tiles' packed layout (packed_size(rows, w) doubles).
void pack_block(const Stack& s, int64_t b, int64_t c0, int64_t w, double* dst) {
  with_row_pointers(s, b, c0, [&](auto rows) { gram_tiles::pack(rows, s.rows, w, dst); });
}

// The points of batch element b scaled by their coefficients, Y = coef * X, in gram_tiles' panels of
// columns for rows_times_panels: [panels(d)][N][kPanel], zero past column d.
void scaled_point_panels(const Stack& s, int64_t b, const double* coef, double* y) {
  constexpr int64_t P = gram_tiles::kPanel;
  const int64_t n = s.rows, d = s.d;
  with_row_pointers(s, b, 0, [&](auto rows) {
    for (int64_t t0 = 0; t0 < d; t0 += P) {
      const int64_t width = std::min(P, d - t0);
      double* panel = y + t0 * n;
      for (int64_t c = 0; c < n; ++c) {
        const auto* x = rows[c] + t0;
        double* o = panel + c * P;
        for (int64_t t = 0; t < width; ++t) o[t] = coef[c] * static_cast<double>(x[t]);
        std::fill(o + width, o + P, 0.0);
      }
    }
  });
}

// Columns per task when the few-points Gram of one element is split over threads.
constexpr int64_t kFewPointsGrain = 16384;

void few_points_gram(const Stack& s, int64_t b, double* out, bool parallel) {
  const int64_t n = s.rows;
  std::fill(out, out + n * n, 0.0);
  AT_DISPATCH_FLOATING_TYPES(s.parts[0].scalar_type(), "kivi_fast_few_points_gram", [&] {
    auto add_columns = [&](int64_t c0, int64_t c1, double* acc) {
      const scalar_t* rows[few_points::kMaxRows];
      row_pointers(s, b, c0, rows);
      few_points::add_gram_lower(rows, n, c1 - c0, acc);
    };
    if (!parallel || s.d < 2 * kFewPointsGrain || at::get_num_threads() == 1) {
      add_columns(0, s.d, out);
      return;
    }
    sum_of_thread_partials(n, s.d, kFewPointsGrain, wrap(out, {n, n}), [&](int64_t c0, int64_t c1, Tensor part) {
      add_columns(c0, c1, part.data_ptr<double>());
    });
  });
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < i; ++j) out[j * n + i] = out[i * n + j];
}

// Inner products of the stacked points of batch element b into the upper triangle of out ([N, N]).
// Parallel over column blocks (thread-local partial sums) when asked and there is more than one block;
// one block's tiles are shared by the threads. Where norms is given and the Gram is one block of tiles
// on one thread, of a matrix larger than this machine's L3, out gets the squared distances instead
// (what the whole-matrix pass makes of it, bit for bit) and norms the squared norms, and the call returns
// true: the row tiles run from the last, so that each tile's rows turn into distances while they are
// in cache, every norm they need (g_jj, j >= i) already computed. At (2000, 32) the separate pass
// read and wrote the 64 MB triangle again (bench/ab.py 1.022-1.025); at (1000, 32) (32 MB) it was
// even, at (100, 51) (320 KB, in L2) ~1.5% slower, hence the size gate.
constexpr int64_t kFusedSqdistBytes = int64_t{32} << 20;
bool gram_one(const Stack& s, int64_t b, double* out, bool parallel, double* norms = nullptr,
              Middle* middle = nullptr) {
  if (use_few_points(s.rows)) {
    few_points_gram(s, b, out, parallel);
    return false;
  }
  const int64_t workers = parallel ? at::get_num_threads() : 1;
  const int64_t n = s.rows;
  const Stack::Blocks split = s.column_blocks(workers);  // not a structured binding: lambdas capture these
  const int64_t width = split.width, blocks = split.count;
  const bool tiles = gram_tiles::enabled() && width <= gram_tiles::kMaxPackColumns;
  const int64_t row_tiles = gram_tiles::row_tiles(n);
  if (tiles && parallel && blocks == 1) {
    double* buf = thread_work().block.get(gram_tiles::packed_size(n, width));
    pack_block(s, b, 0, s.d, buf);
    // row tile t costs ~n - 4 t: the pairs (t, row_tiles - 1 - t) cost the same
    at::parallel_for(0, (row_tiles + 1) / 2, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        gram_tiles::gram_upper(buf, n, s.d, out, n, false, t, t + 1);
        const int64_t u = row_tiles - 1 - t;
        if (u != t) gram_tiles::gram_upper(buf, n, s.d, out, n, false, u, u + 1);
      }
    });
    return false;
  }
  if (tiles && !parallel && blocks == 1 && norms != nullptr &&
      n * n * static_cast<int64_t>(sizeof(double)) > kFusedSqdistBytes) {
    double* buf = thread_work().block.get(gram_tiles::packed_size(n, width));
    pack_block(s, b, 0, s.d, buf);
    // The median's counting pass (select_two_sampled) on each tile's distances while they are in cache,
    // against a bracket from a sample of distances summed from the input rows: at (2000, 32) the
    // separate pass read the 64 MB triangle once more.
    std::optional<BracketTally> tally;
    if (middle != nullptr && n * (n - 1) / 2 > kPackedPairs) {
      // from the input rows (contiguous; the packed panels put each coordinate on another line)
      with_row_pointers(s, b, 0, [&](auto x) {
        start_tally_from_points(tally, n, s.d, [&](int64_t i) { return x[i]; });
      });
    }
    constexpr int64_t R = gram_tiles::kTileRows;
    for (int64_t t = row_tiles - 1; t >= 0; --t) {
      gram_tiles::gram_upper(buf, n, s.d, out, n, false, t, t + 1);
      const int64_t i0 = t * R, i1 = std::min(n, i0 + R);
      for (int64_t i = i0; i < i1; ++i) norms[i] = out[i * n + i];
      gram_rows_to_sqdist(out, n, norms, i0, i1);
      if (tally)
        for (int64_t i = i0; i < i1; ++i) tally->add(0, out + i * n + i + 1, n - 1 - i);
    }
    finish_tally(tally, middle);
    return true;
  }
  auto add_blocks = [&](int64_t k0, int64_t k1, double* target, bool first_assigns) {
    double* buf = thread_work().block.get(tiles ? gram_tiles::packed_size(n, width) : n * width);
    for (int64_t k = k0; k < k1; ++k) {
      const int64_t c0 = k * width, w = std::min(width, s.d - c0);
      const bool assign = first_assigns && k == k0;
      if (tiles) {
        pack_block(s, b, c0, w, buf);
        gram_tiles::gram_upper(buf, n, w, target, n, !assign, 0, row_tiles);
      } else {
        s.load(b, c0, w, buf);
        add_gram_upper(target, n, buf, n, w, assign);
      }
    }
  };
  if (!parallel || blocks == 1) {
    add_blocks(0, blocks, out, true);  // one thread, or one block of GEMMs (BLAS uses the threads)
  } else {
    sum_of_thread_partials(n, blocks, 1, wrap(out, {n, n}), [&](int64_t k0, int64_t k1, Tensor part) {
      add_blocks(k0, k1, part.data_ptr<double>(), false);
    });
  }
  return false;
}

// Squared distances of the stacked points of batch element b into sq ([N, N]; the upper triangle and
// the diagonal: callers read nothing else) and their squared norms into norms ([N]).
void distances_one(const Stack& s, int64_t b, double* sq, double* norms, bool parallel, Work& work,
                   Middle* middle = nullptr) {
  if (use_direct_distances(s.rows, s.d)) {
    direct_sqdist(s, b, sq, norms, parallel, work, middle);
    return;
  }
  if (gram_one(s, b, sq, parallel, norms, middle)) return;
  const int64_t n = s.rows;
  for (int64_t i = 0; i < n; ++i) norms[i] = sq[i * n + i];
  gram_rows_to_sqdist(sq, n, norms, 0, n);
}

// NaN/Inf in a sample makes its squared norm NaN/Inf: rows [0, n_den) are denom, then numer.
void check_finite(const double* norms, int64_t n_den, int64_t n, Names names) {
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK_VALUE(std::isfinite(norms[i]), i < n_den ? names.denom : names.numer, kNotFiniteMessage);
  }
}

double checked_median(const double* sq, int64_t n, bool parallel, const Middle& middle = {}) {
  const double sigma = median_of_pairs(sq, n, parallel, middle);
  TORCH_CHECK_VALUE(sigma > 0, kZeroMedianMessage);
  return sigma;
}

// Below this much work per element (N^2 max(d, 8) multiply-adds, ~0.2 ms at 1 thread), splitting one
// element over threads costs more in parallel-region overhead than it saves. Measured with bench/ab.py
// at 2 threads, forward+backward, against session 10's code (2^24, and the uneven column blocks that
// Stack::column_blocks now avoids, which these shapes do not have): (100, 327) 1.19x, (300, 32) 1.19x,
// and before the loops were aligned (CMakeLists.txt) (100, 200) 1.16x, (100, 150) 1.06x, (100, 100)
// 1.03x faster; 2^20 made (100, 32) and (100, 51) 4% slower than 2^21.
constexpr int64_t kMinSplitWork = int64_t{1} << 21;

// Runs fn(b, parallel, work) for every batch element: in parallel over the batch when it can
// occupy the threads, otherwise one element after another, each using the threads inside when it is
// large enough.
template <class Fn>
void for_each_element(const Stack& s, Fn fn) {
  if (s.batch >= at::get_num_threads()) {
    at::parallel_for(0, s.batch, 1, [&](int64_t b0, int64_t b1) {
      Work& work = thread_work();
      for (int64_t b = b0; b < b1; ++b) fn(b, false, work);
      work.trim();
    });
  } else {
    const bool split = s.rows * s.rows * std::max<int64_t>(s.d, 8) >= kMinSplitWork;
    Work& work = thread_work();
    for (int64_t b = 0; b < s.batch; ++b) fn(b, split, work);
    work.trim();
  }
}

// Systems up to this size are factored by rows::cholesky_upper: at 100 x 100, 18-25 us against 48 us for
// MKL's dpotrf on this machine's AMD EPYC core, which loses to MKL's blocked code from ~300 rows. Against
// the float32 factor refined in float64 that larger systems get (solve_refined) the crossover is also
// near 300-350 rows (bench/README.md, session 10).
constexpr int64_t kOwnCholeskyMaxRows = 256;

// Refinement steps after the first float32 solve before the float32 factor is given up for a float64
// one. Each step multiplies the error by about cond(A) eps_float32, cond(A) <= (1 + lam) / lam (the
// kernel's eigenvalues lie in [0, n_den]). Measured (_refined_solve_counts): 3 solves in all at
// lam = 1e-3 ((1000, 32), (2000, 32)), 4 at 1e-2 (300 rows), 9 at a condition number of 6e6. A step
// that does not halve the residual ends it sooner.
constexpr int kMaxRefinements = 30;

// How solve_refined's calls ended since the library was loaded: converged, float32 could not factor,
// the steps stalled; and the float32 solves they made (what the tests read through _refined_solve_counts).
std::atomic<int64_t> refined_converged{0}, refined_factor_failed{0}, refined_stalled{0}, refined_solves{0};

// The upper triangle (row-major; LAPACK's column-major lower one) of A = K_dd / n_den + lam I into a
// (leading dimension ld), from the first n_den rows of the N x N kernel (row-major, stride n).
template <class T>
void fill_system_row(const double* kernel, int64_t n, int64_t n_den, double lam, T* a, int64_t ld, int64_t i) {
  const double inv_n = 1.0 / static_cast<double>(n_den);
  rows::scale_copy(kernel + i * n + i, inv_n, a + i * ld + i, n_den - i);
  a[i * ld + i] = static_cast<T>(kernel[i * n + i] * inv_n + lam);
}
template <class T>
void fill_system_upper(const double* kernel, int64_t n, int64_t n_den, double lam, T* a, int64_t ld) {
  for (int64_t i = 0; i < n_den; ++i) fill_system_row(kernel, n, n_den, lam, a, ld, i);
}

// Whether systems of n_den rows are solved by solve_refined (the float32 factor).
bool uses_refined_solve(int64_t n_den) {
  return n_den > kOwnCholeskyMaxRows && dpotrf_ != nullptr && dpotrs_ != nullptr && spotrf_ != nullptr &&
         spotrs_ != nullptr && use_external_blas;
}

// What the kernel's exponentials pass fills of the fit's system while each of the first n_den rows is
// in cache: the right-hand side's sums over the numer columns, and where solve_refined will run its
// float32 system (n_den x n_den, upper triangle). At (2000, 32) each was a pass over 16-32 MB of rows.
struct SystemRows {
  int64_t n_den;
  double lam;
  double* numer_sums;  // [n_den]
  float* system32;     // or null
};
// The float32 system's buffer in scratch (solve_refined's).
float* system32_buffer(Scratch& scratch, int64_t n_den) {
  return reinterpret_cast<float*>(scratch.get((n_den * n_den + 1) / 2));
}

// y = K_dd x, and where sums is given sums = K_dd 1, from the upper triangle of K_dd (the first n_den
// rows and columns of the N x N kernel, row-major), four rows at a time: their diagonal block, then
// their rows past it give them their sums over j with k_ij x_j and add k_ij x_i to y_j. Half the bytes
// of full rows, and the lower triangle need not be mirrored; one row at a time (a dot and an axpy)
// ran at half a plain dot's bandwidth, four at a time 2.3x faster than that (the refinement's
// residuals at (2000, 32): bench/ab.py 1.034x). In parallel, each thread adds into a zeroed partial
// of its own, so the last bits of y (and of a refined solution) depend on the number of threads.
void symmetric_times(const double* kernel, int64_t n, int64_t n_den, const double* x, double* y, double* sums,
                     bool parallel) {
  const int64_t outputs = sums != nullptr ? 2 : 1;
  const int64_t parts = parallel ? at::get_num_threads() : 1;
  std::vector<double> partial(parts * outputs * n_den, 0.0);
  const std::vector<double> ones(sums != nullptr ? n_den : 0, 1.0);
  auto block = [&](int64_t t) {
    double* const part = partial.data() + (parallel ? at::get_thread_num() : 0) * outputs * n_den;
    const int64_t i0 = 4 * t, i1 = std::min(n_den, i0 + 4);
    for (int64_t o = 0; o < outputs; ++o) {
      const double* v = o == 0 ? x : ones.data();
      double* py = part + o * n_den;
      for (int64_t i = i0; i < i1; ++i) {
        const double* k = kernel + i * n;
        py[i] += k[i] * v[i];
        for (int64_t j = i + 1; j < i1; ++j) {
          py[i] += k[j] * v[j];
          py[j] += k[j] * v[i];
        }
      }
      if (i1 - i0 == 4 && i1 < n_den) {
        double own[4];
        rows::dots4_axpy(kernel + i0 * n + i1, n, v + i1, v + i0, py + i1, n_den - i1, own);
        for (int64_t r = 0; r < 4; ++r) py[i0 + r] += own[r];
      }
    }
  };
  const int64_t blocks = (n_den + 3) / 4;
  if (parallel) {
    for_triangle_rows(blocks, parallel, 4, block);
  } else {
    for (int64_t t = 0; t < blocks; ++t) block(t);
  }
  for (int64_t o = 0; o < outputs; ++o) {
    double* out = o == 0 ? y : sums;
    std::copy_n(partial.data() + o * n_den, n_den, out);
    for (int64_t p = 1; p < parts; ++p)
      for (int64_t i = 0; i < n_den; ++i) out[i] += partial[(p * outputs + o) * n_den + i];
  }
}

// A x = b for A = K_dd / n_den + lam I (K_dd: the first n_den rows and columns of the N x N kernel,
// row-major, upper triangle) by LAPACK's float32 Cholesky and refinement in float64, as LAPACK's dsposv
// (which torch does not export): x = solve32(b), then x += solve32(b - A x) while that halves the
// float64 residual, until ||r|| <= eps ||A|| ||x|| (infinity norms, eps = 2^-53: float64's rounding of
// A x) or, where the steps stop halving it, dsposv's test ||r|| <= sqrt(n_den) eps ||A|| ||x||: a
// backward error as small as float64 Cholesky's. The float32 factor costs half the float64 one (2000 rows:
// 50 against 110 ms, 1 thread) and each step a float32 solve and one pass over the upper triangle in
// float64 (symmetric_times). Each right-hand side is scaled to a largest entry of 1 before it is
// rounded, so float32's range never limits it. The float32 system is in system32_buffer(scratch),
// filled by the exponentials' pass (SystemRows). b is overwritten with x where this returns true; it is
// left as it was where float32 cannot factor A (cond(A) beyond about 1 / eps_float32) or the steps
// stall, and the caller then factors in float64.
bool solve_refined(const double* kernel, int64_t n, int64_t n_den, double lam, double* b, Scratch& scratch,
                   bool parallel) {
  const double inv_n = 1.0 / static_cast<double>(n_den);
  float* const factor = system32_buffer(scratch, n_den);
  const int nn = static_cast<int>(n_den), one = 1;
  int info = 0;
  spotrf_("L", &nn, factor, &nn, &info);
  if (info != 0) {
    ++refined_factor_failed;
    return false;
  }
  std::vector<double> x(n_den, 0.0), r(b, b + n_den), kx(n_den), row_norm(n_den);
  std::vector<float> step(n_den);
  double r_norm = rows::max_abs(r.data(), n_den);
  if (r_norm == 0.0) {  // b = 0: every kernel value between the two samples underflowed; x = 0 = b
    ++refined_converged;
    return true;
  }
  double a_norm = 0.0;  // ||A||_inf, summed in the first residual pass (the kernel is >= 0)
  const double eps = 0.5 * std::numeric_limits<double>::epsilon(), dsposv_factor = std::sqrt(static_cast<double>(n_den));
  for (int it = 0; it <= kMaxRefinements && std::isfinite(r_norm); ++it) {
    rows::scale_copy(r.data(), 1.0 / r_norm, step.data(), n_den);
    spotrs_("L", &nn, &one, factor, &nn, step.data(), &nn, &info);
    ++refined_solves;
    for (int64_t i = 0; i < n_den; ++i) x[i] += r_norm * static_cast<double>(step[i]);
    const bool first = it == 0;
    symmetric_times(kernel, n, n_den, x.data(), kx.data(), first ? row_norm.data() : nullptr, parallel);
    for (int64_t i = 0; i < n_den; ++i) r[i] = b[i] - (inv_n * kx[i] + lam * x[i]);
    if (first) a_norm = inv_n * *std::max_element(row_norm.begin(), row_norm.end()) + lam;
    const double previous = r_norm;
    r_norm = rows::max_abs(r.data(), n_den);
    // Steps go on while they halve the residual, down to float64's rounding of A x; where they stop
    // halving, dsposv's test decides.
    const double rounding = eps * a_norm * rows::max_abs(x.data(), n_den);
    const bool last = it == kMaxRefinements || (!first && !(r_norm <= 0.5 * previous));
    if (r_norm <= rounding || (last && r_norm <= dsposv_factor * rounding)) {
      ++refined_converged;
      std::copy(x.begin(), x.end(), b);
      return true;
    }
    if (last) break;
  }
  ++refined_stalled;  // or a residual that is not finite (b is finite: it cannot come from there)
  return false;
}

// (K_dd / n_den + lam I) alpha = -K_dn 1 / (lam n_den n_num) by Cholesky, from the kernel of the
// stacked points [denom; numer] (N x N, row-major, upper triangle of rows [0, n_den)) and what the
// exponentials' pass filled (SystemRows: alpha holds K_dn 1, and where refined, the float32 system
// for solve_refined). alpha gets n_den values.
void solve_alpha_one(const double* kernel, int64_t n, int64_t n_den, double lam, double* alpha, Work& work,
                     bool parallel, bool refined) {
  const int64_t n_num = n - n_den;
  const double rhs_scale = -1.0 / (lam * static_cast<double>(n_den) * static_cast<double>(n_num));
  for (int64_t i = 0; i < n_den; ++i) alpha[i] *= rhs_scale;
  const bool own = n_den <= kOwnCholeskyMaxRows;
  const bool lapack = dpotrf_ != nullptr && dpotrs_ != nullptr && use_external_blas;
  if (refined && solve_refined(kernel, n, n_den, lam, alpha, work.system, parallel)) {
    return;
  }
  // our Cholesky wants padded rows (see rows::cholesky_upper); LAPACK and ATen a contiguous matrix
  const int64_t ld = own ? rows::cholesky_ld(n_den) : n_den;
  const int64_t rows_alloc = own ? rows::cholesky_rows(n_den) : n_den;
  double* const system = work.system.get(rows_alloc * ld);
  // Only the upper triangle is filled: what every Cholesky path here reads. The padding, and the three
  // entries left of the diagonal that our Cholesky's diagonal blocks update, are zeroed: stale bits
  // there could be denormals.
  fill_system_upper(kernel, n, n_den, lam, system, ld);
  if (own) {
    for (int64_t i = 0; i < n_den; ++i) {
      double* a = system + i * ld;
      std::fill(a + std::max<int64_t>(0, i - 3), a + i, 0.0);
      std::fill(a + n_den, a + ld, 0.0);
    }
  }
  std::fill(system + n_den * ld, system + rows_alloc * ld, 0.0);
  int info = 0;
  if (own) {
    info = rows::cholesky_upper(system, n_den, ld) ? 0 : 1;
    if (info == 0) rows::cholesky_solve_upper(system, n_den, ld, alpha);
  } else if (lapack) {
    const int nn = static_cast<int>(n_den), one = 1;
    dpotrf_("L", &nn, system, &nn, &info);
    if (info == 0) dpotrs_("L", &nn, &one, system, &nn, alpha, &nn, &info);
  } else {
    auto [chol, status] = at::linalg_cholesky_ex(wrap(system, {n_den, n_den}), /*upper=*/true);
    info = status.item<int>();
    if (info == 0) {
      auto x = wrap(alpha, {n_den, 1});
      x.copy_(at::cholesky_solve(x.clone(), chol, /*upper=*/true));
    }
  }
  TORCH_CHECK_VALUE(info == 0, kNotPositiveDefiniteMessage, " (lam = ", lam, ")");
}

// The kernel in the first `rows` rows of sq (n x n) from the squared distances in its upper triangle:
// exp of the upper part, the diagonal 1, and where `lower`, the lower part mirrored (the kernel is
// symmetric), else only the three entries left of the diagonal (what gram_tiles::rows_times_panels
// reads of it with first_row). The fit reads only the upper part; the evaluation reads whole rows, or
// the upper part through rows_times_panels. Mirroring only the evaluation's rows was no faster at
// (2000, 32) than all of them (bench/ab.py 0.993 and 1.011 in two runs).
constexpr int64_t kL2Bytes = int64_t{512} << 10;  // this project's AMD EPYC core's
void kernel_rows_from_upper(double* sq, int64_t n, int64_t rows, double sigma, bool parallel, const SystemRows& sys,
                            bool lower) {
  const double scale = -0.5 / (sigma * sigma);
  auto exp_rows = [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      rows::scaled_exp(sq + i * n + i + 1, scale, n - i - 1);
      sq[i * n + i] = 1.0;
      if (i >= sys.n_den) continue;
      sys.numer_sums[i] = rows::sum(sq + i * n + sys.n_den, n - sys.n_den);
      if (sys.system32 != nullptr) fill_system_row(sq, n, sys.n_den, sys.lam, sys.system32, sys.n_den, i);
    }
  };
  // in strips of 8 columns: the 8 source rows are read along their length, a cache line of each at a
  // time, instead of a line per element down a column. Without `lower`, only the entries (i, j) with
  // i - j <= kNearDiagonal: a row tile's rows below its first read those along the rows.
  constexpr int64_t kStrip = 8, kNearDiagonal = gram_tiles::kTileRows - 1;
  auto mirror_strips = [&](int64_t s0, int64_t s1) {
    for (int64_t j0 = s0 * kStrip; j0 < std::min(rows, s1 * kStrip); j0 += kStrip) {
      const int64_t j1 = std::min(rows, j0 + kStrip);
      const int64_t i_end = lower ? rows : std::min(rows, j1 + kNearDiagonal);
      for (int64_t i = j0 + 1; i < i_end; ++i) {
        double* ri = sq + i * n;
        const int64_t j_begin = lower ? j0 : std::max(j0, i - kNearDiagonal);
        for (int64_t j = j_begin, end = std::min(j1, i); j < end; ++j) ri[j] = sq[j * n + i];
      }
    }
  };
  const int64_t strips = (rows + kStrip - 1) / kStrip;
  if (parallel) {  // a strip writes rows below it, which are another thread's: all exponentials first
    at::parallel_for(0, rows, 16, exp_rows);
    at::parallel_for(0, strips, 4, mirror_strips);
  } else if (rows * n * static_cast<int64_t>(sizeof(double)) > kL2Bytes) {
    // each strip's rows mirrored right after their exponentials, while they are in L2 ((2000, 32):
    // bench/ab.py 1.015x; below L2 nothing to gain, and 128 x (100, 8) 1% slower)
    for (int64_t t = 0; t < strips; ++t) {
      exp_rows(t * kStrip, std::min(rows, (t + 1) * kStrip));
      mirror_strips(t, t + 1);
    }
  } else {
    exp_rows(0, rows);
    mirror_strips(0, strips);
  }
}

// The fit of numer / denom for batch element b: leaves the coefficients [alpha; beta 1] in work.coef
// ([N]) and the kernel of the stacked points in the first kernel_rows rows of work.sq ([N, N]; the
// fit itself reads only the n_den denominator rows, a caller evaluating at the numer points asks for
// all; their lower part as kernel_rows_from_upper leaves it), and returns the bandwidth.
double fit_one(const Stack& s, int64_t b, int64_t n_den, int64_t kernel_rows, bool lower, double lam,
               const double* sigma_given, Names names, bool parallel, Work& work) {
  TORCH_INTERNAL_ASSERT(kernel_rows >= n_den, "the solve reads the denominator's rows");
  const int64_t n = s.rows;
  double* sq = work.sq.get(n * n);
  double* norms = work.norms.get(n);
  double* coef = work.coef.get(n);
  Middle middle;
  distances_one(s, b, sq, norms, parallel, work, sigma_given == nullptr ? &middle : nullptr);
  check_finite(norms, n_den, n, names);
  const double sigma = sigma_given != nullptr ? sigma_given[b] : checked_median(sq, n, parallel, middle);
  float* const system32 = uses_refined_solve(n_den) ? system32_buffer(work.system, n_den) : nullptr;
  kernel_rows_from_upper(sq, n, kernel_rows, sigma, parallel, {n_den, lam, coef, system32}, lower);
  solve_alpha_one(sq, n, n_den, lam, coef, work, parallel, system32 != nullptr);
  std::fill(coef + n_den, coef + n, 1.0 / (lam * static_cast<double>(n - n_den)));
  return sigma;
}

const double* sigma_data(const std::optional<Tensor>& sigma) {
  return sigma.has_value() ? sigma->data_ptr<double>() : nullptr;
}

}  // namespace

Tensor sqdist(const Tensor& x, const Tensor& y) {
  Stack s({x, y});
  const int64_t nx = x.size(1), ny = y.size(1), n = s.rows;
  auto out = at::empty({s.batch, nx, ny}, at::kDouble);
  for_each_element(s, [&](int64_t b, bool parallel, Work& work) {
    double* sq = work.sq.get(n * n);
    double* norms = work.norms.get(n);
    distances_one(s, b, sq, norms, parallel, work);
    check_finite(norms, nx, n, {"y", "x"});
    double* o = out.data_ptr<double>() + b * nx * ny;
    for (int64_t i = 0; i < nx; ++i) std::copy_n(sq + i * n + nx, ny, o + i * ny);
  });
  return out;
}

Tensor median_bandwidth(const Tensor& x) {
  Stack s({x});
  const int64_t n = s.rows;
  auto sigma = at::empty({s.batch}, at::kDouble);
  for_each_element(s, [&](int64_t b, bool parallel, Work& work) {
    double* sq = work.sq.get(n * n);
    double* norms = work.norms.get(n);
    Middle middle;
    distances_one(s, b, sq, norms, parallel, work, &middle);
    check_finite(norms, n, n, {"x", "x"});
    sigma.data_ptr<double>()[b] = checked_median(sq, n, parallel, middle);
  });
  return sigma;
}

Fit fit(const Tensor& numer, const Tensor& denom, double lam, const std::optional<Tensor>& sigma, Names names) {
  Stack s({denom, numer});
  const int64_t n = s.rows;
  auto coef = at::empty({s.batch, n}, at::kDouble);
  auto used = at::empty({s.batch}, at::kDouble);
  for_each_element(s, [&](int64_t b, bool parallel, Work& work) {
    const int64_t n_den = denom.size(1);
    used.data_ptr<double>()[b] = fit_one(s, b, n_den, n_den, false, lam, sigma_data(sigma), names, parallel, work);
    std::copy_n(work.coef.get(n), n, coef.data_ptr<double>() + b * n);
  });
  return {coef, used, Tensor()};
}

// Up to this many dimensions the projection of the weights (see kl) is summed row by row, all d sums
// in registers; above, a GEMM does it faster ((1000, 32): 45 against 63 ms forward+backward).
constexpr int64_t kRowDotsMaxDim = 8;
static_assert(kRowDotsMaxDim <= kMaxDirectDimTiles && kRowDotsMaxDim <= kMaxDirectDimGemm,
              "the row dots read the transposed points that direct_sqdist leaves");

std::tuple<Tensor, Tensor, Tensor> kl(const Tensor& prior_z, const Tensor& q_z, double lam, double clip,
                                      const std::optional<Tensor>& sigma, bool reverse, bool grad_state) {
  const KlRoles roles = kl_roles(prior_z, q_z, reverse);
  Stack s({roles.denom, roles.numer});
  const int64_t n = s.rows, n_den = roles.denom.size(1), m = q_z.size(1), d = s.d;
  const bool projection = grad_state && kl_state_is_projection(n, d);
  const int64_t width = grad_state ? kl_state_width(n, d) : 0;
  auto kl_out = at::empty({s.batch}, at::kDouble);
  auto state = kept_outputs::empty({s.batch, m, width}, at::TensorOptions(at::kDouble));
  auto used = at::empty({s.batch}, at::kDouble);
  const bool direct = d <= kRowDotsMaxDim;
  // Where the projection takes gram_tiles' row tiles, r_j comes from the same pass over the kernel
  // rows (with grad_state or not, so that the value does not depend on it). Row-wise, it is a column
  // d of Y = coef in the row dots' pass (rows::dots_with_columns sums each column alike, with
  // grad_state or not: 128x(100, 8) read each kernel row twice before); elsewhere from rows::dot.
  const bool tiled_rows = kl_state_is_projection(n, d) && !direct && gram_tiles::enabled();
  // The row tiles read the kernel's lower part from its upper part above kPanelOrderMaxRows points,
  // where mirroring it was a pass over memory ((2000, 32): 16 MB written, read again by the tiles).
  const bool tiles_read_upper = tiled_rows && n > gram_tiles::kPanelOrderMaxRows;
  for_each_element(s, [&](int64_t b, bool parallel, Work& work) {
    // the evaluation reads the kernel rows of q_z: the denominator's own (reverse) or all of them
    const double sg = fit_one(s, b, n_den, roles.row0 + m, !tiles_read_upper, lam, sigma_data(sigma), roles.names,
                              parallel, work);
    used.data_ptr<double>()[b] = sg;
    // The evaluation points q_z are fitted samples too: their kernel rows are already in work.sq
    // (where tiles_read_upper, their upper part and the three entries left of the diagonal).
    // r_j = sum_c coef_c k(c, z_j); W_jc = coef_c k(c, z_j) / (sigma^2 r_j), zero where r_j <= clip.
    const double* coef = work.coef.get(n);
    const double* kernel_rows = work.sq.get(n * n) + roles.row0 * n;
    double* out = state.data_ptr<double>() + b * m * width;
    // The projection: sum_c W_jc c = row_scale_j sum_c k(c, z_j) (coef_c c), so the kernel rows times
    // the points scaled by their coefficients, Y = coef * X (no W needed). Up to kRowDotsMaxDim
    // dimensions Y is kept transposed ([d + 1, N] with coef in row d, from the points direct_sqdist left,
    // asked for at the size it asked for, so that Scratch::get hands them back as they are) for row-wise dot
    // products (d sums in registers). Above, Y goes in gram_tiles' panels for its register tiles
    // (against MKL's GEMM, forward+backward 1.07x faster at (100, 51), 1.11x at (100, 32), 1.05x at
    // (100, 16), 1.04-1.06x at (1000, 32) and (2000, 32): bench/ab.py, float32); where the tiles are
    // off (AVX-512, no AVX2), [N, d] for one GEMM.
    static_assert(kRowDotsMaxDim + 1 <= rows::kDotsColumnsPerPass, "the row dots and the ratio in one pass");
    const bool tiles = projection && tiled_rows;
    double* const y = !projection ? nullptr
                      : tiles     ? work.points.get(gram_tiles::panels(d) * gram_tiles::kPanel * n)
                      : direct    ? work.points.get(n * (d + 1))  // direct_sqdist's, with its spare row
                                  : work.points.get(n * d);
    if (projection && direct) {
      for (int64_t k = 0; k < d; ++k)
        for (int64_t c = 0; c < n; ++c) y[k * n + c] *= coef[c];
      std::copy_n(coef, n, y + d * n);
    } else if (tiles) {
      scaled_point_panels(s, b, coef, y);
    } else if (projection) {
      s.load(b, 0, d, y);
      for (int64_t c = 0; c < n; ++c) rows::scale(y + c * d, coef[c], d);
    }
    std::vector<double> log_r(m), row_scale(m), ratio(tiled_rows ? m : 0);
    if (tiled_rows) {
      // Up to kPanelOrderMaxRows points on one thread even when the element is split: d < N - 1 makes
      // it at most ~16 M multiply-adds ((100, 100): 2 M, ~50 us). Above, rows of the kernel per thread.
      // split over threads at whole row tiles: where the tiles read the upper part, a row's sums depend
      // on where its tile starts
      constexpr int64_t T = gram_tiles::kTileRows;
      auto kernel_times_y = [&](int64_t t0, int64_t t1) {
        const int64_t j0 = t0 * T, j1 = std::min(m, t1 * T);
        gram_tiles::rows_times_panels(kernel_rows + j0 * n, j1 - j0, n, y, tiles ? d : 0, n, out + j0 * width, width,
                                      coef, ratio.data() + j0, tiles_read_upper ? roles.row0 + j0 : -1);
      };
      if (parallel && n > gram_tiles::kPanelOrderMaxRows) {
        at::parallel_for(0, gram_tiles::row_tiles(m), 64 / T, kernel_times_y);
      } else {
        kernel_times_y(0, gram_tiles::row_tiles(m));
      }
    }
    auto rows_body = [&](int64_t j0, int64_t j1) {
      if (projection && direct) {  // two rows a pass: each load of Y serves both
        int64_t j = j0;
        for (; j + 2 <= j1; j += 2)
          rows::dots_with_columns_two_rows(kernel_rows + j * n, kernel_rows + (j + 1) * n, y, n, d + 1,
                                           out + j * width, out + (j + 1) * width);
        if (j < j1) rows::dots_with_columns(kernel_rows + j * n, y, n, d + 1, out + j * width);
      }
      for (int64_t j = j0; j < j1; ++j) {
        const double* k = kernel_rows + j * n;
        double* const p = grad_state ? out + j * width : nullptr;
        double r;
        if (tiled_rows) {
          r = ratio[j];
        } else if (projection && direct) {
          r = p[d];
        } else if (direct) {
          rows::dots_with_columns(k, coef, n, 1, &r);
        } else {
          r = rows::dot(coef, k, n);
        }
        log_r[j] = std::log(std::max(r, clip));
        row_scale[j] = r > clip ? 1.0 / (sg * sg * r) : 0.0;
        if (!grad_state) continue;
        if (!projection) {  // the weights W_j = row_scale_j coef * k
          rows::mul_scale(coef, k, row_scale[j], out + j * n, n);
          continue;
        }
        out[j * width + d] = row_scale[j] * r;  // sum_c W_jc
        if (tiles) {
          rows::scale(out + j * width, row_scale[j], d);
        } else if (direct) {
          for (int64_t t = 0; t < d; ++t) p[t] *= row_scale[j];
        }
      }
    };
    if (parallel) {
      at::parallel_for(0, m, 16, rows_body);
    } else {
      rows_body(0, m);
    }
    if (projection && !direct && !tiles) {
      // as P^T = Y^T K^T: MKL runs this orientation of the thin product ~1.8x faster than K Y
      // ([1000, 2000] x [2000, 32]: 4.5 against 7.9 ms on this machine's core)
      double* const ptp = work.product.get(d * m);  // [d, m]
      gemm(true, true, d, m, n, y, d, kernel_rows, n, false, ptp, m);
      for (int64_t j = 0; j < m; ++j)
        for (int64_t t = 0; t < d; ++t) out[j * width + t] = ptp[t * m + j] * row_scale[j];
    }
    const double mean = std::accumulate(log_r.begin(), log_r.end(), 0.0) / static_cast<double>(m);
    kl_out.data_ptr<double>()[b] = reverse ? -mean : mean;
  });
  return {kl_out, state, used};
}

namespace {

// weighted_grad by few_points' register tiles: grad_j = scale_j (sum_c W_jc c - w_sum_j z_j) straight
// from the input rows (the first n stacked rows are the fitted points; z's m rows start at stacked row
// z_row), in float64 registers, with the weights V = scale W folded per chunk of outputs: where z's rows
// are among the fitted ones (the kl op's q_z), V_jc = scale_j (W_jc - [c = z_row + j] w_sum_j) and the
// tiles store their sums as they are, with no pass over z's rows and no scaling per column
// (bench/ab.py, forward+backward, float32: (10, 314000) 1.049x faster at 1 thread, 1.048x at 2, float64
// 1.009x; the other shapes even, 0.991-1.015, where two identical builds differ by up to 1.1%); other
// z (the ratio at new points) keeps its own term, scale_j w_sum_j z_j, per column. Up to kMaxOutRows
// evaluation points in one pass over the rows; more in chunks of 15 (three tiles of 5 rows) over
// column blocks whose n input rows stay in L2 for all the chunks (each chunk's V, 15 n doubles, is
// folded again per block: 1/64 of the block's multiply-adds at most). MKL's GEMM on the rows copied to
// float64 (for_each_block), which packs both operands again, was slower from 200 to 1000 points
// (bench/ab.py, forward+backward, float32, 1 thread: (100, 700) 1.074x faster with the tiles, (100,
// 50000) 1.068x, (150, 1000) 1.066x, (300, 2000) 1.075x, (500, 1000) 1.195x); blocks of 64 KB or chunks
// of 10 rows: 1-2.5% slower at (100, 50000). Where gram_tiles are off (AVX-512, whose 8-wide GEMMs were
// not measured against these), the GEMM stays.
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
  TORCH_INTERNAL_ASSERT(weights.is_contiguous(), "kivi_fast: weighted_grad reads weights as [B, m, N] rows");
  auto w_sum = weights.sum(-1).contiguous();
  auto scale = row_scale.to(at::kDouble).contiguous();
  auto grad = kept_outputs::empty_like(z);
  const int64_t d = s.d;
  const bool few = use_few_points(n) && m <= few_points::kMaxOutRows;  // on AVX-512 too
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

Tensor kl_grad(const Tensor& grad_kl, const Tensor& state, const Tensor& q_z, const Tensor& prior_z, bool reverse) {
  const int64_t batch = q_z.size(0), m = q_z.size(1), d = q_z.size(2);
  if (!kl_state_is_projection(prior_z.size(1) + m, d)) {
    const KlRoles roles = kl_roles(prior_z, q_z, reverse);
    auto scale = kl_row_scale(grad_kl, m, reverse).contiguous();
    return weighted_grad(scale.unsqueeze(1).expand({batch, m}), state.contiguous(), q_z, roles.numer, roles.denom);
  }
  // grad_j = scale (sum_c W_jc c - (sum_c W_jc) z_j), from the projection [sum_c W_jc c, sum_c W_jc].
  // The scale is read here rather than made by kl_row_scale's tensor ops: at (100, 8) the backward's
  // arithmetic takes less time than three small ATen calls.
  std::vector<double> sp(batch);
  const double factor = kl_row_factor(m, reverse);
  const auto g = grad_kl.reshape({-1});  // a view for the [] or expanded [B] grads autograd passes
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, g.scalar_type(), "kivi_fast_kl_grad_scale", [&] {
    const auto acc = g.accessor<scalar_t, 1>();
    for (int64_t b = 0; b < batch; ++b) sp[b] = static_cast<double>(acc[b]) * factor;
  });
  auto z = q_z.contiguous();
  auto p = state.contiguous();
  auto grad = kept_outputs::empty_like(z);
  AT_DISPATCH_FLOATING_TYPES(z.scalar_type(), "kivi_fast_kl_grad", [&] {
    const scalar_t* zp = z.data_ptr<scalar_t>();
    const double* pp = p.data_ptr<double>();
    scalar_t* gp = grad.data_ptr<scalar_t>();
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t j = 0; j < m; ++j) {
        const int64_t row = b * m + j;
        const double* pr = pp + row * (d + 1);
        for (int64_t k = 0; k < d; ++k)
          gp[row * d + k] = static_cast<scalar_t>(sp[b] * (pr[k] - pr[d] * static_cast<double>(zp[row * d + k])));
      }
  });
  return grad;
}

bool set_external_blas(bool flag) { return use_external_blas.exchange(flag); }

std::vector<int64_t> median_counts() { return {median_bracket_held.load(), median_bracket_missed.load()}; }

std::vector<double> set_median_bracket(int64_t sample_size, double sds) {
  TORCH_CHECK(sample_size >= 0 && sample_size <= (int64_t{1} << 24),
              "kivi_fast::_set_median_bracket: sample_size must be in [0, 2^24], got ", sample_size);
  TORCH_CHECK(std::isfinite(sds) && sds >= 0, "kivi_fast::_set_median_bracket: sds must be finite and >= 0, got ", sds);
  return {static_cast<double>(median_sample_size.exchange(sample_size)), median_bracket_sds.exchange(sds)};
}

std::vector<int64_t> refined_solve_counts() {
  return {refined_converged.load(), refined_factor_failed.load(), refined_stalled.load(), refined_solves.load()};
}

}  // namespace cpu
}  // namespace kivi_fast
