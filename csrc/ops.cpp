// The torch custom ops of kivi_fast: schemas, the checks of their arguments, and one kernel per op
// that picks the CPU (csrc/cpu/) or the device-generic (csrc/generic.cpp) building blocks. Autograd
// formulas are in csrc/autograd.cpp, fake kernels in Python (kivi_fast/_ops.py), test switches in their
// own namespace (csrc/testing.cpp). Sample arguments are batched [B, n, d]; Python adds the batch
// dimension, except for kl and kl_grad, which also take an unbatched pair [n, d] (see kl_op).
//
// CUDA tensors: kl and kl_grad have CUDA kernels (csrc/cuda/, when torch is a CUDA build) for the
// shapes cuda::handles_kl accepts; every other op and shape takes the device-generic kernels.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <atomic>
#include <cmath>

#include "kivi.h"

namespace kivi_fast {

#ifndef KIVI_FAST_WITH_CUDA
// A build without the CUDA kernels (torch is a CPU build): nothing is registered for the CUDA key,
// so these are never called.
namespace cuda {
bool handles_kl(int64_t, int64_t, int64_t, int) { return false; }
bool handles_kl_grad(int64_t, int64_t, int64_t, int64_t) { return false; }
std::tuple<Tensor, Tensor, Tensor, Tensor> kl(const Tensor&, const Tensor&, double, double,
                                              const std::optional<Tensor>&, bool, bool) {
  TORCH_CHECK(false, "kivi_fast was built without its CUDA kernels");
}
Tensor kl_grad(const Tensor&, const Tensor&, const Tensor&, const Tensor&, bool) {
  TORCH_CHECK(false, "kivi_fast was built without its CUDA kernels");
}
void set_stage_clocks(const std::optional<Tensor>&) {
  TORCH_CHECK(false, "kivi_fast was built without its CUDA kernels");
}
bool set_two_blocks_per_sm(bool) { TORCH_CHECK(false, "kivi_fast was built without its CUDA kernels"); }
bool set_paired_elimination(bool) { TORCH_CHECK(false, "kivi_fast was built without its CUDA kernels"); }
bool set_gathered_selection(bool) { TORCH_CHECK(false, "kivi_fast was built without its CUDA kernels"); }
bool set_gemm_kernel_values(bool) { TORCH_CHECK(false, "kivi_fast was built without its CUDA kernels"); }
bool set_generic_kernels(bool) { TORCH_CHECK(false, "kivi_fast was built without its CUDA kernels"); }
bool set_tile_subblocks(bool) { TORCH_CHECK(false, "kivi_fast was built without its CUDA kernels"); }
bool set_balanced_tile_ranges(bool) { TORCH_CHECK(false, "kivi_fast was built without its CUDA kernels"); }
bool set_product_tile_distances(bool) { TORCH_CHECK(false, "kivi_fast was built without its CUDA kernels"); }
bool set_gemm_pair_distances(bool) { TORCH_CHECK(false, "kivi_fast was built without its CUDA kernels"); }
bool set_paired_weight_dims(bool) { TORCH_CHECK(false, "kivi_fast was built without its CUDA kernels"); }
bool set_weight_kernel(bool) { TORCH_CHECK(false, "kivi_fast was built without its CUDA kernels"); }
}  // namespace cuda
#endif

namespace {

// Tests flip this (set_force_generic) to run the device-generic path on CPU tensors (the path CUDA
// tensors take).
std::atomic<bool> force_generic{false};

// kCpu: the kernel registered for the CPU dispatch key; otherwise the CompositeExplicitAutograd
// kernel that serves CUDA and every other device.
template <bool kCpu>
bool use_cpu() { return kCpu && !force_generic.load(); }

// The kl ops' kernels: the CPU's, the CUDA kernels', or the device-generic ones (any device; also
// what the other two fall back to when forced, and CUDA for the shapes its kernels do not take).
enum class Backend { cpu, generic, cuda };
template <bool kCpu>
constexpr Backend kl_backend = kCpu ? Backend::cpu : Backend::generic;

// The backend that runs a call: the registered one; generic when forced, or for the shapes the CUDA
// kernels do not take (cuda_takes() is asked for Backend::cuda only: it reads the device's limits).
template <class CudaTakes>
Backend resolve(Backend registered, CudaTakes cuda_takes) {
  if (force_generic.load() || (registered == Backend::cuda && !cuda_takes())) return Backend::generic;
  return registered;
}

// The ops are also callable directly (torch.ops.kivi_fast.*), without the Python checks of
// kivi_fast/_validate.py: sample arguments are checked here too, so that a mismatch is an error and
// never a read past the end of a buffer.
// unbatched_ok: the kl ops, which also take an unbatched pair (see kl_op); the checks read the
// arguments as given, so that the messages show the shapes the caller passed.
void check_samples(const char* op, const char* name, const Tensor& x, int64_t min_rows, bool unbatched_ok = false) {
  const bool rank_ok = x.dim() == 3 || (unbatched_ok && x.dim() == 2);
  TORCH_CHECK_VALUE(rank_ok && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble),
                    "kivi_fast::", op, ": ", name, " must be a float32 or float64 ",
                    unbatched_ok ? "[n, d] or [B, n, d]" : "[B, n, d]", " tensor, got ", x.scalar_type(),
                    " of shape ", x.sizes());
  TORCH_CHECK_VALUE(x.layout() == at::kStrided, "kivi_fast::", op, ": ", name, " must be a dense tensor, got ",
                    x.layout());
  TORCH_CHECK_VALUE(x.size(-2) >= min_rows && x.size(-1) >= 1, "kivi_fast::", op, ": ", name, " must hold at least ",
                    min_rows, " samples of at least one dimension, got shape ", x.sizes());
}

void check_pair(const char* op, const char* name_a, const Tensor& a, const char* name_b, const Tensor& b,
                bool unbatched_ok = false) {
  check_samples(op, name_a, a, 1, unbatched_ok);
  check_samples(op, name_b, b, 1, unbatched_ok);
  TORCH_CHECK_VALUE(a.dim() == b.dim(), "kivi_fast::", op, ": ", name_a, " and ", name_b,
                    " must both be unbatched [n, d] or both batched [B, n, d], got shapes ", a.sizes(), " and ",
                    b.sizes());
  const bool same_batch = a.dim() == 2 || a.size(0) == b.size(0);
  TORCH_CHECK_VALUE(same_batch && a.size(-1) == b.size(-1), "kivi_fast::", op, ": ", name_a, " and ", name_b,
                    " must have the same batch size and dimension, got shapes ", a.sizes(), " and ", b.sizes());
  TORCH_CHECK_VALUE(a.scalar_type() == b.scalar_type() && a.device() == b.device(), "kivi_fast::", op, ": ", name_a,
                    " and ", name_b, " must have the same dtype and device, got ", a.scalar_type(), " on ",
                    a.device(), " and ", b.scalar_type(), " on ", b.device());
}

// A tensor argument beside the samples (alpha, row_scale, grad_kl): dense, floating-point, on the
// samples' device (a kernel reads it there). Its shape is the op's to check.
void check_alongside(const char* op, const char* name, const Tensor& t, const at::Device& device) {
  TORCH_CHECK_VALUE(t.layout() == at::kStrided && at::isFloatingType(t.scalar_type()), "kivi_fast::", op, ": ",
                    name, " must be a dense floating-point tensor, got ", t.scalar_type(), " ", t.layout());
  TORCH_CHECK_VALUE(t.device() == device, "kivi_fast::", op, ": ", name, " must be on the samples' device ", device,
                    ", got ", t.device());
}

// A given bandwidth: one value per batch element (the kernels read sigma[b]; `or_one`: or one for all),
// on the samples' device (a kernel reads it there), and on the CPU, where reading it is free, each at
// least kMinBandwidth and finite (on a GPU one that is not gives NaN for its batch element).
void check_sigma(const char* op, const Tensor& sigma, int64_t batch, const at::Device& device, bool or_one = false) {
  TORCH_CHECK_VALUE(sigma.dim() <= 1 && (sigma.numel() == batch || (or_one && sigma.numel() == 1)), "kivi_fast::", op,
                    ": sigma must hold one bandwidth per batch element (", batch, ")", or_one ? " or one for all" : "",
                    ", got shape ", sigma.sizes());
  TORCH_CHECK_VALUE(sigma.device() == device, "kivi_fast::", op, ": sigma must be on the samples' device ", device,
                    ", got ", sigma.device());
  TORCH_CHECK_VALUE(at::isFloatingType(sigma.scalar_type()), "kivi_fast::", op,
                    ": sigma must be a floating-point tensor, got ", sigma.scalar_type());
  if (sigma.is_cpu()) {  // (a loop over the B values: no ATen calls on a path taken at every step)
    const auto s = sigma.to(at::kDouble).contiguous();
    const double* v = s.data_ptr<double>();
    for (int64_t b = 0; b < s.numel(); ++b) {
      TORCH_CHECK_VALUE(v[b] >= kMinBandwidth && std::isfinite(v[b]), "kivi_fast::", op,
                        ": sigma must be finite and at least ", kMinBandwidth, " (its square a normal float64), got ",
                        v[b], " for batch element ", b);
    }
  }
}

void check_sigma(const char* op, const std::optional<Tensor>& sigma, int64_t batch, const at::Device& device) {
  if (sigma.has_value()) check_sigma(op, *sigma, batch, device);
}

// The fit's ridge coefficient, as the kernels need it: a normal float64 (from a subnormal lam the fit's
// 1 / (lam n_p n_q) is infinite and the estimate NaN). kivi_fast/_validate.py holds the public API's
// stricter lam floor, 1e-10, which is about accuracy (bench/lam_floor.py calls below it), not validity.
void check_lam(const char* op, double lam) {
  TORCH_CHECK_VALUE(lam >= std::numeric_limits<double>::min() && std::isfinite(lam), "kivi_fast::", op,
                    ": lam must be positive and finite, and a normal float64 (at least ",
                    std::numeric_limits<double>::min(), "), got ", lam);
}

template <bool kCpu>
Tensor sqdist_op(const Tensor& x, const Tensor& y) {
  check_pair("sqdist", "x", x, "y", y);
  return use_cpu<kCpu>() ? cpu::sqdist(x.contiguous(), y.contiguous()) : generic::sqdist(x, y);
}

template <bool kCpu>
Tensor rbf_gram_op(const Tensor& x, const Tensor& y, const Tensor& sigma) {
  auto sq = sqdist_op<kCpu>(x, y);  // (its check_pair first: x is then [B, n, d])
  check_sigma("rbf_gram", sigma, x.size(0), x.device(), /*or_one=*/true);
  auto s = sigma.to(at::kDouble).view({-1, 1, 1});
  return at::exp(sq / (s * s * -2.0)).to(x.scalar_type());
}

template <bool kCpu>
Tensor median_bandwidth_op(const Tensor& x) {
  check_samples("median_bandwidth", "x", x, 2);
  return use_cpu<kCpu>() ? cpu::median_bandwidth(x.contiguous()) : generic::median_bandwidth(x);
}

// A float64 copy of a given bandwidth: the ops return the bandwidth used, and a custom op's output
// may not alias its argument.
std::optional<Tensor> owned_double(const std::optional<Tensor>& sigma) {
  if (!sigma.has_value()) return std::nullopt;
  // [B] whether given as [B] or, for one batch element, as []
  return sigma->to(at::kDouble, /*non_blocking=*/false, /*copy=*/true).reshape({-1}).contiguous();
}

template <bool kCpu>
Fit fit_any(const Tensor& numer, const Tensor& denom, double lam, const std::optional<Tensor>& sigma,
            Names names) {
  const auto s = owned_double(sigma);
  return use_cpu<kCpu>() ? cpu::fit(numer.contiguous(), denom.contiguous(), lam, s, names)
                        : generic::fit(numer, denom, lam, s, names);
}

template <bool kCpu>
std::tuple<Tensor, Tensor> fit_op(const Tensor& numer, const Tensor& denom, double lam,
                                  const std::optional<Tensor>& sigma) {
  check_pair("fit", "numer", numer, "denom", denom);
  check_sigma("fit", sigma, numer.size(0), numer.device());
  check_lam("fit", lam);
  auto f = fit_any<kCpu>(numer, denom, lam, sigma, {"numer", "denom"});
  return {f.coef.narrow(1, 0, denom.size(1)).contiguous(), f.sigma};
}

// Evaluation of a fitted ratio from kernel values k(c, z_j) [B, m, N] of the stacked points [B, N, d]:
// r_j = sum_c coef_c k(c, z_j), and where grad_state the grad state (grad_state_width in kivi.h): the
// float64 weights W_jc = coef_c k(c, z_j) / sigma^2, or with few dimensions their projection on the
// points, [sum_c W_jc c, r_j / sigma^2].
std::tuple<Tensor, Tensor> evaluate(const Tensor& kernel_zc, const Tensor& points, const Tensor& coef,
                                    const Tensor& sigma, bool grad_state) {
  auto terms = kernel_zc * coef.unsqueeze(1);
  auto r = terms.sum(-1);
  if (!grad_state) return {r, r.new_empty({r.size(0), r.size(1), 0})};
  const auto var = (sigma * sigma).view({-1, 1, 1});
  if (grad_state_is_projection(points.size(1), points.size(2))) {
    return {r, at::cat({at::bmm(terms, points.to(at::kDouble)), r.unsqueeze(-1)}, 2).div_(var)};
  }
  return {r, terms.div_(var)};
}

template <bool kCpu>
std::tuple<Tensor, Tensor> ratio_op(const Tensor& z, const Tensor& numer, const Tensor& denom, const Tensor& alpha,
                                    double beta, const Tensor& sigma, bool grad_state) {
  check_pair("ratio", "numer", numer, "denom", denom);
  check_pair("ratio", "z", z, "denom", denom);
  const int64_t batch = z.size(0);
  TORCH_CHECK_VALUE(alpha.dim() == 2 && alpha.size(0) == batch && alpha.size(1) == denom.size(1),
                    "kivi_fast::ratio: alpha must have shape [B, n_denom] = [", batch, ", ", denom.size(1),
                    "], got ", alpha.sizes());
  check_alongside("ratio", "alpha", alpha, z.device());
  TORCH_CHECK_VALUE(std::isfinite(beta), "kivi_fast::ratio: beta must be finite, got ", beta);
  check_sigma("ratio", sigma, batch, z.device(), /*or_one=*/true);
  auto s = sigma.to(at::kDouble).reshape({-1}).expand({batch}).contiguous();
  auto coef = at::cat({alpha.to(at::kDouble), at::full({alpha.size(0), numer.size(1)}, beta,
                                                       alpha.options().dtype(at::kDouble))}, 1);
  // Where values are read (generic.cpp's reads_back), by a loop over the coefficients just made, which
  // allocates and dispatches nothing (isfinite().all() does both: 6 us a call at [1, 100], 29 at
  // [128, 100], timed from Python; kl calls this op every step). Elsewhere a non-finite weight gives
  // NaN for its batch element, as the other value checks do on a GPU.
  if (coef.is_cpu()) {
    const double* c = coef.data_ptr<double>();
    bool finite = true;
    for (int64_t i = 0, n = coef.numel(); i < n; ++i) finite &= std::isfinite(c[i]);
    TORCH_CHECK_VALUE(finite, "kivi_fast::ratio: alpha must be finite (the fitted weights of "
                      "DensityRatio.alpha), got NaN or Inf");
  }
  if (use_cpu<kCpu>()) return cpu::ratio(z.contiguous(), numer.contiguous(), denom.contiguous(), coef, s, grad_state);
  const auto points = stack_points(denom, numer);
  // (the fitted points passed the fit's checks: a row that fails here is z's, or z is far from them)
  auto kernel = at::exp(generic::sqdist(z, points, {"z", "z"}) / (s * s * -2.0).view({-1, 1, 1}));
  auto [r, state] = evaluate(kernel, points, coef, s, grad_state);
  return {r.to(z.scalar_type()), state};
}

// kl and kl_grad also take one unbatched pair ([n, d] samples, a [] estimate): kivi_fast.kl passes
// unbatched samples as they are, so that a training step's graph holds no batch-dimension views, each
// with its own backward (at (100, 8), with the fast path of the Python checks, that makes the
// wrapper's forward+backward call 27 us instead of 48: bench/overhead.py). The kernels see [1, n, d].
Tensor batched(const Tensor& x, bool single) { return single ? x.unsqueeze(0) : x; }

template <Backend kB>
std::tuple<Tensor, Tensor, Tensor, Tensor> kl_op(const Tensor& prior_z_in, const Tensor& q_z_in, double lam,
                                                 double clip, const std::optional<Tensor>& sigma, bool reverse,
                                                 bool grad_state) {
  check_pair("kl", "prior_z", prior_z_in, "q_z", q_z_in, /*unbatched_ok=*/true);
  const bool single = q_z_in.dim() == 2;
  const Tensor prior_z = batched(prior_z_in, single), q_z = batched(q_z_in, single);
  check_sigma("kl", sigma, q_z.size(0), q_z.device());
  check_lam("kl", lam);
  TORCH_CHECK_VALUE(clip > 0.0 && clip < 1.0, "kivi_fast::kl: clip must lie in (0, 1), got ", clip);
  const auto s = owned_double(sigma);
  const Backend backend = resolve(kB, [&] {
    return cuda::handles_kl(prior_z.size(1) + q_z.size(1), q_z.size(2), q_z.size(0), q_z.get_device());
  });
  auto [kl, state, used, clipped] =
      backend == Backend::cpu    ? cpu::kl(prior_z.contiguous(), q_z.contiguous(), lam, clip, s, reverse, grad_state)
      : backend == Backend::cuda ? cuda::kl(prior_z, q_z, lam, clip, s, reverse, grad_state)
                                 : generic::kl(prior_z, q_z, lam, clip, s, reverse, grad_state);
  kl = kl.to(q_z.scalar_type());
  if (single) {  // in place on tensors of this call: the outputs stay views of nothing
    kl.squeeze_(0);
    state.squeeze_(0);
    used.squeeze_(0);
    clipped.squeeze_(0);
  }
  return {kl, state, used, clipped};
}

template <bool kCpu>
Tensor weighted_grad_op(const Tensor& row_scale, const Tensor& state, const Tensor& z, const Tensor& numer,
                        const Tensor& denom) {
  check_pair("weighted_grad", "numer", numer, "denom", denom);
  check_pair("weighted_grad", "z", z, "denom", denom);
  const int64_t B = z.size(0), m = z.size(1), N = numer.size(1) + denom.size(1);
  const int64_t width = grad_state_width(N, z.size(2));
  TORCH_CHECK_VALUE(state.dim() == 3 && state.size(0) == B && state.size(1) == m && state.size(2) == width &&
                        state.scalar_type() == at::kDouble,
                    "kivi_fast::weighted_grad: state must be float64 [", B, ", ", m, ", ", width,
                    "] (the ratio op's grad state), got ", state.scalar_type(), " ", state.sizes());
  TORCH_CHECK_VALUE(row_scale.dim() == 2 && row_scale.size(0) == B && row_scale.size(1) == m,
                    "kivi_fast::weighted_grad: row_scale must have shape [", B, ", ", m, "], got ", row_scale.sizes());
  check_alongside("weighted_grad", "row_scale", row_scale, z.device());
  check_alongside("weighted_grad", "state", state, z.device());
  return use_cpu<kCpu>() ? cpu::weighted_grad(row_scale, state.contiguous(), z, numer, denom)
                         : generic::weighted_grad(row_scale, state, z, numer, denom);
}

template <Backend kB>
Tensor kl_grad_op(const Tensor& grad_kl, const Tensor& state_in, const Tensor& q_z_in, const Tensor& prior_z_in,
                  bool reverse) {
  check_pair("kl_grad", "prior_z", prior_z_in, "q_z", q_z_in, /*unbatched_ok=*/true);
  const bool single = q_z_in.dim() == 2;
  const Tensor prior_z = batched(prior_z_in, single), q_z = batched(q_z_in, single);
  const int64_t width = grad_state_width(prior_z.size(1) + q_z.size(1), q_z.size(2));
  const auto expected = single ? std::vector<int64_t>{q_z.size(1), width}
                               : std::vector<int64_t>{q_z.size(0), q_z.size(1), width};
  TORCH_CHECK_VALUE(state_in.sizes() == at::IntArrayRef(expected) && state_in.scalar_type() == at::kDouble,
                    "kivi_fast::kl_grad: state must be the float64 ", at::IntArrayRef(expected),
                    " grad state of kl (called with grad_state=True), got ", state_in.scalar_type(), " ",
                    state_in.sizes());
  const Tensor state = batched(state_in, single);
  TORCH_CHECK_VALUE(grad_kl.numel() == q_z.size(0) && at::isFloatingType(grad_kl.scalar_type()),
                    "kivi_fast::kl_grad: grad_kl must be a floating-point tensor of ", q_z.size(0),
                    " elements, got ", grad_kl.scalar_type(), " ", grad_kl.sizes());
  check_alongside("kl_grad", "grad_kl", grad_kl, q_z.device());
  check_alongside("kl_grad", "state", state, q_z.device());
  const Backend backend = resolve(kB, [&] {
    return cuda::handles_kl_grad(prior_z.size(1) + q_z.size(1), q_z.size(1), q_z.size(2), q_z.size(0));
  });
  auto grad = backend == Backend::cpu    ? cpu::kl_grad(grad_kl, state, q_z, prior_z, reverse)
              : backend == Backend::cuda ? cuda::kl_grad(grad_kl, state, q_z, prior_z, reverse)
                                         : generic::kl_grad(grad_kl, state, q_z, prior_z, reverse);
  if (single) grad.squeeze_(0);
  return grad;
}

template <bool kCpu>
void register_kernels(torch::Library& m) {
  m.impl("sqdist", &sqdist_op<kCpu>);
  m.impl("rbf_gram", &rbf_gram_op<kCpu>);
  m.impl("median_bandwidth", &median_bandwidth_op<kCpu>);
  m.impl("fit", &fit_op<kCpu>);
  m.impl("ratio", &ratio_op<kCpu>);
  m.impl("kl", &kl_op<kl_backend<kCpu>>);
  m.impl("weighted_grad", &weighted_grad_op<kCpu>);
  m.impl("kl_grad", &kl_grad_op<kl_backend<kCpu>>);
}

}  // namespace

