#include "cpu/buffers.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstdlib>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace kivi_fast {
namespace cpu {

Tensor wrap(double* data, at::IntArrayRef sizes) {
  return at::from_blob(data, sizes, at::TensorOptions().dtype(at::kDouble));
}

void Scratch::release_if_above(int64_t keep, int64_t lazy_keep) {
  if (capacity_ <= keep) return;
#ifdef MADV_FREE
  if (capacity_ <= lazy_keep && madvise(data_.get(), rounded_bytes(capacity_), MADV_FREE) == 0) return;
#endif
  data_.reset();
  capacity_ = 0;
}

void Scratch::Free::operator()(double* p) const { std::free(p); }

double* Scratch::allocate(int64_t n) {
  const size_t bytes = static_cast<size_t>(n) * sizeof(double);
  void* p = bytes >= kAlignedFrom ? huge_pages::allocate(rounded_bytes(n)) : std::malloc(bytes);
  TORCH_CHECK(p != nullptr, "kivi_fast: could not allocate ", bytes, " bytes of scratch memory");
  return static_cast<double*>(p);
}

void Work::trim() {
  constexpr int64_t kLazyKeep = int64_t{1} << 25;
  static_assert(kKeptDoubles * sizeof(double) >= Scratch::kAlignedFrom, "lazily released buffers must be 2 MB aligned");
  for (Scratch* b : {&sq, &norms, &system, &coef, &block, &points, &product})
    b->release_if_above(kKeptDoubles, kLazyKeep);
}

Work& thread_work() {
  thread_local Work work;
  return work;
}

}  // namespace cpu
}  // namespace kivi_fast
