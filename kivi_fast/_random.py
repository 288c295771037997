"""Random draws that torch.compile can trace at any size."""

from __future__ import annotations

from typing import Optional

import torch


def standard_normal(shape, generator: Optional[torch.Generator] = None, *, dtype=None, device=None) -> torch.Tensor:
    """``torch.randn(shape, ...)``, with ``generator`` passed only when there is one: under torch.compile
    (torch 2.13) ``randn(size, generator=None)`` fails once a second size makes the size symbolic (a
    kl or a sampler compiled, then called with another sample count, raised)."""
    if generator is None:
        return torch.randn(shape, dtype=dtype, device=device)
    return torch.randn(shape, generator=generator, dtype=dtype, device=device)
