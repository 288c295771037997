// The gradient ops' outputs, and the kl op's state for its backward, on buffers kept between calls. A
// gradient w.r.t. the samples is as large as the samples (12.5 MB for an MNIST layer of 10 x 314000
// float32): glibc's malloc hands such a block to the kernel after free() about one call in three, and
// the next call faults every 4 KB page in again (on this project's VM 3066 page faults, 2.5 us each:
// 7.7 ms, more than (10, 314000)'s 3.4 ms backward). A tensor from here goes back to a pool when torch
// frees it (the training loop's zero_grad), and the next call of the same size takes it again. The kl
// op's state for the backward comes from here too: from 128 KB (glibc's first mmap threshold) glibc
// maps such a block afresh, and once its threshold has moved, takes it from a heap grown for it, so a
// training loop's every step would touch fresh pages (bench/run.py's next-call peak memory would be
// 0.13-0.25 MB at (1000, 32), 0.5 MB at (2000, 32)).
#pragma once

#include <ATen/core/Tensor.h>

namespace kivi_fast {
namespace kept_outputs {

// Like at::empty_like(like) with contiguous strides (CPU): from 128 KB on, on a kept buffer (rounded to
// 4 KB pages, from 8 MB on to 2 MB huge pages where the kernel gives them); smaller ones from torch's
// allocator. Up to 32 idle buffers, 256 MB in all, stay mapped (in RSS) for the next call of their size,
// the oldest freed first to make room; those above 32 MB are handed back lazily (MADV_FREE). The
// storage cannot grow (resize_ to a larger size fails), as for any tensor from at::from_blob.
at::Tensor empty_like(const at::Tensor& like);
// The same for at::empty(sizes, options) (CPU).
at::Tensor empty(at::IntArrayRef sizes, const at::TensorOptions& options);
// How many buffers the pool has allocated since load, not taken from its idle ones (for tests).
int64_t fresh_buffers();

}  // namespace kept_outputs
}  // namespace kivi_fast
