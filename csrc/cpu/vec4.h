// Four doubles for the loops compiled once per ISA level (KIVI_FAST_ISA_CLONES, isa.h): GCC lowers the
// type to one AVX register or two SSE2 ones, whichever the clone has. Only for those files: they are
// compiled with -Wno-psabi (CMakeLists.txt), since the type passes through inline helpers only.
#pragma once

namespace kivi_fast {
namespace rows {

typedef double Vec4 __attribute__((vector_size(32), aligned(8)));

inline Vec4 load4(const double* p) {
  Vec4 v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

inline void store4(double* p, Vec4 v) { __builtin_memcpy(p, &v, sizeof v); }

}  // namespace rows
}  // namespace kivi_fast
