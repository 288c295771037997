// The bandwidth's median: the median distance over the n (n - 1) / 2 distinct pairs of the stacked
// points (numpy's convention for an even count: the mean of the two middle distances), from their
// squared distances. Exact: a selection, not an estimate.
//
// Selection by bins: one pass for the range, one for a histogram of equal-width bins over it (the bin
// index is monotone in the value), then std::nth_element only on the values in the one or two bins that
// hold the middle ranks. Three streaming passes instead of nth_element's data-dependent branches over
// all pairs.
//
// From 4096 pairs a sample of the pairs brackets the middle ranks first: one pass counts the pairs
// below the bracket and gathers those inside it, and the selection goes on among those alone, by
// another bracket of their own while more than 4096 are inside (select_two_of: Floyd and Rivest's
// step), then by the bins. The bins over all pairs take three passes, one of them a histogram at
// ~1.5 cycles a value; the bracket's pass is a compare and a compacting store, and it runs where the
// distances are computed, while they are in cache (distances.cpp: direct_sqdist's rows, gram_one's
// tiles, through BracketTally), else over the finished triangle (select_two_sampled). The result is
// exact whatever the sample: a bracket that misses a rank (odds ~0.3% a bracket at 3 standard
// deviations each side, as far as the sample's ranks are binomial) hands the selection to the bins.
//
// The sample: above kPackedPairs (8 M pairs at (2000, 32)) 2^15 pseudo-random pairs, the same at every
// call; up to kPackedPairs 0.2 count^(2/3) (the order of Floyd and Rivest's, the sample's cost against
// that of the values left inside its bracket: 147 of 128x(100, 8)'s 19900 pairs an element). The sample
// size (0: the bins only) and the bracket's half-width in standard deviations are settable, and each
// bracket's outcome counted, for tests.
//
// The passes over the pairs are row kernels compiled once per ISA level (rows:: below; isa.h).
#pragma once

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

namespace kivi_fast {
namespace rows {
// lo = min(lo, x[0, n)), hi = max(hi, x[0, n))
void min_max(const double* x, int64_t n, double& lo, double& hi);
// the same while copying x to out (one pass where a copy and a range would take two)
void copy_min_max(const double* x, double* out, int64_t n, double& lo, double& hi);
// Bin of v among `bins` equal-width bins starting at lo: min(bins - 1, floor((v - lo) inv_width)),
// monotone in v (v >= lo). histogram() adds the counts of x[0, n) to hist; gather_bins() writes the
// values whose bin is in [first, last] to out and returns how many. 32-bit counts: the histogram of
// a selection stays in L1, and no count can pass 2^31 (that takes N > 65536 points, a 34 GB matrix).
inline int32_t bin_of(double v, double lo, double inv_width, int32_t bins) {
  const auto b = static_cast<int32_t>((v - lo) * inv_width);
  return b < bins ? b : bins - 1;
}
void histogram(const double* x, int64_t n, double lo, double inv_width, int32_t bins, int32_t* hist);
int64_t gather_bins(const double* x, int64_t n, double lo, double inv_width, int32_t bins, int32_t first,
                    int32_t last, double* out);
// Adds to below how many of x[0, n) are < lo, writes those in [lo, hi] to out (room for n values) and
// returns how many it wrote: the one pass of a selection whose ranks a sample bracketed.
int64_t count_below_gather(const double* x, int64_t n, double lo, double hi, double* out, int64_t& below);
// Tests: count_below_gather's portable version even where the AVX2 one runs; returns the old setting.
bool set_portable_gather(bool flag);

}  // namespace rows

namespace cpu {

// Up to this many pairs, one thread packs the upper triangle into one array first: three passes
// over one array instead of three calls per row (rows of 100 values at n = 200 spend as much time
// in call overhead and loop tails as in the vector loops).
constexpr int64_t kPackedPairs = int64_t{1} << 20;
// From this many pairs a sample brackets the middle ranks (above).
constexpr int64_t kMinSampledPairs = 4096;

// The most points whose median distance the selection takes (its 32-bit counts; N^2 float64 is 34 GB
// there). Checked before the N x N distances are allocated: by the median's callers, where none is given.
constexpr int64_t kMaxMedianPoints = 65536;
inline void check_median_points(int64_t n) {
  TORCH_CHECK_VALUE(n <= kMaxMedianPoints, "kivi_fast: the median bandwidth takes at most ", kMaxMedianPoints,
                    " points (n_p + n_q, or x's rows), got ", n, "; pass a bandwidth");
}

// What a pass that computed the distances may leave for the median: whether it already counted the
// pairs against the sampled bracket (select_two_sampled's work), and the two middle values if that held.
struct Middle {
  bool counted = false;
  std::optional<std::pair<double, double>> values;
};

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

// Bounds [lo, hi] for ranks k and k + 1 of `total` values, from a sample of s of them: an end past the
// sample is infinite.
struct Bracket {
  double lo = -std::numeric_limits<double>::infinity(), hi = std::numeric_limits<double>::infinity();
};

// One pass over the pairs against a bracket [lo, hi] of ranks k and k + 1 that a sample set: how many
// pairs lie below it, and the pairs inside it, per task (add(t, ...) from task t). finish() selects the
// two ranks among those inside where the bracket held them, and counts both outcomes.
class BracketTally {
 public:
  // The bracket from the sample's values (reordered), for ranks k, k + 1 of `pairs` values.
  BracketTally(std::vector<double>& sample, int64_t k, int64_t pairs, int tasks);
  void add(int t, const double* row, int64_t count) {
    Found& f_t = found_[t];
    f_t.size += rows::count_below_gather(row, count, bracket_.lo, bracket_.hi, f_t.room(count), below_[t]);
  }
  // The two ranks where the bracket held them (and counts the outcome).
  std::optional<std::pair<double, double>> finish();

 private:
  // one buffer per task of a parallel loop, owned by the calling thread: a task id is not an OS
  // thread (ATen's native pool may run two tasks of one loop on one thread)
  static std::vector<Found>& buffers();
  int64_t k_, pairs_;
  Bracket bracket_;
  std::vector<Found>& found_;
  std::vector<int64_t> below_;
};

// A thread-local buffer for the sample of a bracket over `pairs` values (null: none, the bins only).
std::vector<double>* median_sample(int64_t pairs);

// The 0-based rank of the lower middle distance of n points.
int64_t median_rank(int64_t n);

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

// The squared distance of two rows of d values, in float64, for a sample: four sums, since one chain
// of dependent additions costs 1.5% of (2000, 32)'s call.
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
void finish_tally(std::optional<BracketTally>& tally, Middle* middle);

// The median distance from the upper triangle of the n x n squared distances sq (middle: what the
// distances' pass already found of it); a median of 0 is an error (kZeroMedianMessage).
double checked_median(const double* sq, int64_t n, bool parallel, const Middle& middle = {});

// Tests: how the sampled brackets ended since load, [held, missed (the bins took over)]; and the
// sample's size (0: the bins only) and the bracket's half-width in standard deviations, returning the
// old pair.
std::vector<int64_t> median_counts();
std::vector<double> set_median_bracket(int64_t sample_size, double sds);

}  // namespace cpu
}  // namespace kivi_fast
