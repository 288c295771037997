// Test switches and counters of the kernels, in a library of their own, torch.ops.kivi_fast_testing.*,
// so that the public namespace torch.ops.kivi_fast holds only the tensor ops. None is a tensor op: each
// sets a process-wide flag or reads a counter, and the setters return the old value so that a test can
// restore it.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "cpu/blas.h"
#include "cpu/few_points.h"
#include "cpu/gram_tiles.h"
#include "cpu/kept_outputs.h"
#include "cpu/median.h"
#include "cpu/solve.h"
#include "kivi.h"

namespace kivi_fast {

TORCH_LIBRARY(kivi_fast_testing, m) {
  // The device-generic kernels (the path CUDA tensors take) for CPU tensors too.
  m.def("set_force_generic(bool flag) -> bool", &set_force_generic);
  // The few-points kernels' AVX-512 (true) or AVX2 (false) version, where the CPU has both; and
  // whether this CPU has AVX-512 (else the switch's true runs the AVX2 version).
  m.def("set_few_points_avx512(bool flag) -> bool", &few_points::set_avx512);
  m.def("few_points_avx512_available() -> bool", &few_points::avx512_available);
  // The Gram's register tiles (true, where the CPU has AVX2 + FMA) or the split GEMMs (false); and
  // whether this CPU can run the tiles.
  m.def("set_gram_tiles(bool flag) -> bool", &gram_tiles::set_enabled);
  m.def("gram_tiles_available() -> bool", &gram_tiles::available);
  // The ATen calls in place of torch's exported BLAS/LAPACK symbols.
  m.def("set_external_blas(bool flag) -> bool", &cpu::set_external_blas);
  // How the solves of systems above 256 rows ended, [converged, float32 could not factor, stalled,
  // float32 solves made] since load.
  m.def("refined_solve_counts() -> int[]", &cpu::refined_solve_counts);
  // How the median's sampled brackets ended, [held, missed]; and the sample that brackets the middle
  // ranks: its size (0: the bins only) and the bracket's half-width in standard deviations (returns the
  // old [size, sds]).
  m.def("median_counts() -> int[]", &cpu::median_counts);
  m.def("set_median_bracket(int sample_size, float sds) -> float[]", &cpu::set_median_bracket);
  // The bracket's counting pass in portable C++ even on an AVX2 CPU.
  m.def("set_portable_gather(bool flag) -> bool", &rows::set_portable_gather);
  // How many kept buffers were allocated afresh since load (cpu/kept_outputs.h).
  m.def("kept_fresh_buffers() -> int", &kept_outputs::fresh_buffers);
  // Benches: CUDA kl forwards record block 0's clock at their stages into buffer (int64 [6], on the
  // samples' GPU: start, distances, median, system, solve, end); None stops it. An error in a build
  // without the CUDA kernels.
  m.def("set_forward_stage_clocks(Tensor? buffer) -> ()", &cuda::set_stage_clocks);
  // Whether CUDA batches of more than one wave of blocks take the forward kernel's two-blocks-per-SM
  // variant (default true). An error in a build without the CUDA kernels.
  m.def("set_two_blocks_per_sm(bool flag) -> bool", &cuda::set_two_blocks_per_sm);
  // Whether the CUDA forward kernel's elimination takes two columns a step (default true) or one. An
  // error in a build without the CUDA kernels.
  m.def("set_paired_elimination(bool flag) -> bool", &cuda::set_paired_elimination);
  m.def("set_gathered_selection(bool flag) -> bool", &cuda::set_gathered_selection);
  m.def("set_gemm_kernel_values(bool flag) -> bool", &cuda::set_gemm_kernel_values);
  // Whether the generic path on CUDA tensors (many points) takes its CUDA kernels (default true) or
  // ATen's composition of the same steps. An error in a build without the CUDA kernels.
  m.def("set_generic_kernels(bool flag) -> bool", &cuda::set_generic_kernels);
  // Whether the CUDA tiled distances compute only the sub-blocks that hold a needed pair (default
  // true), and whether the weight state's CUDA backward takes two dimensions a thread (default true).
  // Errors in a build without the CUDA kernels.
  m.def("set_tile_subblocks(bool flag) -> bool", &cuda::set_tile_subblocks);
  m.def("set_balanced_tile_ranges(bool flag) -> bool", &cuda::set_balanced_tile_ranges);
  m.def("set_product_tile_distances(bool flag) -> bool", &cuda::set_product_tile_distances);
  m.def("set_gemm_pair_distances(bool flag) -> bool", &cuda::set_gemm_pair_distances);
  m.def("set_paired_weight_dims(bool flag) -> bool", &cuda::set_paired_weight_dims);
  m.def("set_weight_kernel(bool flag) -> bool", &cuda::set_weight_kernel);
}

}  // namespace kivi_fast