bool set_force_generic(bool flag) { return force_generic.exchange(flag); }

TORCH_LIBRARY(kivi_fast, m) {
  m.def("sqdist(Tensor x, Tensor y) -> Tensor");
  m.def("rbf_gram(Tensor x, Tensor y, Tensor sigma) -> Tensor");
  m.def("median_bandwidth(Tensor x) -> Tensor");
  m.def("fit(Tensor numer, Tensor denom, float lam, Tensor? sigma) -> (Tensor, Tensor)");
  // (r in z's dtype, the grad state that weighted_grad takes: float64, grad_state_width in kivi.h). As
  // kl's grad_state: without it the state is left empty, and a gradient always gets it.
  m.def("ratio(Tensor z, Tensor numer, Tensor denom, Tensor alpha, float beta, Tensor sigma, bool grad_state=True) "
        "-> (Tensor, Tensor)");
  // grad_state: whether to return what the backward needs; kivi_fast.kl passes false when no gradient
  // can be asked for (no grad mode, or q_z not requiring grad), and a gradient always gets it.
  // Samples [B, n, d], or both [n, d]: outputs without the batch dimension. Returns (KL, grad state,
  // sigma, clipped): the estimate in the samples' dtype, then float64: what the backward needs, the
  // bandwidth used, and the fraction of q_z's points whose fitted ratio was <= clip (see kivi.h).
  m.def("kl(Tensor prior_z, Tensor q_z, float lam, float clip, Tensor? sigma, bool reverse, bool grad_state=True) "
        "-> (Tensor, Tensor, Tensor, Tensor)");
  m.def("weighted_grad(Tensor row_scale, Tensor state, Tensor z, Tensor numer, Tensor denom) -> Tensor");
  m.def("kl_grad(Tensor grad_kl, Tensor state, Tensor q_z, Tensor prior_z, bool reverse) -> Tensor");
  // The diagonal Gaussian contrast's forward, (z, std, t), and backward (kivi.h, cuda::standardize):
  // CUDA kernels only, for kivi_fast/contrast.py, whose ATen composition serves every other device.
  m.def("standardize(Tensor x, bool to_standard_normal, float bias) -> (Tensor, Tensor, Tensor)");
  m.def("standardize_grad(Tensor? grad_z, Tensor? grad_t, Tensor z, Tensor std, Tensor x, bool to_standard_normal) "
        "-> Tensor");
}

// CPU tensors get the CPU kernels; CUDA and any other device get the generic kernels built from
// ATen calls (CompositeExplicitAutograd: used where no device-specific kernel is registered, while
// the autograd formulas of csrc/autograd.cpp still apply).
TORCH_LIBRARY_IMPL(kivi_fast, CPU, m) { register_kernels<true>(m); }
TORCH_LIBRARY_IMPL(kivi_fast, CompositeExplicitAutograd, m) { register_kernels<false>(m); }
#ifdef KIVI_FAST_WITH_CUDA
// kl and kl_grad (the other ops of CUDA tensors keep the generic kernels above), and the contrast's.
TORCH_LIBRARY_IMPL(kivi_fast, CUDA, m) {
  m.impl("kl", &kl_op<Backend::cuda>);
  m.impl("kl_grad", &kl_grad_op<Backend::cuda>);
  m.impl("standardize", &cuda::standardize);
  m.impl("standardize_grad", &cuda::standardize_grad);
}
#endif

}  // namespace kivi_fast
