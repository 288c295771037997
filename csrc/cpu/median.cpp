#include <ATen/ATen.h>
#include "cpu/median.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <numeric>
#include <optional>
#include <vector>

#include "cpu/buffers.h"
#include "cpu/isa.h"
#include "cpu/loops.h"
#include "cpu/vec4.h"
#include "kivi.h"

namespace kivi_fast {
namespace cpu {
namespace {

// Up to this many values the bins are not worth their passes: one selection over all.
constexpr int64_t kMinBinnedPairs = 512;

int64_t small_sample_size(int64_t count) {
  return std::max<int64_t>(2, std::llround(0.2 * std::pow(static_cast<double>(count), 2.0 / 3.0)));
}

std::atomic<int64_t> median_sample_size{int64_t{1} << 15};
std::atomic<double> median_bracket_sds{3.0};
std::atomic<int64_t> median_bracket_held{0}, median_bracket_missed{0};

// Bounds [lo, hi] for ranks k and k + 1 of `total` values, from a sample of s of them (reordered):
// ranks k and k + 1 sit at ~f s in the sample, with a binomial spread; the bracket reaches
// median_bracket_sds standard deviations (+ 2 ranks) each side.
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

// How many values the sample of a bracket over `count` values takes (0: none, the bins only).
int64_t bracket_sample_size(int64_t count) {
  const int64_t set = median_sample_size.load();
  if (set < 2) return 0;
  return count > kPackedPairs ? set : std::min(set, small_sample_size(count));
}

std::pair<double, double> select_two_of(const double* values, int64_t count, int64_t k);

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
  check_median_points(n);  // (the callers checked before allocating; pairs < 2^31 follows)
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

double median_of_pairs(const double* sq, int64_t n, bool parallel, const Middle& middle = {}) {
  const int64_t pairs = n * (n - 1) / 2;
  const auto [lo, hi] = select_two(sq, n, median_rank(n), parallel, middle);
  if (pairs % 2 == 1) return std::sqrt(lo);
  return 0.5 * (std::sqrt(lo) + std::sqrt(hi));
}

}  // namespace

BracketTally::BracketTally(std::vector<double>& sample, int64_t k, int64_t pairs, int tasks)
    : k_(k), pairs_(pairs), bracket_(bracket_from(sample.data(), static_cast<int64_t>(sample.size()), k, pairs)),
      found_(buffers()), below_(tasks, 0) {
  if (static_cast<int>(found_.size()) < tasks) found_.resize(tasks);
  for (int t = 0; t < tasks; ++t) found_[t].size = 0;
}

std::optional<std::pair<double, double>> BracketTally::finish() {
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
    // by more brackets, then bins: at (2000, 32) ~1.7% of the pairs are inside, and nth_element over
    // the ~3% that 5 standard deviations leave costs 2.5% of the call
    result = select_two_of(all.data.get(), all.size, k_ - under);
  }
  ++(held ? median_bracket_held : median_bracket_missed);
  // like Work's buffers, none kept above 32 MB (many tied distances put most pairs in the bracket)
  for (Found& f_t : found_)
    if (f_t.capacity > kKeptDoubles) f_t = Found();
  return result;
}

std::vector<Found>& BracketTally::buffers() {
  thread_local std::vector<Found> mine;
  return mine;
}

// A thread-local buffer for the sample of a bracket over `pairs` values (null: none, the bins only).
std::vector<double>* median_sample(int64_t pairs) {
  const int64_t s = bracket_sample_size(pairs);
  if (s == 0) return nullptr;
  thread_local std::vector<double> sample;
  sample.resize(s);
  return &sample;
}

int64_t median_rank(int64_t n) { return (n * (n - 1) / 2 - 1) / 2; }

// What that pass leaves the median, where a tally ran.
void finish_tally(std::optional<BracketTally>& tally, Middle* middle) {
  if (!tally) return;
  middle->counted = true;
  middle->values = tally->finish();
}

double checked_median(const double* sq, int64_t n, bool parallel, const Middle& middle) {
  const double sigma = median_of_pairs(sq, n, parallel, middle);
  TORCH_CHECK_VALUE(sigma > 0, kZeroMedianMessage);
  return sigma;
}

std::vector<int64_t> median_counts() { return {median_bracket_held.load(), median_bracket_missed.load()}; }

std::vector<double> set_median_bracket(int64_t sample_size, double sds) {
  TORCH_CHECK(sample_size >= 0 && sample_size <= (int64_t{1} << 24),
              "kivi_fast_testing::set_median_bracket: sample_size must be in [0, 2^24], got ", sample_size);
  TORCH_CHECK(std::isfinite(sds) && sds >= 0,
              "kivi_fast_testing::set_median_bracket: sds must be finite and >= 0, got ", sds);
  return {static_cast<double>(median_sample_size.exchange(sample_size)), median_bracket_sds.exchange(sds)};
}

}  // namespace cpu

