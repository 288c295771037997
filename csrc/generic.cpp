// Device-generic implementation: ATen calls, so it runs wherever ATen does (CUDA tensors for the ops
// and shapes that csrc/cuda/'s fused kernels do not take). It is also the baseline the CPU kernels
// (csrc/cpu/) are tested against. On CUDA some of its pieces are kernels of csrc/cuda/, where ATen
// would take several launches or a buffer: the packed pairs (cuda::pair_sqdist) and their median
// (cuda::median_of_pairs), the blocks of kernel values for samples with few dimensions
// (cuda::kernel_block), the fit's coefficients from its solve (cuda::fit_coef), and the kl forward's
// end (cuda::kl_finish).
//
// Off the CPU nothing here reads a value back to the host (a read stalls the stream at every call and
// breaks CUDA-graph capture): where the CPU raises an error for a value (NaN/Inf samples, a zero
// median, a system that is not positive definite), other devices give NaN for that batch element.
//
// Memory (what a GPU holds for the shapes the CUDA kernels leave here: many points, or many points in
// many dimensions): a fit never makes the N x N kernel matrix. The median reads the N (N - 1) / 2
// pairs' squared distances, packed, and frees them; the system (n_den x n_den, float64, factored in
// place) is then the largest buffer; the kernel values that the right side and the evaluation read are
// made in chunks of rows no larger than the system, never beside it (FitResult). So for n_p = n_q
// the peak is the pairs' N^2 / 2 doubles, and with a given bandwidth the system's N^2 / 4. Samples
// with many dimensions are read in chunks of columns converted to float64 (kChunkBytes), never as a
// float64 copy. python_tests/test_generic_path.py bounds the peaks of the CPU build,
// python_tests/test_cuda_emulation.py those of the GPU build (through the CUDA emulation), and
// bench/generic_memory.py measures the GPU build's against the pure sides.
#include <ATen/ATen.h>
#include "kivi.h"

#include <ATen/record_function.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <tuple>

