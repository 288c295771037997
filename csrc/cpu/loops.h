// How the CPU kernels walk their work: the stacked samples of a fit (Stack) by batch element and by
// column block, over the threads; the rows of an upper triangle in balanced pairs; the stacked rows as
// pointers for the kernels that read the inputs in place.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <vector>

#include "cpu/buffers.h"
#include "cpu/simd_rows.h"

namespace kivi_fast {
namespace cpu {

// A [N, w] float64 column block of about 512 KB, the L2 of this project's AMD EPYC core: larger blocks
// (2 MB: one block for d = 700 at N = 200) are no faster, and a smaller buffer is kept.
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
  // workers blocks of about equal width (whole vectors of 8 columns): otherwise d = 700 at N = 200
  // makes 3 blocks, which 2 threads split 654 : 46 columns.
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

// Whether for_each_block should go over the batch (by_batch) rather than over the column blocks.
inline bool parallel_over_batch(const Stack& s) {
  return s.batch >= at::get_num_threads() || s.column_blocks().count == 1;
}

// Below this much work per element (N^2 max(d, 8) multiply-adds, ~0.2 ms at 1 thread), splitting one
// element over threads costs more in parallel-region overhead than it saves. At 2 threads, forward +
// backward: a bound of 2^24 leaves (100, 327) and (300, 32) 1.19x slower, 2^20 makes (100, 32) and
// (100, 51) 4% slower.
constexpr int64_t kMinSplitWork = int64_t{1} << 21;

// The most bytes that the threads' private n x n float64 buffers may take together: one a thread
// when batch elements run in parallel (each its distances; the fit's system and smaller buffers come
// on top), or when one element's Gram sums its column blocks in per-thread partials. Above it the
// work runs one element, or one block, at a time with the threads inside: at N = 20,000 a buffer is
// 3.2 GB, and one a thread would exhaust the memory, which ends the process (the pages are touched
// after the allocation succeeded) rather than raise an error.
constexpr int64_t kThreadBuffersBytes = int64_t{2} << 30;
inline bool buffer_per_thread_fits(int64_t n) {
  return at::get_num_threads() * n * n * static_cast<int64_t>(sizeof(double)) <= kThreadBuffersBytes;
}

// Runs fn(b, parallel, work) for every batch element: in parallel over the batch when it can
// occupy the threads (and their buffers fit: above), otherwise one element after another, each using
// the threads inside when it is large enough.
template <class Fn>
void for_each_element(const Stack& s, Fn fn) {
  if (s.batch >= at::get_num_threads() && buffer_per_thread_fits(s.rows)) {
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

// Splits [0, end) over the threads in chunks of at least grain, each chunk adding into its thread's
// zeroed n x n float64 partial sum (fn(begin, end, partial)); out = the sum of the partials.
template <class Fn>
void sum_of_thread_partials(int64_t n, int64_t end, int64_t grain, Tensor out, Fn fn) {
  auto partial = at::zeros({at::get_num_threads(), n, n}, at::kDouble);
  at::parallel_for(0, end, grain, [&](int64_t begin, int64_t stop) { fn(begin, stop, partial[at::get_thread_num()]); });
  at::sum_out(out, partial, 0);
}

// The stacked rows of batch element b from column c0, as pointers (out[i]: stacked row i).
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

}  // namespace cpu
}  // namespace kivi_fast
