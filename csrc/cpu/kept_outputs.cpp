#include "kept_outputs.h"

#include "huge_pages.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/util/Exception.h>
#include <c10/util/accumulate.h>

#include <atomic>
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

constexpr size_t kPage = 4096;
// From this size on (glibc's mmap threshold at start-up) glibc maps a block afresh, and once the
// threshold has moved, grows its heap for it; smaller blocks it mostly takes from what the heap holds.
constexpr size_t kMinBytes = size_t{128} << 10;
// From this size on, buffers are rounded to huge pages (at most 1/4 of one wasted); below, to pages.
constexpr size_t kHugeFrom = 4 * huge_pages::kSize;
// What idle buffers may hold in all, and how many: a training step frees each layer's state in its
// backward and each layer's gradient at zero_grad, before the next step asks for them again (two buffers
// a kl call: 8 would evict the states of a 5-layer step before its next forward).
constexpr size_t kMaxIdleBytes = size_t{256} << 20, kMaxIdle = 32;

class Pool {
 public:
  // A buffer of exactly `bytes` (rounded()): the idle one of that size freed last (its lines the
  // likeliest still in cache), else a new one.
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
    void* p = bytes >= kHugeFrom ? huge_pages::allocate(bytes) : std::aligned_alloc(kPage, bytes);
    fresh_.fetch_add(1, std::memory_order_relaxed);
    TORCH_CHECK(p != nullptr, "kivi_fast: could not allocate ", bytes, " bytes for an output");
    return p;
  }
  // p back to the idle buffers, the oldest freed first where that makes room (a size no longer asked
  // for, say the last smaller minibatch's, does not stay for good); above huge_pages::kKeptBytes
  // handed back lazily (MADV_FREE), as the scratch buffers are.
  void give(void* p, size_t bytes) {
#ifdef MADV_FREE
    if (bytes > huge_pages::kKeptBytes) madvise(p, bytes, MADV_FREE);
#endif
    std::vector<void*> evicted;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (bytes > kMaxIdleBytes) {
        evicted.push_back(p);
      } else {
        while (!idle_.empty() && (idle_.size() >= kMaxIdle || idle_bytes_ + bytes > kMaxIdleBytes)) {
          evicted.push_back(idle_.front().first);
          idle_bytes_ -= idle_.front().second;
          idle_.erase(idle_.begin());
        }
        idle_.emplace_back(p, bytes);
        idle_bytes_ += bytes;
      }
    }
    for (void* q : evicted) std::free(q);
  }
  int64_t fresh() const { return fresh_.load(std::memory_order_relaxed); }
  static size_t rounded(size_t bytes) {
    return bytes >= kHugeFrom ? huge_pages::rounded(bytes) : (bytes + kPage - 1) / kPage * kPage;
  }

 private:
  std::mutex mu_;
  std::vector<std::pair<void*, size_t>> idle_;
  size_t idle_bytes_ = 0;
  std::atomic<int64_t> fresh_{0};
};

// Never destroyed: a tensor may be freed after static destructors ran (at interpreter exit).
Pool& pool() {
  static Pool* const p = new Pool;
  return *p;
}

}  // namespace

at::Tensor empty(at::IntArrayRef sizes, const at::TensorOptions& options) {
  // from_blob below would drop a memory format or pinning, and the buffers are host memory
  TORCH_INTERNAL_ASSERT(options.device().is_cpu() && !options.has_memory_format() && !options.pinned_memory());
  const size_t bytes = static_cast<size_t>(c10::multiply_integers(sizes)) * options.dtype().itemsize();
  if (bytes < kMinBytes) return at::empty(sizes, options);
  const size_t rounded = Pool::rounded(bytes);
  void* p = pool().take(rounded);
  return at::from_blob(p, sizes, [rounded](void* q) { pool().give(q, rounded); }, options);
}

at::Tensor empty_like(const at::Tensor& like) { return empty(like.sizes(), like.options()); }

int64_t fresh_buffers() { return pool().fresh(); }

}  // namespace kept_outputs
}  // namespace kivi_fast