// The median's row kernels, each compiled once per ISA level (isa.h).
namespace rows {

KIVI_FAST_ISA_CLONES void min_max(const double* x, int64_t n, double& lo, double& hi) {
  double a = lo, b = hi;
  // The ternary form (not std::min) is what compilers turn into vector min/max reductions.
#pragma omp simd reduction(min : a) reduction(max : b)
  for (int64_t j = 0; j < n; ++j) {
    a = x[j] < a ? x[j] : a;
    b = x[j] > b ? x[j] : b;
  }
  lo = a;
  hi = b;
}

KIVI_FAST_ISA_CLONES void copy_min_max(const double* x, double* out, int64_t n, double& lo, double& hi) {
  double a = lo, b = hi;
#pragma omp simd reduction(min : a) reduction(max : b)
  for (int64_t j = 0; j < n; ++j) {
    const double v = x[j];
    out[j] = v;
    a = v < a ? v : a;
    b = v > b ? v : b;
  }
  lo = a;
  hi = b;
}

KIVI_FAST_ISA_CLONES void histogram(const double* x, int64_t n, double lo, double inv_width, int32_t bins,
                                    int32_t* hist) {
  // The bin indices of a chunk first (vector arithmetic stored to an array, read back by plain loads
  // instead of lane extracts), then the increments. Over many values a bin, they alternate between
  // hist and a second table, so that fewer increments wait on an earlier one to the same count; the
  // tables are summed at the end (19900 values in 2487 bins: 1.2x faster than one table).
  constexpr int64_t kChunk = 256;
  thread_local std::vector<int32_t> second;
  const bool two = n >= 4 * static_cast<int64_t>(bins);
  if (two) second.assign(bins, 0);
  int32_t* const other = two ? second.data() : hist;
  int32_t idx[kChunk];
  for (int64_t j0 = 0; j0 < n; j0 += kChunk) {
    const int64_t len = std::min(kChunk, n - j0);
    const double* xs = x + j0;
#pragma omp simd
    for (int64_t t = 0; t < len; ++t) idx[t] = bin_of(xs[t], lo, inv_width, bins);
    int64_t t = 0;
    for (; t + 2 <= len; t += 2) {
      ++hist[idx[t]];
      ++other[idx[t + 1]];
    }
    if (t < len) ++hist[idx[t]];
  }
  if (two) {
#pragma omp simd
    for (int32_t b = 0; b < bins; ++b) hist[b] += other[b];
  }
}

KIVI_FAST_ISA_CLONES int64_t gather_bins(const double* x, int64_t n, double lo, double inv_width, int32_t bins,
                                         int32_t first, int32_t last, double* out) {
  // Few values fall in the bins sought: test 8 at a time against value bounds half a bin wider than
  // those bins (vector compares), and compute the exact bin only where one may hit.
  const double a = lo + (static_cast<double>(first) - 0.5) / inv_width;
  const double b = lo + (static_cast<double>(last) + 1.5) / inv_width;
  const Vec4 a4 = {a, a, a, a}, b4 = {b, b, b, b};
  int64_t count = 0, j = 0;
  for (; j + 8 <= n; j += 8) {
    const Vec4 v0 = load4(x + j), v1 = load4(x + j + 4);
    const auto hit = ((v0 >= a4) & (v0 <= b4)) | ((v1 >= a4) & (v1 <= b4));
    if ((hit[0] | hit[1] | hit[2] | hit[3]) == 0) continue;
    for (int t = 0; t < 8; ++t) {
      const int32_t bin = bin_of(x[j + t], lo, inv_width, bins);
      if (bin >= first && bin <= last) out[count++] = x[j + t];
    }
  }
  for (; j < n; ++j) {
    const int32_t bin = bin_of(x[j], lo, inv_width, bins);
    if (bin >= first && bin <= last) out[count++] = x[j];
  }
  return count;
}

namespace {

// count_below_gather on any CPU. As in gather_bins, few values fall in [lo, hi]: 8 at a time by vector
// compares, which also count the values below lo (each true lane is -1).
KIVI_FAST_ISA_CLONES int64_t count_below_gather_any(const double* x, int64_t n, double lo, double hi, double* out,
                                                    int64_t& below) {
  const Vec4 lo4 = {lo, lo, lo, lo}, hi4 = {hi, hi, hi, hi};
  decltype(lo4 < hi4) under = {};
  int64_t count = 0, j = 0;
  for (; j + 8 <= n; j += 8) {
    const Vec4 v0 = load4(x + j), v1 = load4(x + j + 4);
    under += (v0 < lo4) + (v1 < lo4);
    const auto hit = ((v0 >= lo4) & (v0 <= hi4)) | ((v1 >= lo4) & (v1 <= hi4));
    if ((hit[0] | hit[1] | hit[2] | hit[3]) == 0) continue;
    for (int t = 0; t < 8; ++t) {  // without branches: which of the 8 are inside is unpredictable
      const double v = x[j + t];
      out[count] = v;
      count += (v >= lo) & (v <= hi);
    }
  }
  for (; j < n; ++j) {
    const double v = x[j];
    below += v < lo;
    out[count] = v;
    count += (v >= lo) & (v <= hi);
  }
  below -= under[0] + under[1] + under[2] + under[3];
  return count;
}

#ifdef KIVI_FAST_X86_SIMD
// AVX2: no branch at all. Each 4 values are stored with those inside moved to the front (a permutation
// looked up by the compare mask) and the output advances by their count: the branch of the version
// above mispredicts on ~20% of 8-value groups at a 3% bracket, and cost 2x this.
struct CompressTable {
  alignas(32) int32_t perm[16][8];
  constexpr CompressTable() : perm() {
    for (int m = 0; m < 16; ++m) {
      int at = 0;
      for (int lane = 0; lane < 4; ++lane)
        if (m & (1 << lane)) {
          perm[m][2 * at] = 2 * lane;
          perm[m][2 * at + 1] = 2 * lane + 1;
          ++at;
        }
      for (; at < 4; ++at) perm[m][2 * at] = perm[m][2 * at + 1] = 0;
    }
  }
};
constexpr CompressTable kCompress;

__attribute__((target("avx2,popcnt"))) int64_t count_below_gather_avx2(const double* x, int64_t n, double lo,
                                                                       double hi, double* out, int64_t& below) {
  const __m256d lo4 = _mm256_set1_pd(lo), hi4 = _mm256_set1_pd(hi);
  __m256i under = _mm256_setzero_si256();
  int64_t count = 0, j = 0;
  for (; j + 4 <= n; j += 4) {
    const __m256d v = _mm256_loadu_pd(x + j);
    under = _mm256_sub_epi64(under, _mm256_castpd_si256(_mm256_cmp_pd(v, lo4, _CMP_LT_OQ)));
    const int inside = _mm256_movemask_pd(
        _mm256_and_pd(_mm256_cmp_pd(v, lo4, _CMP_GE_OQ), _mm256_cmp_pd(v, hi4, _CMP_LE_OQ)));
    const __m256i perm = _mm256_load_si256(reinterpret_cast<const __m256i*>(kCompress.perm[inside]));
    // all 4 stored, count <= j: within out's room for n values
    _mm256_storeu_ps(reinterpret_cast<float*>(out + count), _mm256_permutevar8x32_ps(_mm256_castpd_ps(v), perm));
    count += _mm_popcnt_u32(static_cast<unsigned>(inside));
  }
  alignas(32) int64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), under);
  below += lanes[0] + lanes[1] + lanes[2] + lanes[3];
  return count + count_below_gather_any(x + j, n - j, lo, hi, out + count, below);
}
#endif

}  // namespace

std::atomic<bool> force_portable_gather{false};

int64_t count_below_gather(const double* x, int64_t n, double lo, double hi, double* out, int64_t& below) {
#ifdef KIVI_FAST_X86_SIMD
  if (isa::cpu_has(isa::Level::kAvx2) && !force_portable_gather.load(std::memory_order_relaxed))
    return count_below_gather_avx2(x, n, lo, hi, out, below);
#endif
  return count_below_gather_any(x, n, lo, hi, out, below);
}

bool set_portable_gather(bool flag) { return force_portable_gather.exchange(flag); }

}  // namespace rows
}  // namespace kivi_fast
