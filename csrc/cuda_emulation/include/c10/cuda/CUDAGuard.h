// c10's device guard, for the CPU emulation of csrc/cuda/: one emulated device, nothing to switch.
#pragma once

#include <c10/core/Device.h>

namespace c10::cuda {
struct CUDAGuard {
  explicit CUDAGuard(c10::Device) {}
};
}  // namespace c10::cuda
