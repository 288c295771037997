// Per-device facts and settings the CUDA kernels need, read or made once per device (host code).
#pragma once

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>
#include <map>
#include <utility>

namespace kivi_fast::cuda {

// The most blocks a grid's y or z dimension holds: launches that put the batch there take it in chunks
// of this many elements, and the kernels that need the whole batch in one grid refuse more.
constexpr int64_t kMaxGridYZ = 65535;

// A device attribute (multiprocessor count, the shared memory a block may opt in to), cached (not in
// the CPU emulation, csrc/cuda_emulation/, whose tests change the emulated device between calls).
inline int device_attribute(int device, cudaDeviceAttr attr) {
#ifdef KIVI_FAST_CUDA_EMULATION
  int uncached = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&uncached, attr, device));
  return uncached;
#endif
  static std::mutex mutex;
  static std::map<std::pair<int, int>, int> cache;
  const std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_pair(device, static_cast<int>(attr));
  auto it = cache.find(key);
  if (it == cache.end()) {
    int value = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&value, attr, device));
    it = cache.emplace(key, value).first;
  }
  return it->second;
}

// Lets `kernel` use all the dynamic shared memory `device` allows a block (above 48 KB a kernel must
// opt in), once per kernel and device. Always the device's limit, never a call's own size, so that
// concurrent callers cannot lower it under each other's launch.
inline void allow_all_shared_memory(const void* kernel, int device, int static_bytes) {
  static std::mutex mutex;
  static std::map<std::pair<const void*, int>, bool> done;
  const std::lock_guard<std::mutex> lock(mutex);
  auto& flag = done[std::make_pair(kernel, device)];
#ifndef KIVI_FAST_CUDA_EMULATION  // (whose tests change the emulated device's limit between calls)
  if (flag) return;
#endif
  const int optin = device_attribute(device, cudaDevAttrMaxSharedMemoryPerBlockOptin);
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, optin - static_bytes));
  // the split of the SM's memory between L1 and shared memory is a hint: ask for all of it shared, so
  // that as many blocks fit as the shared memory arithmetic says
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                      cudaSharedmemCarveoutMaxShared));
  flag = true;
}

}  // namespace kivi_fast::cuda