namespace kivi_fast {

Tensor stack_points(const Tensor& denom, const Tensor& numer) { return at::cat({denom, numer}, 1); }

namespace {

// Where a tensor's values may be read back to raise an error (the CPU), and where the cuda:: kernels
// apply (CUDA tensors). The CUDA emulation's build of this file (KIVI_FAST_CUDA_EMULATION: the
// emulation library, csrc/cuda_emulation/) takes every tensor for a CUDA one, so that
// python_tests/test_cuda_emulation.py runs this file's GPU composition on CPU tensors: the cuda::
// kernels between the ATen calls, and NaN where the CPU raises.
#ifdef KIVI_FAST_CUDA_EMULATION
bool reads_back(const Tensor&) { return false; }
[[maybe_unused]] bool on_cuda(const Tensor&) { return true; }
#else
bool reads_back(const Tensor& t) { return t.is_cpu(); }
[[maybe_unused]] bool on_cuda(const Tensor& t) { return t.is_cuda(); }
#endif

// Per squared norm of a centred point (centred()), whether the point can enter the
// distances (kivi.h's squarable: finite and at most a quarter of float64's range, so that no distance
// overflows), as the CPU kernels judge it.
Tensor squarable_rows(const Tensor& sq_norms) { return sq_norms.le(kMaxSquaredNorm); }

// [B, N, d] float64 points less the centre of each batch element ([B, 1, d]: centre_point; none:
// unchanged), in place. Distances from a Gram, |x|^2 + |y|^2 - 2 x.y, keep only the norms'
// difference: far from the origin the norms of uncentred points would cancel to the distances'
// rounding (at (100, 64), 1e6 standard deviations out, 2e-2 of kernel_kl's value); centred, the
// norms stay near the distances.
Tensor centred(Tensor points, const Tensor& centre) {
  return centre.defined() ? points.sub_(centre) : points;
}

// sq_norms: [B, N] of the stacked points [denom; numer], centred
void check_finite_rows(const Tensor& sq_norms, int64_t n_den, Names names) {
  // A NaN/Inf coordinate makes the squared norm of its row NaN/Inf, so the norms (computed anyway
  // for the distances) tell which input is bad without another pass over the samples. Off the CPU
  // the NaN/Inf flows on instead (fit() turns the whole element's coefficients to NaN).
  if (!reads_back(sq_norms)) return;
  auto ok = squarable_rows(sq_norms);
  TORCH_CHECK_VALUE(ok.narrow(1, 0, n_den).all().item<bool>(), names.denom, kNotFiniteMessage);
  TORCH_CHECK_VALUE(ok.narrow(1, n_den, sq_norms.size(1) - n_den).all().item<bool>(), names.numer,
                    kNotFiniteMessage);
}

// [B] median distance from the squared distances of the pairs ([B, P]), checked > 0 on the CPU (NaN
// elsewhere); numpy's convention for an even count (the mean of the two middle distances).
Tensor median_of_pairs(const Tensor& pairs) {
  // named for the profiler: test_generic_path.py sets the CPU's selection buffers apart
  RECORD_FUNCTION("kivi_fast::median_of_pairs", c10::ArrayRef<const c10::IValue>{});
  const int64_t p = pairs.size(1), k = (p + 1) / 2;  // k: 1-based rank of the lower middle
#ifdef KIVI_FAST_WITH_CUDA
  // Many pairs on a GPU: a radix selection in place (no copy of the pairs, no sort).
  if (on_cuda(pairs) && p >= (int64_t{1} << 16)) return cuda::median_of_pairs(pairs);
#endif
  Tensor lo, hi;
  if (!pairs.device().is_cpu() && p >= (int64_t{1} << 16)) {
    // (Without the CUDA kernels.) CUDA's kthvalue gives each row to one thread block: 65 ms for one
    // row of 8 M pairs on an H100, where a device-wide sort takes 1.1 ms.
    auto sorted = std::get<0>(at::sort(pairs, 1));
    lo = sorted.select(1, k - 1);
    hi = sorted.select(1, p / 2);
  } else {
    lo = std::get<0>(at::kthvalue(pairs, k, 1));
    if (p % 2 == 1) {
      hi = lo;
    } else {  // the next larger value, or lo again when it occurs more than once: no second selection
      auto l = lo.unsqueeze(1);
      auto tie = (pairs <= l).sum(1) > k;
      hi = at::where(tie, lo, at::where(pairs > l, pairs, INFINITY).amin(1));
    }
  }
  auto sigma = (lo.clamp_min(0).sqrt() + hi.clamp_min(0).sqrt()) * 0.5;
  // NaN for a zero median, and for non-finite pairs, whose median the selection may still find finite
  // (as cuda/median.cu gives; a fit's floor, kMinBandwidth, is fit_stacked's)
  if (!reads_back(sigma)) return at::where(sigma.gt(0).logical_and_(pairs.isfinite().all(1)), sigma, NAN);
  TORCH_CHECK_VALUE((sigma > 0).all().item<bool>(), kZeroMedianMessage);
  return sigma;
}

}  // namespace

namespace generic {

// (kivi.h says what it is.) The bound: the float64 rounding of a dot product of d terms, d 2^-53
// |x| |y| <= d 2^-53 (|x|^2 + |y|^2) / 2, twice over for -2 x.y, plus the norms' own roundings.
Tensor& zero_below_gram_rounding(Tensor& sq, const Tensor& xn, const Tensor& yn, int64_t d) {
  const double bound = static_cast<double>(d + 2) * std::ldexp(1.0, -52);
  return sq.masked_fill_(sq.lt(xn.unsqueeze(2).add(yn.unsqueeze(1)).mul_(bound)), 0.0);
}

// (kivi.h says what it is.)
Tensor stacked_chunk(const Tensor& denom, const Tensor& numer, int64_t s, int64_t c, const Tensor& buf) {
  auto x = buf.narrow(2, 0, c);
  x.narrow(1, 0, denom.size(1)).copy_(denom.narrow(2, s, c));
  x.narrow(1, denom.size(1), numer.size(1)).copy_(numer.narrow(2, s, c));
  return x;
}

// (kivi.h says what it is.) Coordinate by coordinate: non-finite ones are passed over by fmin and fmax.
Tensor centre_point(const Tensor& a, const Tensor& b) {
  const int64_t na = a.size(1), n = na + b.size(1);
  if (n == 0) return Tensor();
  auto row = [&](int64_t i) { return i < na ? a.narrow(1, i, 1) : b.narrow(1, i - na, 1); };
  const auto r = centre_rows(n);
  auto three = at::cat({row(r[0]), row(r[1]), row(r[2])}, 1).to(at::kDouble);  // [B, 3, d]
  three = at::where(three.isfinite(), three, NAN);
  const Tensor x = three.narrow(1, 0, 1), y = three.narrow(1, 1, 1), z = three.narrow(1, 2, 1);
  return at::fmax(at::fmin(x, y), at::fmin(at::fmax(x, y), z));
}

namespace {

// Squared distances [B, n, m] in float64 of rows x to rows y from their float64 coordinates and squared
// norms: ||x||^2 + ||y||^2 - 2 x.y, the GEMM accumulated onto the norms in place (one [B, n, m]
// buffer, not two), clamped at 0.
Tensor sq_from_gram(const Tensor& x, const Tensor& xn, const Tensor& y, const Tensor& yn) {
  return (xn.unsqueeze(2) + yn.unsqueeze(1)).baddbmm_(x, y.transpose(1, 2), 1.0, -2.0).clamp_min_(0);
}

// Samples with many dimensions (an MNIST layer: (100, 50000)) are read in chunks of columns, each
// converted to float64 in a buffer of about this size, never as one float64 copy of the samples (80 MB
// at (100, 50000) float32, twice what the call needs otherwise). Large enough that the chunks' kernel
// launches stay few on a GPU (~20 chunks at (100, 50000)).
constexpr int64_t kChunkBytes = int64_t{4} << 20;
int64_t chunk_columns(int64_t rows) { return std::max<int64_t>(256, kChunkBytes / (8 * std::max<int64_t>(rows, 1))); }

// Rows of a chunk of kernel values [B, rows, width] (float64) within `budget` bytes, or kChunkBytes
// where that is larger, rounded up to whole rows (at most one row over).
int64_t chunk_rows(int64_t B, int64_t width, int64_t budget) {
  const int64_t row = 8 * std::max<int64_t>(B, 1) * std::max<int64_t>(width, 1);
  return std::max<int64_t>(1, (std::max(kChunkBytes, budget) + row - 1) / row);
}

// The squared distances of the stacked points [denom; numer] ([B, N, d]) and their kernel values, any
// block of them on demand, so that a fit holds only the blocks it is using. Samples with few
// dimensions (within one chunk of columns) keep their float64 copy and squared norms, and a block is
// one GEMM onto the norms; on CUDA a block's kernel values are one launch from the samples as they
// are (differences, cuda::kernel_block), and the norms, which then only mark non-finite rows, are
// computed where asked for (a given bandwidth's check; the median's NaN marks non-finite distances).
// Samples with many dimensions (few points: an MNIST layer) are read once, in chunks of columns, into
// the N x N Gram matrix (small beside the samples), and a block is read from it. The Gram and the
// norms are of the centred points (centred()).
class StackedDistances {
 public:
  StackedDistances(const Tensor& denom, const Tensor& numer)
      : B(denom.size(0)), N(denom.size(1) + numer.size(1)), denom_(denom), numer_(numer) {
#ifdef KIVI_FAST_WITH_CUDA
    // (read once: a switch flipped during the call would leave pairs() and the blocks without a source)
    kernels_ = on_cuda(denom) && cuda::use_generic_kernels();
    if (kernels_) {  // contiguous once, not at each kernel's launch
      denom_ = denom.contiguous();
      numer_ = numer.contiguous();
    }
#endif
    const int64_t d = denom.size(2);
    const int64_t width = chunk_columns(B * N);
    if (d <= width) {
      // cuda::kernel_block reads the samples as they are: no copy kept (at (5000, 64) float32 it would
      // add 5 MB to the pairs' 400), unless its GEMM variant's centred points are asked for
      if (kernels_) {
#ifdef KIVI_FAST_WITH_CUDA
        if (cuda::use_gemm_kernel_values()) {
          centred_ = centred(stack_points(denom_, numer_).to(at::kDouble), centre());
          norms_ = centred_.square().sum(-1);  // (what norms() would make)
        }
#endif
        return;
      }
      points_ = centred(stack_points(denom, numer).to(at::kDouble), centre());
      norms_ = points_.square().sum(-1);
      return;
    }
    auto buf = at::empty({B, N, width}, denom.options().dtype(at::kDouble));
    for (int64_t s = 0; s < d; s += width) {
      const int64_t c = std::min(width, d - s);
      auto x = stacked_chunk(denom, numer, s, c, buf);
      if (centre().defined()) x.sub_(centre().narrow(2, s, c));
      gram_ = s == 0 ? at::bmm(x, x.mT()) : gram_.baddbmm_(x, x.mT());
    }
    norms_ = gram_.diagonal(0, 1, 2).clone();
  }

