// A CPU emulation of the CUDA execution model, enough to run csrc/cuda/'s kernels on CPU tensors in
// CI (no GPU there): their index arithmetic, barriers, warp collectives, shared memory use and host-side
// launch logic are then tested against the CPU kernels on every change. Not their speed, and not the
// GPU's memory model (see below).
//
// A launch runs its blocks one after another; a block's threads are fibers (ucontext) on the calling
// thread, switched only at barriers (__syncthreads*, __syncwarp, the warp shuffles and votes). Between
// two barriers the block's runnable threads run one at a time, each to its next barrier, in an order
// drawn afresh each time from a seeded generator: a thread that reads shared memory another thread
// writes without a barrier between them sees the write or not depending on the order, so a missing
// barrier shows up as results that change with the seed. Shared memory, dynamic and __shared__
// (translate.py adds the call), starts filled with a poison in every block (0xff bytes, NaN doubles,
// with even seeds; 0x5b bytes with odd ones), so reading what was never written shows up too.
//
// Errors the emulation reports (std::runtime_error from the launch, so a C++ exception to the caller,
// never a hang): a __syncthreads that not every live thread of the block reaches, or that threads
// reach at different calls (divergent barriers); a warp collective that some lanes of the warp never
// reach, or reach through a different collective; a block that wrote past its dynamic shared memory
// (into a guard zone after it); a launch whose dynamic shared memory exceeds the emulated device's
// opt-in limit, or whose blocks are not whole warps of at most 1024 threads.
//
// What it cannot see: a lost update (a thread runs from one barrier to the next without interruption,
// so a plain read-modify-write of shared data, where an atomic is needed, looks atomic here: compute-
// sanitizer's racecheck on a GPU is the check for that), races between blocks (they never overlap;
// their order is drawn from the seed), missing __threadfence (every access is sequentially consistent
// here), reads past shared memory and out-of-bounds global accesses (plain C++ pointers), timing. Warp
// collectives must name the whole warp (a partial mask is an error: it is not emulated).
// The emulated device's attributes (multiprocessors, shared memory) are settable, so that tests can
// make a small batch take the paths a large one takes on a real GPU.
#pragma once

#include <bit>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <cstring>
#include <functional>
#include <source_location>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

// The CUDA qualifiers: everything is host code here. __shared__ variables are function-local statics,
// one per kernel (blocks run one at a time on one thread, so one copy serves every block).
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static

struct uint3 {
  unsigned x, y, z;
};
struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct int2 {
  int x, y;
};
inline int2 make_int2(int x, int y) { return {x, y}; }

namespace emu {

// The emulated device's attributes (cudaDeviceGetAttribute): an H100 SXM unless set otherwise.
struct DeviceConfig {
  int multiprocessors = 132;
  int shared_per_block_optin = 232448;  // 227 KB
  int shared_per_multiprocessor = 233472;
  int reserved_shared_per_block = 1024;
};
DeviceConfig& device_config();
// The seed of the orders threads run in (each launch restarts the generator from it).
void set_schedule_seed(uint64_t seed);

// A record of each launch since the last clear: the kernel's name as written at the launch, its grid,
// block and dynamic shared memory.
struct LaunchRecord {
  std::string kernel;
  dim3 grid, block;
  int64_t shared_bytes;
  int64_t block_barriers = 0;  // __syncthreads passed, summed over the blocks (a count of a stage's steps)
};
std::vector<LaunchRecord>& launches();

// The calling fiber's indices (threadIdx and the rest below).
uint3 thread_index();
uint3 block_index();
dim3 block_dim();
dim3 grid_dim();
void* dynamic_shared_memory();
// Whether p points into the block's dynamic shared memory (__shared__ variables are statics here,
// outside it: the kernels never pass one on as a pointer).
bool in_dynamic_shared_memory(const void* p);
// nvcc's __builtin_assume: a false assumption is undefined behaviour there, an error here.
void check_assumption(bool holds, const char* what, const std::source_location& where);
// Fills a __shared__ variable with the poison the first time a thread of each block declares it.
void poison_shared(void* variable, size_t bytes);

// Barriers: the block's (returns the OR of every thread's flag; every live thread must wait at the
// same call, `where`) and the warp's exchange (every lane passes 64 bits and gets all 32 lanes' back;
// `op` names the collective, which all lanes must share).
int block_barrier(int flag, const std::source_location& where);
const uint64_t* warp_exchange(uint64_t bits, const char* op);
unsigned lane_id();
// The warp collectives here are whole-warp ones: a partial mask, which they would not honour, is an error.
void check_full_mask(unsigned mask, const char* op);

// Runs `body` as grid x block threads (the launch behind kernel<<<grid, block, shared, stream>>>);
// kernel_id: the kernel's address, as cudaFuncSetAttribute names it.
void run_grid(const char* kernel, const void* kernel_id, dim3 grid, dim3 block, int64_t shared_bytes,
              const std::function<void()>& body);
// cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes); and forgetting
// every kernel's (the emulated device has changed).
void set_max_dynamic_shared(const void* kernel_id, int bytes);
void forget_function_attributes();

template <typename T>
uint64_t to_bits(T v) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>);
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  return bits;
}
template <typename T>
T from_bits(uint64_t bits) {
  T v;
  std::memcpy(&v, &bits, sizeof(T));
  return v;
}

