"""Token sampling: greedy (argmax) by default; temperature / top-k / top-p with torch when asked.

`sample_on_device` leaves the ids on the device (the next step's input ids can be read from there without a
host round trip); `TokenTransfer` copies them into pinned host memory asynchronously and waits for them only when
the host needs the values (the engine's overlapped step); `TokenTransfer.wait` is the one device->host sync of
a step.
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


def sample_on_device(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    greedy: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits [N, V] float -> int64 token ids [N] on logits' device; no host sync (multinomial draws included).
    greedy: logits.argmax(-1) computed already (the decode graph's output launch, toggle decode_io); the rows that
    sample are written into it."""
    ids = logits.argmax(dim=-1) if greedy is None else greedy
    for i, (p, g) in enumerate(zip(params, generators, strict=True)):
        if p.temperature > 0.0:
            ids[i] = _sample_row(logits[i], p, g)
    return ids


class TokenTransfer:
    """Sampled ids device -> pinned host, without blocking the host until `wait`.

    Double-buffered: the engine keeps at most two steps' ids in flight (the step being resolved and the one just
    launched), and a buffer is reused only after its `wait` returned, so a copy never lands in memory the host is
    still reading. On CPU (no CUDA) the copy is synchronous and `wait` returns at once."""

    def __init__(self, max_rows: int, device: torch.device):
        self.cuda = device.type == "cuda"
        self.host = [torch.zeros(max_rows, dtype=torch.int64, pin_memory=self.cuda) for _ in range(2)]
        self.events = [torch.cuda.Event() if self.cuda else None for _ in range(2)]
        self.k = 0

    def start(self, ids: torch.Tensor) -> tuple[int, int]:
        """Begin copying ids [N] (device int64); returns the ticket to `wait` on."""
        n = ids.numel()
        if n > self.host[0].numel():
            raise ValueError(f"{n} sampled rows exceed the transfer buffer ({self.host[0].numel()})")
        k = self.k
        self.k ^= 1
        self.host[k][:n].copy_(ids, non_blocking=self.cuda)
        if self.cuda:
            self.events[k].record()
        return k, n

    def wait(self, ticket: tuple[int, int]) -> list[int]:
        """Block until the copy of `ticket` ran; the ids as host ints."""
        k, n = ticket
        if self.cuda:
            self.events[k].synchronize()
        return self.host[k][:n].tolist()