  // [B, rows, cols]: the squared distances of points [r0, r0 + rows) to points [c0, c0 + cols), a new
  // tensor (the caller turns it into kernel values in place); exact zeros on the diagonal, where the
  // GEMM formula leaves rounding noise.
  Tensor block(int64_t r0, int64_t rows, int64_t c0, int64_t cols) const {
    auto xn = norms_.narrow(1, r0, rows), yn = norms_.narrow(1, c0, cols);
    Tensor out;
    if (points_.defined()) {
      out = sq_from_gram(points_.narrow(1, r0, rows), xn, points_.narrow(1, c0, cols), yn);
    } else {
      out = (xn.unsqueeze(2) + yn.unsqueeze(1)).add_(gram_.narrow(1, r0, rows).narrow(2, c0, cols), -2.0).clamp_min_(0);
    }
    const int64_t lo = std::max(r0, c0), hi = std::min(r0 + rows, c0 + cols);
    if (lo < hi) out.narrow(1, lo - r0, hi - lo).narrow(2, lo - c0, hi - lo).diagonal(0, 1, 2).zero_();
    return out;
  }

  // [B, rows, cols]: the kernel values exp(D / scale) of the same block (scale = -2 sigma^2 [B, 1, 1]):
  // on CUDA, samples with few dimensions in one launch (cuda::kernel_block), else the block's squared
  // distances turned into kernel values in place.
  Tensor kernel(int64_t r0, int64_t rows, int64_t c0, int64_t cols, const Tensor& scale) const {
#ifdef KIVI_FAST_WITH_CUDA
    if (fused()) return fused_kernel(r0, rows, c0, cols, scale, 1.0, 0.0);
#endif
    return block(r0, rows, c0, cols).div_(scale).exp_();
  }

