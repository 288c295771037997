// Large buffers on 2 MB pages where the kernel offers transparent huge pages (a fresh 128 MB kernel
// matrix otherwise takes ~32k page faults), and how long buffers stay mapped: the one policy of the
// scratch buffers (buffers.h) and of kept_outputs' gradient buffers.
#pragma once

#include <cstddef>
#include <cstdlib>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace kivi_fast {
namespace huge_pages {

inline constexpr size_t kSize = size_t{1} << 21;
// Buffers up to this size stay mapped between calls; larger ones are handed back after use, lazily
// (MADV_FREE) up to a bound each owner sets.
inline constexpr size_t kKeptBytes = size_t{32} << 20;

inline size_t rounded(size_t bytes) { return (bytes + kSize - 1) / kSize * kSize; }

// A buffer of `bytes` (a multiple of kSize), 2 MB aligned, huge pages advised; null where none is left.
inline void* allocate(size_t bytes) {
  void* p = std::aligned_alloc(kSize, bytes);
#ifdef MADV_HUGEPAGE
  if (p != nullptr) madvise(p, bytes, MADV_HUGEPAGE);
#endif
  return p;
}

}  // namespace huge_pages
}  // namespace kivi_fast
