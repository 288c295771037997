// The fiber scheduler behind emulator.h: one block at a time, its threads switched at barriers.
//
// A fiber starts by swapcontext (makecontext gives it its stack) and then switches by _setjmp /
// _longjmp, which save no signal mask: swapcontext's system call each way made the switches half of
// the emulation's time. (glibc's fortified longjmp refuses jumps between stacks, hence the #undef.)
#undef _FORTIFY_SOURCE
#include "emulator.h"

#include <setjmp.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <sstream>
#include <stdexcept>
#include <unordered_map>

namespace emu {
namespace {

uint64_t schedule_seed = 0;

enum class State { ready, block_barrier, warp_barrier, done };

struct Fiber {
  ucontext_t context;  // its start
  jmp_buf jump;        // where it yielded
  bool started = false;
  uint3 index;
  unsigned linear;
  State state = State::ready;
  int flag = 0;                // block barrier: this thread's flag, then the block's OR
  std::source_location where;  // and the call it waits at
  uint64_t bits = 0;           // warp exchange: this lane's value
  const char* op = nullptr;    // and the collective it is in
  uint64_t exchanged[32] = {};  // every lane's value, once the warp has met
};

constexpr size_t kStackBytes = 256 * 1024;  // a fiber's stack, below it a page that faults
constexpr size_t kGuardDoubles = 2048;      // after a block's dynamic shared memory: a write there is an error
constexpr uint64_t kGuardWord = 0xa5a5a5a5a5a5a5a5ull;  // (neither poison: a poison-valued write shows too)
constexpr int kDefaultSharedBytes = 48 * 1024;  // static + dynamic shared memory a block has without opt-in
// Shared memory's bytes before a block writes them: 0xff (NaN doubles, -1 integers) with even
// schedule seeds, 0x5b (3.7e127, large integers) with odd ones, since an atomicAdd onto -1 can land
// where a count that starts at 0 would.
unsigned char poison_byte() { return schedule_seed % 2 == 0 ? 0xff : 0x5b; }
uint64_t poison_word() { return 0x0101010101010101ull * poison_byte(); }

// A fiber's stack: mapped (not zero-filled up front), with an inaccessible page below it.
struct Stack {
  char* base = nullptr;
  Stack() {
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    void* p = mmap(nullptr, kStackBytes + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::runtime_error("emulated CUDA: no memory for a thread's stack");
    mprotect(p, page, PROT_NONE);
    base = static_cast<char*>(p) + page;
  }
  Stack(const Stack&) = delete;
  Stack& operator=(const Stack&) = delete;
};

struct Scheduler {
  ucontext_t main;   // (what the first switch to a fiber saves, never resumed)
  jmp_buf back;      // where the fibers yield to
  std::vector<Fiber> fibers;
  std::vector<std::unique_ptr<Stack>> stacks;
  std::exception_ptr error;  // what a thread of the block threw
  std::vector<double> shared;  // the block's dynamic shared memory (8-byte aligned), then the guard
  size_t shared_doubles = 0;
  Fiber* current = nullptr;
  uint3 block{0, 0, 0};
  dim3 block_dim, grid_dim;
  const std::function<void()>* body = nullptr;
  std::mt19937_64 rng;
  bool in_launch = false;
  uint64_t block_serial = 0;                     // blocks run since load
  std::unordered_map<void*, uint64_t> poisoned;  // __shared__ variables: the block that last poisoned them
  int64_t static_bytes = 0;                      // the __shared__ variables the current block declared
  std::map<const void*, int> max_dynamic_shared;  // cudaFuncSetAttribute's, per kernel
  const void* kernel_id = nullptr;               // the launch's kernel and dynamic shared memory
  int64_t dynamic_bytes = 0;
};

Scheduler& scheduler() {
  static Scheduler s;
  return s;
}


Fiber& current_fiber() {
  Scheduler& s = scheduler();
  if (s.current == nullptr) throw std::runtime_error("emulated CUDA: a device function called outside a kernel");
  return *s.current;
}

// A thread's life: the kernel body, then back to the scheduler for good. An exception (device code
// cannot throw, but the emulation's own checks do) must not unwind past the fiber's first frame: it
// is kept for run_grid to rethrow.
[[noreturn]] void fiber_main() {
  Scheduler& s = scheduler();
  try {
    (*s.body)();
  } catch (...) {
    if (!s.error) s.error = std::current_exception();
  }
  s.current->state = State::done;
  _longjmp(s.back, 1);
}

// Parks fiber f (the current one) at a barrier until the scheduler releases it.
void wait(Fiber& f, State state) {
  f.state = state;
  if (_setjmp(f.jump) == 0) _longjmp(scheduler().back, 1);
}

// Runs fiber f until it yields or ends.
void resume(Scheduler& s, Fiber& f) {
  s.current = &f;
  if (_setjmp(s.back) == 0) {
    if (f.started) _longjmp(f.jump, 1);
    f.started = true;
    swapcontext(&s.main, &f.context);
  }
  s.current = nullptr;
}

// Where the block's live threads wait, grouped: "32 threads (first 0) at __syncthreads, kl.cu:60; ...".
std::string describe(const std::vector<Fiber>& fibers) {
  std::vector<std::pair<std::string, std::pair<unsigned, unsigned>>> groups;  // place, (count, first)
  for (const Fiber& f : fibers) {
    if (f.state == State::done) continue;
    std::string place = f.state == State::block_barrier
                            ? std::string("__syncthreads, ") + f.where.file_name() + ":" + std::to_string(f.where.line())
                        : f.state == State::warp_barrier ? std::string(f.op) + ", warp " + std::to_string(f.linear / 32)
                                                         : std::string("running");
    auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == place; });
    if (it == groups.end()) {
      groups.push_back({place, {1, f.linear}});
    } else {
      ++it->second.first;
    }
  }
  std::ostringstream out;
  for (const auto& [place, n] : groups) out << " " << n.first << " threads (first " << n.second << ") at " << place << ";";
  return out.str();
}

bool same_call(const std::source_location& a, const std::source_location& b) {
  return a.line() == b.line() && a.column() == b.column() && std::strcmp(a.file_name(), b.file_name()) == 0;
}

// Releases what can be released once no thread can run: the block barrier when every live thread is
// at it (at the same call), else each warp whose lanes are all in the same collective. False: nothing
// can move.
bool release(Scheduler& s) {
  std::vector<Fiber>& fibers = s.fibers;
  bool any_live = false, all_at_block = true;
  const Fiber* first = nullptr;
  int flags = 0;
  for (const Fiber& f : fibers) {
    if (f.state == State::done) continue;
    any_live = true;
    all_at_block &= f.state == State::block_barrier && (first == nullptr || same_call(f.where, first->where));
    if (first == nullptr) first = &f;
    flags |= f.flag;
  }
  if (!any_live) return false;
  if (all_at_block) {
    ++launches().back().block_barriers;
    for (Fiber& f : fibers) {
      if (f.state == State::done) continue;
      f.state = State::ready;
      f.flag = flags;
    }
    return true;
  }
  bool released = false;
  for (size_t w = 0; w * 32 < fibers.size(); ++w) {
    Fiber* lanes = fibers.data() + w * 32;
    bool met = true;
    for (int l = 0; l < 32 && met; ++l) {
      met = lanes[l].state == State::warp_barrier && std::strcmp(lanes[l].op, lanes[0].op) == 0;
    }
    if (!met) continue;
    for (int l = 0; l < 32; ++l) {
      for (int k = 0; k < 32; ++k) lanes[l].exchanged[k] = lanes[k].bits;
      lanes[l].state = State::ready;
    }
    released = true;
  }
  return released;
}

std::string block_name(const Scheduler& s, const char* kernel) {
  std::ostringstream out;
  out << "emulated CUDA: " << kernel << ", block (" << s.block.x << ", " << s.block.y << ", " << s.block.z << ")";
  return out.str();
}

// The block's static (its __shared__ variables) and dynamic shared memory within what CUDA allows: 48 KB
// in all, unless cudaFuncSetAttribute raised the kernel's dynamic limit (which CUDA refuses above the
// device's opt-in limit less the static part).
void check_shared_memory(const Scheduler& s, const char* kernel) {
  const auto it = s.max_dynamic_shared.find(s.kernel_id);
  const int optin = device_config().shared_per_block_optin;
  std::ostringstream msg;
  if (it == s.max_dynamic_shared.end()) {
    if (s.static_bytes + s.dynamic_bytes > kDefaultSharedBytes) {
      msg << " uses " << s.static_bytes << " bytes of static and " << s.dynamic_bytes << " of dynamic shared memory, "
          << "above the " << kDefaultSharedBytes << " a block has unless cudaFuncSetAttribute allows more";
    }
  } else if (it->second + s.static_bytes > optin) {
    msg << ": cudaFuncSetAttribute allowed " << it->second << " bytes of dynamic shared memory, which with its "
        << s.static_bytes << " static bytes exceed the device's " << optin << " (CUDA refuses the attribute)";
  } else if (s.dynamic_bytes > it->second) {
    msg << " asks for " << s.dynamic_bytes << " bytes of dynamic shared memory, above the " << it->second
        << " cudaFuncSetAttribute allowed";
  }
  if (!msg.str().empty()) throw std::runtime_error(block_name(s, kernel) + msg.str());
}

void run_block(Scheduler& s, const char* kernel) {
  ++s.block_serial;
  const unsigned threads = s.block_dim.x * s.block_dim.y * s.block_dim.z;
  s.fibers.assign(threads, Fiber{});
  while (s.stacks.size() < threads) s.stacks.push_back(std::make_unique<Stack>());
  std::fill(s.shared.begin(), s.shared.begin() + s.shared_doubles, std::bit_cast<double>(poison_word()));
  std::fill(s.shared.begin() + s.shared_doubles, s.shared.end(), std::bit_cast<double>(kGuardWord));
  s.static_bytes = 0;
  for (unsigned t = 0; t < threads; ++t) {
    Fiber& f = s.fibers[t];
    f.linear = t;
    f.index = {t % s.block_dim.x, t / s.block_dim.x % s.block_dim.y, t / (s.block_dim.x * s.block_dim.y)};
    getcontext(&f.context);
    f.context.uc_stack.ss_sp = s.stacks[t]->base;
    f.context.uc_stack.ss_size = kStackBytes;
    f.context.uc_link = nullptr;  // fiber_main never returns
    makecontext(&f.context, fiber_main, 0);
  }
  std::vector<unsigned> order(threads);
  for (unsigned t = 0; t < threads; ++t) order[t] = t;
  for (;;) {
    std::shuffle(order.begin(), order.end(), s.rng);
    bool ran = false;
    for (unsigned t : order) {
      Fiber& f = s.fibers[t];
      if (f.state != State::ready) continue;
      ran = true;
      resume(s, f);
      if (s.error) std::rethrow_exception(s.error);
    }
    if (ran) continue;
    if (std::all_of(s.fibers.begin(), s.fibers.end(), [](const Fiber& f) { return f.state == State::done; })) {
      for (size_t i = s.shared_doubles; i < s.shared.size(); ++i) {
        if (std::bit_cast<uint64_t>(s.shared[i]) != kGuardWord) {
          throw std::runtime_error(block_name(s, kernel) + " wrote past its " + std::to_string(8 * s.shared_doubles) +
                                   " bytes of dynamic shared memory (at byte " + std::to_string(8 * i) + ")");
        }
      }
      check_shared_memory(s, kernel);
      return;
    }
    if (!release(s)) {
      throw std::runtime_error(block_name(s, kernel) +
                               " is stuck: a barrier or warp collective that not every live thread (lane) reaches, "
                               "or reaches at another call:" + describe(s.fibers));
    }
  }
}

}  // namespace