  // [B, n, n]: the fit's system K_dd / n + lam I over the first n points (the denominator's).
  Tensor system(int64_t n, const Tensor& scale, double lam) const {
#ifdef KIVI_FAST_WITH_CUDA
    if (fused()) return fused_kernel(0, n, 0, n, scale, n, lam);
#endif
    auto out = kernel(0, n, 0, n, scale).div_(static_cast<double>(n));
    out.diagonal(0, 1, 2).add_(lam);
    return out;
  }

  // [B, N (N - 1) / 2]: the pairs i < j, packed row by row (kivi.h, cuda::pair_sqdist's layout).
  // Float64 for float32 samples too: float32 pairs would halve the peak and the median's passes, but
  // the fit amplifies a change of the bandwidth by up to ~1 / lam, and the median of rounded pairs is
  // off by up to 2^-25: sigma (1 + 2^-25) moves the gradient at (300, 301, 21), lam = 1e-3, by 3e-5 of
  // its scale. Float32 storage would need an exact second stage over the pairs that share the median's
  // rounded key.
  Tensor pairs() const {
#ifdef KIVI_FAST_WITH_CUDA
    if (kernels_) return cuda::pair_sqdist(denom_, numer_);  // no chunks
#endif
    auto out = at::empty({B, N * (N - 1) / 2}, norms_.options());  // (made in the constructor here)
    // named for the profiler: the chunks, which the GPU build does without (test_generic_path.py)
    RECORD_FUNCTION("kivi_fast::pack_pairs", c10::ArrayRef<const c10::IValue>{});
    const int64_t step = chunk_rows(B, N, 0);
    for (int64_t r0 = 0, at_pair = 0; r0 < N - 1; r0 += step) {
      const int64_t rows = std::min(step, N - 1 - r0), cols = N - 1 - r0;
      // row r0 + i holds the pairs with columns r0 + 1 + j, j >= i: the upper triangle of the block,
      // gathered by index (a mask's count would be read back to the host off the CPU)
      auto upper = at::triu_indices(rows, cols, 0, norms_.options().dtype(at::kLong));
      auto sq = block(r0, rows, r0 + 1, cols);
      zero_below_gram_rounding(sq, norms_.narrow(1, r0, rows), norms_.narrow(1, r0 + 1, cols), denom_.size(2));
      auto chunk = sq.view({B, rows * cols}).index_select(1, upper[0] * cols + upper[1]);
      out.narrow(1, at_pair, chunk.size(1)).copy_(chunk);
      at_pair += chunk.size(1);
    }
    return out;
  }

