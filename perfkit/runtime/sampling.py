"""Token sampling: greedy (argmax) by default; temperature / top-k / top-p with torch when asked.

`sample` returns host ints: the `.tolist()` at the end is the one device->host sync of a step.
"""

from __future__ import annotations

import torch

from perfkit.runtime.scheduler import SamplingParams


def _sample_row(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> torch.Tensor:
    x = logits.float() / p.temperature
    if p.top_k > 0:
        kth = torch.topk(x, min(p.top_k, x.numel())).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if p.top_p < 1.0:
        sp, si = torch.sort(probs, descending=True)
        drop = (sp.cumsum(0) - sp) > p.top_p  # keep the smallest prefix with mass >= top_p
        sp = sp.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, si, sp)
    return torch.multinomial(probs, 1, generator=gen)[0]


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """logits [N, V] float -> N token ids on the host (one per row)."""
    if all(p.temperature == 0.0 for p in params):
        return logits.argmax(dim=-1).tolist()
    ids = logits.argmax(dim=-1)
    for i, (p, g) in enumerate(zip(params, generators, strict=True)):
        if p.temperature > 0.0:
            ids[i] = _sample_row(logits[i], p, g)
    return ids.tolist()
