#include "cpu/solve.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu/blas.h"
#include "cpu/loops.h"
#include "kivi.h"

namespace kivi_fast {
namespace cpu {
namespace {

// Systems up to this size are factored by rows::cholesky_upper: at 100 x 100, 18-25 us against 48 us for
// MKL's dpotrf on this project's AMD EPYC core, which loses to MKL's blocked code from ~300 rows. Against
// the float32 factor refined in float64 that larger systems get (solve_refined) the crossover is also
// near 300-350 rows.
constexpr int64_t kOwnCholeskyMaxRows = 256;

// Refinement steps after the first float32 solve before the float32 factor is given up for a float64
// one. Each step multiplies the error by about cond(A) eps_float32, cond(A) <= (1 + lam) / lam (the
// kernel's eigenvalues lie in [0, n_den]): 3 solves in all at lam = 1e-3 ((1000, 32), (2000, 32)), 4 at
// 1e-2 (300 rows), 9 at a condition number of 6e6 (refined_solve_counts). A step that does not halve
// the residual ends it sooner.
constexpr int kMaxRefinements = 30;

// How solve_refined's calls ended since the library was loaded: converged, float32 could not factor,
// the steps stalled; and the float32 solves they made (what the tests read through refined_solve_counts).
std::atomic<int64_t> refined_converged{0}, refined_factor_failed{0}, refined_stalled{0}, refined_solves{0};

template <class T>
void fill_system_upper(const double* kernel, int64_t n, int64_t n_den, double lam, T* a, int64_t ld) {
  for (int64_t i = 0; i < n_den; ++i) fill_system_row(kernel, n, n_den, lam, a, ld, i);
}

// y = K_dd x, and where sums is given sums = K_dd 1, from the upper triangle of K_dd (the first n_den
// rows and columns of the N x N kernel, row-major), four rows at a time: their diagonal block, then
// their rows past it give them their sums over j with k_ij x_j and add k_ij x_i to y_j. Half the bytes
// of full rows, and the lower triangle need not be mirrored; one row at a time (a dot and an axpy)
// runs at half a plain dot's bandwidth, four at a time 2.3x faster than that. In parallel, each thread
// adds into a zeroed partial of its own, so the last bits of y (and of a refined solution) depend on
// the number of threads.
void symmetric_times(const double* kernel, int64_t n, int64_t n_den, const double* x, double* y, double* sums,
                     bool parallel) {
  const int64_t outputs = sums != nullptr ? 2 : 1;
  const int64_t parts = parallel ? at::get_num_threads() : 1;
  std::vector<double> partial(parts * outputs * n_den, 0.0);
  const std::vector<double> ones(sums != nullptr ? n_den : 0, 1.0);
  auto block = [&](int64_t t) {
    double* const part = partial.data() + (parallel ? at::get_thread_num() : 0) * outputs * n_den;
    const int64_t i0 = 4 * t, i1 = std::min(n_den, i0 + 4);
    for (int64_t o = 0; o < outputs; ++o) {
      const double* v = o == 0 ? x : ones.data();
      double* py = part + o * n_den;
      for (int64_t i = i0; i < i1; ++i) {
        const double* k = kernel + i * n;
        py[i] += k[i] * v[i];
        for (int64_t j = i + 1; j < i1; ++j) {
          py[i] += k[j] * v[j];
          py[j] += k[j] * v[i];
        }
      }
      if (i1 - i0 == 4 && i1 < n_den) {
        double own[4];
        rows::dots4_axpy(kernel + i0 * n + i1, n, v + i1, v + i0, py + i1, n_den - i1, own);
        for (int64_t r = 0; r < 4; ++r) py[i0 + r] += own[r];
      }
    }
  };
  const int64_t blocks = (n_den + 3) / 4;
  if (parallel) {
    for_triangle_rows(blocks, parallel, 4, block);
  } else {
    for (int64_t t = 0; t < blocks; ++t) block(t);
  }
  for (int64_t o = 0; o < outputs; ++o) {
    double* out = o == 0 ? y : sums;
    std::copy_n(partial.data() + o * n_den, n_den, out);
    for (int64_t p = 1; p < parts; ++p)
      for (int64_t i = 0; i < n_den; ++i) out[i] += partial[(p * outputs + o) * n_den + i];
  }
}

// A x = b for A = K_dd / n_den + lam I (K_dd: the first n_den rows and columns of the N x N kernel,
// row-major, upper triangle) by LAPACK's float32 Cholesky and refinement in float64, as LAPACK's dsposv
// (which torch does not export): x = solve32(b), then x += solve32(b - A x) while that halves the
// float64 residual, until ||r|| <= eps ||A|| ||x|| (infinity norms, eps = 2^-53: float64's rounding of
// A x) or, where the steps stop halving it, dsposv's test ||r|| <= sqrt(n_den) eps ||A|| ||x||: a
// backward error as small as float64 Cholesky's. The float32 factor costs half the float64 one (2000 rows:
// 50 against 110 ms, 1 thread) and each step a float32 solve and one pass over the upper triangle in
// float64 (symmetric_times). Each right-hand side is scaled to a largest entry of 1 before it is
// rounded, so float32's range never limits it. The float32 system is in system32_buffer(scratch),
// filled by the exponentials' pass (SystemRows). b is overwritten with x where this returns true; it is
// left as it was where float32 cannot factor A (cond(A) beyond about 1 / eps_float32) or the steps
// stall, and the caller then factors in float64.
bool solve_refined(const double* kernel, int64_t n, int64_t n_den, double lam, double* b, Scratch& scratch,
                   bool parallel) {
  const double inv_n = 1.0 / static_cast<double>(n_den);
  float* const factor = system32_buffer(scratch, n_den);
  const int nn = static_cast<int>(n_den), one = 1;
  int info = 0;
  spotrf_("L", &nn, factor, &nn, &info);
  if (info != 0) {
    ++refined_factor_failed;
    return false;
  }
  std::vector<double> x(n_den, 0.0), r(b, b + n_den), kx(n_den), row_norm(n_den);
  std::vector<float> step(n_den);
  double r_norm = rows::max_abs(r.data(), n_den);
  if (r_norm == 0.0) {  // b = 0: every kernel value between the two samples underflowed; x = 0 = b
    ++refined_converged;
    return true;
  }
  double a_norm = 0.0;  // ||A||_inf, summed in the first residual pass (the kernel is >= 0)
  const double eps = 0.5 * std::numeric_limits<double>::epsilon(), dsposv_factor = std::sqrt(static_cast<double>(n_den));
  for (int it = 0; it <= kMaxRefinements && std::isfinite(r_norm); ++it) {
    rows::scale_copy(r.data(), 1.0 / r_norm, step.data(), n_den);
    spotrs_("L", &nn, &one, factor, &nn, step.data(), &nn, &info);
    ++refined_solves;
    for (int64_t i = 0; i < n_den; ++i) x[i] += r_norm * static_cast<double>(step[i]);
    const bool first = it == 0;
    symmetric_times(kernel, n, n_den, x.data(), kx.data(), first ? row_norm.data() : nullptr, parallel);
    for (int64_t i = 0; i < n_den; ++i) r[i] = b[i] - (inv_n * kx[i] + lam * x[i]);
    if (first) a_norm = inv_n * *std::max_element(row_norm.begin(), row_norm.end()) + lam;
    const double previous = r_norm;
    r_norm = rows::max_abs(r.data(), n_den);
    // Steps go on while they halve the residual, down to float64's rounding of A x; where they stop
    // halving, dsposv's test decides.
    const double rounding = eps * a_norm * rows::max_abs(x.data(), n_den);
    const bool last = it == kMaxRefinements || (!first && !(r_norm <= 0.5 * previous));
    if (r_norm <= rounding || (last && r_norm <= dsposv_factor * rounding)) {
      ++refined_converged;
      std::copy(x.begin(), x.end(), b);
      return true;
    }
    if (last) break;
  }
  ++refined_stalled;  // or a residual that is not finite (b is finite: it cannot come from there)
  return false;
}

}  // namespace

bool uses_refined_solve(int64_t n_den) {
  return n_den > kOwnCholeskyMaxRows && has_lapack_float64() && has_lapack_float32();
}

float* system32_buffer(Scratch& scratch, int64_t n_den) {
  return reinterpret_cast<float*>(scratch.get((n_den * n_den + 1) / 2));
}

void solve_alpha_one(const double* kernel, int64_t n, int64_t n_den, double lam, double* alpha, Work& work,
                     bool parallel, bool refined) {
  const int64_t n_num = n - n_den;
  const double rhs_scale = -1.0 / (lam * static_cast<double>(n_den) * static_cast<double>(n_num));
  for (int64_t i = 0; i < n_den; ++i) alpha[i] *= rhs_scale;
  const bool own = n_den <= kOwnCholeskyMaxRows;
  const bool lapack = has_lapack_float64();
  if (refined && solve_refined(kernel, n, n_den, lam, alpha, work.system, parallel)) {
    return;
  }
  // our Cholesky wants padded rows (see rows::cholesky_upper); LAPACK and ATen a contiguous matrix
  const int64_t ld = own ? rows::cholesky_ld(n_den) : n_den;
  const int64_t rows_alloc = own ? rows::cholesky_rows(n_den) : n_den;
  double* const system = work.system.get(rows_alloc * ld);
  // Only the upper triangle is filled: what every Cholesky path here reads. The padding, and the three
  // entries left of the diagonal that our Cholesky's diagonal blocks update, are zeroed: stale bits
  // there could be denormals.
  fill_system_upper(kernel, n, n_den, lam, system, ld);
  if (own) {
    for (int64_t i = 0; i < n_den; ++i) {
      double* a = system + i * ld;
      std::fill(a + std::max<int64_t>(0, i - 3), a + i, 0.0);
      std::fill(a + n_den, a + ld, 0.0);
    }
  }
  std::fill(system + n_den * ld, system + rows_alloc * ld, 0.0);
  int info = 0;
  if (own) {
    info = rows::cholesky_upper(system, n_den, ld) ? 0 : 1;
    if (info == 0) rows::cholesky_solve_upper(system, n_den, ld, alpha);
  } else if (lapack) {
    const int nn = static_cast<int>(n_den), one = 1;
    dpotrf_("L", &nn, system, &nn, &info);
    if (info == 0) dpotrs_("L", &nn, &one, system, &nn, alpha, &nn, &info);
  } else {
    auto [chol, status] = at::linalg_cholesky_ex(wrap(system, {n_den, n_den}), /*upper=*/true);
    info = status.item<int>();
    if (info == 0) {
      auto x = wrap(alpha, {n_den, 1});
      x.copy_(at::cholesky_solve(x.clone(), chol, /*upper=*/true));
    }
  }
  TORCH_CHECK_VALUE(info == 0, kNotPositiveDefiniteMessage, " (lam = ", lam, ")");
}

std::vector<int64_t> refined_solve_counts() {
  return {refined_converged.load(), refined_factor_failed.load(), refined_stalled.load(), refined_solves.load()};
}

}  // namespace cpu
}  // namespace kivi_fast