// kernel<<<grid, block, shared, stream>>>(args...), as csrc/cuda_emulation/translate.py writes it:
// emu::launch("kernel", kernel, grid, block, shared, stream)(args...).
template <typename... Params>
struct Launch {
  const char* name;
  void (*kernel)(Params...);
  dim3 grid, block;
  int64_t shared_bytes;
  template <typename... Args>
  void operator()(Args&&... args) const {
    // the arguments converted to the kernel's parameter types once, as a real launch copies them
    std::tuple<std::decay_t<Params>...> params(std::forward<Args>(args)...);
    auto* k = kernel;
    run_grid(name, reinterpret_cast<const void*>(k), grid, block, shared_bytes, [&] { std::apply(k, params); });
  }
};
template <typename... Params, typename Stream = int>
Launch<Params...> launch(const char* name, void (*kernel)(Params...), dim3 grid, dim3 block, int64_t shared_bytes = 0,
                         const Stream& = {}) {
  return {name, kernel, grid, block, shared_bytes};
}

}  // namespace emu

#define threadIdx (::emu::thread_index())
#define blockIdx (::emu::block_index())
#define blockDim (::emu::block_dim())
#define gridDim (::emu::grid_dim())

inline void __syncthreads(const std::source_location& where = std::source_location::current()) {
  emu::block_barrier(0, where);
}
inline int __syncthreads_or(int flag, const std::source_location& where = std::source_location::current()) {
  return emu::block_barrier(flag != 0, where);
}
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  emu::check_full_mask(mask, "__syncwarp");
  emu::warp_exchange(0, "__syncwarp");
}
inline void __threadfence() {}
inline unsigned __isShared(const void* p) { return emu::in_dynamic_shared_memory(p) ? 1u : 0u; }
#define __builtin_assume(...) ::emu::check_assumption((__VA_ARGS__), #__VA_ARGS__, std::source_location::current())

// The warp collectives take the types CUDA's overloads take (no other, so that code nvcc rejects is
// rejected here too), and exchange their bits.
template <typename T>
concept WarpValue = std::same_as<T, int> || std::same_as<T, unsigned> || std::same_as<T, long> ||
                    std::same_as<T, unsigned long> || std::same_as<T, long long> ||
                    std::same_as<T, unsigned long long> || std::same_as<T, float> || std::same_as<T, double>;
