#include "kept_outputs.h"

#include <ATen/ops/empty_like.h>
#include <ATen/ops/from_blob.h>
#include <c10/util/Exception.h>

#include <cstdlib>
#include <mutex>
#include <utility>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace kivi_fast {
namespace kept_outputs {
namespace {

constexpr size_t kHugePage = size_t{1} << 21;
// Below this, glibc's heap reuses freed blocks without giving them back.
constexpr size_t kMinBytes = kHugePage;
// What idle buffers may hold in all, and how many: a training step frees each layer's gradient before
// the next step asks for it again.
constexpr size_t kMaxIdleBytes = size_t{256} << 20, kMaxIdle = 8;
// Idle buffers above this are handed back lazily (MADV_FREE), as csrc/cpu.cpp's scratch buffers.
constexpr size_t kLazyFrom = size_t{32} << 20;

class Pool {
 public:
  // A buffer of exactly `bytes` (a multiple of kHugePage): the idle one of that size freed last (its
  // lines the likeliest still in cache), else a new one.
  void* take(size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (size_t i = idle_.size(); i-- > 0;)
        if (idle_[i].second == bytes) {
          void* p = idle_[i].first;
          idle_.erase(idle_.begin() + static_cast<std::ptrdiff_t>(i));
          idle_bytes_ -= bytes;
          return p;
        }
    }
    void* p = std::aligned_alloc(kHugePage, bytes);
    TORCH_CHECK(p != nullptr, "kivi_fast: could not allocate ", bytes, " bytes for a gradient");
#ifdef MADV_HUGEPAGE
    madvise(p, bytes, MADV_HUGEPAGE);
#endif
    return p;
  }
  void give(void* p, size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (idle_.size() < kMaxIdle && idle_bytes_ + bytes <= kMaxIdleBytes) {
#ifdef MADV_FREE
        if (bytes > kLazyFrom) madvise(p, bytes, MADV_FREE);
#endif
        idle_.emplace_back(p, bytes);
        idle_bytes_ += bytes;
        return;
      }
    }
    std::free(p);
  }

 private:
  std::mutex mu_;
  std::vector<std::pair<void*, size_t>> idle_;
  size_t idle_bytes_ = 0;
};

// Never destroyed: a tensor may be freed after static destructors ran (at interpreter exit).
Pool& pool() {
  static Pool* const p = new Pool;
  return *p;
}

}  // namespace

at::Tensor empty_like(const at::Tensor& like) {
  const size_t bytes = static_cast<size_t>(like.numel()) * like.element_size();
  if (bytes < kMinBytes) return at::empty_like(like, like.options().memory_format(at::MemoryFormat::Contiguous));
  const size_t rounded = (bytes + kHugePage - 1) / kHugePage * kHugePage;
  void* p = pool().take(rounded);
  return at::from_blob(p, like.sizes(), [rounded](void* q) { pool().give(q, rounded); }, like.options());
}

}  // namespace kept_outputs
}  // namespace kivi_fast
