// The part of the CUDA runtime API that csrc/cuda/ calls, for its CPU emulation (../emulator.h): the
// device attributes come from the emulated device's settings; a kernel's dynamic shared memory limit
// is kept (the launches are checked against it), the carveout hint ignored.
#pragma once

#include "../emulator.h"

enum cudaError_t { cudaSuccess = 0 };
enum cudaDeviceAttr {
  cudaDevAttrMultiProcessorCount,
  cudaDevAttrMaxSharedMemoryPerBlockOptin,
  cudaDevAttrMaxSharedMemoryPerMultiprocessor,
  cudaDevAttrReservedSharedMemoryPerBlock,
};
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize, cudaFuncAttributePreferredSharedMemoryCarveout };
constexpr int cudaSharedmemCarveoutMaxShared = 100;

inline cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int /*device*/) {
  const emu::DeviceConfig& c = emu::device_config();
  switch (attr) {
    case cudaDevAttrMultiProcessorCount: *value = c.multiprocessors; break;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = c.shared_per_block_optin; break;
    case cudaDevAttrMaxSharedMemoryPerMultiprocessor: *value = c.shared_per_multiprocessor; break;
    case cudaDevAttrReservedSharedMemoryPerBlock: *value = c.reserved_shared_per_block; break;
  }
  return cudaSuccess;
}
inline cudaError_t cudaFuncSetAttribute(const void* kernel, cudaFuncAttribute attr, int value) {
  if (attr == cudaFuncAttributeMaxDynamicSharedMemorySize) emu::set_max_dynamic_shared(kernel, value);
  return cudaSuccess;
}