DeviceConfig& device_config() {
  static DeviceConfig config;
  return config;
}

void set_schedule_seed(uint64_t seed) { schedule_seed = seed; }

std::vector<LaunchRecord>& launches() {
  static std::vector<LaunchRecord> records;
  return records;
}

uint3 thread_index() { return current_fiber().index; }
uint3 block_index() { return scheduler().block; }
dim3 block_dim() { return scheduler().block_dim; }
dim3 grid_dim() { return scheduler().grid_dim; }
void* dynamic_shared_memory() { return scheduler().shared.data(); }

bool in_dynamic_shared_memory(const void* p) {
  const Scheduler& s = scheduler();
  const auto* begin = reinterpret_cast<const char*>(s.shared.data());
  const auto* c = static_cast<const char*>(p);
  return std::less_equal<>()(begin, c) && std::less<>()(c, begin + 8 * s.shared_doubles);
}

void check_assumption(bool holds, const char* what, const std::source_location& where) {
  if (!holds) {
    const Scheduler& s = scheduler();
    throw std::runtime_error(block_name(s, launches().back().kernel.c_str()) + ", thread " +
                             std::to_string(current_fiber().index.x) + ": the assumption " + what + " is false (" +
                             where.file_name() + ":" + std::to_string(where.line()) + ")");
  }
}

