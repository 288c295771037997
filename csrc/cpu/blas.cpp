#include "cpu/blas.h"

#include <ATen/ATen.h>

#include <atomic>

namespace kivi_fast {
namespace cpu {
namespace {

std::atomic<bool> use_external_blas{true};

}  // namespace

bool external_blas() { return use_external_blas; }
bool set_external_blas(bool flag) { return use_external_blas.exchange(flag); }
bool has_lapack_float64() { return dpotrf_ != nullptr && dpotrs_ != nullptr && use_external_blas; }
bool has_lapack_float32() { return spotrf_ != nullptr && spotrs_ != nullptr && use_external_blas; }

void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const double* a, int64_t lda, const double* b,
          int64_t ldb, bool accumulate, double* c, int64_t ldc) {
  if (dgemm_ != nullptr && use_external_blas) {
    // the row-major C is the column-major C^T = op(B)^T op(A)^T, and each row-major operand read
    // column-major is its transpose
    const int mm = static_cast<int>(n), nn = static_cast<int>(m), kk = static_cast<int>(k);
    const int la = static_cast<int>(lda), lb = static_cast<int>(ldb), lc = static_cast<int>(ldc);
    const double one = 1.0, beta = accumulate ? 1.0 : 0.0;
    dgemm_(trans_b ? "T" : "N", trans_a ? "T" : "N", &mm, &nn, &kk, &one, b, &lb, a, &la, &beta, c, &lc);
    return;
  }
  auto view = [](const double* x, int64_t rows, int64_t cols, int64_t ld, bool trans) {
    auto t = at::from_blob(const_cast<double*>(x), {rows, cols}, {ld, 1}, at::TensorOptions().dtype(at::kDouble));
    return trans ? t.t() : t;
  };
  auto out = view(c, m, n, ldc, false);
  auto op_a = trans_a ? view(a, k, m, lda, true) : view(a, m, k, lda, false);
  auto op_b = trans_b ? view(b, n, k, ldb, true) : view(b, k, n, ldb, false);
  if (accumulate) {
    out.addmm_(op_a, op_b);
  } else {
    at::mm_out(out, op_a, op_b);
  }
}

}  // namespace cpu
}  // namespace kivi_fast
