"""Kernel timing shared by the kernel benchmarks (W4A16, MoE): CUDA-graph replays, L2 flushed between them."""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton


def graph_ms(fn: Callable[[], object], warmup: int = 25, rep: int = 100) -> float:
    """Median ms of ``fn`` captured in a CUDA graph: no host launch gaps, as in a decode step replayed from a graph;
    ``triton.testing.do_bench`` flushes L2 between replays. Without CUDA (the CPU smoke tests of the sweeps) it
    times ``fn`` eagerly."""
    if not torch.cuda.is_available():
        return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up (compiles, allocator) outside the capture
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return triton.testing.do_bench(g.replay, warmup=warmup, rep=rep, return_mode="median")
