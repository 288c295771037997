"""kivi_fast: Kernel Implicit Variational Inference (Shi, Sun & Zhu, ICLR 2018), fast and tested.

    import kivi_fast
    kl = kivi_fast.kl(prior_samples, posterior_samples)   # differentiable w.r.t. the posterior samples

``kivi_fast.backend()`` tells whether the compiled ops (``"cpp"``) or the pure-PyTorch reference
(``"reference"``, also ``kivi_fast.reference``) is in use; ``KIVI_FAST_BACKEND=reference`` forces it.
"""

from . import reference
from ._backend import backend
from .estimator import (ClippingWarning, DensityRatio, adaptive_contrast_kl, kernel_kl, kl, median_bandwidth,
                        rbf_gram)

__all__ = ["kl", "kernel_kl", "DensityRatio", "adaptive_contrast_kl", "rbf_gram", "median_bandwidth", "backend",
           "reference", "ClippingWarning"]
__version__ = "0.1.0"
