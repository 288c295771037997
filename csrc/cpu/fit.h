// The fit of one batch element on the CPU: squared distances (distances.h), the median bandwidth
// (median.h), the kernel's exponentials, and the solve for the coefficients (solve.h), on the calling
// thread's buffers (buffers.h). Also the sqdist, median_bandwidth and fit ops' CPU kernels (kivi.h).
#pragma once

#include <ATen/ATen.h>
#include <cstdint>
#include <optional>

#include "cpu/buffers.h"
#include "cpu/loops.h"
#include "kivi.h"

namespace kivi_fast {
namespace cpu {

// The fit of numer / denom for batch element b: leaves the coefficients [alpha; beta 1] in work.coef
// ([N]) and the kernel of the stacked points in the first kernel_rows rows of work.sq ([N, N]; the
// fit itself reads only the n_den denominator rows, a caller evaluating at the numer points asks for
// all; their lower part as kernel_rows_from_upper leaves it), and returns the bandwidth.
double fit_one(const Stack& s, int64_t b, int64_t n_den, int64_t kernel_rows, bool lower, double lam,
               const double* sigma_given, Names names, bool parallel, Work& work);

// A given bandwidth's values (float64 [B]), or null for the median.
const double* sigma_data(const std::optional<Tensor>& sigma);

}  // namespace cpu
}  // namespace kivi_fast
