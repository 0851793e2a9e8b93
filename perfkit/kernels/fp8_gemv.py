"""FP8 weight-only (W8A16) GEMV for decode-shaped FP8 linears: ``y = x @ dequant(W)^T`` with few rows of x.

Why: the W8A8 path (:func:`perfkit.kernels.fp8.fp8_linear`) quantises x per token (amax, scale, cast: several
tiny kernels per linear) and then runs ``torch._scaled_mm``. At M = 1 that loses: on the H200, 31B batch-1
decode with FP8 weights measured 21.0 ms TPOT against 16.7 ms with bf16 weights, although FP8 reads half the
weight bytes. Decode is bandwidth-bound, so one kernel that streams the weight once and leaves x alone should
approach the DRAM bound (``fp8_gemv_traffic``: N*K + 4N + M*K*2 + M*N*2 bytes at 4.3 TB/s).

Format (the one of ``fp8.py`` / ``Fp8Linear``): ``weight`` float8_e4m3fn [N, K] (row-major, unit stride along K),
``weight_scale`` fp32 [N] (per output row), ``dequant(W)[n, k] = float(weight[n, k]) * weight_scale[n]``.

Kernel (``_fp8_gemv_kernel``, CUDA cores, no ``tl.dot``): a program owns BLOCK_N weight rows and up to BLOCK_M rows
of x (BLOCK_M = min(config.block_m, next power of two >= M): M = 1 does no padded work) and streams its share of
K in BLOCK_K steps. The weight is read as int32 words ([N, K/4], a view: K % 4 == 0 is the one shape
requirement). A step's weight tile is [BLOCK_N, BLOCK_K/8] groups of 8 K-contiguous bytes (2 words, one 8-byte
load per thread and row; a warp's 32 lanes read 256 contiguous bytes of a row, the warps side by side along K),
x's tile [BLOCK_M, BLOCK_K/8] groups of 8 elements (one 16-byte load for bf16 / fp16), laid out the same way, so
each thread converts its x elements once and uses them for all BLOCK_N rows it holds, with no layout shuffle
(this needs BLOCK_K a multiple of 256 * num_warps; fp32 x, or smaller steps, go through shared memory). The next
step's weight words are already in flight while this one is computed (register double buffer). Each word becomes
4 fp32 (exact: every e4m3 value is an fp16 and an fp32; on sm_89+ two ``cvt.rn.f16x2.e4m3x2`` and four f16 ->
f32 in inline PTX), and per group a chain of 8 FMAs adds the products to an fp32 partial sum: the accumulator is
[BLOCK_M, BLOCK_N, BLOCK_K/8], reduced over K (lanes and warps) once, in the epilogue, with the per-row scale (one
multiply per output, not per weight) and the cast to x's dtype. Only full BLOCK_K steps run in the loop (no masks,
so the loads stay vectors); the K tail (K not a multiple of BLOCK_K) is one masked step after it; rows past N / M
are clamped on load and masked on store. Rows of x past BLOCK_M are further programs (grid dim 2) that stream the
weight again: the kernel is meant for M <= BLOCK_M (``FP8_GEMV_MAX_M`` rows, what ``Fp8Linear`` routes here).
Cost: one FFMA per weight byte and row of x, plus ~2.3 instructions per weight byte for loads, conversion and
addressing (counted in the sm_90 SASS of the loop from an offline Triton 3.9 compile of GEMV_CONFIG, no GPU run:
~3.3 instructions per byte at M = 1, ~7.0 at M = 4, ~12 at M = 8). An estimate, not a measurement: an H200 issues
about 132 SMs x 128 lanes x ~1.9 GHz = ~32e12 thread-instructions/s, ~7.5 per byte at 4.3 TB/s, so M = 1..2 leave
headroom while M = 8 is likely issue-bound on CUDA cores (a tensor-core variant would be the next step there).

Split-K (grid dim 1) when N / BLOCK_N (x M tiles) programs are fewer than ``MIN_PROGRAMS_PER_SM`` per SM (the
H200 has 132): each split writes its scaled fp32 partial to [S, M, N] and ``w4a16_gemm._finish_split`` sums them
in the fixed order 0..S-1 (deterministic, no atomics) and casts.

Numerics: weight-only. x is NOT quantised (unlike ``fp8_linear``, which rounds x per token to e4m3, ~2.5 %
relative per linear), so the result is the dequantised linear up to fp32 accumulation: a bf16 / fp16 x times an
e4m3 weight is exact in fp32 (at most 11 + 4 significant bits; fp32 x: one rounding per product), the sums are
fp32 (a chain per lane's groups along K, then a tree over lanes and warps; split-K adds S partials in order), the
per-row scale is one more rounding, then the output cast. :func:`fp8_gemv_ref` (dequantise in torch, fp32 matmul)
is the single source of truth. No host syncs: CUDA-graph capturable. On CPU the kernel runs under
``TRITON_INTERPRET=1`` (set before importing triton; the inline PTX is off there); the interpreter's e4m3
conversion matches torch's for every byte except the NaN codes 0x7F / 0xFF (it returns +-480), which
``quantize_fp8_rowwise`` never produces.

Tuning: ``FP8_GEMV_MAX_M`` comes from the H200 sweep of 12-01c (``python3 -m perfkit.kernels.fp8_gemv --sweep
[--out FILE]``, ``sweep_fp8_gemv``: the tiles of ``SWEEP_CONFIGS`` at the 31B's decode shapes against bf16 cuBLAS
and the W8A8 ``fp8_linear`` path), ``GEMV_CONFIG`` from its rerun of 12-01i: 43.5-63.8 % of the DRAM bound at
M = 1 with ``group=16`` (36-51 % before). ``group=16``: each thread holds 16 K of a row per step (one 16-byte
weight load, x as two 16-byte loads) and keeps 4 accumulator chains, one per word (``_fp8_gemv_step16``), as the
W4A16 wide gemv does. Compiled offline for sm_90 with Triton 3.6 at M = 1 (integer arguments and pointers taken
as divisible by 16, as the real shapes are), its loop takes 3.5-3.9 SASS instructions per weight byte (4 or 8
rows x 2048) against 5.7 for the 8-byte 8 x 4 x 1024 tile counted the same way, with 104-172 registers against 48.

Tensor cores (``Fp8GemvConfig.tc``, sm_90+, bf16 x, M <= GEMV_TC_MAX_M = 32; ``pick_config``): the CUDA-core kernel
pays one FMA per weight byte and row of x, so from M = 2 the decode rows took W8A8 ``scaled_mm`` instead, which was
slower than bf16 at M 2-16 (per-token quantisation launches, and cuBLAS's FP8 tiles at tiny M). Since 12-18 those
rows, and M = 1 on the wide or large products, run the W4A16 tensor-core gemv's loop on e4m3 words
(``w4a16_gemm._w4a16_gemv_tc_kernel`` with FP8=1): each thread's 16-byte weight loads become the warpgroup MMA's
register operand as bf16x2 pairs (a ``prmt``, two masks, a shift and one bf16x2 multiply by 2^120 per pair: exact
e4m3 values, in the same permuted K order, so the same x tile serves both formats), row m of x in the MMA's column
m, the per-row scale in the epilogue, split over K with the splits summed in the launch (``split_counter``). 4.0
SASS instructions per weight byte in the loop at 128-wide steps, 3.6 at 256-wide (sm_90 compile). Same numerics as
the CUDA-core kernel: exact products, fp32 sums, one rounding by the scale, one by the output cast. H200 12-18,
chained with PDL (``h200-runs/2026-12-18/2-probe.jsonl``): 69-86 % of the load-only ceiling at M 1-16 on the six
31B shapes; 31B FP8 TPOT c2 21.24 -> 10.96 ms, c4 21.51 -> 11.51, c16 25.43 -> 16.62, c1 11.85 -> 10.82. M 17-32
run as one program per 32 rows of x (``tc_cols`` 32, 12-19: the tile decoded once for all of them; 31B FP8 c32
TPOT 23.53 ms), W8A8 above (``GEMV_TC_MAX_M``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch
import triton
import triton.language as tl

from perfkit.kernels.fp8 import FP8_DTYPE, dequantize_fp8_rowwise, fp8_linear, fp8_supported, quantize_fp8_rowwise
from perfkit.kernels.launch import capability, interpreting, sm_count
from perfkit.kernels.pdl import pdl_enter, pdl_launch
from perfkit.kernels.stream import chain_args, chain_columns, stream_chain_us, stream_read_ms
from perfkit.kernels.timing import graph_ms
from perfkit.kernels.w4a16_gemm import (
    HBM_BYTES_PER_S,
    W4A16Config,
    _finish_split,
    _launch_gemv_tc,
    tc_grid,
    tc_groups_pay,
    tc_rows_fit,
    tensor_cores_for_gemv,
)
from perfkit.kernels.w4a16_gemm import _fit as _fit_w4a16

# The largest flattened M that Fp8Linear (backend fp8-scaled-mm) sends to fp8_gemv instead of the W8A8
# scaled_mm path, from the H200 sweep (`python3 -m perfkit.kernels.fp8_gemv --sweep`, 12-01c): summed over the
# six 31B shapes with the 8-row tile, the gemv takes 363 us at M=1 (347 with the 4-row default) against 476 us for
# scaled_mm (and 418 us for bf16 cuBLAS), but 494 vs 479 us at M=2 and 720 vs 479 us at M=4 (one CUDA-core FMA per
# weight byte per row).
FP8_GEMV_MAX_M = 1
MIN_PROGRAMS_PER_SM = 2  # below this many programs per SM the gemv splits K
MAX_SPLIT_K = 8
X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# --------------------------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------------------------


@triton.jit
def _e4m3x4_to_f32(wd, ASM: tl.constexpr):
    """int32 words of 4 e4m3 bytes -> 4 fp32 tensors (bytes 0..3 = elements 4w .. 4w + 3, little-endian), exact.
    ASM (sm_89+): two ``cvt.rn.f16x2.e4m3x2`` on the word's halves, four f16 -> f32 (Triton's own e4m3 lowering
    unpacks and re-packs every byte first: ~60 % more instructions per step in the sm_90 SASS of the loop). Else:
    each byte bitcast to float8e4nv and converted by Triton (the interpreter; GPUs without FP8 conversions)."""
    if ASM:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 l, h, a0, a1, b0, b1; .reg .b32 a, b; mov.b32 {l, h}, $4; cvt.rn.f16x2.e4m3x2 a, l; "
            "cvt.rn.f16x2.e4m3x2 b, h; mov.b32 {a0, a1}, a; mov.b32 {b0, b1}, b; cvt.f32.f16 $0, a0; "
            "cvt.f32.f16 $1, a1; cvt.f32.f16 $2, b0; cvt.f32.f16 $3, b1; }",
            "=r,=r,=r,=r,r",
            [wd],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32),
            is_pure=True,
            pack=1,
        )
    f0 = (wd & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    f1 = ((wd >> 8) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    f2 = ((wd >> 16) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    f3 = ((wd >> 24) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return f0, f1, f2, f3


@triton.jit
def _fp8_gemv_step(acc, wd, x, ASM: tl.constexpr):
    """acc [BM, BN, G] fp32 + one K step: weight words wd [1, BN, G, 2] (group g = elements 8g .. 8g + 7 = word
    h, byte j at 8g + 4h + j) times x [BM, 1, G, 8]: per group a chain of 8 FMAs into the group's partial sum (no
    reduction tree, no cross-thread shuffle). All splits stay in-thread: each thread holds a group's 2 words and 8
    x elements."""
    f0, f1, f2, f3 = _e4m3x4_to_f32(wd, ASM)  # [1, BN, G, 2 (h)] each
    w00, w10 = tl.split(f0)  # w{h}{j}: [1, BN, G]
    w01, w11 = tl.split(f1)
    w02, w12 = tl.split(f2)
    w03, w13 = tl.split(f3)
    xf = tl.reshape(x.to(tl.float32), (x.shape[0], 1, x.shape[2], 2, 2, 2))  # [BM, 1, G, h, j // 2, j % 2], exact
    x_even, x_odd = tl.split(xf)
    x0, x2 = tl.split(x_even)  # x{j}: [BM, 1, G, 2 (h)]
    x1, x3 = tl.split(x_odd)
    x00, x10 = tl.split(x0)  # x{h}{j}: [BM, 1, G]
    x01, x11 = tl.split(x1)
    x02, x12 = tl.split(x2)
    x03, x13 = tl.split(x3)
    acc = tl.fma(w00, x00, acc)  # explicit FMAs: no reliance on Triton's FP fusion default
    acc = tl.fma(w01, x01, acc)
    acc = tl.fma(w02, x02, acc)
    acc = tl.fma(w03, x03, acc)
    acc = tl.fma(w10, x10, acc)
    acc = tl.fma(w11, x11, acc)
    acc = tl.fma(w12, x12, acc)
    return tl.fma(w13, x13, acc)


@triton.jit
def _fp8_gemv_step16(acc, wd, x, ASM: tl.constexpr):
    """The 16-element form of :func:`_fp8_gemv_step`: acc [BM, BN, G, 4] fp32 + weight words wd [1, BN, G, 4]
    (group g = elements 16g .. 16g + 15 = word h, byte j at 16g + 4h + j; one 16-byte load per thread and row)
    times x [BM, 1, G, 16]: a chain of 4 FMAs per word (byte j of each word), the 4 words' chains kept apart in
    the accumulator's last axis and reduced with the groups in the epilogue."""
    f0, f1, f2, f3 = _e4m3x4_to_f32(wd, ASM)  # byte j of each word: [1, BN, G, 4 (h)]
    xf = tl.reshape(x.to(tl.float32), (x.shape[0], 1, x.shape[2], 4, 2, 2))  # [BM, 1, G, h, j // 2, j % 2]
    x_even, x_odd = tl.split(xf)
    x0, x2 = tl.split(x_even)  # x{j}: [BM, 1, G, 4 (h)]
    x1, x3 = tl.split(x_odd)
    acc = tl.fma(f0, x0, acc)
    acc = tl.fma(f1, x1, acc)
    acc = tl.fma(f2, x2, acc)
    return tl.fma(f3, x3, acc)