  // the stacked points in float64 ([B, N, d]), a new copy (the one kept is centred)
  Tensor points() const { return stack_points(denom_, numer_).to(at::kDouble); }
  // [B, N]: the squared norms of the centred points; NaN/Inf for a row with a NaN/Inf coordinate
  const Tensor& norms() const {
    if (!norms_.defined()) norms_ = centred(points(), centre()).square().sum(-1);  // (fused)
    return norms_;
  }
  // whether the value checks read their results back to raise errors (the CPU), or give NaN
  bool checks_read_back() const { return reads_back(denom_); }

  int64_t B, N;

 private:
  Tensor denom_, numer_;
  mutable Tensor centre_;  // [B, 1, d]: the point the Gram's points are centred on (made on demand)
  const Tensor& centre() const {
    if (!centre_.defined()) centre_ = centre_point(denom_, numer_);
    return centre_;
  }
  bool kernels_ = false;  // on CUDA with cuda::use_generic_kernels(): the pairs from the samples
  Tensor points_;       // few dimensions, not fused: [B, N, d] float64, centred
  Tensor gram_;         // many dimensions: [B, N, N]
  mutable Tensor norms_;  // (made on demand when fused, but with the GEMM kernel values)

  Tensor centred_;  // fused with set_gemm_kernel_values: [B, N, d], once a fit (their norms: norms_)

