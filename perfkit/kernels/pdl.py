"""Programmatic dependent launch (PDL) for the decode step's Triton kernels (toggle ``pdl``).

Why: a batch-1 decode step is hundreds of small kernels in a row (26B-A4B: 463 per step, most of them 1-8 us), and
each one starts only after the one before it has finished: its CTAs are scheduled, then its first DRAM round trip
begins from cold. With PDL (sm_90+) a kernel launched with ``launch_pdl=True`` may start while its predecessor
drains: its CTAs are resident and waiting when the predecessor ends. On the H200 (12-06 call 1,
``docs/h200-runs/2026-12-06/1-pdl.jsonl``, CUDA graphs of chains of 20 dependent batch-1 GEMVs) this took
1.0-1.35 us off each link: 26B-A4B gate_up / down 182.2 -> 155.3 us, qkv / o 278.2 -> 251.6, 31B o_proj
486.8 -> 466.4 (cuBLAS 205.2 / 303.1 / 491.7). In the engine (``configs/ab_pdl.yaml``, 12-06 call 4, TPOT p50):
26B-A4B c1 3.347 -> 3.133 ms, c4 -1.5 %, c8 -1.7 %; 31B c1 16.51 -> 16.37, c4 -1.0 %, c8 -0.6 % (31B c1 +0.36 % in
call 2, where ``decode_gemv=auto``'s near-ties between cuBLAS and the gemv fell the other way). Hence the toggle's
default, auto: on wherever it can run. Since 12-15 the quantised linears' batch-1 kernels take part too (the W4A16
tensor-core and wide gemvs, the FP8 GEMV): 31B NVFP4 c1 9.68 -> 9.40 ms, 31B FP8 c1 12.34 -> 12.13 ms
(``docs/h200-runs/2026-12-15/``).

How a kernel takes part: it gets a ``PDL`` constexpr and calls :func:`pdl_enter` with it before its first read of
anything a predecessor wrote (activations, routing, page tables, the KV cache) and before its first write of
anything a predecessor reads. ``pdl_enter`` waits until every kernel before it in the stream has finished and its
writes are visible (``griddepcontrol.wait``), then lets the kernel after it launch early
(``griddepcontrol.launch_dependents``). Loads of constant data (weights) may come before it. The rule that keeps
this correct: **every program of a PDL kernel runs pdl_enter on every path**, including programs with nothing to
do; a program that exits without waiting would let a later kernel run before an earlier one has finished.

Reading before the wait what the launch just before did not write (12-08's gather kernel computing everything
first, 12-09's decode kernel reading its page table and keys first) made no measurable difference in the engine and
was removed: the wait is at the top of every kernel.

Kernels launched without the attribute (cuBLAS, FlashInfer, torch) wait for their predecessor as always, and a PDL
kernel after one of them starts once it has finished: mixing is safe. Waiting is transitive: a kernel that passed
its wait knows every kernel before its predecessor has finished too. Under the CPU interpreter (and off CUDA, or
before sm_90) ``PDL`` is 0 and the launch is a plain one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from perfkit.kernels.launch import capability, interpreting


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """Wait for the stream's earlier kernels (their writes visible), then let the next kernel launch. A no-op
    when PDL is 0 (the interpreter has no griddepcontrol)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


def pdl_available(device: torch.device) -> bool:
    """PDL can run here: a CUDA device of compute capability 9.0 or newer, outside the CPU interpreter."""
    if device.type != "cuda" or interpreting() or not torch.cuda.is_available():
        return False
    return capability(device) >= (9, 0)


def pdl_launch(pdl: bool) -> dict:
    """Launch arguments of a kernel with a ``PDL`` constexpr: ``PDL`` and, when on, ``launch_pdl=True``."""
    return {"PDL": 1, "launch_pdl": True} if pdl else {"PDL": 0}
