// Kernels with the bugs the CPU emulation is there to catch, in CUDA syntax: built through translate.py
// like csrc/cuda/'s kernels (never by nvcc), so that python_tests/test_cuda_emulation.py checks both the
// translation and that the emulation catches each bug.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <cuda_runtime.h>

#include <string>

namespace kivi_fast::cuda_emulation {
namespace {

__global__ void unsynchronized_neighbours(double* out) {  // reads a neighbour's shared write, no barrier
  extern __shared__ double shared[];
  const unsigned t = threadIdx.x;
  shared[t] = t;
  out[t] = shared[(t + 1) % blockDim.x];
}

__global__ void divergent_barrier(double* out) {  // the first warp waits at another barrier
  if (threadIdx.x < 32) {
    __syncthreads();
  } else {
    __syncthreads();
  }
  out[threadIdx.x] = 1.0;
}

__global__ void shuffle_after_exit(double* out) {  // half a warp has left before its shuffle
  if ((threadIdx.x & 31) < 16) return;
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1.0, 1);
}

__global__ void write_past_shared(double* out) {  // one double too many
  extern __shared__ double shared[];
  shared[threadIdx.x + 1] = 1.0;
  out[threadIdx.x] = 1.0;
}

__global__ void unwritten_static_shared(double* out) {  // a __shared__ total never set to 0
  __shared__ double total;
  if (threadIdx.x == 0) total += 1.0;
  __syncthreads();
  out[threadIdx.x] = total;
}

__global__ void shared_beyond_48kb(double* out) {  // 16 KB static + 40 KB dynamic, no opt-in
  extern __shared__ double shared[];
  __shared__ double table[2048];
  table[threadIdx.x] = 1.0;
  shared[threadIdx.x] = table[threadIdx.x];
  out[threadIdx.x] = shared[threadIdx.x];
}

__global__ void partial_warp_shuffle(double* out) {  // a mask the emulation does not model
  out[threadIdx.x] = __shfl_xor_sync(0x0000ffffu, 1.0, 1);
}

__global__ void global_assumed_shared(double* out) {  // out is global memory; shared is not out's
  extern __shared__ double shared[];
  double* p = threadIdx.x < 32 ? shared : out;
  __builtin_assume(__isShared(p));
  p[threadIdx.x] = 1.0;
  out[threadIdx.x] = 1.0;
}

__global__ void launch_from_a_kernel(double* out) {  // (dynamic parallelism, which kivi_fast does not use)
  if (threadIdx.x == 0) divergent_barrier<<<1, 64>>>(out);
}

}  // namespace

// One 64-thread block of the named kernel; its output per thread.
at::Tensor run_buggy_kernel(const std::string& name) {
  auto out = at::zeros({64}, at::kDouble);
  double* o = out.data_ptr<double>();
  if (name == "unsynchronized_neighbours") {
    unsynchronized_neighbours<<<1, 64, 64 * 8>>>(o);
  } else if (name == "divergent_barrier") {
    divergent_barrier<<<1, 64>>>(o);
  } else if (name == "shuffle_after_exit") {
    shuffle_after_exit<<<1, 64>>>(o);
  } else if (name == "write_past_shared") {
    write_past_shared<<<1, 64, 64 * 8>>>(o);
  } else if (name == "unwritten_static_shared") {
    unwritten_static_shared<<<1, 64>>>(o);
  } else if (name == "shared_beyond_48kb") {
    shared_beyond_48kb<<<1, 64, 40 * 1024>>>(o);
  } else if (name == "partial_warp_shuffle") {
    partial_warp_shuffle<<<1, 64>>>(o);
  } else if (name == "global_assumed_shared") {
    global_assumed_shared<<<1, 64, 64 * 8>>>(o);
  } else if (name == "launch_from_a_kernel") {
    launch_from_a_kernel<<<1, 64>>>(o);
  } else {
    TORCH_CHECK_VALUE(false, "run_buggy_kernel: no kernel ", name);
  }
  return out;
}

}  // namespace kivi_fast::cuda_emulation
