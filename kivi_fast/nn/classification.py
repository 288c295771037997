"""A BNN classifier with one posterior per weight matrix (the paper's Sec. 5.2.2, App. F): MMNN implicit
posteriors with KIVI's KL, a factorized Gaussian with the closed form (Bayes-by-Backprop), or the
prior-contrastive method (a logistic-regression discriminator per layer estimates log q/p).

Network: x [B, 784] -> ReLU(. W_1) -> ReLU(. W_2) -> . W_3 logits [B, 10], each W_l [n_in + 1, n_out]
with the bias as its last row, pre-activations scaled by 1/sqrt(n_in + 1) (:func:`kivi_fast.nn.bnn.mlp_forward`,
as the regression BNN), prior N(0, I) on every weight. ELBO = N E_q[mean log p(y | x, W)] - sum_l KL_l.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn
from torch.nn import functional as F

import kivi_fast

from ._checks import batch, exact, kl_options, positive_float, positive_int, positive_ints, samples
from .bnn import mlp_forward
from .gaussian import FactorizedGaussian
from .mmnn import MMNN

POSTERIORS = ("kivi", "bbb", "pc")
BBB_INIT_STD = 1e-3  # "bbb": the standard deviations at the start, near a point estimate (Blundell et al.)


def mmnn_shapes(n_out: int, n_in_plus_bias: int, hidden: int, last_layer: bool, noise=(30, 30)) -> list:
    """App. F's MMNN for one weight matrix of the MNIST BNN: 30 x 30 N(0, I) noise, two hidden
    matrix-multiplication layers of N x N (30 x N for the last weight matrix) with ReLU, a linear output
    of n_out x (n_in + 1) (the paper writes the matrix out x in)."""
    inner = (30, hidden) if last_layer else (hidden, hidden)
    return [tuple(noise), inner, inner, (n_out, n_in_plus_bias)]


def paper_mmnn_hidden(width: int) -> int:
    """App. F: N = 500 for L = 400, else 800."""
    return 500 if width <= 400 else 800


class MatrixPosterior(nn.Module):
    """An MMNN whose n_out x (n_in + 1) samples are returned as the [n_in + 1, n_out] matrices that
    :func:`mlp_forward` takes, flattened: ``sample(n)`` -> [n, (n_in + 1) n_out] (a permutation of the
    MMNN's coordinates: KL and prior are unchanged).

    The output layer is rescaled at construction so that the weights start with standard deviation
    ``init_std`` (measured on 4 draws of torch's generator): the MMNN's fan-in initialization alone gives
    ~0.02, and with the network's 1/sqrt(fan-in) scaling such weights pass almost no signal through
    three layers, so training starts flat (measured: L = 100, 5,000 images, 3 epochs: 79% test error
    against BBB's 50%, whose means start at the prior's scale)."""

    def __init__(self, shapes, init_std: float = 1.0):
        super().__init__()
        self.mmnn = MMNN(shapes)
        self.dim = self.mmnn.dim
        with torch.no_grad():
            last = self.mmnn.layers[-1]
            last.right.mul_(positive_float("init_std", init_std) / float(self.mmnn.sample_matrices(4).std()))

    def sample(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """[n, (n_in + 1) n_out] samples (reparameterized)."""
        return self.mmnn.sample_matrices(n, generator).transpose(1, 2).reshape(n, self.dim)


class LogisticDiscriminator(nn.Module):
    """T(w) = a . w + c over flattened weights [n, dim] -> [n]: the logit of P(w from q | w), so that at the
    optimum T = log q(w) / p(w) (the prior-contrastive method with the paper's discriminator)."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.bias = nn.Parameter(torch.zeros(()))

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w @ self.weight + self.bias

    def loss(self, q_samples: torch.Tensor, prior_samples: torch.Tensor) -> torch.Tensor:
        """Logistic loss with q's samples labelled 1 and the prior's 0 (q's samples detached)."""
        t_q, t_p = self(q_samples.detach()), self(prior_samples)
        return F.softplus(-t_q).mean() + F.softplus(t_p).mean()


class ClassificationBNN(nn.Module):
    """MLP ``sizes`` (784, L, L, 10) with a posterior per weight matrix: ``method`` "kivi" (MMNN, KL by
    :func:`kivi_fast.kernel_kl`, n_p prior samples against the n_q posterior samples the likelihood
    uses), "bbb" (factorized Gaussian, closed-form KL) or "pc" (MMNN, KL = mean T(w) of a
    :class:`LogisticDiscriminator` per layer, trained by :meth:`discriminator_loss`)."""

    def __init__(self, sizes: Sequence[int] = (784, 400, 400, 10), method: str = "kivi", *,
                 mmnn_hidden: int | None = None, lam: float = 1e-3, clip: float = 1e-8, n_prior: int = 10,
                 bbb_init_std: float = BBB_INIT_STD):
        super().__init__()
        if method not in POSTERIORS:
            raise ValueError(f"method must be one of {', '.join(POSTERIORS)}, got {method!r}")
        sizes = positive_ints("sizes", sizes)
        if len(sizes) < 3:
            raise ValueError(f"sizes must be (inputs, hidden, ..., classes), at least three, got {sizes}")
        self.sizes = sizes
        self.method = method
        self.lam, self.clip, _ = kl_options(lam, clip)
        self.n_prior = samples("n_prior", n_prior) if method == "kivi" else n_prior
        self.shapes = [(n_in + 1, n_out) for n_in, n_out in zip(sizes[:-1], sizes[1:])]
        hidden = paper_mmnn_hidden(sizes[1]) if mmnn_hidden is None else positive_int("mmnn_hidden", mmnn_hidden)
        if method == "bbb":
            bbb_init_std = positive_float("bbb_init_std", bbb_init_std)
            self.posteriors = nn.ModuleList(FactorizedGaussian(a * b, std=bbb_init_std, mean_init_std=1.0)
                                            for a, b in self.shapes)
        else:
            self.posteriors = nn.ModuleList(
                MatrixPosterior(mmnn_shapes(b, a, hidden, i == len(self.shapes) - 1))
                for i, (a, b) in enumerate(self.shapes))
        self.discriminators = (nn.ModuleList(LogisticDiscriminator(a * b) for a, b in self.shapes)
                               if method == "pc" else None)

    def generator_parameters(self):
        return self.posteriors.parameters()

    def sample_weights(self, n: int) -> list[torch.Tensor]:
        """n flat samples per weight matrix, [n, (n_in + 1) n_out] each."""
        n = positive_int("n", n)
        return [q.sample(n) for q in self.posteriors]

    def logits(self, x: torch.Tensor, flat: Sequence[torch.Tensor]) -> torch.Tensor:
        """[S, B, 10] for the S weight samples ``flat``."""
        return mlp_forward(x, [w.reshape(w.shape[0], *s) for w, s in zip(flat, self.shapes)])

    def layer_kls(self, flat: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """KL(q(W_l) || N(0, I)) per weight matrix, 0-d each: closed form ("bbb", ``flat`` unused), the
        discriminators' mean logit ("pc"), or KIVI from the samples ``flat`` and n_prior prior draws."""
        if self.method == "bbb":
            return [q.kl_to_standard_normal() for q in self.posteriors]
        if self.method == "pc":  # the discriminators held fixed: the ELBO moves the posteriors only
            return [(w @ t.weight.detach() + t.bias.detach()).mean() for t, w in zip(self.discriminators, flat)]
        return [kivi_fast.kernel_kl(torch.randn(self.n_prior, w.shape[1], dtype=w.dtype, device=w.device), w,
                                    self.lam, clip=self.clip) for w in flat]

    def discriminator_loss(self, flat: Sequence[torch.Tensor]) -> torch.Tensor:
        """PC's discriminators' logistic loss on the posterior samples ``flat`` and as many prior draws."""
        if self.discriminators is None:
            raise ValueError(f'discriminator_loss needs method="pc" (the discriminators), got {self.method!r}')
        return sum(t.loss(w, torch.randn_like(w)) for t, w in zip(self.discriminators, flat))

    def elbo(self, x: torch.Tensor, y: torch.Tensor, n_data: int, n_samples: int = 10) -> dict:
        """The ELBO of the whole training set of ``n_data`` points from the minibatch x [B, inputs],
        y [B] (class indices), and its terms (totals)."""
        self._check_batch(x, y, n_data)
        flat = self.sample_weights(positive_int("n_samples", n_samples))
        log_lik = -F.cross_entropy(self.logits(x, flat).flatten(0, 1), y.repeat(n_samples), reduction="mean")
        log_lik = log_lik * n_data
        kl = torch.stack(self.layer_kls(flat)).sum()
        return {"elbo": log_lik - kl, "log_lik": log_lik, "kl": kl, "samples": flat}

    def _check_batch(self, x, y, n_data) -> None:
        batch(x, self.sizes[0], n_data)
        exact("y", y, (x.shape[0],), floating=False)
        if y.dtype not in (torch.long, torch.uint8):  # (cross_entropy's target dtypes)
            raise TypeError(f"y must hold class indices as int64 or uint8, got {y.dtype}")

    def forward(self, x: torch.Tensor, y: torch.Tensor, n_data: int, n_samples: int = 10
                ) -> tuple[torch.Tensor, dict]:
        """One training step's loss, -ELBO / n_data (for "pc" plus the discriminators' loss, which moves
        only the discriminators), and the ELBO's terms."""
        out = self.elbo(x, y, n_data, n_samples)
        loss = -out["elbo"] / n_data
        if self.method == "pc":
            loss = loss + self.discriminator_loss(out["samples"])
        return loss, out

    @torch.no_grad()
    def predict_proba(self, x: torch.Tensor, n_samples: int = 10) -> torch.Tensor:
        """The posterior predictive: class probabilities averaged over ``n_samples`` weight draws, [B, 10]."""
        batch(x, self.sizes[0])  # (one image [784] gave [S, 10], the samples' probabilities, as a batch)
        return self.logits(x, self.sample_weights(n_samples)).softmax(-1).mean(0)


def n_weights(sizes: Sequence[int]) -> int:
    """The weights of the MLP ``sizes``, biases included."""
    return sum((a + 1) * b for a, b in zip(sizes[:-1], sizes[1:]))


__all__ = ["ClassificationBNN", "LogisticDiscriminator", "MatrixPosterior", "mmnn_shapes", "paper_mmnn_hidden",
           "n_weights", "POSTERIORS"]
