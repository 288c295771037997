"""Variational posteriors, Bayesian-network layers and the VAE, for a training loop of your own.

Each posterior is an ``nn.Module`` with ``sample(n) -> [n, d]`` (reparameterized), ready for
:func:`kivi_fast.kl`:

- :class:`MLPGenerator`: implicit, standard-normal noise through an MLP (the paper's regression BNNs;
  with ``noise_at``, a second noise inside it: :func:`stochastic_net_2d`, the paper's 2-D toy network).
- :class:`MMNN`: implicit, a matrix of noise through matrix-multiplication layers (the paper's Alg. 2),
  for weight matrices too large for an MLP generator.
- :class:`FactorizedGaussian`: explicit, N(mean, diag(std^2)) with a closed-form KL to N(0, I), the
  mean-field baseline.
- :class:`PlanarFlow`: explicit, a planar normalizing flow whose density is exact.

:mod:`kivi_fast.nn.bnn` holds the BNN for regression of the paper's Sec. 4 / App. E
(:class:`RegressionBNN`, its Gamma noise precision and test metrics), one posterior per weight matrix;
:mod:`kivi_fast.nn.classification` the BNN for MNIST classification of Sec. 5.2.2
(:class:`ClassificationBNN`: MMNN posteriors with KIVI, or the BBB and prior-contrastive baselines);
:mod:`kivi_fast.nn.vae` the VAE of Sec. 5.3 (:func:`build_vae`: an implicit or Gaussian encoder, a
Bernoulli decoder, the KL by KIVI or in closed form).
"""

from .bnn import GammaPrecision, RegressionBNN, mlp_forward
from .classification import ClassificationBNN
from .flows import PlanarFlow
from .gaussian import FactorizedGaussian, gaussian_kl_to_standard_normal
from .generator import MLPGenerator, NoiseInjection, stochastic_net_2d
from .mmnn import MMNN, MatrixMultiplicationLayer
from .vae import VAE, BernoulliDecoder, GaussianEncoder, ImplicitEncoder, build_vae

__all__ = ["MLPGenerator", "NoiseInjection", "stochastic_net_2d", "MMNN", "MatrixMultiplicationLayer",
           "FactorizedGaussian", "gaussian_kl_to_standard_normal", "PlanarFlow", "RegressionBNN", "ClassificationBNN",
           "GammaPrecision", "mlp_forward", "VAE", "BernoulliDecoder", "GaussianEncoder", "ImplicitEncoder",
           "build_vae"]
