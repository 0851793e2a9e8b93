"""Kernel timing shared by the kernel benchmarks (W4A16, MoE, GEMV): CUDA-graph replays, either one call with L2
flushed between replays (``graph_ms``) or a sequence of calls back to back (``graph_sequence_us``)."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

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


def graph_sequence_us(fn: Callable[[object], object], args: Sequence[object], calls: int, replays: int) -> float:
    """Median us per call of ``fn(a)`` over ``calls`` calls cycling through ``args``, captured in one CUDA graph
    (back to back, as in a decode step's graph; distinct weights as ``args`` keep L2 from serving a re-read)."""
    seq = [args[i % len(args)] for i in range(calls)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for a in seq:  # compile / warm up outside the capture
            fn(a)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for a in seq:
            fn(a)
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    del graph
    return statistics.median(times)
