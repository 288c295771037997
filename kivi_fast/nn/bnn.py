"""Bayesian neural network regression with a Gamma-prior noise precision (the paper's Sec. 4, App. E).

Model (normalized targets y):

    W_l ~ N(0, I)  (biases included as an extra input row),   lambda ~ Gamma(6, 6)  (shape, rate),
    y | x, W, lambda ~ N(f(x, W), 1 / lambda).

Variational posterior q(W, lambda) = prod_l q(W_l) q(lambda), with q(W_l) one posterior per layer
(implicit: KL estimated by KIVI; or factorized Gaussian: KL in closed form) and
q(lambda) = Gamma(alpha, beta). The ELBO of Appendix E:

    L = sum_i 1/2 E_q(W) [psi(alpha) - log beta - (alpha / beta) (y_i - f(x_i, W))^2 - log 2 pi]
        - sum_l KL(q(W_l) || N(0, I)) - KL(Gamma(alpha, beta) || Gamma(6, 6)),

with the sum over the data estimated from a minibatch scaled by N / batch size.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn

import kivi_fast

from ..contrast import MIN_PRIOR_SAMPLES
from ._checks import batch, exact, kl_options, positive_float, positive_int, positive_ints, samples
from .flows import PlanarFlow

LOG_2PI = math.log(2 * math.pi)
PRIOR_PRECISION = (6.0, 6.0)  # Gamma(shape, rate) prior on the noise precision (App. E)
KL_METHODS = ("kivi", "kivi-ac", "kivi-contrast", "factorized")


# ---- the noise precision ------------------------------------------------------------------------

def gamma_kl(alpha_q, beta_q, alpha_p, beta_p) -> torch.Tensor:
    """KL(Gamma(alpha_q, beta_q) || Gamma(alpha_p, beta_p)), shape-rate parameterization, closed form:

    (a_q - a_p) psi(a_q) - lgamma(a_q) + lgamma(a_p) + a_p (log b_q - log b_p) + a_q (b_p - b_q) / b_q.
    """
    # (numbers in the dtype and on the device of the first tensor: float32 constants beside float64
    # parameters left a KL of -7.5e-8 at the prior)
    like = next((v for v in (alpha_q, beta_q, alpha_p, beta_p) if isinstance(v, torch.Tensor)), None)
    kw = {} if like is None else {"dtype": like.dtype, "device": like.device}
    a_q, b_q, a_p, b_p = (torch.as_tensor(v, **kw) for v in (alpha_q, beta_q, alpha_p, beta_p))
    return ((a_q - a_p) * torch.digamma(a_q) - torch.lgamma(a_q) + torch.lgamma(a_p)
            + a_p * (b_q.log() - b_p.log()) + a_q * (b_p - b_q) / b_q)


class GammaPrecision(nn.Module):
    """q(lambda) = Gamma(alpha, beta) over the noise precision of normalized targets.

    alpha, beta are kept positive through their logarithms; they start at the prior Gamma(6, 6)
    (precision 1, i.e. noise std 1 = the targets' own std, the natural ignorance of normalized data).
    """

    def __init__(self, alpha: float = PRIOR_PRECISION[0], beta: float = PRIOR_PRECISION[1],
                 prior: tuple[float, float] = PRIOR_PRECISION):
        super().__init__()
        self.log_alpha = nn.Parameter(torch.tensor(math.log(positive_float("alpha", alpha))))
        self.log_beta = nn.Parameter(torch.tensor(math.log(positive_float("beta", beta))))
        if isinstance(prior, (str, bytes)) or not isinstance(prior, Sequence) or len(prior) != 2:
            raise ValueError(f"prior must be a Gamma's (shape, rate), two positive numbers, got {prior!r}")
        self.prior = (positive_float("prior[0]", prior[0]), positive_float("prior[1]", prior[1]))

    @property
    def alpha(self) -> torch.Tensor:
        return self.log_alpha.exp()

    @property
    def beta(self) -> torch.Tensor:
        return self.log_beta.exp()

    def expected_log_likelihood(self, y: torch.Tensor, y_hat: torch.Tensor) -> torch.Tensor:
        """E_q(lambda) log N(y; y_hat, 1/lambda) = 1/2 [psi(a) - log b - (a/b)(y - y_hat)^2 - log 2 pi],
        elementwise (E[log lambda] = psi(a) - log b and E[lambda] = a / b for Gamma(a, b))."""
        a, b = self.alpha, self.beta
        return 0.5 * (torch.digamma(a) - b.log() - a / b * (y - y_hat).pow(2) - LOG_2PI)

    def kl(self) -> torch.Tensor:
        """KL(q(lambda) || prior), a 0-d tensor (closed form: :func:`gamma_kl`)."""
        return gamma_kl(self.alpha, self.beta, *self.prior)

    def predictive_log_prob(self, y: torch.Tensor, y_hat: torch.Tensor, integrate: bool = True) -> torch.Tensor:
        """log p(y | y_hat) with the precision under q(lambda), elementwise.

        integrate=True (default) integrates lambda out exactly: int N(y; y_hat, 1/lambda) Gamma(lambda;
        a, b) dlambda is a Student-t with 2a degrees of freedom, location y_hat and scale sqrt(b / a).
        This is the posterior predictive of the fitted model, the quantity "test log-likelihood"
        estimates (as SVGD does by averaging over its sampled precisions). integrate=False plugs in
        the posterior mean precision a / b (a Gaussian), for comparison; with a ~ N / 2 the two differ
        by O(1/N).
        """
        a, b = self.alpha, self.beta
        if not integrate:
            return 0.5 * (a.log() - b.log() - a / b * (y - y_hat).pow(2) - LOG_2PI)
        nu, scale = 2 * a, (b / a).sqrt()
        t2 = ((y - y_hat) / scale).pow(2)
        return (torch.lgamma((nu + 1) / 2) - torch.lgamma(nu / 2) - 0.5 * (nu * math.pi).log() - scale.log()
                - (nu + 1) / 2 * torch.log1p(t2 / nu))


# ---- the network --------------------------------------------------------------------------------

def mlp_forward(x: torch.Tensor, weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """Outputs of the ReLU MLP for S weight samples: x [B, D], weights[l] [S, n_in + 1, n_out] -> [S, B]
    for one output (the regression BNN), [S, B, n_out] for more (the classifier's logits).

    The last row of each weight matrix is the bias. Each layer's pre-activation is divided by
    sqrt(n_in + 1), as in PBP and ZhuSuan's BNN examples (the paper's code base): with N(0, I) weights
    it keeps the pre-activations O(1) whatever the width, so the N(0, I) prior is a sensible one.
    """
    h = x
    for i, w in enumerate(weights):
        h = (h @ w[:, :-1] + w[:, -1:]) / math.sqrt(w.shape[1])
        if i < len(weights) - 1:
            h = torch.relu(h)
    return h.squeeze(-1)


class RegressionBNN(nn.Module):
    """A BNN for 1-D regression: ``layer_sizes`` (D, hidden..., 1), one posterior per weight matrix.

    ``posteriors[l]`` is any module with ``sample(n) -> [n, (n_in + 1) n_out]`` (row-major
    [n_in + 1, n_out], bias row last). ``kl_method`` says how KL(q(W_l) || N(0, I)) is computed:
    "kivi" (the paper: :func:`kivi_fast.kernel_kl` between n_p prior and n_q posterior samples), "kivi-ac"
    (:func:`kivi_fast.adaptive_contrast_kl`, App. D, per layer, with ``contrast``: "diagonal" by
    default, the paper's, which the UCI results use; "auto" is the library's default),
    "kivi-contrast" (:func:`kivi_fast.kl` with its default Gaussian contrast) or "factorized" (closed
    form).
    """

    def __init__(self, layer_sizes: Sequence[int], posteriors: Sequence[nn.Module], kl_method: str = "kivi",
                 lam: float = 1e-3, n_prior: int = 100, contrast: str = "diagonal"):
        super().__init__()
        if kl_method not in KL_METHODS:
            raise ValueError(f"kl_method must be one of {KL_METHODS}, got {kl_method!r}")
        layer_sizes = positive_ints("layer_sizes", layer_sizes)
        if len(layer_sizes) < 2 or layer_sizes[-1] != 1:
            raise ValueError(f"layer_sizes must be (inputs, [hidden, ...], 1), got {layer_sizes}")
        self.layer_sizes = layer_sizes
        self.shapes = [(n_in + 1, n_out) for n_in, n_out in zip(layer_sizes[:-1], layer_sizes[1:])]
        if len(posteriors) != len(self.shapes):
            raise ValueError(f"need one posterior per layer ({len(self.shapes)}), got {len(posteriors)}")
        for i, (q, (a, b)) in enumerate(zip(posteriors, self.shapes)):
            if getattr(q, "dim", a * b) != a * b:  # (a posterior that says its sample size)
                raise ValueError(f"posteriors[{i}] samples {q.dim} weights; layer {i} has ({a - 1} + 1) x {b} = "
                                 f"{a * b} (bias row included)")
            # (PlanarFlow's kl_to_standard_normal is a Monte Carlo (estimate, error) pair, not a term to train on)
            if kl_method == "factorized" and (not hasattr(q, "kl_to_standard_normal") or isinstance(q, PlanarFlow)):
                raise TypeError(f'kl_method="factorized" needs posteriors with a closed-form '
                                f"kl_to_standard_normal(); posteriors[{i}] is a {type(q).__name__}")
        self.posteriors = nn.ModuleList(posteriors)
        self.precision = GammaPrecision()
        self.kl_method = kl_method
        self.lam, _, self.contrast = kl_options(lam, None, contrast)
        self.n_prior = n_prior if kl_method == "factorized" else samples("n_prior", n_prior)
        if kl_method == "kivi-contrast" and not isinstance(self.n_prior, torch.SymInt) and \
                self.n_prior < MIN_PRIOR_SAMPLES:
            raise ValueError(f"n_prior must be at least {MIN_PRIOR_SAMPLES} for kl_method 'kivi-contrast' "
                             f"(kivi_fast.kl's Gaussian contrast of the prior's samples), got {self.n_prior}")

    def sample_weights(self, n: int) -> list[torch.Tensor]:
        """n flat samples per layer, [n, (n_in + 1) n_out] each."""
        n = positive_int("n", n)
        return [q.sample(n) for q in self.posteriors]

    def weight_matrices(self, flat: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The flat samples as the weight matrices [n, n_in + 1, n_out] that :func:`mlp_forward` takes."""
        return [w.reshape(w.shape[0], *shape) for w, shape in zip(flat, self.shapes)]

    def layer_kls(self, flat: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """KL(q(W_l) || N(0, I)) per layer, from the posterior samples ``flat`` (ignored if factorized)."""
        if self.kl_method == "factorized":
            return [q.kl_to_standard_normal() for q in self.posteriors]
        kls = []
        for w in flat:
            if self.kl_method in ("kivi", "kivi-contrast"):
                prior = torch.randn(self.n_prior, w.shape[1], dtype=w.dtype, device=w.device)
                kl = kivi_fast.kernel_kl if self.kl_method == "kivi" else kivi_fast.kl
                kls.append(kl(prior, w, self.lam))
            else:
                kls.append(kivi_fast.adaptive_contrast_kl(w, None, self.lam, n_prior=self.n_prior,
                                                            contrast=self.contrast))
        return kls

    def elbo(self, x: torch.Tensor, y: torch.Tensor, n_data: int, n_samples: int = 100) -> dict[str, torch.Tensor]:
        """ELBO of the whole data set estimated from the minibatch (x, y) of a set of ``n_data`` points.

        The same ``n_samples`` posterior samples serve the likelihood (M) and the KL estimate (n_q), as
        in the paper's setting n_q = M. x [B, D], y [B]. Returns the ELBO and its terms, all as totals
        (not per point).
        """
        self.check_batch(x, y, n_data)
        flat = self.sample_weights(n_samples)
        y_hat = mlp_forward(x, self.weight_matrices(flat))  # [S, B]
        log_lik = self.precision.expected_log_likelihood(y, y_hat).mean(0).sum() * (n_data / x.shape[0])
        kl_w = torch.stack(self.layer_kls(flat)).sum()
        kl_prec = self.precision.kl()
        return {"elbo": log_lik - kl_w - kl_prec, "log_lik": log_lik, "kl_weights": kl_w, "kl_precision": kl_prec}

    def check_batch(self, x, y, n_data: int) -> None:
        """What :meth:`elbo` checks of its data: x [B, D] with B >= 1, y [B], n_data >= B."""
        batch(x, self.layer_sizes[0], n_data)
        exact("y", y, (x.shape[0],))

    @torch.no_grad()
    def predict(self, x: torch.Tensor, n_samples: int = 100) -> torch.Tensor:
        """Network outputs for ``n_samples`` posterior draws: x [B, D] -> [S, B] (normalized units)."""
        batch(x, self.layer_sizes[0])
        return mlp_forward(x, self.weight_matrices(self.sample_weights(n_samples)))


@torch.no_grad()
def evaluate(model: RegressionBNN, x: torch.Tensor, y_raw: torch.Tensor, y_mean: float, y_std: float,
                 n_samples: int = 100) -> dict[str, float]:
    """Test RMSE of the predictive mean and test log-likelihood per point, in original units of y.

    log p(y*) = log (1/S) sum_s p(y* | W_s) with W_s ~ q(W) and the precision integrated under
    q(lambda) (Student-t, ``GammaPrecision.predictive_log_prob``); ``test_ll_plugin`` uses the
    posterior mean precision instead. Normalized -> original units: y = y_std y_n + y_mean, so the
    density gains a factor 1 / y_std.
    """
    y_hat = model.predict(x, n_samples)  # [S, B] (x checked)
    # (a y of another shape broadcast against the [S, B] predictions into a plausible wrong RMSE)
    exact("y_raw", y_raw, (x.shape[0],))
    y_std = positive_float("y_std", y_std)
    y_n = (y_raw - y_mean) / y_std
    rmse = ((y_hat.mean(0) * y_std + y_mean - y_raw).pow(2).mean().sqrt())
    out = {"rmse": float(rmse)}
    for key, integrate in (("test_ll", True), ("test_ll_plugin", False)):
        log_p = model.precision.predictive_log_prob(y_n, y_hat, integrate=integrate)  # [S, B]
        ll = torch.logsumexp(log_p, 0) - math.log(y_hat.shape[0]) - math.log(y_std)
        out[key] = float(ll.mean())
    return out
