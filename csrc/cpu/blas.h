// BLAS and LAPACK as linked into torch (MKL or OpenBLAS export these Fortran names), called directly:
// an ATen call costs ~5 us of dispatch and tensor set-up, as much as a 100 x 100 x 51 product's
// arithmetic. Weak: where a build of torch does not export them they are null, and the ATen calls (one
// more copy each) are used instead.
#pragma once

#include <cstdint>

extern "C" {
void dpotrf_(const char* uplo, const int* n, double* a, const int* lda, int* info) __attribute__((weak));
void dpotrs_(const char* uplo, const int* n, const int* nrhs, const double* a, const int* lda, double* b,
             const int* ldb, int* info) __attribute__((weak));
void spotrf_(const char* uplo, const int* n, float* a, const int* lda, int* info) __attribute__((weak));
void spotrs_(const char* uplo, const int* n, const int* nrhs, const float* a, const int* lda, float* b,
             const int* ldb, int* info) __attribute__((weak));
void dgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k, const double* alpha,
            const double* a, const int* lda, const double* b, const int* ldb, const double* beta, double* c,
            const int* ldc) __attribute__((weak));
}

namespace kivi_fast {
namespace cpu {

// Whether to call the symbols above where torch exports them; off, the ATen calls that builds without
// them use, and no float32 factor of large systems (the solve's float64 Cholesky only).
bool external_blas();
// Tests: switches external_blas(); returns the old value.
bool set_external_blas(bool flag);
// Whether LAPACK's float64 Cholesky (dpotrf_, dpotrs_), and its float32 one (spotrf_, spotrs_), are
// there to call.
bool has_lapack_float64();
bool has_lapack_float32();

// Row-major C [m, n] = op(A) op(B) (accumulate: C += op(A) op(B)), op(X) = X^T where trans_x, with
// leading dimensions lda, ldb, ldc: BLAS's dgemm where external_blas(), else ATen's.
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const double* a, int64_t lda, const double* b,
          int64_t ldb, bool accumulate, double* c, int64_t ldc);

}  // namespace cpu
}  // namespace kivi_fast
