// The fiber scheduler behind emulator.h: one block at a time, its threads switched at barriers.
//
// A fiber starts by swapcontext (makecontext gives it its stack) and then switches by _setjmp /
// _longjmp, which save no signal mask: swapcontext's system call each way made the switches half of
// the emulation's time. (glibc's fortified longjmp refuses jumps between stacks, hence the #undef.)
#undef _FORTIFY_SOURCE
#include "emulator.h"

#include <setjmp.h>
#include <ucontext.h>

#include <algorithm>
#include <memory>
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

constexpr size_t kStackBytes = 256 * 1024;
constexpr size_t kGuardDoubles = 512;  // after a block's dynamic shared memory: a write there is an error
// Shared memory's bytes before a block writes them: 0xff (NaN doubles, -1 integers) with even
// schedule seeds, 0x5b (3.7e127, large integers) with odd ones, since an atomicAdd onto -1 can land
// where a count that starts at 0 would.
unsigned char poison_byte() { return schedule_seed % 2 == 0 ? 0xff : 0x5b; }
uint64_t poison_word() { return 0x0101010101010101ull * poison_byte(); }

struct Scheduler {
  ucontext_t main;   // (what the first switch to a fiber saves, never resumed)
  jmp_buf back;      // where the fibers yield to
  std::vector<Fiber> fibers;
  std::vector<std::unique_ptr<char[]>> stacks;
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

[[noreturn]] void fiber_main() {
  Scheduler& s = scheduler();
  (*s.body)();
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

void run_block(Scheduler& s, const char* kernel) {
  ++s.block_serial;
  const unsigned threads = s.block_dim.x * s.block_dim.y * s.block_dim.z;
  s.fibers.assign(threads, Fiber{});
  while (s.stacks.size() < threads) s.stacks.push_back(std::make_unique<char[]>(kStackBytes));
  std::fill(s.shared.begin(), s.shared.end(), std::bit_cast<double>(poison_word()));
  for (unsigned t = 0; t < threads; ++t) {
    Fiber& f = s.fibers[t];
    f.linear = t;
    f.index = {t % s.block_dim.x, t / s.block_dim.x % s.block_dim.y, t / (s.block_dim.x * s.block_dim.y)};
    getcontext(&f.context);
    f.context.uc_stack.ss_sp = s.stacks[t].get();
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
    }
    if (ran) continue;
    if (std::all_of(s.fibers.begin(), s.fibers.end(), [](const Fiber& f) { return f.state == State::done; })) {
      for (size_t i = s.shared_doubles; i < s.shared.size(); ++i) {
        if (std::bit_cast<uint64_t>(s.shared[i]) != poison_word()) {
          std::ostringstream msg;
          msg << "emulated CUDA: " << kernel << ", block (" << s.block.x << ", " << s.block.y << ", " << s.block.z
              << ") wrote past its " << 8 * s.shared_doubles << " bytes of dynamic shared memory (at byte "
              << 8 * i << ")";
          throw std::runtime_error(msg.str());
        }
      }
      return;
    }
    if (!release(s)) {
      std::ostringstream msg;
      msg << "emulated CUDA: " << kernel << ", block (" << s.block.x << ", " << s.block.y << ", " << s.block.z
          << ") is stuck: a barrier or warp collective that not every live thread (lane) reaches, or reaches at another call:"
          << describe(s.fibers);
      throw std::runtime_error(msg.str());
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

void poison_shared(void* variable, size_t bytes) {
  Scheduler& s = scheduler();
  uint64_t& last = s.poisoned[variable];
  if (last == s.block_serial) return;
  last = s.block_serial;
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

void run_grid(const char* kernel, dim3 grid, dim3 block, int64_t shared_bytes, const std::function<void()>& body) {
  Scheduler& s = scheduler();
  if (s.in_launch) throw std::runtime_error("emulated CUDA: a launch from inside a kernel");
  const int64_t threads = int64_t{block.x} * block.y * block.z;
  if (threads < 1 || threads > 1024 || threads % 32 != 0) {
    throw std::runtime_error(std::string("emulated CUDA: ") + kernel + " launched with " + std::to_string(threads) +
                             " threads a block (the emulation takes whole warps, at most 1024)");
  }
  if (shared_bytes < 0 || shared_bytes > device_config().shared_per_block_optin) {
    throw std::runtime_error(std::string("emulated CUDA: ") + kernel + " asks for " + std::to_string(shared_bytes) +
                             " bytes of dynamic shared memory, above the device's " +
                             std::to_string(device_config().shared_per_block_optin));
  }
  launches().push_back({kernel, grid, block, shared_bytes});
  s.in_launch = true;
  s.body = &body;
  s.block_dim = block;
  s.grid_dim = grid;
  s.shared_doubles = (shared_bytes + 7) / 8;
  s.shared.assign(s.shared_doubles + kGuardDoubles, 0.0);
  s.rng.seed(schedule_seed);
  try {
    for (unsigned z = 0; z < grid.z; ++z) {
      for (unsigned y = 0; y < grid.y; ++y) {
        for (unsigned x = 0; x < grid.x; ++x) {
          s.block = {x, y, z};
          run_block(s, kernel);
        }
      }
    }
  } catch (...) {
    s.in_launch = false;
    s.fibers.clear();
    throw;
  }
  s.in_launch = false;
}

}  // namespace emu
