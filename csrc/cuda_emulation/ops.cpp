// torch.ops.kivi_fast_cuda_emulation.*: csrc/cuda/'s host functions and kernels run on CPU tensors by
// the emulation of emulator.h (tests only: python_tests/test_cuda_emulation.py). The arguments are
// those of kivi.h's cuda:: functions, already batched and checked as csrc/ops.cpp would.
//
// This library is compiled with kivi_fast renamed (CMakeLists.txt), so that its copies of kivi.h's
// inline functions and of the cuda:: functions never meet the real library's in one process.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

#include "kivi.h"
// last: its macros (threadIdx, ...) and global min/max are for device code only
#include "cuda_emulation/emulator.h"

namespace kivi_fast {
namespace cuda_emulation {
at::Tensor run_buggy_kernel(const std::string& name);  // buggy_kernels.cu
}  // namespace cuda_emulation
namespace {

bool handles_kl(int64_t n_total, int64_t d, int64_t batch) { return cuda::handles_kl(n_total, d, batch, 0); }

// generic::fit (csrc/generic.cpp, built here for a GPU): its coefficients and bandwidth.
std::tuple<at::Tensor, at::Tensor> generic_fit(const at::Tensor& numer, const at::Tensor& denom, double lam,
                                               const std::optional<at::Tensor>& sigma) {
  Fit f = generic::fit(numer, denom, lam, sigma, {"numer", "denom"});
  return {f.coef, f.sigma};
}

// The emulated device: multiprocessors, shared memory a block may opt in to, shared memory per
// multiprocessor, reserved per block; and the seed of the threads' order.
void configure(int64_t multiprocessors, int64_t shared_per_block_optin, int64_t shared_per_multiprocessor,
               int64_t reserved_shared_per_block, int64_t seed) {
  TORCH_CHECK_VALUE(multiprocessors > 0 && shared_per_block_optin > 0 && shared_per_multiprocessor > 0 &&
                        reserved_shared_per_block >= 0,
                    "configure: the device's attributes must be positive");
  emu::DeviceConfig& c = emu::device_config();
  c.multiprocessors = static_cast<int>(multiprocessors);
  c.shared_per_block_optin = static_cast<int>(shared_per_block_optin);
  c.shared_per_multiprocessor = static_cast<int>(shared_per_multiprocessor);
  c.reserved_shared_per_block = static_cast<int>(reserved_shared_per_block);
  emu::set_schedule_seed(static_cast<uint64_t>(seed));
  emu::forget_function_attributes();  // another device: its kernels' limits are set afresh
}

// The launches since the last call (which clears them): their kernels' names as written at the launch,
// and [grid x, y, z, threads, dynamic shared bytes, block barriers passed] each.
std::tuple<std::vector<std::string>, std::vector<int64_t>> take_launches() {
  std::vector<std::string> names;
  std::vector<int64_t> shapes;
  for (const emu::LaunchRecord& r : emu::launches()) {
    names.push_back(r.kernel);
    for (int64_t v : {int64_t{r.grid.x}, int64_t{r.grid.y}, int64_t{r.grid.z},
                      int64_t{r.block.x} * r.block.y * r.block.z, r.shared_bytes, r.block_barriers}) {
      shapes.push_back(v);
    }
  }
  emu::launches().clear();
  return {names, shapes};
}

}  // namespace

TORCH_LIBRARY(kivi_fast_cuda_emulation, m) {
  m.def("kl(Tensor prior_z, Tensor q_z, float lam, float clip, Tensor? sigma, bool reverse, bool grad_state)"
        " -> (Tensor, Tensor, Tensor, Tensor)",
        &cuda::kl);
  m.def("kl_grad(Tensor grad_kl, Tensor state, Tensor q_z, Tensor prior_z, bool reverse) -> Tensor", &cuda::kl_grad);
  m.def("pair_sqdist(Tensor denom, Tensor numer) -> Tensor", &cuda::pair_sqdist);
  m.def("kernel_block(Tensor denom, Tensor numer, int r0, int rows, int c0, int cols, Tensor scale, float divisor,"
        " float diagonal) -> Tensor",
        &cuda::kernel_block);
  m.def("fit_coef(Tensor x, Tensor info, Tensor sigma, int N, float beta) -> Tensor", &cuda::fit_coef);
  m.def("kl_finish(Tensor r_src, Tensor? state, Tensor sigma, float clip, bool reverse) -> (Tensor, Tensor)",
        &cuda::kl_finish);
  m.def("median_of_pairs(Tensor pairs) -> Tensor", &cuda::median_of_pairs);
  m.def("standardize(Tensor x, bool to_standard_normal, float bias) -> (Tensor, Tensor, Tensor)", &cuda::standardize);
  m.def("standardize_grad(Tensor? grad_z, Tensor? grad_t, Tensor z, Tensor std, Tensor x, bool to_standard_normal) "
        "-> Tensor", &cuda::standardize_grad);
  // the generic path as CUDA tensors take it (csrc/generic.cpp): the shapes the kernels above leave it
  m.def("generic_kl(Tensor prior_z, Tensor q_z, float lam, float clip, Tensor? sigma, bool reverse,"
        " bool grad_state) -> (Tensor, Tensor, Tensor, Tensor)",
        &generic::kl);
  m.def("generic_kl_grad(Tensor grad_kl, Tensor state, Tensor q_z, Tensor prior_z, bool reverse) -> Tensor",
        &generic::kl_grad);
  m.def("generic_fit(Tensor numer, Tensor denom, float lam, Tensor? sigma) -> (Tensor, Tensor)", &generic_fit);
  m.def("generic_median_bandwidth(Tensor x) -> Tensor", &generic::median_bandwidth);
  m.def("set_generic_kernels(bool flag) -> bool", &cuda::set_generic_kernels);
  m.def("handles_kl(int n_total, int d, int batch) -> bool", &handles_kl);
  m.def("median_blocks_per_element(int P, int nb, int sms) -> int", &cuda::median_blocks_per_element);
  m.def("handles_kl_grad(int n_total, int n_q, int d, int batch) -> bool", &cuda::handles_kl_grad);
  m.def("set_two_blocks_per_sm(bool flag) -> bool", &cuda::set_two_blocks_per_sm);
  m.def("set_paired_elimination(bool flag) -> bool", &cuda::set_paired_elimination);
  m.def("set_gathered_selection(bool flag) -> bool", &cuda::set_gathered_selection);
  m.def("set_gemm_kernel_values(bool flag) -> bool", &cuda::set_gemm_kernel_values);
  m.def("set_tile_subblocks(bool flag) -> bool", &cuda::set_tile_subblocks);
  m.def("set_balanced_tile_ranges(bool flag) -> bool", &cuda::set_balanced_tile_ranges);
  m.def("set_product_tile_distances(bool flag) -> bool", &cuda::set_product_tile_distances);
  m.def("set_gemm_pair_distances(bool flag) -> bool", &cuda::set_gemm_pair_distances);
  m.def("set_paired_weight_dims(bool flag) -> bool", &cuda::set_paired_weight_dims);
  m.def("set_weight_kernel(bool flag) -> bool", &cuda::set_weight_kernel);
  m.def("configure(int multiprocessors, int shared_per_block_optin, int shared_per_multiprocessor,"
        " int reserved_shared_per_block, int seed) -> ()",
        &configure);
  m.def("take_launches() -> (str[], int[])", &take_launches);
  // kernels with the bugs the emulation must catch (buggy_kernels.cu)
  m.def("run_buggy_kernel(str name) -> Tensor", &cuda_emulation::run_buggy_kernel);
}

}  // namespace kivi_fast
