// How the CPU kernels pick their instruction set: the one mechanism of all three kernel families.
//
//  - Where hand-written x86 kernels compile (x86-64 GCC or Clang, unless KIVI_FAST_NO_MULTIVERSION is
//    defined), KIVI_FAST_X86_SIMD is defined and functions take an instruction set with KIVI_AVX2 (AVX2 +
//    FMA) or KIVI_AVX512 (AVX-512F). Elsewhere each family compiles its portable version, or tells its
//    callers to keep the GEMMs (few_points::available(), gram_tiles::available()).
//  - At run time, isa::cpu_level() says which of those the CPU runs: gram_tiles.cpp whether its AVX2
//    tiles can run, median.cpp whether its AVX2 counting pass can; isa::prefer_512_bit() whether
//    few_points.cpp takes its AVX-512 or AVX2 kernels and the Gram MKL's GEMMs or the AVX2 tiles.
//  - Loops written in plain C++ (simd_rows.cpp, median.cpp) are compiled once per level with
//    KIVI_FAST_ISA_CLONES (GCC function multiversioning: the loader picks the clone from the CPU's
//    features), where the platform's loader supports it (glibc's ifunc).
//
// Each family keeps its own test switch (in csrc/testing.cpp) to run either choice where the CPU has
// both, so that both are tested on an AVX-512 CPU. A CUDA build would dispatch on the device, in
// csrc/cuda/, not here.
#pragma once

#if defined(__GNUC__) && defined(__x86_64__) && !defined(KIVI_FAST_NO_MULTIVERSION)
#define KIVI_FAST_X86_SIMD 1
#include <immintrin.h>
#define KIVI_AVX2 __attribute__((target("avx2,fma")))
#define KIVI_AVX512 __attribute__((target("avx512f")))
#endif

#if defined(KIVI_FAST_X86_SIMD) && defined(__linux__)
// Each function marked KIVI_FAST_ISA_CLONES is compiled for AVX-512, AVX2 with FMA (x86-64-v3) and the
// baseline ISA, the marks on the definitions only, so that callers go through the resolver. Helpers the
// clones call must be always inlined, so that each clone gets its own copy (an out-of-line helper is
// compiled for the baseline ISA only).
#if !defined(__clang__) && __GNUC__ >= 12
// x86-64-v3 = AVX2 + FMA (+ BMI); older compilers get plain AVX2 (no FMA)
#define KIVI_FAST_ISA_CLONES __attribute__((target_clones("avx512f", "arch=x86-64-v3", "default")))
#else
#define KIVI_FAST_ISA_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#endif
#else
#define KIVI_FAST_ISA_CLONES
#endif

namespace kivi_fast {
namespace isa {

// Ordered: a CPU at one level runs the kernels of every level below it.
enum class Level : int {
  kBaseline = 0,
  kAvx2 = 1,    // AVX2 and FMA
  kAvx512 = 2,  // AVX-512F as well
};

// This CPU's level, read on first use (not during the library's static initialization, before which
// the CPU's features may not be known).
inline Level cpu_level() {
#ifdef KIVI_FAST_X86_SIMD
  static const Level level = [] {
    __builtin_cpu_init();
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (avx2 && __builtin_cpu_supports("avx512f")) return Level::kAvx512;
    return avx2 ? Level::kAvx2 : Level::kBaseline;
  }();
  return level;
#else
  return Level::kBaseline;
#endif
}

inline bool cpu_has(Level level) { return cpu_level() >= level; }

// Whether the 512-bit choices are taken where 256-bit kernels exist too: few_points.cpp's AVX-512
// kernels, and MKL's 8-wide GEMMs rather than gram_tiles' 4-wide register tiles. Not on AMD's family
// 25 (Zen 4), which runs 512-bit instructions as two 256-bit halves: there the 256-bit kernels were
// faster or level on every shape measured, float32 and float64 (bench/isa_choices.py; bench/README.md,
// "Instruction sets"). Other AVX-512 CPUs (Intel's, AMD's later families) were not measured: the
// 512-bit choices stand there.
inline bool prefer_512_bit() {
#if defined(KIVI_FAST_X86_SIMD) && (defined(__clang__) || __GNUC__ >= 11)  // (older GCCs lack amdfam19h)
  static const bool prefer = cpu_has(Level::kAvx512) && !__builtin_cpu_is("amdfam19h");
  return prefer;
#else
  return cpu_has(Level::kAvx512);
#endif
}

}  // namespace isa
}  // namespace kivi_fast