  // few dimensions with the kernels: the kernel values from the samples too (no Gram of many dimensions)
  bool fused() const { return kernels_ && !gram_.defined(); }
#ifdef KIVI_FAST_WITH_CUDA
  Tensor fused_kernel(int64_t r0, int64_t rows, int64_t c0, int64_t cols, const Tensor& scale, double divisor,
                      double diagonal) const {
    if (centred_.defined()) {
      return cuda::gram_kernel_block(centred_, norms_, r0, rows, c0, cols, scale.view({-1}), divisor, diagonal);
    }
    return cuda::kernel_block(denom_, numer_, r0, rows, c0, cols, scale.view({-1}), divisor, diagonal);
  }
#endif
};

// The fit's system K_dd / n_den + lam I solved for its right side K_dn 1 / (lam n_den n_num): x
// [B, n_den, 1] (alpha = -x) and Cholesky's info [B] (0: positive definite; checked here on the CPU).
// The right side first, from the numerator's columns in chunks of rows within budget bytes, then the
// system, factored in place.
std::pair<Tensor, Tensor> solve_system(const StackedDistances& dist, int64_t n_den, const Tensor& scale, double lam,
                                       int64_t budget) {
  const int64_t B = scale.size(0), n_num = dist.N - n_den;
  auto rhs = at::empty({B, n_den, 1}, scale.options());
  const int64_t step = chunk_rows(B, n_num, budget);
  for (int64_t r0 = 0; r0 < n_den; r0 += step) {
    const int64_t rows = std::min(step, n_den - r0);
    auto part = rhs.narrow(1, r0, rows);
    at::sum_out(part, dist.kernel(r0, rows, n_den, n_num, scale), -1, true);
  }
  rhs.div_(lam * static_cast<double>(n_den) * static_cast<double>(n_num));
  auto system = dist.system(n_den, scale, lam);
  // Factored in place: the system is symmetric, so its transpose is the column-major layout LAPACK and
  // cuSOLVER factor, and at::linalg_cholesky_ex_out then neither copies it nor allocates the factor
  // (an n_den x n_den float64 matrix: 200 MB at n_den = 5,000).
  auto chol = system.mT();
  auto info = at::empty({B}, system.options().dtype(at::kInt));
  at::linalg_cholesky_ex_out(chol, info, chol);
  if (reads_back(chol)) {
    TORCH_CHECK_VALUE((info == 0).all().item<bool>(), kNotPositiveDefiniteMessage, " (lam = ", lam, ")");
  }
  // two triangular solves rather than cholesky_solve, whose CUDA version may read its status back
  auto y = at::linalg_solve_triangular(chol, rhs, /*upper=*/false);
  return {at::linalg_solve_triangular(chol.mH(), y, /*upper=*/true), info};
}

// A fit of numer / denom from their stacked points' distances: coef [B, N] and sigma [B], the kernel's
// scale for the evaluation, and the bytes a chunk of kernel rows may take: the system's. The chunks
// never coexist with the system or the median's pairs (the right side's chunks come between the two,
// the evaluation's after both), so the peak stays the larger of those two, and on a GPU, where the
// host's launches bound these shapes, the chunks are few: at n_p = n_q one for the right side and two
// for the evaluation.
struct FitResult {
  Fit fit;
  Tensor scale;  // -2 sigma^2 [B, 1, 1]
  int64_t chunk_budget;
};

FitResult fit_stacked(const StackedDistances& dist, int64_t n_den, double lam, const std::optional<Tensor>& sigma,
                      Names names) {
  if (dist.checks_read_back()) check_finite_rows(dist.norms(), n_den, names);
  auto s = sigma.has_value() ? *sigma : median_of_pairs(dist.pairs());
  // A given bandwidth: NaN where it is not at least kMinBandwidth and finite, and for non-finite
  // samples, which the norms mark (also coordinates whose squares overflow, as the CPU's check; the
  // median marks non-finite distances, as kl.cu). A median below the floor: refused, or NaN.
  if (!reads_back(s)) {
    auto ok = s.ge(kMinBandwidth);
    if (sigma.has_value()) ok.logical_and_(s.isfinite()).logical_and_(squarable_rows(dist.norms()).all(1));
    s = at::where(ok, s, NAN);
  } else if (!sigma.has_value()) {  // (a given one: checked by the op)
    TORCH_CHECK_VALUE((s >= kMinBandwidth).all().item<bool>(), kSmallMedianMessage);
  }
  const int64_t budget = 8 * dist.B * n_den * n_den;
  const auto scale = (s * s * -2.0).view({-1, 1, 1});
  auto [x, info] = solve_system(dist, n_den, scale, lam, budget);
  const double beta = 1.0 / (lam * static_cast<double>(dist.N - n_den));
#ifdef KIVI_FAST_WITH_CUDA
  if (on_cuda(x) && cuda::use_generic_kernels()) {
    return {{cuda::fit_coef(x, info, s, dist.N, beta), s}, scale, budget};  // one launch
  }
#endif
  // off the CPU: NaN for an element whose system failed or whose samples are not finite (check_finite_rows)
  auto alpha = -x.squeeze(-1);
  if (!reads_back(alpha)) {
    alpha = at::where((info == 0).unsqueeze(-1).logical_and(squarable_rows(dist.norms()).all(1, true)), alpha, NAN);
  }
  auto betas = at::full({alpha.size(0), dist.N - n_den}, beta, alpha.options());
  return {{at::cat({alpha, betas}, 1), s}, scale, budget};
}

// grad_j = row_scale_j (sum_c W_jc c - (sum_c W_jc) z_j) from the projection (row_scale [B, m] or [B, 1])
Tensor grad_from_projection(const Tensor& projection, const Tensor& row_scale, const Tensor& z) {
  const int64_t d = z.size(2);
  auto grad = projection.narrow(2, 0, d) - projection.narrow(2, d, 1) * z.to(at::kDouble);
  return (grad * row_scale.unsqueeze(-1)).to(z.scalar_type());
}

// grad_j = sum_c W_jc c - zw_j z_j, c over the stacked points [denom; numer], with float64 products,
// returned in z's dtype: W [B, m, N] float64 with the row scales folded in; zw [B, m, 1], or undefined
// where z's term is folded into W too. Float32 samples are read in chunks of columns converted to
// float64 (chunk_columns), the buffers reused by every chunk: no float64 copy of the samples, and no
// temporary of the gradient's size.
Tensor weighted_points(const Tensor& w, const Tensor& zw, const Tensor& z, const Tensor& denom,
                       const Tensor& numer) {
  const int64_t B = z.size(0), m = z.size(1), d = z.size(2), n_den = denom.size(1), N = w.size(2);
  auto grad = at::empty(z.sizes(), z.options());
  if (z.scalar_type() == at::kDouble) {  // the samples as they are: straight into the gradient
    at::bmm_out(grad, w.narrow(2, 0, n_den), denom).baddbmm_(w.narrow(2, n_den, N - n_den), numer);
    if (zw.defined()) grad.addcmul_(zw, z, -1.0);
    return grad;
  }
  const int64_t width = std::min(d, chunk_columns(B * std::max(N, m)));
  auto buf = at::empty({B, N, width}, w.options());
  auto g = at::empty({B, m, width}, w.options());
  auto zbuf = zw.defined() ? at::empty({B, m, width}, w.options()) : Tensor();
  for (int64_t s = 0; s < d; s += width) {
    const int64_t c = std::min(width, d - s);
    auto gc = g.narrow(2, 0, c);
    at::bmm_out(gc, w, stacked_chunk(denom, numer, s, c, buf));
    if (zw.defined()) gc.addcmul_(zw, zbuf.narrow(2, 0, c).copy_(z.narrow(2, s, c)), -1.0);
    grad.narrow(2, s, c).copy_(gc);
  }
  return grad;
}

}  // namespace

Tensor sqdist(const Tensor& x, const Tensor& y, Names names) {
  const auto centre = centre_point(x, y);
  // (copies: the inputs, float64 already, must not be centred in place)
  auto x64 = centred(x.to(at::kDouble, false, true), centre);
  auto y64 = centred(y.to(at::kDouble, false, true), centre);
  auto xn = x64.pow(2).sum(-1);
  auto yn = y64.pow(2).sum(-1);
  check_finite_rows(at::cat({xn, yn}, 1), x.size(1), names);
  return sq_from_gram(x64, xn, y64, yn);
}

Tensor median_bandwidth(const Tensor& x) {
  const auto none = x.new_empty({x.size(0), 0, x.size(2)});
  const StackedDistances dist(x, none);
  if (dist.checks_read_back()) check_finite_rows(dist.norms(), x.size(1), {"x", "x"});
  return median_of_pairs(dist.pairs());
}

Fit fit(const Tensor& numer, const Tensor& denom, double lam, const std::optional<Tensor>& sigma, Names names) {
  const StackedDistances dist(denom, numer);
  return fit_stacked(dist, denom.size(1), lam, sigma, names).fit;
}

std::tuple<Tensor, Tensor, Tensor, Tensor> kl(const Tensor& prior_z, const Tensor& q_z, double lam, double clip,
                                              const std::optional<Tensor>& sigma, bool reverse, bool grad_state) {
  const KlRoles roles = kl_roles(prior_z, q_z, reverse);
  const int64_t B = q_z.size(0), n_q = q_z.size(1), d = q_z.size(2), n_den = roles.denom.size(1);
  const StackedDistances dist(roles.denom, roles.numer);
  const int64_t N = dist.N;
  const auto [f, scale, budget] = fit_stacked(dist, n_den, lam, sigma, roles.names);
  const bool projection = grad_state_is_projection(N, d);
  // The evaluation at q_z (the stacked rows [row0, row0 + n_q)), in chunks of rows of their kernel
  // values against all N points, each chunk one GEMM with coef_c: r_j = sum_c coef_c k(c, z_j); for a
  // projection state the same GEMM with [coef_c c, coef_c] gives [sum_c coef_c k(c, z_j) c, r_j], the
  // state's unscaled rows; a weights state keeps coef_c k(c, z_j). (The projection's GEMM runs without
  // a gradient to come too: r's bits then do not depend on it.)
  const auto coef = f.coef.unsqueeze(-1);  // [B, N, 1]
  const bool with_points = projection;
  const auto by = with_points ? at::cat({dist.points() * coef, coef}, 2) : coef;
  auto out = at::empty({B, n_q, by.size(2)}, f.coef.options());
  auto weights = grad_state && !projection ? at::empty({B, n_q, N}, f.coef.options()) : Tensor();
  const int64_t step = chunk_rows(B, N, budget);
  for (int64_t j0 = 0; j0 < n_q; j0 += step) {
    const int64_t rows = std::min(step, n_q - j0);
    auto k = dist.kernel(roles.row0 + j0, rows, 0, N, scale);  // [B, rows, N]
    auto part = out.narrow(1, j0, rows);
    at::bmm_out(part, k, by);
    if (weights.defined()) {
      auto w = weights.narrow(1, j0, rows);
      at::mul_out(w, k, f.coef.unsqueeze(1));
    }
  }
  // The state's rows scaled by d log r / dz = (d r / dz) / r, with grad_z k(c, z) = k(c, z) (c - z) /
  // sigma^2; clipped: none.
  auto state = !grad_state ? out.new_empty({B, n_q, 0}) : with_points ? out : weights;
#ifdef KIVI_FAST_WITH_CUDA
  // One launch for the 13 below where the state is small (a block an element scales it; the host bounds
  // such calls, as (1000, 32)'s), ATen's launches, over the whole GPU, for larger ones.
  if (on_cuda(out) && cuda::use_generic_kernels() && n_q > 0 && n_q * state.size(2) <= (int64_t{1} << 17)) {
    auto [kl, clipped] = cuda::kl_finish(out, grad_state ? std::optional<Tensor>(state) : std::nullopt, f.sigma,
                                         clip, reverse);
    return {kl, state, f.sigma, clipped};
  }
#endif
  const auto r = out.select(2, by.size(2) - 1);
  // (0, not 0 / 0, where a clipped r_j is 0: as the CPU and CUDA kernels)
  auto row_scale = at::where(r > clip, 1.0 / (r * (f.sigma * f.sigma).unsqueeze(1)), 0.0);
  auto kl = at::log(r.clamp_min(clip)).mean(-1);
  if (reverse) kl.neg_();
  auto clipped = (r <= clip).to(at::kDouble).mean(-1);
  if (grad_state) state.mul_(row_scale.unsqueeze(-1));  // (r, a view of the projection state, is not read again)
  return {kl, state, f.sigma, clipped};
}

Tensor kl_grad(const Tensor& grad_kl, const Tensor& state, const Tensor& q_z, const Tensor& prior_z, bool reverse) {
  auto row_scale = kl_row_scale(grad_kl, q_z.size(1), reverse).view({-1, 1});
  if (grad_state_is_projection(prior_z.size(1) + q_z.size(1), q_z.size(2))) {
    return grad_from_projection(state, row_scale, q_z);
  }
  const KlRoles roles = kl_roles(prior_z, q_z, reverse);
  // q_z_j is stacked point row0 + j: its term -(sum_c W_jc) q_z_j folds into that weight.
  auto w = state * row_scale.unsqueeze(-1);
  w.narrow(2, roles.row0, q_z.size(1)).diagonal(0, 1, 2).sub_(w.sum(-1));
  return weighted_points(w, Tensor(), q_z, roles.denom, roles.numer);
}

Tensor weighted_grad(const Tensor& row_scale, const Tensor& state, const Tensor& z, const Tensor& numer,
                     const Tensor& denom) {
  if (grad_state_is_projection(denom.size(1) + numer.size(1), z.size(2))) {
    return grad_from_projection(state, row_scale.to(at::kDouble), z);
  }
  auto scale = row_scale.to(at::kDouble).unsqueeze(-1);  // [B, m, 1]
  return weighted_points(state * scale, state.sum(-1, true).mul_(scale), z, denom, numer);
}

}  // namespace generic
}  // namespace kivi_fast
