// The CPU kernels' scratch memory: per-thread buffers kept between calls, since training calls the ops
// with the same shapes at every step (no allocation, no page faults). Large ones sit on 2 MB pages where
// the kernel offers transparent huge pages (huge_pages.h).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <memory>

#include "cpu/huge_pages.h"

namespace kivi_fast {
namespace cpu {

using at::Tensor;

// A float64 tensor over data (not owned).
Tensor wrap(double* data, at::IntArrayRef sizes);

// A growable scratch buffer whose contents start uninitialized (a std::vector would zero them). From
// kAlignedFrom bytes on it is 2 MB aligned and advised onto huge pages: a fresh 128 MB kernel matrix
// ((2000, 32)) on 4 KB pages takes ~32k page faults, about a quarter of such a call.
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
  void release_if_above(int64_t keep, int64_t lazy_keep);

 private:
  struct Free {
    void operator()(double* p) const;
  };
  static size_t rounded_bytes(int64_t n) { return huge_pages::rounded(static_cast<size_t>(n) * sizeof(double)); }
  static double* allocate(int64_t n);
  std::unique_ptr<double[], Free> data_;
  int64_t capacity_ = 0;
};

// Per-thread buffers up to this size are kept between calls as they are; larger ones are handed back
// after each call (Work::trim).
constexpr int64_t kKeptDoubles = huge_pages::kKeptBytes / sizeof(double);

// The buffers of one batch element's work, one set per thread. Those above 32 MB are handed back after
// a call, lazily up to 256 MB each: freed outright, the 128 MB kernel matrix of (2000, 32) would be
// faulted in and zeroed again at every call (~10 ms of ~115). The 256 MB bound is per buffer (a
// thread's Work has seven), on what stays mapped (RSS) between calls until the kernel needs the memory.
struct Work {
  Scratch sq, norms, system, coef;
  Scratch block;    // samples converted to float64, a column block ([N, w], or gram_tiles' packed panels)
  Scratch points;   // the stacked samples in float64: [d, N] (transposed, room for [d + 1, N]) after
                    // direct_sqdist, else [N, d] (kl's projection: scaled, or in gram_tiles' panels)
  Scratch product;  // the backward's weights times a column block
  void trim();
};

// The calling thread's Work.
Work& thread_work();

}  // namespace cpu
}  // namespace kivi_fast
