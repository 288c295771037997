"""Variational posteriors over weights, each an ``nn.Module`` with ``sample(n) -> [n, d]``.

- :class:`MLPGenerator`: implicit, standard-normal noise through an MLP (the paper's regression BNNs).
- :class:`MMNN`: implicit, a matrix of noise through matrix-multiplication layers (the paper's Alg. 2),
  for weight matrices too large for an MLP generator.
- :class:`FactorizedGaussian`: explicit, N(mu, diag(sigma^2)) with a closed-form KL to N(0, I), the
  baseline of the paper's appendix table.
"""

from .factorized import FactorizedGaussian
from .mlp_generator import MLPGenerator
from .mmnn import MMNN, MatrixMultiplicationLayer

__all__ = ["MLPGenerator", "MMNN", "MatrixMultiplicationLayer", "FactorizedGaussian"]
