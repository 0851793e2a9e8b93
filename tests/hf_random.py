"""Random HF weights for the vision parity tests (test_vision.py, test_vision_parity.py).

One rule for the parameters, so both tests exercise the same kind of non-trivial weights: norm weights around 1
(not the all-ones init, which would hide a `1 + w` mix-up), a position table of visible scale, and fan-in scaled
matrices. Buffers (clip ranges, standardize, layer scalars) stay with each test: their values are chosen per test.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


@torch.no_grad()
def randomize_parameters_(named_parameters: Iterable[tuple[str, torch.Tensor]], g: torch.Generator) -> None:
    """Overwrite every parameter in place, drawing from `g` in iteration order."""
    for name, p in named_parameters:
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
        elif "position_embedding_table" in name:
            p.copy_(0.5 * torch.randn(p.shape, generator=g))
        else:
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