void poison_shared(void* variable, size_t bytes) {
  Scheduler& s = scheduler();
  uint64_t& last = s.poisoned[variable];
  if (last == s.block_serial) return;
  last = s.block_serial;
  s.static_bytes += static_cast<int64_t>(bytes);
  std::memset(variable, poison_byte(), bytes);
}
unsigned lane_id() { return current_fiber().linear & 31; }

int block_barrier(int flag, const std::source_location& where) {
  Fiber& f = current_fiber();
  f.flag = flag;
  f.where = where;
  wait(f, State::block_barrier);
  return f.flag;
}

const uint64_t* warp_exchange(uint64_t bits, const char* op) {
  Fiber& f = current_fiber();
  f.bits = bits;
  f.op = op;
  wait(f, State::warp_barrier);
  return f.exchanged;
}

void set_max_dynamic_shared(const void* kernel_id, int bytes) {
  if (bytes < 0) throw std::runtime_error("emulated CUDA: cudaFuncSetAttribute with a negative shared memory size");
  scheduler().max_dynamic_shared[kernel_id] = bytes;
}

void check_full_mask(unsigned mask, const char* op) {
  if (mask != 0xffffffffu) {
    throw std::runtime_error(std::string("emulated CUDA: ") + op + " with a partial warp mask (" +
                             std::to_string(mask) + "), which the emulation does not model");
  }
}

