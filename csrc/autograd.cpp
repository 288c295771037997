// The autograd formulas of the kl and ratio ops (the paper's Eq. 8): the fitted ratio (coefficients,
// centres, bandwidth) is held fixed and the gradient flows through the evaluation points only, so
//   d/dz_j f(z_j) = row_scale_j (sum_c W_jc c - (sum_c W_jc) z_j),
// from the float64 weights W that the forward already computed, or their projection on the points
// (the grad state; grad_state_width in kivi.h): the ratio op's backward is the weighted_grad op, the
// kl op's the kl_grad op.
//
// They are registered in C++ under the Autograd key rather than from Python: a training step then
// never enters the interpreter for this op's forward or backward, which at small shapes (a VAE
// latent, 100 x 8) cost more than the numerics. Fake kernels for torch.compile stay in Python.
//
// The other ops have no gradient (the Python API detaches their inputs, and the contrast's standardize
// ops have theirs in kivi_fast/contrast.py's autograd.Function). Called directly on inputs that require
// grad, they raise at backward naming the op: without a kernel under this key, torch's fallback would
// only warn and give those inputs no gradient.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/library.h>

#include "kivi.h"

namespace kivi_fast {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using KlSignature = std::tuple<Tensor, Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, double, double,
                                                                const std::optional<Tensor>&, bool, bool);
using RatioSignature = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                                   double, const Tensor&, bool);
using WeightedGradSignature = Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&);
using KlGradSignature = Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, bool);

template <class Signature>
c10::TypedOperatorHandle<Signature> op_handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// Through the dispatcher, so CPU and other devices each get their own kernel.
Tensor weighted_grad(const Tensor& row_scale, const Tensor& state, const Tensor& z, const Tensor& numer,
                     const Tensor& denom) {
  static const auto op = op_handle<WeightedGradSignature>("kivi_fast::weighted_grad");
  return op.call(row_scale, state, z, numer, denom);
}

Tensor kl_grad(const Tensor& grad_kl, const Tensor& state, const Tensor& q_z, const Tensor& prior_z, bool reverse) {
  static const auto op = op_handle<KlGradSignature>("kivi_fast::kl_grad");
  return op.call(grad_kl, state, q_z, prior_z, reverse);
}

class KlFunction : public torch::autograd::Function<KlFunction> {
 public:
  static constexpr bool is_traceable = true;  // the backward only reads what the forward saved