template <WarpValue T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask) {
  emu::check_full_mask(mask, "__shfl_xor_sync");
  const uint64_t* all = emu::warp_exchange(emu::to_bits(v), "__shfl_xor_sync");
  return emu::from_bits<T>(all[(emu::lane_id() ^ static_cast<unsigned>(lane_mask)) & 31]);
}
template <WarpValue T>
T __shfl_sync(unsigned mask, T v, int src_lane) {
  emu::check_full_mask(mask, "__shfl_sync");
  const uint64_t* all = emu::warp_exchange(emu::to_bits(v), "__shfl_sync");
  return emu::from_bits<T>(all[static_cast<unsigned>(src_lane) & 31]);
}
template <WarpValue T>
T __shfl_up_sync(unsigned mask, T v, unsigned delta) {
  emu::check_full_mask(mask, "__shfl_up_sync");
  const uint64_t* all = emu::warp_exchange(emu::to_bits(v), "__shfl_up_sync");
  const unsigned lane = emu::lane_id();
  return lane >= delta ? emu::from_bits<T>(all[lane - delta]) : v;
}
template <WarpValue T>
unsigned __match_any_sync(unsigned mask, T v) {  // lanes whose values have the same bits
  emu::check_full_mask(mask, "__match_any_sync");
  const uint64_t mine = emu::to_bits(v);
  const uint64_t* all = emu::warp_exchange(mine, "__match_any_sync");
  unsigned peers = 0;
  for (unsigned l = 0; l < 32; ++l) peers |= (all[l] == mine ? 1u : 0u) << l;
  return peers;
}
inline unsigned __ballot_sync(unsigned mask, int predicate) {  // bit l: lane l's predicate
  emu::check_full_mask(mask, "__ballot_sync");
  const uint64_t* all = emu::warp_exchange(predicate != 0, "__ballot_sync");
  unsigned bits = 0;
  for (unsigned l = 0; l < 32; ++l) bits |= (all[l] != 0 ? 1u : 0u) << l;
  return bits;
}
inline int __any_sync(unsigned mask, int predicate) {
  emu::check_full_mask(mask, "__any_sync");
  const uint64_t* all = emu::warp_exchange(predicate != 0, "__any_sync");
  for (unsigned l = 0; l < 32; ++l) {
    if (all[l] != 0) return 1;
  }
  return 0;
}
inline int __ffs(int v) { return v == 0 ? 0 : std::countr_zero(static_cast<unsigned>(v)) + 1; }
inline int __popc(unsigned v) { return std::popcount(v); }
inline long long __double_as_longlong(double v) { return std::bit_cast<long long>(v); }
inline double __longlong_as_double(long long v) { return std::bit_cast<double>(v); }
inline long long clock64() {  // a tick per read: stage clocks come out ordered
  static long long ticks = 0;
  return ++ticks;
}
template <typename T>
T __ldcg(const T* p) {
  return *p;
}

// Atomics, with CUDA's overloads: threads never run at the same time, so a read-modify-write is atomic
// as it stands.
namespace emu {
template <typename T>
T add(T* p, T v) {
  const T old = *p;
  *p = old + v;
  return old;
}
template <typename T>
T least(T* p, T v) {
  const T old = *p;
  if (v < old) *p = v;
  return old;
}
}  // namespace emu
inline int atomicAdd(int* p, int v) { return emu::add(p, v); }
inline unsigned atomicAdd(unsigned* p, unsigned v) { return emu::add(p, v); }
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) { return emu::add(p, v); }
inline float atomicAdd(float* p, float v) { return emu::add(p, v); }
inline double atomicAdd(double* p, double v) { return emu::add(p, v); }
inline int atomicMin(int* p, int v) { return emu::least(p, v); }
inline unsigned atomicMin(unsigned* p, unsigned v) { return emu::least(p, v); }
inline long long atomicMin(long long* p, long long v) { return emu::least(p, v); }
inline unsigned long long atomicMin(unsigned long long* p, unsigned long long v) { return emu::least(p, v); }

// Device math that CUDA has in the global namespace.
using std::isinf;
using std::isnan;
// min and max: of two integers of one type (CUDA finds mixed ones such as (int64_t, int) ambiguous;
// here they do not compile either), or fmin/fmax's for floating point (NaN loses).
template <std::integral T>
T min(T a, T b) {
  return b < a ? b : a;
}
template <std::integral T>
T max(T a, T b) {
  return a < b ? b : a;
}
inline double min(double a, double b) { return std::fmin(a, b); }
inline double max(double a, double b) { return std::fmax(a, b); }
inline float min(float a, float b) { return std::fmin(a, b); }
inline float max(float a, float b) { return std::fmax(a, b); }