void forget_function_attributes() { scheduler().max_dynamic_shared.clear(); }

void run_grid(const char* kernel, const void* kernel_id, dim3 grid, dim3 block, int64_t shared_bytes,
              const std::function<void()>& body) {
  Scheduler& s = scheduler();
  const auto refuse = [&](const std::string& why) {
    throw std::runtime_error(std::string("emulated CUDA: ") + kernel + " " + why);
  };
  if (s.in_launch) refuse("launched from inside a kernel");
  const int64_t threads = int64_t{block.x} * block.y * block.z;
  if (grid.x < 1 || grid.x > 2147483647u || grid.y < 1 || grid.y > 65535 || grid.z < 1 || grid.z > 65535) {
    refuse("launched with grid (" + std::to_string(grid.x) + ", " + std::to_string(grid.y) + ", " +
           std::to_string(grid.z) + "): each dimension must be at least 1, y and z at most 65535");
  }
  if (block.x > 1024 || block.y > 1024 || block.z > 64 || threads < 1 || threads > 1024 || threads % 32 != 0) {
    refuse("launched with " + std::to_string(threads) + " threads a block (CUDA's limits, and the emulation takes "
           "whole warps)");
  }
  if (shared_bytes < 0 || shared_bytes > device_config().shared_per_block_optin) {
    refuse("asks for " + std::to_string(shared_bytes) + " bytes of dynamic shared memory, above the device's " +
           std::to_string(device_config().shared_per_block_optin));
  }
  launches().push_back({kernel, grid, block, shared_bytes, 0});
  s.in_launch = true;
  s.error = nullptr;
  s.body = &body;
  s.kernel_id = kernel_id;
  s.dynamic_bytes = shared_bytes;
  s.block_dim = block;
  s.grid_dim = grid;
  s.shared_doubles = (shared_bytes + 7) / 8;
  s.shared.assign(s.shared_doubles + kGuardDoubles, 0.0);
  s.rng.seed(schedule_seed);
  // the blocks in an order drawn from the seed too (a real GPU runs them in any order, many at once)
  const uint64_t blocks = uint64_t{grid.x} * grid.y * grid.z;
  std::vector<uint64_t> order(blocks);
  std::iota(order.begin(), order.end(), uint64_t{0});
  std::shuffle(order.begin(), order.end(), s.rng);
  try {
    for (const uint64_t b : order) {
      s.block = {static_cast<unsigned>(b % grid.x), static_cast<unsigned>(b / grid.x % grid.y),
                 static_cast<unsigned>(b / (uint64_t{grid.x} * grid.y))};
      run_block(s, kernel);
    }
  } catch (...) {
    s.in_launch = false;
    s.fibers.clear();
    s.error = nullptr;
    throw;
  }
  s.in_launch = false;
}

}  // namespace emu