  static variable_list forward(AutogradContext* ctx, const Tensor& prior_z, const Tensor& q_z, double lam,
                               double clip, const std::optional<Tensor>& sigma, bool reverse) {
    static const auto op = op_handle<KlSignature>("kivi_fast::kl");
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [kl, state, used, clipped] = op.call(prior_z, q_z, lam, clip, sigma, reverse, /*grad_state=*/true);
    ctx->save_for_backward({state, q_z, prior_z});
    ctx->saved_data["reverse"] = reverse;
    ctx->mark_non_differentiable({state, used, clipped});
    // state, used and clipped never get a gradient: no zero tensors made for them at every backward
    ctx->set_materialize_grads(false);
    return {kl, state, used, clipped};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!ctx->needs_input_grad(1) || !grads[0].defined()) {
      return {Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
    }
    const auto saved = ctx->get_saved_variables();
    auto grad_q = kl_grad(grads[0], saved[0], saved[1], saved[2], ctx->saved_data["reverse"].toBool());
    return {Tensor(), grad_q, Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

class RatioFunction : public torch::autograd::Function<RatioFunction> {
 public:
  static constexpr bool is_traceable = true;

  static variable_list forward(AutogradContext* ctx, const Tensor& z, const Tensor& numer, const Tensor& denom,
                               const Tensor& alpha, double beta, const Tensor& sigma) {
    static const auto op = op_handle<RatioSignature>("kivi_fast::ratio");
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [r, state] = op.call(z, numer, denom, alpha, beta, sigma, /*grad_state=*/true);
    ctx->save_for_backward({state, z, numer, denom});
    ctx->mark_non_differentiable({state});
    // the state never gets a gradient: no float64 tensor of zeros made for it at every backward
    ctx->set_materialize_grads(false);
    return {r, state};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!ctx->needs_input_grad(0) || !grads[0].defined()) {
      return {Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
    }
    const auto saved = ctx->get_saved_variables();
    auto grad_z = weighted_grad(grads[0].to(at::kDouble), saved[0], saved[1], saved[2], saved[3]);
    return {grad_z, Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

// The backwards' own ops, kl_grad and weighted_grad, are differentiable once: differentiating their
// result (a second derivative, as torch.autograd.grad(..., create_graph=True) then a second grad
// asks) raises this, where without an autograd kernel torch would warn and give no gradient or a
// partial one, silently wrong.
constexpr const char* kNoSecondDerivative =
    "kivi_fast: second derivatives of the KIVI estimators are not supported (their gradient is the paper's "
    "Eq. 8, the fitted ratio held fixed, computed by the op ";

template <class Signature>
class OnceDifferentiable : public torch::autograd::Function<OnceDifferentiable<Signature>> {
 public:
  static constexpr bool is_traceable = true;

  template <class... Args>
  static variable_list forward(AutogradContext* ctx, const char* name, Args&&... args) {
    ctx->saved_data["name"] = std::string(name);
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return {op_handle<Signature>(name).call(std::forward<Args>(args)...)};
  }

  static variable_list backward(AutogradContext* ctx, variable_list) {
    TORCH_CHECK_NOT_IMPLEMENTED(false, kNoSecondDerivative, ctx->saved_data["name"].toStringRef(), ")");
    return {};
  }
};

Tensor weighted_grad_autograd(const Tensor& row_scale, const Tensor& state, const Tensor& z, const Tensor& numer,
                              const Tensor& denom) {
  if (!torch::autograd::compute_requires_grad(row_scale, state, z, numer, denom)) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return weighted_grad(row_scale, state, z, numer, denom);
  }
  return OnceDifferentiable<WeightedGradSignature>::apply("kivi_fast::weighted_grad", row_scale, state, z, numer,
                                                          denom)[0];
}

Tensor kl_grad_autograd(const Tensor& grad_kl, const Tensor& state, const Tensor& q_z, const Tensor& prior_z,
                        bool reverse) {
  if (!torch::autograd::compute_requires_grad(grad_kl, state, q_z, prior_z)) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return kl_grad(grad_kl, state, q_z, prior_z, reverse);
  }
  return OnceDifferentiable<KlGradSignature>::apply("kivi_fast::kl_grad", grad_kl, state, q_z, prior_z, reverse)[0];
}

std::tuple<Tensor, Tensor, Tensor, Tensor> kl_autograd(const Tensor& prior_z, const Tensor& q_z, double lam,
                                                       double clip, const std::optional<Tensor>& sigma, bool reverse,
                                                       bool grad_state) {
  if (!at::GradMode::is_enabled() || !q_z.requires_grad()) {
    // no gradient can be asked for: no graph node. The state is still returned as asked (a graph
    // traced with a gradient, replayed without one, expects it).
    static const auto op = op_handle<KlSignature>("kivi_fast::kl");
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return op.call(prior_z, q_z, lam, clip, sigma, reverse, grad_state);
  }
  auto out = KlFunction::apply(prior_z, q_z, lam, clip, sigma, reverse);
  return {out[0], out[1], out[2], out[3]};
}

std::tuple<Tensor, Tensor> ratio_autograd(const Tensor& z, const Tensor& numer, const Tensor& denom,
                                          const Tensor& alpha, double beta, const Tensor& sigma, bool grad_state) {
  if (!at::GradMode::is_enabled() || !z.requires_grad()) {  // as kl_autograd
    static const auto op = op_handle<RatioSignature>("kivi_fast::ratio");
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return op.call(z, numer, denom, alpha, beta, sigma, grad_state);
  }
  auto out = RatioFunction::apply(z, numer, denom, alpha, beta, sigma);
  return {out[0], out[1]};
}

}  // namespace

TORCH_LIBRARY_IMPL(kivi_fast, Autograd, m) {
  m.impl("kl", &kl_autograd);
  m.impl("ratio", &ratio_autograd);
  m.impl("kl_grad", &kl_grad_autograd);
  m.impl("weighted_grad", &weighted_grad_autograd);
  for (const char* op : {"sqdist", "rbf_gram", "median_bandwidth", "fit", "standardize", "standardize_grad"}) {
    m.impl(op, torch::autograd::autogradNotImplementedFallback());
  }
}

}  // namespace kivi_fast