@triton.jit
def _fp8_gemv_kernel(
    x_ptr,  # [M, K] activations (bf16 / fp16 / fp32), unit stride along K
    w_ptr,  # [N, K/4] int32: the float8_e4m3fn weight [N, K] as words (4 elements each, little-endian)
    s_ptr,  # [N] fp32 per-row weight scale
    out_ptr,  # [M, N] output (x's dtype), or [SPLIT, M, N] fp32 partials (split-K)
    M,
    N,
    K,  # multiple of 4
    stride_xm,
    stride_wn,  # in words
    stride_os,
    stride_om,
    k_per_split,  # multiple of BLOCK_K
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # >= GROUP; a multiple of 32 * GROUP * num_warps keeps x in the weight tile's layout
    GROUP: tl.constexpr,  # K elements per thread and row per step: 8 (one 8-byte load) or 16 (one 16-byte load)
    ASM: tl.constexpr,  # inline-PTX e4m3 -> fp32 (sm_89+; not the interpreter)
    PDL: tl.constexpr = 0,  # launched with launch_pdl (perfkit/kernels/pdl.py): the first weight tile loads first
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    G: tl.constexpr = BLOCK_K // GROUP
    WORDS: tl.constexpr = GROUP // 4
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.minimum(offs_n, N - 1).to(tl.int64)  # rows past N / M re-read the last row (not stored): no load masks
    rm = tl.minimum(offs_m, M - 1).to(tl.int64)
    kx = (GROUP * tl.arange(0, G))[:, None] + tl.arange(0, GROUP)[None, :]  # [G, GROUP]: x's K offsets in a step
    kw = (WORDS * tl.arange(0, G))[:, None] + tl.arange(0, WORDS)[None, :]  # [G, WORDS]: the weight's words
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    k_main = k_lo + (k_hi - k_lo) // BLOCK_K * BLOCK_K  # end of this split's full steps
    # 4-D tiles: weight words [1, BN, G, 2], x [BM, 1, G, 8]. Their loads fix the layouts: one 8-element group per
    # thread (8 B of weight, 16 B of bf16 x), 32 lanes x num_warps warps side by side along K, the BN weight rows
    # and BM x rows repeated in each thread's registers, so x (converted once) serves all BN rows of a thread and
    # the product needs no layout conversion (x is issued first: the product then takes the weight's layout)
    w_ptrs = w_ptr + (rn * stride_wn)[None, :, None, None] + (k_lo // 4 + kw)[None, None, :, :]
    x_ptrs = x_ptr + (rm * stride_xm)[:, None, None, None] + (k_lo + kx)[None, None, :, :]
    if GROUP == 16:
        acc = tl.zeros((BLOCK_M, BLOCK_N, G, WORDS), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N, G), dtype=tl.float32)

    # full steps: unmasked vector loads; the next step's weight tile is loaded before this step's math (the last
    # step's "next" is clamped onto itself: an L1 / L2 re-read instead of a mask)
    wd = tl.load(w_ptrs, mask=(4 * kw < k_main - k_lo)[None, None, :, :], other=0)  # all-true, or no full step
    pdl_enter(PDL)  # x is the predecessor's output; the weight is constant, so its first tile is already in flight
    for k0 in range(k_lo, k_main, BLOCK_K):
        x = tl.load(x_ptrs + (k0 - k_lo))
        k_next = tl.minimum(k0 + BLOCK_K, k_main - BLOCK_K)
        wd_next = tl.load(w_ptrs + (k_next - k_lo) // 4)
        if GROUP == 16:
            acc = _fp8_gemv_step16(acc, wd, x, ASM)
        else:
            acc = _fp8_gemv_step(acc, wd, x, ASM)
        wd = wd_next
    if k_main < k_hi:  # the K tail: one masked step (zeros past k_hi in both operands)
        x = tl.load(x_ptrs + (k_main - k_lo), mask=(kx < k_hi - k_main)[None, None, :, :], other=0.0)
        wd = tl.load(w_ptrs + (k_main - k_lo) // 4, mask=(4 * kw < k_hi - k_main)[None, None, :, :], other=0)
        if GROUP == 16:
            acc = _fp8_gemv_step16(acc, wd, x, ASM)
        else:
            acc = _fp8_gemv_step(acc, wd, x, ASM)

    scale = tl.load(s_ptr + rn)  # [BN] fp32
    if GROUP == 16:
        acc = tl.sum(acc, axis=3)  # [BM, BN, G]: a word's 4 chains
    y = tl.sum(acc, axis=2) * scale[None, :]  # [BM, BN]: the groups (lanes and warps) reduced once
    out = out_ptr + pid_k.to(tl.int64) * stride_os + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out, y.to(out_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


# --------------------------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------------------------


def _pow2(v: int) -> bool:
    return isinstance(v, int) and v >= 1 and v & (v - 1) == 0


@dataclass(frozen=True)
class Fp8GemvConfig:
    """One tile of ``_fp8_gemv_kernel`` (no autotune: ``sweep_fp8_gemv`` times them on the GPU).

    ``block_m``: the most rows of x per program (a program takes min(block_m, next power of two >= M));
    ``block_n`` weight rows per program; ``block_k`` (>= 16) K elements per step, so a step loads block_n *
    block_k weight bytes. Keep ``block_k`` a multiple of 256 * ``num_warps`` (8 elements per lane, lanes and warps
    side by side along K): then x's tile loads in the weight tile's layout; smaller steps are correct but move x
    through shared memory every step. Registers per thread grow with block_m * block_n (the accumulator) and
    block_n * block_k / (32 * num_warps) (the weight bytes, twice: the next step is in flight). ``num_stages`` is
    passed to Triton (the loop has no ``tl.dot``; the prefetch is done by hand, in registers). ``split_k``: None =
    chosen from the grid and the SM count, 1 = never, S = at most S splits. ``group``: K elements each thread
    holds per row and step, 8 (two words, one 8-byte load) or 16 (four words, one 16-byte load, x as two 16-byte
    loads; the form that took the W4A16 gemv from 51-62 % to 59-66 % of the read ceiling; keep block_k a multiple
    of 512 * num_warps for it). ``tc``: the tensor-core gemv instead (``w4a16_gemm._w4a16_gemv_tc_kernel`` on e4m3
    words: block_n weight rows as the MMA's M side, >= 16; block_k >= 64; num_stages its cp.async stages; block_m
    and group unused; ``tc_cols`` as ``W4A16Config``'s); it takes bf16 x on sm_90+ (and the interpreter), other x
    runs the CUDA-core kernel's default tile. Sizes are powers of two (ValueError otherwise)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int = 1
    split_k: int | None = None
    group: int = 8
    tc: bool = False
    tc_cols: int = 16

    def __post_init__(self) -> None:
        ok = all(_pow2(v) for v in (self.block_m, self.block_n, self.block_k, self.num_warps))
        ok = ok and self.block_k >= 16 and isinstance(self.num_stages, int) and self.num_stages >= 1
        ok = ok and (self.split_k is None or (isinstance(self.split_k, int) and self.split_k >= 1))
        ok = ok and self.group in (8, 16) and self.tc_cols in (16, 32)
        ok = ok and (not self.tc or (self.block_n >= 16 and self.block_k >= 64))
        if not ok:
            raise ValueError(
                f"bad Fp8GemvConfig {self}: block_m, block_n, block_k and num_warps must be powers of two, "
                "block_k >= 16, num_stages >= 1, split_k None or >= 1, group 8 or 16, tc_cols 16 or 32; "
                "tc: block_n >= 16, block_k >= 64"
            )


# From the H200 sweep (12-01c, `3-fp8_gemv_sweep.jsonl`): at M = 1 (all Fp8Linear routes here, FP8_GEMV_MAX_M)
# 4 weight rows x 1024 K with 4 warps is the best tile over the six 31B shapes (geomean 1.02x the per-shape best;
# 347 us summed, 36-51 % of the DRAM bound, against 363 us for 8 rows). block_m 8: up to 8 rows of x in one row
# tile (the weight streamed once) for callers that pass more rows. sm_90 SASS of the loop (offline Triton 3.9
# compile of the 8-row tile, not a timing): 61 registers and ~3.3 instructions per weight byte at M = 1; 130
# registers, ~7.0 at M = 4; 203 registers, ~12 at M = 8 (one CUDA-core FMA per weight byte per row: why the
# gemv loses to scaled_mm from M = 2 on). No split-K at the 31B shapes (>= 1344 programs).
# H200 12-01i (docs/h200-runs/2026-12-01i/1-fp8_sweep.jsonl): at M = 1 the 16-byte form, 2 weight rows x 2048 K
# on 4 warps, is the best tile on all six shapes, 43.5-63.8 % of the DRAM bound (geomean 1.00x the per-shape best)
# against 35.7-50.9 % (1.235x) for the 8 x 4 x 1024 tile above, which stays ahead at M = 2-4 (M > 1 goes to
# scaled_mm anyway, FP8_GEMV_MAX_M). block_m 2: a caller with more rows streams the weight once per 2 rows.
GEMV_CONFIG = Fp8GemvConfig(block_m=2, block_n=2, block_k=2048, num_warps=4, num_stages=1, group=16)
# The CPU interpreter runs one program at a time in Python (cost ~ programs x ops): one wide tile per problem.
INTERPRETER_CONFIG = Fp8GemvConfig(block_m=8, block_n=64, block_k=128, num_warps=4, num_stages=1)
# M 1..GEMV_TC_MAX_M with bf16 x on sm_90+, K of whole 64-wide steps: the tensor-core gemv on e4m3 words (the W4A16
# one's loop, ``_tc_e4m3_tile``). Why: at M > 1 the CUDA-core kernel pays one FMA per weight byte and row, and the
# W8A8 scaled_mm path quantises x per token in extra launches: 31B FP8 c4 TPOT 21.31 ms against 17.86 for bf16
# (H200 12-17 ``8-h200_quant.json``). H200 12-18 (``h200-runs/2026-12-18/2-probe.jsonl``, chained with PDL, us, the
# six 31B shapes): 256-wide steps (64 weight rows x 256 bytes per stage) win at M 1-8 (5376 x 21504: 33.75 at M = 1,
# 32.7-33.9 at M 2-8, against 43.06 / 34.76-39.67 with 128-wide steps), 128-wide steps at M 9-16 (36.4 vs 39.8 at
# M = 16: the wide step's x tile takes the registers over the 128 cap); W8A8 took 89-97 us there, bf16 cuBLAS 57-58.
# At M = 1 the CUDA-core gemv stays ahead on the long-K products of 5376 rows below GEMV_TC_M1_MIN_ELEMENTS (5376 x
# 8192 15.46 vs 17.07, 5376 x 16384 26.98 vs 27.32); the tensor-core gemv wins the rest (43008 x 5376 65.67 vs 74.69,
# 5376 x 21504 33.75 vs 35.20).
GEMV_TC_CONFIG = Fp8GemvConfig(block_m=1, block_n=64, block_k=256, num_warps=4, num_stages=3, tc=True)
GEMV_TC_ROWS_CONFIG = Fp8GemvConfig(block_m=1, block_n=64, block_k=128, num_warps=4, num_stages=3, tc=True)
GEMV_TC_WIDE_STEP_MAX_M = 8  # GEMV_TC_CONFIG up to here, GEMV_TC_ROWS_CONFIG above
# Beyond 16 rows one program per 16-row group of x (``w4a16_gemm.GEMV_TC_MAX_ROW_GROUPS``), each decoding the weight
# tile again. H200 12-18 (``7-groups.jsonl``, chained us, tc / W8A8): M = 32 5376 x 21504 67.49 / 82.05, 43008 x 5376
# 121.10 / 112.56, 5376 x 8192 28.03 / 41.96; M = 64 122.81 / 84.35, 217.95 / 109.84, 50.18 / 43.57. Up to 32 rows:
# 31B FP8 c32 forward_decode device mean 26.88 -> 26.15 ms (``7-e_f8_*.json``).
GEMV_TC_MAX_M = 32
# ... since 12-19 as programs of 32 rows of x (``tc_cols`` 32: the tile decoded once for all of them). H200 12-19
# (``h200-runs/2026-12-19/3-cols.jsonl``, chained us, 32-row programs / 16-row groups / W8A8) at M = 32: 5376 x 21504
# 43.5 / 67.0 / 88.3, 43008 x 5376 85.6 / 121.0 / 111.0, 5376 x 8192 20.6 / 28.4 / 45.0. At M 48-64 (two such
# programs) W8A8 wins on 43008 x 5376 (155-158 vs 109-111 us) and ties on 5376 x 21504: the limit stays 32.
GEMV_TC_COLS_CONFIG = Fp8GemvConfig(block_m=1, block_n=64, block_k=128, num_warps=4, num_stages=3, tc=True, tc_cols=32)
GEMV_TC_M1_MIN_ELEMENTS = 100 * 1024 * 1024  # M = 1: the tc gemv where N >= K or N * K >= this
INLINE_ASM_CVT = True  # GPU sm_89+: inline-PTX e4m3 -> fp32 (False: Triton's own conversion)


def default_config() -> Fp8GemvConfig:
    """GEMV_CONFIG, or INTERPRETER_CONFIG under the CPU interpreter."""
    return INTERPRETER_CONFIG if interpreting() else GEMV_CONFIG


def _tc_fits(M: int, x: torch.Tensor) -> bool:
    """Whether the tensor-core gemv can take these rows: bf16 x (the MMA's B operand), at most 16 rows per group of
    programs and GEMV_TC_MAX_ROW_GROUPS groups, on an sm_90+ GPU or the interpreter (its fp32 form). Where it is
    the default: ``pick_config``."""
    return tc_rows_fit(M, x.dtype) and (interpreting() or tensor_cores_for_gemv(x.device))


def _tc_tile(cfg: Fp8GemvConfig, M: int, N: int, K: int) -> W4A16Config:
    """A tc Fp8GemvConfig as the tensor-core gemv's own tile, clipped to tiny problems as the W4A16 one is."""
    tile = W4A16Config(1, cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages, split_k=cfg.split_k, tc=True,
                       tc_cols=cfg.tc_cols)  # fmt: skip
    return _fit_w4a16(tile, "gemv", M, N, K)


def gemv_max_m(x_dtype: torch.dtype, device: torch.device | str) -> int:
    """The most rows ``Fp8Linear`` sends to ``fp8_gemv`` (K a multiple of 64): GEMV_TC_MAX_M for bf16 x on sm_90+,
    else FP8_GEMV_MAX_M. Recorded in results (``fp8_gemv_max_m``)."""
    tc = x_dtype == torch.bfloat16 and not interpreting() and tensor_cores_for_gemv(torch.device(device))
    return GEMV_TC_MAX_M if tc else FP8_GEMV_MAX_M


def pick_config(M: int, N: int, K: int, x: torch.Tensor) -> Fp8GemvConfig | None:
    """The tile ``fp8_gemv`` runs for M rows of x against an N x K weight: the tensor-core tile for 1..GEMV_TC_MAX_M
    rows of bf16 x on sm_90+ with K a multiple of 64 (GEMV_TC_CONFIG up to GEMV_TC_WIDE_STEP_MAX_M rows, then
    GEMV_TC_ROWS_CONFIG to 16, GEMV_TC_COLS_CONFIG above; the step halved until it divides K: the 26B-A4B's 2112 runs
    64-wide steps), at M = 1 only where N >= K or N * K >= GEMV_TC_M1_MIN_ELEMENTS, above 16 rows only where
    ``w4a16_gemm.tc_groups_pay`` (the W4A16 rule); else the CUDA-core tile up to FP8_GEMV_MAX_M rows; None
    beyond: the product is not a decode gemv (``Fp8Linear`` then runs W8A8 ``scaled_mm``)."""
    wide = M > 1 or N >= K or N * K >= GEMV_TC_M1_MIN_ELEMENTS
    shape_ok = wide and tc_groups_pay(M, N, K) and M <= GEMV_TC_MAX_M and K % 64 == 0
    if shape_ok and not interpreting() and _tc_fits(M, x):
        cfg = GEMV_TC_CONFIG if M <= GEMV_TC_WIDE_STEP_MAX_M else GEMV_TC_ROWS_CONFIG if M <= 16 else GEMV_TC_COLS_CONFIG
        bk = cfg.block_k
        while K % bk:
            bk //= 2
        return cfg if bk == cfg.block_k else dataclasses.replace(cfg, block_k=bk)
    return default_config() if M <= FP8_GEMV_MAX_M else None


def _has_fp8_cvt(device: torch.device) -> bool:
    return capability(device) >= (8, 9)  # cvt.rn.f16x2.e4m3x2: sm_89+ (False off CUDA)


def _asm(device: torch.device) -> bool:
    return INLINE_ASM_CVT and not interpreting() and _has_fp8_cvt(device)


def _fit(cfg: Fp8GemvConfig, M: int, N: int, K: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) of the launch: block_m capped at M's next power of two (M = 1 computes one
    row), block_n / block_k at N's / K's (no change at model shapes, much less wasted work at the tiny test ones)."""
    bm = min(cfg.block_m, triton.next_power_of_2(M))
    bn = min(cfg.block_n, triton.next_power_of_2(N))
    bk = min(cfg.block_k, max(16, triton.next_power_of_2(K)))
    return bm, bn, bk


def _split_k(cfg: Fp8GemvConfig, block_k: int, device: torch.device, programs: int, K: int) -> tuple[int, int]:
    """(splits, K per split): split K only while the grid has fewer than MIN_PROGRAMS_PER_SM programs per SM (or
    as forced by ``cfg.split_k``), at most MAX_SPLIT_K and the number of K steps; whole K steps per split."""
    steps = triton.cdiv(K, block_k)
    split = cfg.split_k
    if split is None:
        target = MIN_PROGRAMS_PER_SM * sm_count(device)
        split = 1 if programs >= target else triton.cdiv(target, max(programs, 1))
    split = max(1, min(split, steps, MAX_SPLIT_K))
    k_per_split = triton.cdiv(steps, split) * block_k
    return triton.cdiv(K, k_per_split), k_per_split


def _check(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> tuple[int, int, int]:
    if x.dim() != 2 or x.dtype not in X_DTYPES:
        raise ValueError(f"x must be 2-D [M, K] bf16 / fp16 / fp32, got {x.dtype} {tuple(x.shape)}")
    M, K = x.shape
    if weight.dim() != 2 or weight.dtype != FP8_DTYPE or weight.shape[1] != K:
        raise ValueError(f"weight must be float8_e4m3fn [N, K={K}], got {weight.dtype} {tuple(weight.shape)}")
    N = weight.shape[0]
    if K % 4:
        raise ValueError(f"fp8_gemv needs K % 4 == 0 (the weight is read as int32 words), got K={K}")
    if weight.stride(1) != 1 and N > 1 and K > 1:
        raise ValueError(f"weight must have unit stride along K, got strides {weight.stride()}")
    if weight_scale.dtype != torch.float32 or tuple(weight_scale.shape) != (N,):
        raise ValueError(f"weight_scale must be fp32 [N={N}], got {weight_scale.dtype} {tuple(weight_scale.shape)}")
    if not (x.device == weight.device == weight_scale.device):
        raise ValueError(f"x, weight, weight_scale on different devices: {x.device}, {weight.device}, "
                         f"{weight_scale.device}")  # fmt: skip
    return M, N, K


def _words(weight: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn [N, K] -> int32 [N, K/4], the same bytes (a view: rows are contiguous and K % 4 == 0; a copy
    only when the storage offset is not a multiple of 4 bytes or the rows are padded)."""
    if weight.shape[0] > 1 and weight.stride(0) % 4:
        weight = weight.contiguous()
    try:
        return weight.view(torch.int32)
    except RuntimeError:  # storage offset not a multiple of 4 bytes
        return weight.clone().view(torch.int32)


def fp8_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    config: Fp8GemvConfig | None = None,
    pdl: bool = False,
    split_counter: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``x [M, K] @ dequant(weight [N, K])^T -> [M, N]`` in ``out_dtype`` (bf16 / fp16 / fp32, default x's dtype),
    weight-only (x not quantised; format, tiling and numerics: module docstring). x: bf16 / fp16 / fp32, rows may be
    strided (a copy is made only if its K stride is not 1); weight float8_e4m3fn [N, K] with unit stride along K;
    weight_scale fp32 [N]. ``config``: the tile (default ``pick_config``, the CUDA-core ``default_config()`` where it
    has none; a tc tile the tensor-core gemv cannot take runs the CUDA-core default). No host sync: CUDA-graph
    capturable. CUDA: sm_89+ (Triton's float8e4nv conversions; the FP8 linears need it anyway). pdl: launch with
    programmatic dependent launch (perfkit/kernels/pdl.py; sm_90+ only, the caller checks); a split-K sum after it
    launches plainly. ``split_counter``: the tensor-core gemv's splits summed in its own launch
    (``w4a16_gemm.new_split_counter(N, device)``, owned by the caller, never shared by two launches at once)."""
    M, N, K = _check(x, weight, weight_scale)
    if x.device.type == "cuda" and not interpreting() and not _has_fp8_cvt(x.device):
        raise RuntimeError(
            f"fp8_gemv needs an sm_89+ GPU (e4m3 conversions), got {torch.cuda.get_device_name(x.device)}"
        )
    if out_dtype is not None and out_dtype not in X_DTYPES:
        raise ValueError(f"out_dtype must be bf16 / fp16 / fp32, got {out_dtype}")
    cfg = config or pick_config(M, N, K, x) or default_config()
    if not isinstance(cfg, Fp8GemvConfig):
        raise ValueError(f"config must be an Fp8GemvConfig, got {type(cfg).__name__}")
    if cfg.tc and not _tc_fits(M, x):
        cfg = default_config()
    out_dtype = out_dtype or x.dtype
    if M == 0 or N == 0:
        return torch.empty((M, N), dtype=out_dtype, device=x.device)
    if K == 0:
        return torch.zeros((M, N), dtype=out_dtype, device=x.device)
    if x.stride(1) != 1:
        x = x.contiguous()
    scale = weight_scale.contiguous()
    words = _words(weight)  # [N, K/4] int32
    if cfg.tc:
        tile = _tc_tile(cfg, M, N, K)
        return _launch_gemv_tc(x, words, words, scale, 1, out_dtype, tile, split_counter, pdl, fp8=True)
    bm, bn, bk = _fit(cfg, M, N, K)
    grid_n, grid_m = triton.cdiv(N, bn), triton.cdiv(M, bm)
    split, k_per_split = _split_k(cfg, bk, x.device, grid_n * grid_m, K)
    out = torch.empty((M, N), dtype=out_dtype, device=x.device)
    target = out if split == 1 else torch.empty((split, M, N), dtype=torch.float32, device=x.device)
    _fp8_gemv_kernel[(grid_n, split, grid_m)](
        x, words, scale, target,
        M, N, K,
        x.stride(0), words.stride(0), 0 if split == 1 else target.stride(0), N, k_per_split,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP=min(cfg.group, bk), ASM=_asm(x.device), num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **pdl_launch(pdl),
    )  # fmt: skip
    return out if split == 1 else _finish_split(target, out)  # the W4A16 GEMM's fixed-order reduce


# --------------------------------------------------------------------------------------------------------------
# Reference and traffic
# --------------------------------------------------------------------------------------------------------------


def fp8_gemv_ref(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """The single source of truth of :func:`fp8_gemv`: dequantise W in torch (fp32), fp32 matmul of the
    unquantised x, cast to ``out_dtype`` (default x's dtype)."""
    return (x.float() @ dequantize_fp8_rowwise(weight, weight_scale).T).to(out_dtype or x.dtype)


def fp8_gemv_traffic(M: int, N: int, K: int, act_bytes: int = 2, out_bytes: int = 2) -> dict[str, float]:
    """Minimum DRAM bytes (weight N*K + scales 4N + x M*K*act_bytes read, M*N*out_bytes written) and FLOPs (2MNK);
    ``bound_ms`` = total bytes / 4.3 TB/s (H200 achievable): the decode target."""
    weight = N * K + 4 * N
    read = weight + M * K * act_bytes
    written = M * N * out_bytes
    return {
        "weight_bytes": weight,
        "bytes_read": read,
        "bytes_written": written,
        "total_bytes": read + written,
        "flops": 2 * M * N * K,
        "bound_ms": (read + written) / HBM_BYTES_PER_S * 1e3,
    }


# --------------------------------------------------------------------------------------------------------------
# Timing (CUDA)
# --------------------------------------------------------------------------------------------------------------

# The 31B's decode linears as [N, K]: merged q|k|v, merged gate|up, down, and the other attention / MLP widths.
SWEEP_SHAPES: tuple[tuple[int, int], ...] = (
    (21504, 5376),
    (43008, 5376),
    (5376, 21504),
    (16384, 5376),
    (5376, 16384),
    (5376, 8192),
)
SWEEP_MS: tuple[int, ...] = (1, 2, 4, 8, 16)
# Tiles timed per (shape, M), None = GEMV_CONFIG. The 8-byte form: 4-16 weight rows, steps of 256 * num_warps (x
# in the weight's layout) or twice that, one smaller step (x through shared memory), split-K forced off (1) and on
# (2), block_m = 8 (each program takes min(8, M) rows); then the 16-byte form with block_m 2. Each tile compiles in
# ~1 s per M and tile height.
SWEEP_CONFIGS: tuple[Fp8GemvConfig | None, ...] = (
    None,  # GEMV_CONFIG: since 12-01i the 16-byte 2 x 2 x 2048 tile, 4 warps
    Fp8GemvConfig(block_m=8, block_n=4, block_k=1024, num_warps=4),  # GEMV_CONFIG from 12-01c to 12-01i
    Fp8GemvConfig(block_m=8, block_n=8, block_k=1024, num_warps=4),  # the first default (12-01c sweep)
    Fp8GemvConfig(block_m=8, block_n=16, block_k=1024, num_warps=4),
    Fp8GemvConfig(block_m=8, block_n=8, block_k=2048, num_warps=4),
    Fp8GemvConfig(block_m=8, block_n=4, block_k=2048, num_warps=8),
    Fp8GemvConfig(block_m=8, block_n=8, block_k=2048, num_warps=8),
    Fp8GemvConfig(block_m=8, block_n=16, block_k=2048, num_warps=8),
    Fp8GemvConfig(block_m=8, block_n=8, block_k=512, num_warps=4),
    Fp8GemvConfig(block_m=8, block_n=8, block_k=1024, num_warps=4, split_k=1),
    Fp8GemvConfig(block_m=8, block_n=8, block_k=1024, num_warps=4, split_k=2),
    Fp8GemvConfig(block_m=8, block_n=16, block_k=1024, num_warps=4, split_k=2),
    # 16-byte groups (12-01h; 2 x 2 x 2048, the GEMV_CONFIG above since 12-01i, was the fourth): steps of
    # 512 * num_warps keep x in the weight's layout. At most 2 rows of x per program: 8 rows spill (an sm_90
    # compile of 8 x 4 x 2048: 255 registers + 424 bytes of stack)
    Fp8GemvConfig(block_m=2, block_n=4, block_k=2048, num_warps=4, group=16),
    Fp8GemvConfig(block_m=2, block_n=8, block_k=2048, num_warps=4, group=16),
    Fp8GemvConfig(block_m=2, block_n=4, block_k=4096, num_warps=8, group=16),
    GEMV_TC_CONFIG,  # the tensor-core gemv (12-18): 256-wide steps, M 1-8 by default
    GEMV_TC_ROWS_CONFIG,  # 128-wide steps, M 9-16 by default
)
SWEEP_WARMUP_MS = 5  # triton.testing.do_bench times (ms): ~25 ms per measurement keeps the sweep near a minute
SWEEP_REP_MS = 20


def _bench_weights(N: int, K: int, seed: int, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random FP8 weight [N, K] (std 0.02, quantised per row), its scales, and the dequantised bf16 weight for the
    cuBLAS baseline (same shape and bytes as a bf16 checkpoint)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(N, K, device=device, generator=gen) * 0.02
    q, s = quantize_fp8_rowwise(w)
    del w
    return q, s, dequantize_fp8_rowwise(q, s).to(torch.bfloat16)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref| (elementwise-max relative error)."""
    return ((out.float() - ref).abs().max() / ref.abs().max().clamp(min=1e-30)).item()


def _gemv_row(
    x: torch.Tensor,
    q: torch.Tensor,
    s: torch.Tensor,
    ref: torch.Tensor,
    cfg: Fp8GemvConfig,
    baselines: dict[str, float | None],
    warmup: int,
    rep: int,
    chain: tuple[Sequence[tuple[torch.Tensor, torch.Tensor]], float] | None = None,
) -> dict:
    """One tile timed as one launch per CUDA-graph replay (``graph_ms``) and, with ``chain = (weights,
    stream_chain_us)``, back to back over those distinct (q, scale) weights against the load-only chain of the
    same bytes (``perfkit.kernels.stream.stream_chain_us``: the decode step's condition)."""
    M, K = x.shape
    N = q.shape[0]

    def fn() -> torch.Tensor:
        return fp8_gemv(x, q, s, config=cfg)

    err = _rel_err(fn(), ref)
    ms = graph_ms(fn, warmup, rep)
    t = fp8_gemv_traffic(M, N, K, x.element_size(), x.element_size())
    bm, bn, bk = _fit(cfg, M, N, K)
    if cfg.tc and _tc_fits(M, x):
        split = tc_grid(M, N, K, _tc_tile(cfg, M, N, K), sm_count(x.device))[2]
    else:
        split, _ = _split_k(cfg, bk, x.device, triton.cdiv(N, bn) * triton.cdiv(M, bm), K)
    bf16_ms, mm_ms = baselines["bf16_cublas_ms"], baselines["fp8_scaled_mm_ms"]
    return {
        "M": M,
        "N": N,
        "K": K,
        "config": asdict(cfg),
        "splits": split,
        "median_ms": ms,
        "bound_ms": t["bound_ms"],
        "pct_of_bound": 100.0 * t["bound_ms"] / ms,
        "stream_ms": baselines["stream_ms"],
        "pct_of_stream": 100.0 * baselines["stream_ms"] / ms,
        "achieved_tb_s": t["total_bytes"] / ms / 1e9,
        "bf16_cublas_ms": bf16_ms,
        "fp8_scaled_mm_ms": mm_ms,
        "speedup_vs_bf16": bf16_ms / ms,
        "speedup_vs_scaled_mm": None if mm_ms is None else mm_ms / ms,
        "rel_err_vs_ref": err,
        **({} if chain is None else chain_columns(lambda w: fp8_gemv(x, *w, config=cfg), *chain)),
    }


def _baselines(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, w_bf16: torch.Tensor, warmup: int, rep: int):
    """CUDA-graph medians of bf16 cuBLAS ``x @ w^T``, of the W8A8 ``fp8_linear`` (None below sm_89) and of the
    load-only read of the GEMV's bytes (``perfkit.kernels.stream``: the ceiling a kernel of this size reaches)."""
    xb = x.to(torch.bfloat16)
    out: dict[str, float | None] = {"bf16_cublas_ms": graph_ms(lambda: xb @ w_bf16.T, warmup, rep)}
    out["fp8_scaled_mm_ms"] = graph_ms(lambda: fp8_linear(x, q, s), warmup, rep) if fp8_supported(x.device) else None
    t = fp8_gemv_traffic(x.shape[0], q.shape[0], q.shape[1], x.element_size(), x.element_size())
    out["stream_ms"] = stream_read_ms(int(t["total_bytes"]), device=x.device.type, warmup=warmup, rep=rep)["stream_ms"]
    return out


def bench_fp8_gemv(
    M: int,
    N: int,
    K: int,
    config: Fp8GemvConfig | None = None,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    warmup: int = 25,
    rep: int = 100,
    device: str = "cuda",
) -> dict:
    """GPU timing of one FP8 GEMV (random weights): CUDA-graph median (``graph_ms``, L2 flushed between
    replays), us per launch in a back-to-back chain (``chain_us``) against the chained load-only read, the bandwidth
    bound and the % of it reached, bf16 cuBLAS and the W8A8 ``fp8_linear`` at the same
    shape, and the max relative error against ``fp8_gemv_ref``."""
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("bench_fp8_gemv needs CUDA")
    q, s, w_bf16 = _bench_weights(N, K, seed, device)
    x = torch.randn(M, K, device=device, generator=torch.Generator(device=device).manual_seed(seed + 1)).to(dtype)
    ref = fp8_gemv_ref(x, q, s, out_dtype=torch.float32)
    base = _baselines(x, q, s, w_bf16, warmup, rep)
    nbytes = int(fp8_gemv_traffic(M, N, K, x.element_size(), x.element_size())["total_bytes"])
    weights = chain_args((q, s), lambda i: _bench_weights(N, K, seed + 1000 + i, device)[:2], nbytes)
    chain = (weights, stream_chain_us(nbytes, device)["stream_chain_us"])
    return _gemv_row(x, q, s, ref, config or pick_config(M, N, K, x) or default_config(), base, warmup, rep, chain)


def _sweep_summary(results: Sequence[dict]) -> list[dict]:
    """Best tile per (shape, M); per M the tile with the best geometric mean over shapes of time relative to each
    shape's best (a default-config candidate); and ``max_m``: the largest swept M up to which the best tile beats
    scaled_mm at every shape (a FP8_GEMV_MAX_M candidate)."""
    ok = [r for r in results if "median_ms" in r and "summary" not in r]
    best: dict[tuple[int, int, int], dict] = {}
    for r in ok:
        key = (r["N"], r["K"], r["M"])
        if key not in best or r["median_ms"] < best[key]["median_ms"]:
            best[key] = r
    summary: list[dict] = [
        {"summary": "best_config", "N": N, "K": K, "M": M, "config": r["config"], "median_ms": r["median_ms"],
         "pct_of_bound": r["pct_of_bound"], "speedup_vs_bf16": r["speedup_vs_bf16"],
         "speedup_vs_scaled_mm": r["speedup_vs_scaled_mm"]}
        for (N, K, M), r in sorted(best.items(), key=lambda kv: (kv[0][2], kv[0][0], kv[0][1]))
    ]  # fmt: skip
    groups: dict[tuple[int, str], list[float]] = {}
    for r in ok:
        rel = r["median_ms"] / best[(r["N"], r["K"], r["M"])]["median_ms"]
        groups.setdefault((r["M"], json.dumps(r["config"], sort_keys=True)), []).append(rel)
    per_m: dict[int, tuple[float, str, int]] = {}
    for (M, cfg), rels in groups.items():
        score = math.exp(sum(math.log(v) for v in rels) / len(rels))
        if M not in per_m or score < per_m[M][0]:
            per_m[M] = (score, cfg, len(rels))
    summary += [
        {"summary": "best_config_per_m", "M": M, "config": json.loads(cfg), "shapes": n,
         "geomean_time_vs_best": round(score, 4)}
        for M, (score, cfg, n) in sorted(per_m.items())
    ]  # fmt: skip
    max_m = 0
    for M in sorted({M for (_, _, M) in best}):
        wins = [r["speedup_vs_scaled_mm"] for (_, _, m), r in best.items() if m == M]
        if not wins or any(w is None or w <= 1.0 for w in wins):
            break
        max_m = M
    summary.append({"summary": "max_m", "max_m": max_m})
    return summary


def _print_table(summary: Sequence[dict], log: Callable[[str], None]) -> None:
    rows = [d for d in summary if d["summary"] == "best_config"]
    log(f"{'M':>2} {'N':>6} {'K':>6}  {'best tile (m,n,k,warps,split)':<30} {'ms':>8} {'%bound':>7} "
        f"{'x bf16':>7} {'x scaled_mm':>11}")  # fmt: skip
    for d in rows:
        c = d["config"]
        tile = f"{c['block_m']},{c['block_n']},{c['block_k']},{c['num_warps']},{c['split_k']}"
        mm = "-" if d["speedup_vs_scaled_mm"] is None else f"{d['speedup_vs_scaled_mm']:.2f}"
        log(f"{d['M']:>2} {d['N']:>6} {d['K']:>6}  {tile:<30} {d['median_ms']:>8.4f} {d['pct_of_bound']:>6.1f}% "
            f"{d['speedup_vs_bf16']:>7.2f} {mm:>11}")  # fmt: skip
    for d in summary:
        if d["summary"] == "best_config_per_m":
            log(f"M={d['M']}: best tile over shapes {d['config']} (geomean {d['geomean_time_vs_best']} x best)")
        elif d["summary"] == "max_m":
            log(f"gemv beats scaled_mm at every shape up to M={d['max_m']} (FP8_GEMV_MAX_M candidate)")


def sweep_fp8_gemv(
    shapes: Sequence[tuple[int, int]] = SWEEP_SHAPES,
    ms: Sequence[int] = SWEEP_MS,
    configs: Sequence[Fp8GemvConfig | None] = SWEEP_CONFIGS,
    dtype: torch.dtype = torch.bfloat16,
    warmup: int = SWEEP_WARMUP_MS,
    rep: int = SWEEP_REP_MS,
    log: Callable[[str], None] | None = print,
    out: str | None = None,
    device: str = "cuda",
) -> list[dict]:
    """Time every (shape [N, K], M, tile): one dict per measurement (``bench_fp8_gemv``'s keys; ``error`` instead
    of the timings when a tile fails), then the summary dicts (``_sweep_summary``). Weights are built once per
    shape, the baselines (bf16 cuBLAS, W8A8 scaled_mm) once per (shape, M). ``out``: a JSONL file, one line per
    dict, written as measured (without ``out`` the lines go to ``log``); ``log`` also gets a summary table at the
    end."""
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("sweep_fp8_gemv needs CUDA")
    cfgs = [c or GEMV_CONFIG for c in configs]
    results: list[dict] = []
    fh = open(out, "w") if out else None  # closed in the finally below
    t0 = time.perf_counter()

    def emit(d: dict) -> None:
        results.append(d)
        if fh is not None:
            fh.write(json.dumps(d) + "\n")
            fh.flush()
        elif log is not None:
            log(json.dumps(d))

    try:
        for N, K in shapes:
            q, s, w_bf16 = _bench_weights(N, K, 0, device)
            gen = torch.Generator(device=device).manual_seed(1)
            for M in ms:
                x = torch.randn(M, K, device=device, generator=gen).to(dtype)
                ref = fp8_gemv_ref(x, q, s, out_dtype=torch.float32)
                base = _baselines(x, q, s, w_bf16, warmup, rep)
                for cfg in cfgs:
                    try:
                        emit(_gemv_row(x, q, s, ref, cfg, base, warmup, rep))
                    except Exception as exc:  # a tile that does not compile or fit: record it, keep sweeping
                        emit({"M": M, "N": N, "K": K, "config": asdict(cfg),
                              "error": f"{type(exc).__name__}: {exc}"[:300]})  # fmt: skip
            del q, s, w_bf16
            if device == "cuda":
                torch.cuda.empty_cache()
        summary = _sweep_summary(results)
        for d in summary:
            emit(d)
        emit({"summary": "wall_s", "wall_s": round(time.perf_counter() - t0, 1)})
    finally:
        if fh is not None:
            fh.close()
    if log is not None:
        _print_table(summary, log)
        log(f"sweep: {sum('median_ms' in r and 'summary' not in r for r in results)} timings in {results[-1]['wall_s']} s"
            + (f", rows in {out}" if out else ""))  # fmt: skip
    return results


def _main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m perfkit.kernels.fp8_gemv",
        description="FP8 weight-only GEMV: time tiles at the 31B decode shapes on a CUDA GPU.",
    )
    parser.add_argument("--sweep", action="store_true", help="time SWEEP_SHAPES x SWEEP_MS x SWEEP_CONFIGS")
    parser.add_argument("--out", default=None, help="JSONL file for the sweep's rows (default: printed)")
    args = parser.parse_args(argv)
    if not args.sweep:
        parser.print_help()
        return 0
    if not torch.cuda.is_available():
        print("fp8_gemv --sweep needs a CUDA GPU (none visible); nothing timed.")
        return 2
    sweep_fp8_gemv(out=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
