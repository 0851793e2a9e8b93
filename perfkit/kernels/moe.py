"""Fused MoE for Gemma4 26B-A4B (``reference/gemma4.md`` §3): routing kernel + expert GEMMs, no loop over E.

Shapes: T tokens, H hidden (2816), I expert intermediate (704), E experts (128), K slots per token (top-8);
the T*K (token, slot) "pairs" p = t*K + k. Experts are GeGLU-tanh: y = Wd (gelu_tanh(Wg x) * (Wu x)).

Routing (:func:`moe_routing`, one program per token)::

    w, idx = topk(softmax_f32(logits), K); w /= sum(w); w *= per_expert_scale[idx]     w fp32 [T, K], idx [T, K]

:func:`fused_moe` then takes one of two paths, chosen by the number of pairs P = T*K (``path="auto"``: P <=
``MOE_GATHER_MAX_PAIRS`` -> gather, else sorted). Both are sync-free (expert ids are read on the device, no
``.item()`` / ``.tolist()``), so both are CUDA-graph capturable, and both give the same result up to fp32
accumulation order (the sorted path also rounds its per-pair outputs y to x's dtype before the combine).

Gather path (decode; 2 kernels, no sort)::

    gate_up   act[p, n] = gelu_tanh(x[p // K] . Wg[e][n]) * (x[p // K] . Wu[e][n]),  e = idx[p]
              grid (P, cdiv(I, BLOCK_N)); Wg = gate_up_proj[e][:I], Wu = gate_up_proj[e][I:]; act [P, I]
    down      out[t, n] = sum_k w[t, k] * (act[t*K + k] . Wd[e_k][n]),  e_k = idx[t, k]
              grid (T, cdiv(H, BLOCK_N)); routing weight and combine fused, the K slots summed in a fixed order
              in fp32 (deterministic, no atomics), out [T, H] stored once

    Why: at decode P is tiny (8 at batch 1, 128 at batch 16), so grouping pairs by expert buys no weight reuse
    worth its cost: the align step is ~25 small launches (sort, scans, searchsorted, scatter) plus a combine, per
    MoE layer, next to two GEMMs that stream ~95 MB in ~22 us. Each program is a GEMV on CUDA cores (one row per
    pair, so a tensor-core tile of >= 16 rows would be mostly padding): broadcast multiply into an fp32
    [BLOCK_N, BLOCK_K] accumulator over a loop of K-chunks, one tl.sum at the end. Pair-major grids (pairs /
    tokens vary fastest) put the pairs that share an expert on the same weight tile at the same time, so at
    batch > 1 their re-reads mostly hit L2. Pairs whose routing weight is exactly 0 (the expert-parallel wrapper
    routes other ranks' pairs to local expert 0 with weight 0) read no weights.

Sorted path (prefill / large batches; grouped tensor-core GEMMs)::

    align     the pairs sorted by expert (stable), each expert's run padded to BLOCK_M rows;
              sorted_ids [n_blocks_max * BLOCK_M] (pad = T*K), block_expert [n_blocks_max] (unused block = E).
              Pure tensor ops, no host sync: n_blocks_max = cdiv(T*K, BLOCK_M) + min(E, T*K)
              bounds sum_e cdiv(n_e, BLOCK_M); programs of unused blocks exit at once.
    gate_up   act[p] = gelu_tanh(x[p // K] @ Wg[e].T) * (x[p // K] @ Wu[e].T)     (one grouped GEMM, two
              accumulators: the gate rows [0, I) and up rows [I, 2I) of gate_up_proj[e]; act [T*K, I] pair order)
    down      y[p] = w[p] * (act[p] @ Wd[e].T)                                   (grouped GEMM, weight fused)
    combine   out[t] = sum_k y[t*K + k]                                          (deterministic, no atomics)

    Each program owns a BLOCK_M x BLOCK_N tile of one expert's rows, so each active expert's weights stream from
    DRAM once per step (per N tile). Tiles: decode-sized (T*K <= 1024) BLOCK_M 16 with narrow N tiles for SM
    coverage; prefill BLOCK_M 64.

Quantised experts (:func:`fused_moe_quantized`, :class:`QuantExpertWeights`; NVFP4 and FP8 checkpoints of 26B-A4B):
the sorted path with the same align step and the same two grouped GEMMs, whose weight tiles are dequantised in
registers (``_moe_gemm_q_kernel``). NVFP4 tiles decode exactly as the W4A16 GEMM's (``w4a16_gemm._dequant_tile``:
e2m1 * e4m3 is exact in bf16), FP8 tiles are e4m3 converted to bf16 (exact); each feeds a tensor-core dot, and
the per-row scale (the NVFP4 global scale, per row so gate and up may differ; the FP8 channel scale) multiplies
the accumulator in the epilogue. Weight-only: x stays in its dtype. Weight bytes per active expert: 0.56 B
(NVFP4) / 1 B (FP8) per element instead of 2 (``fused_moe_traffic(weight_format=)``; reference: ``fused_moe_ref`` on
``QuantExpertWeights.dequantize()``). Why not the per-expert loop the quantised experts used before:
its ``bincount(...).tolist()`` synced every MoE layer and launched 2 GEMMs per active expert (~128 per layer at
batch 64): 1.33 s per decode step on the H200 at c64, and no decode graph captured above batch 8.
``path="gather"`` (NVFP4, bf16 x): the decode form, two kernels built on the wide W4A16 gemv
(``w4a16_gemm._wide_loop``: 16-byte weight loads, two row sets per program sharing x). gate_up takes a pair's
gate rows and up rows as its two sets, with GeGLU in the epilogue. down writes each pair's weighted product in
fp32, and torch sums the K slots. ``QuantizedExperts`` uses it by default (toggle ``moe_gather=kernels``): on the
H200 (12-01f, ``configs/ab_moe_gather.yaml``) 26B-A4B NVFP4 decode TPOT went 4.07 -> 3.50 ms at c1 and
10.51 -> 7.48 ms at c8 against the gemv gather.

Math: bf16 (or fp32) operands, fp32 accumulation (fp32 inputs use IEEE dots, no TF32), outputs in x's dtype.
Under ``TRITON_INTERPRET=1`` the sorted kernel upcasts its bf16 tiles to fp32 before ``tl.dot`` (``UPCAST``: the
interpreter's bf16 dot multiplies the raw uint16 bits); the gather kernels always convert their bf16 loads to
fp32 before any arithmetic (that is their math on the GPU too), so they need no such switch.
Tile sizes of the gather path (``GATHER_*_TILES``) are picked for the H200 (132 SMs, memory bound) and can be
overridden per call (``gate_up_tiles=`` / ``down_tiles=``); ``python3 -m perfkit.kernels.moe --sweep`` times
both paths and a few tile variants on a CUDA GPU (:func:`bench_fused_moe`).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from perfkit.kernels.fp8 import quantize_fp8_rowwise
from perfkit.kernels.gelu_mul import _gelu_tanh_f32
from perfkit.kernels.launch import interpreting
from perfkit.kernels.pdl import pdl_enter, pdl_launch
from perfkit.kernels.timing import graph_ms
from perfkit.kernels.w4a16_gemm import (
    _asm,
    _dequant_tile,
    _dot_scales,
    _e4m3_times_2m8,
    _int64_rows,
    _vec_scales,
    _wide_gemv,
    _wide_loop,
    _wide_ptrs,
    _wide_sum,
    _wide_x,
    _words,
    dequantize_nvfp4,
    dequantize_nvfp4_triton,
    quantize_nvfp4,
    vec_scales_fit,
)

HBM_BYTES_PER_S = 4.3e12  # achievable H200 DRAM bandwidth used for "% of bound" (as in w4a16_gemm)
MOE_PATHS = ("auto", "gather", "sorted")
QUANT_EXPERT_FORMATS = ("nvfp4", "fp8")
QUANT_MOE_PATHS = ("sorted", "gather", "dequant")  # fused_moe_quantized(path=)
# path="auto": T*K at or below this takes the gather path. H200 sweep (docs/h200-runs/2026-12-01b/2-moe-sweep.txt):
# gather beats sorted up to 64 pairs (T=8: 194 vs 214 us) and loses from 128 (T=16: 327 vs 298 us)
MOE_GATHER_MAX_PAIRS = 64
# Gather-path tiles (H200: 132 SMs; at batch 1 gate_up runs 8 x 704/8 = 704 programs, down 2816/8 = 352). The
# fastest of 36 per kernel in `python3 -m perfkit.kernels.moe --tiles` on the H200
# (docs/h200-runs/2026-12-01b/4-moe-tiles.jsonl, 26B-A4B shapes, summed over T = 1 and 8): gate_up 28.7 us at T=1
# (16 x 256 x 4 warps: 32.5), down 19.4 us (8 x 256 x 4 warps: 21.8).
GATHER_GATE_UP_TILES = {"BLOCK_N": 8, "BLOCK_K": 128, "num_warps": 8}  # BLOCK_N rows of I, BLOCK_K of H
# Since 12-06 the prefetching form (tile keys PREFETCH / EVICT_FIRST) is the default where it won: the H200 sweep of
# 12-06 (docs/h200-runs/2026-12-06/3-gather_sweep.jsonl, 26B-A4B shapes, one kernel per CUDA graph, L2 flushed):
# gate_up T = 1 28.22 -> 24.38 us, T = 4 72.42 -> 71.20, but T = 16 189.8 -> 198.1 (and no prefetching tile beat
# the plain one by more than 0.3 % at T = 8 in call 1), so gate_up prefetches up to 32 pairs (T 4 at top-8); down
# T = 1 19.68 -> 16.10, T = 4 48.86 -> 44.42, T = 16 123.7 -> 121.1 with evict-first (the bf16 gather path serves
# up to MOE_GATHER_MAX_PAIRS = 64, T 8).
GATHER_GATE_UP_PREFETCH_TILES = {"BLOCK_N": 8, "BLOCK_K": 256, "num_warps": 2, "PREFETCH": 1, "EVICT_FIRST": 1}
GATHER_GATE_UP_PREFETCH_MAX_PAIRS = 32
GATHER_DOWN_TILES = {"BLOCK_N": 8, "BLOCK_K": 128, "num_warps": 4, "PREFETCH": 1, "EVICT_FIRST": 1}  # BLOCK_N rows
# of H, BLOCK_K of I; before 12-06: {"BLOCK_N": 8, "BLOCK_K": 128, "num_warps": 8} (plain)
_TILE_KEYS = ("BLOCK_N", "BLOCK_K", "num_warps", "num_stages")
_GATHER_TILE_KEYS = (*_TILE_KEYS, "PREFETCH", "EVICT_FIRST")  # the bf16 gather kernels' prefetching form
# NVFP4 gather kernels (``_fused_moe_gather_w4a16``): the wide W4A16 gemv's layout (each thread 32 consecutive K
# of a row: BLOCK_N or BLOCK_N / 2 rows per set x BLOCK_K / 32 chunks = 32 x num_warps threads). H200 sweep at
# 26B-A4B shapes (12-01f call 4, docs/h200-runs/2026-12-01f/4-gather_tiles.jsonl; one MoE layer, CUDA graph, L2
# flushed): gate_up 8 x 256 on 2 warps ties 8 x 512 on 4 at T = 1 (33.3 us) and is 5 % faster at T = 8 (115.8
# vs 122.0 us); no down tile beat 16 x 128 on 1 warp by more than 1 %. The layer: 34 us at T = 1 (52.6 through
# the gemv gather), 122 us at T = 8 (222.8).
GATHER_W4A16_GATE_UP_TILES = {"BLOCK_N": 8, "BLOCK_K": 256, "num_warps": 2}  # 8 gate + 8 up rows of I, 256 of H
GATHER_W4A16_DOWN_TILES = {"BLOCK_N": 16, "BLOCK_K": 128, "num_warps": 1}  # 2 x 8 rows of H, 128 of I per pair

# --------------------------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------------------------


@triton.jit
def _moe_routing_kernel(
    logits_ptr,  # [T, E] router logits (any float dtype)
    scale_ptr,  # [E] per_expert_scale
    w_ptr,  # [T, K] fp32 out
    idx_ptr,  # [T, K] int32 out
    E,
    stride_l,
    TOP_K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    PDL: tl.constexpr = 0,  # launched with launch_pdl (perfkit/kernels/pdl.py)
):
    pdl_enter(PDL)
    _route_row(logits_ptr, tl.program_id(0).to(tl.int64), stride_l, scale_ptr, w_ptr, idx_ptr, E, TOP_K, BLOCK_K,
               BLOCK_E)  # fmt: skip


@triton.jit
def _route_row(logits_ptr, t, stride_l, scale_ptr, w_ptr, idx_ptr, E, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr,
               BLOCK_E: tl.constexpr):  # fmt: skip
    """Row t of the routing (:func:`_topk_row`), stored as (w fp32 [., TOP_K], ids int32 [., TOP_K]). Also the
    routing program of gemv's routed form (perfkit/kernels/gemv.py), which replaces this kernel's launch at batch-1
    decode."""
    wv, iv = _topk_row(logits_ptr, t, stride_l, scale_ptr, E, TOP_K, BLOCK_K, BLOCK_E)
    kk = tl.arange(0, BLOCK_K)
    km = kk < TOP_K
    tl.store(w_ptr + t * TOP_K + kk, wv, mask=km)
    tl.store(idx_ptr + t * TOP_K + kk, iv, mask=km)


@triton.jit
def _topk_row(logits_ptr, t, stride_l, scale_ptr, E, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr,
              BLOCK_E: tl.constexpr):  # fmt: skip
    """Row t of the routing: softmax(fp32) -> iterative top-k -> renormalise -> * per_expert_scale ->
    (w fp32 [BLOCK_K], ids int32 [BLOCK_K]); lanes from TOP_K on hold 0. Every program of the batch-1 MoE FFN's
    gate_up launch runs it too (perfkit/kernels/moe_ffn.py), so it must stay cheap: 128 logits, 8 argmax passes."""
    e = tl.arange(0, BLOCK_E)
    z = tl.load(logits_ptr + t * stride_l + e, mask=e < E, other=-float("inf")).to(tl.float32)
    p = tl.exp(z - tl.max(z, axis=0))
    p = p / tl.sum(p, axis=0)
    p = tl.where(e < E, p, -1.0)
    kk = tl.arange(0, BLOCK_K)
    wv = tl.zeros([BLOCK_K], dtype=tl.float32)
    iv = tl.zeros([BLOCK_K], dtype=tl.int32)
    for k in tl.static_range(TOP_K):  # iterative argmax; ties -> lowest expert index
        mx = tl.max(p, axis=0)
        i = tl.min(tl.where(p == mx, e, BLOCK_E), axis=0)
        wv = tl.where(kk == k, mx, wv)
        iv = tl.where(kk == k, i, iv)
        p = tl.where(e == i, -1.0, p)
    km = kk < TOP_K
    wv = wv / tl.sum(tl.where(km, wv, 0.0), axis=0)
    wv = wv * tl.load(scale_ptr + iv, mask=km, other=0.0).to(tl.float32)
    return wv, iv


@triton.jit
def _block_rows(sorted_ids_ptr, pid_m, num_pairs, top_k, A_BY_TOKEN: tl.constexpr, BLOCK_M: tl.constexpr):
    """Row block pid_m of the sorted path: its pair ids [BLOCK_M] (pad = num_pairs), which are real, and the
    row of A each reads (the token p // top_k, or the pair itself; 0 for padding), int64."""
    ids = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = ids < num_pairs
    if A_BY_TOKEN:
        arow = ids // top_k
    else:
        arow = ids
    return ids, valid, tl.where(valid, arow, 0).to(tl.int64)


@triton.jit
def _store_block(
    acc, acc_u, c_ptr, topw_ptr, ids, valid, offs_n, nmask, stride_cm, GELU_MUL: tl.constexpr, MUL_W: tl.constexpr
):
    """The sorted kernels' epilogue: GeGLU of the gate / up accumulators (GELU_MUL), times the routing weight
    (MUL_W), stored to the block's real rows in pair order."""
    if GELU_MUL:
        acc = _gelu_tanh_f32(acc) * acc_u
    if MUL_W:
        acc = acc * tl.load(topw_ptr + ids, mask=valid, other=0.0)[:, None]
    c_ptrs = c_ptr + ids.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & nmask[None, :])


@triton.jit
def _moe_gemm_kernel(
    a_ptr,  # [T, Kd] tokens (A_BY_TOKEN) or [T*top_k, Kd] pair rows
    b_ptr,  # [E, N or 2N, Kd] expert weights ([out, in] per expert)
    c_ptr,  # [T*top_k, N] out, pair order
    sorted_ids_ptr,  # [n_blocks_max * BLOCK_M] int32 pair ids grouped by expert (pad = num_pairs)
    block_expert_ptr,  # [n_blocks_max] int32 expert of each row block (E = unused)
    topw_ptr,  # [T*top_k] fp32 routing weights (MUL_W)
    N,
    Kd,
    E,
    num_pairs,
    top_k,
    stride_am,
    stride_be,
    stride_bn,
    stride_bk,
    stride_cm,
    rs_ptr,  # ROW_SCALE: fp32 [E, N or 2N] per-row scale (the dequantised experts' global / channel scale)
    stride_re,
    A_BY_TOKEN: tl.constexpr,
    GELU_MUL: tl.constexpr,
    MUL_W: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,  # interpreter only: its bf16 tl.dot multiplies the raw uint16 bits
    ROW_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_m)
    if e < E:
        ids, valid, arow = _block_rows(sorted_ids_ptr, pid_m, num_pairs, top_k, A_BY_TOKEN, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + arow[:, None] * stride_am + offs_k[None, :]
        b_ptrs = (
            b_ptr + e.to(tl.int64) * stride_be + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None] * stride_bk
        )
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, Kd, BLOCK_K):
            km = offs_k < Kd - k0
            a = tl.load(a_ptrs, mask=valid[:, None] & km[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=km[:, None] & nmask[None, :], other=0.0)
            if UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
            if GELU_MUL:
                bu = tl.load(b_ptrs + N * stride_bn, mask=km[:, None] & nmask[None, :], other=0.0)
                if UPCAST:
                    bu = bu.to(tl.float32)
                acc_u = tl.dot(a, bu, acc_u, input_precision=DOT_PRECISION)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K * stride_bk
        if ROW_SCALE:  # as _moe_gemm_q_kernel's epilogue
            rn = tl.minimum(offs_n, N - 1).to(tl.int64)
            acc = acc * tl.load(rs_ptr + e.to(tl.int64) * stride_re + rn)[None, :]
            if GELU_MUL:
                acc_u = acc_u * tl.load(rs_ptr + e.to(tl.int64) * stride_re + N + rn)[None, :]
        _store_block(acc, acc_u, c_ptr, topw_ptr, ids, valid, offs_n, nmask, stride_cm, GELU_MUL, MUL_W)


@triton.jit
def _moe_gemm_q_kernel(
    a_ptr,  # [T, Kd] tokens (A_BY_TOKEN) or [T*top_k, Kd] pair rows, bf16 / fp16 / fp32
    w_ptr,  # NVFP4: int32 words [E, Nw, Kd/8] of the packed e2m1 codes; FP8: float8_e4m3fn [E, Nw, Kd]
    s_ptr,  # NVFP4: uint8 raw e4m3 block scales [E, Nw, Kd/16]; FP8: unused (pass w_ptr)
    rs_ptr,  # fp32 [E, Nw] per-row scale: the NVFP4 global scale, or the FP8 channel scale
    c_ptr,  # [T*top_k, N] out, pair order
    sorted_ids_ptr,  # as _moe_gemm_kernel
    block_expert_ptr,
    topw_ptr,
    N,
    Kd,
    E,
    num_pairs,
    top_k,
    stride_am,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_re,
    stride_cm,
    A_BY_TOKEN: tl.constexpr,
    GELU_MUL: tl.constexpr,
    MUL_W: tl.constexpr,
    NVFP4: tl.constexpr,
    IEEE: tl.constexpr,  # fp32 activations or the interpreter: fp32 dot; else the exact tile in x's dtype
    ASM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SWAP_AB: tl.constexpr,
    SCALES_VEC: tl.constexpr,
):
    """_moe_gemm_kernel with quantised expert weights, dequantised in registers (module doc, "Quantised
    experts"): each [BLOCK_N, BLOCK_K] weight tile is decoded once per program step and fed to one tensor-core dot
    per row block, the per-row scale applied in the epilogue. Weight-only: x is not quantised.

    SWAP_AB computes the transposed product, out^T [BLOCK_N, BLOCK_M] = W x A^T: the weight tile becomes the dot's
    first operand (its M side, BLOCK_N >= 64 fills a Hopper warpgroup MMA) and the few rows of one expert's block
    its N side, instead of 16 padded rows of which decode fills ~4. The accumulators are transposed once, in the
    epilogue. Why: the skinny W4A16 GEMMs of decode put the weights on the MMA's M side (Marlin, machete); the
    sorted GEMMs ran at ~20 % of their bound with every tile of the plain form (H200 12-01h).

    SCALES_VEC (NVFP4; Kd a multiple of BLOCK_K, BLOCK_K of 64; ``scales_vec_fit``) addresses each step's scales
    from the loop index with 4-byte-aligned rows, so each thread loads a row's BLOCK_K / 16 scales as one 4-byte
    vector, which the pipeliner stages by cp.async with the weight words. Why: ncu on the H200 (12-02, T = 64,
    gate_up) had warps stalled on long scoreboards for 64 % of their cycles and the L1 at 89 % of its throughput
    with DRAM at 21 %; the loop-carried scale pointers lose their alignment, so each scale was a 1-byte load in the
    loop. The scales stay uint8 on purpose: an int32 view split in registers made Triton pick kWidth 4 for the dot
    operand, and the decoded tile then went through shared memory (offline sm_90 TTGIR). The earlier remedy, the
    byte scales loaded a step ahead into registers (SCALES_AHEAD), lost 40-47 % at T = 64 (H200 12-01i) and is
    gone since 12-02."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_m)
    if e < E:
        ids, valid, arow = _block_rows(sorted_ids_ptr, pid_m, num_pairs, top_k, A_BY_TOKEN, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = offs_n < N
        rn = tl.minimum(offs_n, N - 1).to(tl.int64)  # clamped columns are computed, not stored
        offs_k = tl.arange(0, BLOCK_K)
        e64 = e.to(tl.int64)
        a_ptrs = a_ptr + arow[:, None] * stride_am + offs_k[None, :]
        if NVFP4:
            G: tl.constexpr = BLOCK_K // 16
            g = tl.arange(0, G)
            h = tl.arange(0, 2)
            w_rows = tl.multiple_of(rn * stride_wn, 2)  # Kd % 16 == 0: rows start on 8-byte word pairs
            w_ptrs = w_ptr + e64 * stride_we + w_rows[:, None, None] + (2 * g[:, None] + h[None, :])[None, :, :]
            s_rows = e64 * stride_se + rn * stride_sn
            if SCALES_VEC:  # the host checked Kd % 64 == 0: every row's scales start on 4 bytes
                s_rows = tl.multiple_of(s_rows, 4)
            s_ptrs = s_ptr + s_rows[:, None] + g[None, :]
        else:
            w_ptrs = w_ptr + e64 * stride_we + rn[:, None] * stride_wn + offs_k[None, :]
        if SWAP_AB:
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            acc_u = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, Kd, BLOCK_K):
            km = offs_k < Kd - k0
            a = tl.load(a_ptrs, mask=valid[:, None] & km[None, :], other=0.0)
            if IEEE:
                a = a.to(tl.float32)
            if NVFP4:
                g_ok = (k0 // 16 + g) < Kd // 16
                w = tl.load(w_ptrs, mask=g_ok[None, :, None], other=0)
                sr = _q_scales(s_ptrs, k0, Kd, g, SCALES_VEC)
                if GELU_MUL:
                    su = _q_scales(s_ptrs + N * stride_sn, k0, Kd, g, SCALES_VEC)
                sf = (_e4m3_times_2m8(sr) * 4194304.0)[:, :, None]
                tile = _dequant_tile(w.to(tl.uint32, bitcast=True), sf, ASM, 0)  # [BN, BK] fp32, exact
            else:
                tile = tl.load(w_ptrs, mask=km[None, :], other=0.0).to(tl.float32)  # e4m3 -> fp32, exact
            acc = _q_dot(a, tile, acc, IEEE, SWAP_AB)
            if GELU_MUL:  # the up rows [N, 2N) of the same expert
                if NVFP4:
                    wu = tl.load(w_ptrs + N * stride_wn, mask=g_ok[None, :, None], other=0)
                    tile = _dequant_tile(
                        wu.to(tl.uint32, bitcast=True), (_e4m3_times_2m8(su) * 4194304.0)[:, :, None], ASM, 0
                    )
                else:
                    tile = tl.load(w_ptrs + N * stride_wn, mask=km[None, :], other=0.0).to(tl.float32)
                acc_u = _q_dot(a, tile, acc_u, IEEE, SWAP_AB)
            a_ptrs += BLOCK_K
            if NVFP4:
                w_ptrs += BLOCK_K // 8
                if not SCALES_VEC:
                    s_ptrs += G
            else:
                w_ptrs += BLOCK_K
        if SWAP_AB:  # [BN, BM] -> [BM, BN], once per program
            acc = tl.trans(acc)
            acc_u = tl.trans(acc_u)
        acc = acc * tl.load(rs_ptr + e64 * stride_re + rn)[None, :]
        if GELU_MUL:
            acc_u = acc_u * tl.load(rs_ptr + e64 * stride_re + N + rn)[None, :]
        _store_block(acc, acc_u, c_ptr, topw_ptr, ids, valid, offs_n, nmask, stride_cm, GELU_MUL, MUL_W)


@triton.jit
def _q_scales(s_ptrs, k0, k_hi, g, SCALES_VEC: tl.constexpr):
    """Raw e4m3 block scales [BN, G] of the K step at k0, zeros past k_hi. SCALES_VEC: ``s_ptrs`` are step 0's and
    k_hi is a multiple of the step, so one uniform mask per step (it keeps the 4-byte vectors); else ``s_ptrs``
    are this step's (``_dot_scales``)."""
    if SCALES_VEC:
        s = _vec_scales(s_ptrs, k0, k_hi, g)
    else:
        s = _dot_scales(s_ptrs, k0, k_hi, g, False)
    return s


@triton.jit
def _q_dot(a, tile, acc, IEEE: tl.constexpr, SWAP_AB: tl.constexpr):
    """acc += a [BM, BK] x tile [BN, BK]^T, or its transpose (SWAP_AB: acc [BN, BM] += tile x a^T). fp32 operands
    use IEEE dots; a bf16 / fp16 a takes the tile in its dtype (e2m1 * e4m3 and e4m3 are exact in both)."""
    if IEEE:
        if SWAP_AB:
            acc = tl.dot(tile, tl.trans(a), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(tile), acc, input_precision="ieee")
    else:
        t = tile.to(a.dtype)
        if SWAP_AB:
            acc = tl.dot(t, tl.trans(a), acc)
        else:
            acc = tl.dot(a, tl.trans(t), acc)
    return acc


@triton.jit
def _moe_gather_gate_up_kernel(
    x_ptr,  # [T, H] tokens
    w_ptr,  # [E, 2I, H] gate_up_proj, rows [0, I) gate, [I, 2I) up; contiguous along H
    act_ptr,  # [T*K, I] out, pair order, x's dtype
    idx_ptr,  # [T*K] expert of each pair (int32 or int64)
    topw_ptr,  # [T*K] routing weights (only tested against 0: such a pair reads no weights, act row = 0)
    inter,
    H,
    top_k,
    stride_x,
    stride_we,
    stride_wn,
    stride_act,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PREFETCH: tl.constexpr = 0,  # 1: unmasked steps, the next step's tiles loaded before this one's FMAs
    EVICT_FIRST: tl.constexpr = 0,  # 1 (with PREFETCH): weight loads marked evict-first
    PDL: tl.constexpr = 0,  # launched with launch_pdl (perfkit/kernels/pdl.py)
):
    """One program per (pair p, BLOCK_N rows of I): two GEMVs (gate, up) of x[p // K] with expert idx[p]."""
    pdl_enter(PDL)  # the expert ids come from the routing kernel just before
    p = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    e = tl.load(idx_ptr + p).to(tl.int64)  # on the device: no host sync
    h_live = H * (tl.load(topw_ptr + p) != 0).to(tl.int32)  # H, or 0 for a weight-0 pair (a multiple of H
    # keeps the mask's alignment known to the compiler, so the loads stay vectorised)
    t = p // top_k
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < inter
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + t * stride_x + offs_k  # [BLOCK_K]
    if PREFETCH:  # a weight-0 pair runs no step at all
        g_ptrs, u_ptrs = _gate_up_ptrs(w_ptr + e * stride_we, inter, stride_wn, offs_n, offs_k)
        g, u = _gate_up_first(g_ptrs, u_ptrs, h_live, offs_k, BLOCK_K, EVICT_FIRST)
        a = _gate_up_rest(g, u, x_ptrs, g_ptrs, u_ptrs, h_live, offs_k, BLOCK_N, BLOCK_K, EVICT_FIRST)
    else:
        g_ptrs = w_ptr + e * stride_we + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
        u_ptrs = g_ptrs + inter * stride_wn
        acc_g = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            km = offs_k < h_live - k0
            wm = nmask[:, None] & km[None, :]
            xv = tl.load(x_ptrs, mask=km, other=0.0).to(tl.float32)[None, :]
            acc_g += tl.load(g_ptrs, mask=wm, other=0.0).to(tl.float32) * xv
            acc_u += tl.load(u_ptrs, mask=wm, other=0.0).to(tl.float32) * xv
            x_ptrs += BLOCK_K
            g_ptrs += BLOCK_K
            u_ptrs += BLOCK_K
        a = _gelu_tanh_f32(tl.sum(acc_g, axis=1)) * tl.sum(acc_u, axis=1)  # [BLOCK_N]
    tl.store(act_ptr + p * stride_act + offs_n, a.to(act_ptr.dtype.element_ty), mask=nmask)


@triton.jit
def _gate_up_ptrs(w_base, inter, stride_wn, offs_n, offs_k):
    """The gate and up rows offs_n of one [2 * inter, H] gate_up weight at w_base (gate rows, then up), first
    chunk: two [BLOCK_N, BLOCK_K] pointer tiles. Rows past inter point at row inter - 1 (the caller masks its
    store)."""
    rn = tl.minimum(offs_n, inter - 1).to(tl.int64)
    g_ptrs = w_base + rn[:, None] * stride_wn + offs_k[None, :]
    return g_ptrs, g_ptrs + inter * stride_wn


@triton.jit
def _gate_up_first(g_ptrs, u_ptrs, h_live, offs_k, BLOCK_K: tl.constexpr, EVICT_FIRST: tl.constexpr):
    """The first gate / up weight tiles of `_gate_up_rest`'s loop (none when h_live < BLOCK_K). A kernel may issue
    them before its PDL wait: weights are constant."""
    evict: tl.constexpr = "evict_first" if EVICT_FIRST else ""
    first = (offs_k < h_live // BLOCK_K * BLOCK_K)[None, :]
    g = tl.load(g_ptrs, mask=first, other=0.0, eviction_policy=evict)
    u = tl.load(u_ptrs, mask=first, other=0.0, eviction_policy=evict)
    return g, u


@triton.jit
def _gate_up_rest(
    g, u, x_ptrs, g_ptrs, u_ptrs, h_live, offs_k, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVICT_FIRST: tl.constexpr,
):  # fmt: skip
    """gelu_tanh(x . Wg[n]) * (x . Wu[n]) -> fp32 [BLOCK_N] over the first h_live columns (H, or 0 for a pair that
    reads nothing), from `_gate_up_first`'s tiles g / u. x_ptrs [BLOCK_K]: the input's first chunk. Unmasked steps,
    the next step's tiles loaded before this one's FMAs, then one masked tail step."""
    evict: tl.constexpr = "evict_first" if EVICT_FIRST else ""
    h_main = h_live // BLOCK_K * BLOCK_K
    acc_g = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, h_main, BLOCK_K):
        xv = tl.load(x_ptrs + k0).to(tl.float32)[None, :]
        k_next = tl.minimum(k0 + BLOCK_K, h_main - BLOCK_K)
        g_next = tl.load(g_ptrs + k_next, eviction_policy=evict)
        u_next = tl.load(u_ptrs + k_next, eviction_policy=evict)
        acc_g = tl.fma(g.to(tl.float32), xv, acc_g)
        acc_u = tl.fma(u.to(tl.float32), xv, acc_u)
        g, u = g_next, u_next
    if h_main < h_live:  # the H tail: one masked step
        km = offs_k < h_live - h_main
        xv = tl.load(x_ptrs + h_main, mask=km, other=0.0).to(tl.float32)[None, :]
        acc_g += tl.load(g_ptrs + h_main, mask=km[None, :], other=0.0).to(tl.float32) * xv
        acc_u += tl.load(u_ptrs + h_main, mask=km[None, :], other=0.0).to(tl.float32) * xv
    return _gelu_tanh_f32(tl.sum(acc_g, axis=1)) * tl.sum(acc_u, axis=1)


@triton.jit
def _moe_gather_down_kernel(
    act_ptr,  # [T*K, I] gate_up output, pair order
    w_ptr,  # [E, H, I] down_proj; contiguous along I
    out_ptr,  # [T, H] out, x's dtype
    idx_ptr,  # [T*K] expert of each pair (int32 or int64)
    topw_ptr,  # [T*K] routing weights (any float dtype; math in fp32)
    H,
    inter,
    stride_act,
    stride_we,
    stride_wn,
    stride_out,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PREFETCH: tl.constexpr = 0,  # 1: all slots' tiles as one [TOP_K, BLOCK_N, BLOCK_K] load, the next step's first
    EVICT_FIRST: tl.constexpr = 0,  # 1 (with PREFETCH): weight loads marked evict-first
    PDL: tl.constexpr = 0,  # launched with launch_pdl (perfkit/kernels/pdl.py)
):
    """One program per (token t, BLOCK_N rows of H): out[t, n] = sum_k w[t, k] * act[t*K + k] . Wd[e_k][n].

    The K slots are unrolled inside the loop over I, so one loop step issues K independent weight-tile loads;
    the slots are added into one fp32 accumulator in slot order (deterministic), reduced once, stored once.
    PREFETCH: the K slots' tiles are one 3-D load (TOP_K a power of two), the next step's loaded before this one's
    FMAs; the slots are summed per lane, then over K once at the end (another fp32 order)."""
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)
    if PREFETCH:
        slots = t * TOP_K + tl.arange(0, TOP_K)  # [TOP_K] pairs of this token
        es = tl.load(idx_ptr + slots).to(tl.int64)
        wts = tl.load(topw_ptr + slots).to(tl.float32)
        live = (wts != 0)[:, None, None]  # weight-0 slots read nothing
        rn = tl.minimum(offs_n, H - 1).to(tl.int64)
        w_ptrs = w_ptr + es[:, None, None] * stride_we + (rn * stride_wn)[None, :, None] + offs_k[None, None, :]
        a_ptrs = act_ptr + (slots * stride_act)[:, None] + offs_k[None, :]  # [TOP_K, BLOCK_K]
        wv = _down_first(w_ptrs, live, inter, BLOCK_K, EVICT_FIRST)
        y = _down_rest(wv, a_ptrs, w_ptrs, wts, live, inter, TOP_K, BLOCK_N, BLOCK_K, EVICT_FIRST)
    else:
        w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]  # [BLOCK_N, BLOCK_K], expert 0
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            for k in tl.static_range(TOP_K):
                p = t * TOP_K + k
                e = tl.load(idx_ptr + p).to(tl.int64)
                wt = tl.load(topw_ptr + p).to(tl.float32)
                m = offs_k < inter * (wt != 0).to(tl.int32) - k0  # weight 0: reads nothing, adds 0
                a = tl.load(act_ptr + p * stride_act + k0 + offs_k, mask=m, other=0.0).to(tl.float32) * wt
                wv = tl.load(w_rows + e * stride_we + k0, mask=nmask[:, None] & m[None, :], other=0.0)
                acc += wv.to(tl.float32) * a[None, :]
        y = tl.sum(acc, axis=1)
    tl.store(out_ptr + t * stride_out + offs_n, y.to(out_ptr.dtype.element_ty), mask=nmask)


@triton.jit
def _down_first(w_ptrs, live, inter, BLOCK_K: tl.constexpr, EVICT_FIRST: tl.constexpr):
    """The first weight tiles of `_down_rest`'s loop (w_ptrs [S, BLOCK_N, BLOCK_K], live [S, 1, 1]); a kernel may
    issue them before its PDL wait: weights are constant."""
    evict: tl.constexpr = "evict_first" if EVICT_FIRST else ""
    offs_k = tl.arange(0, BLOCK_K)
    return tl.load(w_ptrs, mask=live & (offs_k < inter // BLOCK_K * BLOCK_K)[None, None, :], other=0.0,
                   eviction_policy=evict)  # fmt: skip


@triton.jit
def _down_rest(
    wv, a_ptrs, w_ptrs, wts, live, inter, S: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVICT_FIRST: tl.constexpr,
):  # fmt: skip
    """sum_s wts[s] * (a_s . W_s[n]) over S slots -> fp32 [BLOCK_N], from `_down_first`'s tiles wv: a_ptrs
    [S, BLOCK_K] the slots' activation rows, w_ptrs [S, BLOCK_N, BLOCK_K] their weight rows (first chunk), both of
    length inter; live [S, 1, 1]: slots that read their weight (others add 0). The S tiles are one load, the next
    step's loaded before this one's FMAs; summed per lane, then over S once at the end."""
    evict: tl.constexpr = "evict_first" if EVICT_FIRST else ""
    offs_k = tl.arange(0, BLOCK_K)
    i_main = inter // BLOCK_K * BLOCK_K
    acc3 = tl.zeros([S, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, i_main, BLOCK_K):
        a = tl.load(a_ptrs + k0).to(tl.float32) * wts[:, None]  # [S, BLOCK_K]
        k_next = tl.minimum(k0 + BLOCK_K, i_main - BLOCK_K)
        wv_next = tl.load(w_ptrs + k_next, mask=live, other=0.0, eviction_policy=evict)
        acc3 = tl.fma(wv.to(tl.float32), a[:, None, :], acc3)
        wv = wv_next
    if i_main < inter:  # the I tail: one masked step
        km = offs_k < inter - i_main
        a = tl.load(a_ptrs + i_main, mask=km[None, :], other=0.0).to(tl.float32) * wts[:, None]
        w_tail = tl.load(w_ptrs + i_main, mask=live & km[None, None, :], other=0.0).to(tl.float32)
        acc3 += w_tail * a[:, None, :]  # (a new name: reassigning wv would change its type inside the if)
    return tl.sum(tl.sum(acc3, axis=2), axis=0)


@triton.jit
def _moe_gather_gate_up_w4a16_kernel(
    x_ptr,  # [T, H] bf16 tokens, rows 8-byte aligned
    w_ptr,  # int32 words [E, 2I, H/8] of the NVFP4 gate_up_proj (rows [0, I) gate, [I, 2I) up), H % 32 == 0
    s_ptr,  # uint8 raw e4m3 block scales [E, 2I, H/16]
    rs_ptr,  # fp32 [E, 2I] per-row global scale
    act_ptr,  # [T*K, I] out, pair order, x's dtype
    idx_ptr,  # [T*K] expert of each pair
    topw_ptr,  # [T*K] routing weights (only tested against 0: such a pair skips its loop, only the two prefetched
    # steps are read, and its act row is 0)
    inter,
    H,
    top_k,
    stride_x,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_re,
    stride_act,
    BLOCK_N: tl.constexpr,  # rows of I per program: its gate rows and their up rows are the two row sets
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # H % BLOCK_K == 0
    ASM: tl.constexpr,
):
    """One program per (pair p, BLOCK_N rows of I): the wide W4A16 gemv (``w4a16_gemm._wide_loop``) of x[p // K]
    against expert idx[p]'s gate rows and up rows at once (x converted once for both), GeGLU in the epilogue."""
    p = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    e = tl.load(idx_ptr + p).to(tl.int64)
    live = (tl.load(topw_ptr + p) != 0).to(tl.int32)
    c = tl.arange(0, BLOCK_K // 32)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rg = tl.minimum(offs_n, inter - 1).to(tl.int64)  # rows past I re-read row I - 1 (not stored)
    ru = rg + inter
    wg, sg = _wide_ptrs(w_ptr + e * stride_we, s_ptr + e * stride_se, rg, stride_wn, stride_sn, c)
    wu, su = _wide_ptrs(w_ptr + e * stride_we, s_ptr + e * stride_se, ru, stride_wn, stride_sn, c)
    xp = _wide_x(x_ptr + (p // top_k) * stride_x, c)
    acc_g, acc_u = _wide_loop(wg, sg, wu, su, xp, H * live, H, c, EVEN_K, BLOCK_K, ASM, 0)
    g = _wide_sum(acc_g) * tl.load(rs_ptr + e * stride_re + rg)
    u = _wide_sum(acc_u) * tl.load(rs_ptr + e * stride_re + ru)
    a = _gelu_tanh_f32(g) * u
    tl.store(act_ptr + p * stride_act + offs_n, a.to(act_ptr.dtype.element_ty), mask=offs_n < inter)


@triton.jit
def _moe_gather_down_w4a16_kernel(
    act_ptr,  # [T*K, I] bf16 gate_up output, pair order, rows 8-byte aligned
    w_ptr,  # int32 words [E, H, I/8] of the NVFP4 down_proj, I % 32 == 0
    s_ptr,  # uint8 raw e4m3 block scales [E, H, I/16]
    rs_ptr,  # fp32 [E, H] per-row global scale
    y_ptr,  # [T*K, H] fp32 out: each pair's weighted product (the launcher sums the K slots)
    idx_ptr,  # [T*K] expert of each pair
    topw_ptr,  # [T*K] routing weights (fp32 math; a weight-0 pair skips its loop and stores 0)
    H,
    inter,
    stride_act,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_re,
    stride_y,
    BLOCK_N: tl.constexpr,  # rows of H per program, as two row sets of BLOCK_N / 2
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # I % BLOCK_K == 0
    ASM: tl.constexpr,
):
    """One program per (pair p, BLOCK_N rows of H): y[p, n] = w[p] * act[p] . Wd[idx[p]][n], the wide W4A16 gemv
    with the pair's expert. One program per pair rather than one per token with the K slots inside: unrolled, the
    slots' loads in flight took 255 registers and spilled (sm_90 offline compile)."""
    p = tl.program_id(0).to(tl.int64)
    e = tl.load(idx_ptr + p).to(tl.int64)
    wt = tl.load(topw_ptr + p).to(tl.float32)
    offs_a, ra, ya, offs_b, rb, yb = _wide_gemv(
        act_ptr + p * stride_act, w_ptr + e * stride_we, s_ptr + e * stride_se, tl.program_id(1) * BLOCK_N, H,
        inter, inter * (wt != 0).to(tl.int32), stride_wn, stride_sn, BLOCK_N // 2, BLOCK_K, EVEN_K, ASM, 0,
    )  # fmt: skip
    ya = ya * (wt * tl.load(rs_ptr + e * stride_re + ra))
    yb = yb * (wt * tl.load(rs_ptr + e * stride_re + rb))
    tl.store(y_ptr + p * stride_y + offs_a, ya, mask=offs_a < H)
    tl.store(y_ptr + p * stride_y + offs_b, yb, mask=offs_b < H)


# --------------------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------------------


def moe_routing(
    logits: torch.Tensor, top_k: int, per_expert_scale: torch.Tensor, pdl: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] logits -> (weights fp32 [T, K], expert ids int32 [T, K]) in HF order (renormalise, then scale).
    pdl: launch with programmatic dependent launch (perfkit/kernels/pdl.py; sm_90+ only)."""
    T, E = logits.shape
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k {top_k} must be in [1, {E}]")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    w = torch.empty((T, top_k), dtype=torch.float32, device=logits.device)
    idx = torch.empty((T, top_k), dtype=torch.int32, device=logits.device)
    if T:
        block_e = triton.next_power_of_2(E)
        _moe_routing_kernel[(T,)](
            logits, per_expert_scale, w, idx, E, logits.stride(0),
            TOP_K=top_k, BLOCK_K=triton.next_power_of_2(top_k), BLOCK_E=block_e, num_warps=max(1, min(4, block_e // 64)),
            **pdl_launch(pdl),
        )  # fmt: skip
    return w, idx


def moe_align(topk_idx: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairs grouped by expert, runs padded to block_m: (sorted_ids int32, block_expert int32); see module doc.

    Tensor ops only (scatter_add instead of bincount, which syncs on CUDA), so it is CUDA-graph capturable.
    """
    dev = topk_idx.device
    flat = topk_idx.reshape(-1).long()
    P, E = flat.numel(), num_experts
    n_blocks = triton.cdiv(P, block_m) + min(E, P)
    counts = torch.zeros(E, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    order = torch.sort(flat, stable=True).indices
    sorted_e = flat[order]
    start = torch.cumsum(counts, 0) - counts
    nblk = (counts + block_m - 1) // block_m
    blk_cum = torch.cumsum(nblk, 0)
    dest = (blk_cum - nblk)[sorted_e] * block_m + torch.arange(P, device=dev) - start[sorted_e]
    sorted_ids = torch.full((n_blocks * block_m,), P, dtype=torch.int32, device=dev)
    sorted_ids[dest] = order.to(torch.int32)
    block_expert = torch.searchsorted(blk_cum, torch.arange(n_blocks, device=dev), right=True).to(torch.int32)
    return sorted_ids, block_expert


# Quantised sorted GEMMs (``_moe_gemm_q_kernel``) at decode sizes (T*K <= 1024), what c64 and above decode
# through: the fastest of ``quant_tile_sweep``'s 96 per GEMM (BLOCK_M 16 / 32 x QUANT_TILE_GRID) at T = 64 on the
# H200, 26B-A4B NVFP4 shapes (docs/h200-runs/2026-12-01h/1-moe_qtiles_T64.jsonl): gate_up 293 us (the bf16
# ``_tiles``: 307-327), down 125 us (161-167). BLOCK_M 32 lost every pairing (gate_up >= 352 us).
# With the block scales as 4-byte vectors (SCALES_VEC, 12-02, docs/h200-runs/2026-12-02/2-moe_vec_T64.jsonl, T = 64,
# 80 tiles): gate_up 64 x 128 on 4 warps 256.4 us against 296.5 for the previous 32 x 64 (whose [32, 4] scale tile
# has one byte per thread, so it cannot take the vectors: 294.5 with the flag), down the same tile 105.7 against
# 124.3 us. The sorted NVFP4 GEMMs load their block scales as 4-byte vectors wherever K allows (``scales_vec_fit``).
QUANT_SCALES_VEC = True
QUANT_DECODE_TILES = {
    "gate_up": {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4},
    "down": {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 4, "num_stages": 4},
}


def _tiles(num_pairs: int, stage: str, quant: bool = False) -> dict[str, int]:
    if quant and num_pairs <= 1024:
        return dict(QUANT_DECODE_TILES[stage])
    if num_pairs <= 1024:  # decode: few rows per expert, weight-streaming bound -> narrow N tiles, wide K
        return {"BLOCK_M": 16, "BLOCK_N": 32 if stage == "gate_up" else 64, "BLOCK_K": 128, "num_warps": 4}
    return {"BLOCK_M": 64, "BLOCK_N": 64 if stage == "gate_up" else 128, "BLOCK_K": 64, "num_warps": 4}


def _fit(t: dict[str, int], n: int, kd: int) -> dict[str, int]:
    """Shrink N/K tiles for small problems (tests); never below 16 (tl.dot minimum)."""
    t = dict(t)
    t["BLOCK_N"] = max(16, min(t["BLOCK_N"], triton.next_power_of_2(n)))
    t["BLOCK_K"] = max(16, min(t["BLOCK_K"], triton.next_power_of_2(kd)))
    return t


def select_moe_path(num_pairs: int, path: str = "auto") -> str:
    """The path :func:`fused_moe` takes for ``num_pairs`` = T*K (token, slot) pairs: "gather" or "sorted"."""
    if path not in MOE_PATHS:
        raise ValueError(f"path {path!r} must be one of {', '.join(repr(p) for p in MOE_PATHS)}")
    if path != "auto":
        return path
    return "gather" if num_pairs <= MOE_GATHER_MAX_PAIRS else "sorted"


def _check_tile_keys(override: dict[str, int], allowed: tuple[str, ...]) -> None:
    bad = sorted(set(override) - set(allowed))
    if bad:
        raise ValueError(f"unknown tile keys {bad}; allowed: {', '.join(allowed)}")


def _gather_tiles(
    default: dict[str, int], override: dict[str, int] | None, n: int, kd: int, keys: tuple[str, ...] = _GATHER_TILE_KEYS
) -> dict[str, int]:
    """Default tiles with a per-call override (of ``keys``) merged in, then shrunk for small problems (tests). An
    override of a bf16 gather kernel's tiles runs the plain form unless it sets PREFETCH itself."""
    t = dict(default)
    if override:
        _check_tile_keys(override, keys)
        if "PREFETCH" in keys:
            t.update(PREFETCH=0, EVICT_FIRST=0)
        t.update(override)
    for key in ("BLOCK_N", "BLOCK_K"):
        v = t[key]
        if not (isinstance(v, int) and v > 0 and v & (v - 1) == 0):
            raise ValueError(f"{key} {v!r} must be a power of 2")
    t["BLOCK_N"] = min(t["BLOCK_N"], triton.next_power_of_2(n))
    t["BLOCK_K"] = min(t["BLOCK_K"], triton.next_power_of_2(kd))
    return t


def gather_gate_up_defaults(pairs: int) -> dict[str, int]:
    """The bf16 gate_up gather kernel's default tiles for this many routed pairs (prefetching up to
    GATHER_GATE_UP_PREFETCH_MAX_PAIRS)."""
    small = pairs <= GATHER_GATE_UP_PREFETCH_MAX_PAIRS
    return GATHER_GATE_UP_PREFETCH_TILES if small else GATHER_GATE_UP_TILES


def _gather_gate_up(
    x: torch.Tensor, w_gate_up: torch.Tensor, idx: torch.Tensor, topw: torch.Tensor, top_k: int, tiles: dict,
    pdl: bool = False,
) -> torch.Tensor:  # fmt: skip
    """x [T, H], w_gate_up [E, 2I, H], idx / topw [T*K] -> act [T*K, I] (x's dtype). ``tiles`` already fitted."""
    P, inter, H = idx.numel(), w_gate_up.shape[1] // 2, x.shape[1]
    act = torch.empty((P, inter), dtype=x.dtype, device=x.device)
    _moe_gather_gate_up_kernel[(P, triton.cdiv(inter, tiles["BLOCK_N"]))](
        x, w_gate_up, act, idx, topw, inter, H, top_k,
        x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1), act.stride(0), **tiles, **pdl_launch(pdl),
    )  # fmt: skip
    return act


def _gather_down(
    act: torch.Tensor,
    w_down: torch.Tensor,
    idx: torch.Tensor,
    topw: torch.Tensor,
    top_k: int,
    tiles: dict,
    dtype: torch.dtype,
    pdl: bool = False,
) -> torch.Tensor:
    """act [T*K, I], w_down [E, H, I], idx / topw [T*K] -> out [T, H] (``dtype``). ``tiles`` already fitted."""
    T, H, inter = idx.numel() // top_k, w_down.shape[1], w_down.shape[2]
    if tiles.get("PREFETCH") and top_k & (top_k - 1):  # its [TOP_K, ...] tiles need a power of two
        tiles = {**tiles, "PREFETCH": 0}
    out = torch.empty((T, H), dtype=dtype, device=act.device)
    _moe_gather_down_kernel[(T, triton.cdiv(H, tiles["BLOCK_N"]))](
        act, w_down, out, idx, topw, H, inter,
        act.stride(0), w_down.stride(0), w_down.stride(1), out.stride(0), TOP_K=top_k, **tiles, **pdl_launch(pdl),
    )  # fmt: skip
    return out


def _fused_moe_gather(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_w: torch.Tensor,
    topk_idx: torch.Tensor,
    gate_up_tiles: dict[str, int] | None = None,
    down_tiles: dict[str, int] | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """Decode path: two kernels, no align / sort, no separate combine (see module doc)."""
    H, inter, K = x.shape[1], w_down.shape[2], topk_idx.shape[1]
    idx = topk_idx.reshape(-1).contiguous()  # [T*K]; a view of a contiguous [T, K] (no launch); a strided
    topw = topk_w.reshape(-1).contiguous()  # slice (w[:, :1] reshapes to a stride-K view) is copied
    t1 = _gather_tiles(gather_gate_up_defaults(idx.numel()), gate_up_tiles, inter, H)
    act = _gather_gate_up(x, w_gate_up, idx, topw, K, t1, pdl)
    t2 = _gather_tiles(GATHER_DOWN_TILES, down_tiles, H, inter)
    return _gather_down(act, w_down, idx, topw, K, t2, x.dtype, pdl)


def _sorted_plan(
    topk_w: torch.Tensor, topk_idx: torch.Tensor, E: int, inter: int, H: int, block_m: int | None, quant: bool
) -> tuple[dict[str, int], dict[str, int], torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sorted path's tiles (gate_up, down; ``quant``: those of the quantised GEMMs), its align step and the
    flat fp32 routing weights."""
    P = topk_idx.numel()
    t1, t2 = _fit(_tiles(P, "gate_up", quant), inter, H), _fit(_tiles(P, "down", quant), H, inter)
    bm = block_m or t1["BLOCK_M"]
    t1["BLOCK_M"] = t2["BLOCK_M"] = bm
    sorted_ids, block_expert = moe_align(topk_idx, E, bm)
    return t1, t2, sorted_ids, block_expert, topk_w.reshape(-1).to(torch.float32).contiguous()


def _fused_moe_sorted(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_w: torch.Tensor,
    topk_idx: torch.Tensor,
    block_m: int | None = None,
    row_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Prefill path: align (sort by expert), grouped gate_up and down GEMMs, combine (see module doc).
    ``row_scales``: fp32 [E, 2I] / [E, H] scales of the weights' rows, applied in each GEMM's epilogue (the
    dequantised experts of ``fused_moe_quantized(path="dequant")``)."""
    T, H = x.shape
    E, inter, K = w_gate_up.shape[0], w_down.shape[2], topk_idx.shape[1]
    P = T * K
    t1, t2, sorted_ids, block_expert, w_flat = _sorted_plan(topk_w, topk_idx, E, inter, H, block_m, quant=False)
    n_blocks = block_expert.numel()
    upcast = interpreting() and x.dtype != torch.float32
    prec = "ieee" if x.dtype == torch.float32 or upcast else "tf32"
    rs1, rs2 = (w_flat, w_flat) if row_scales is None else (r.to(torch.float32).contiguous() for r in row_scales)
    scaled = row_scales is not None
    act = torch.empty((P, inter), dtype=x.dtype, device=x.device)
    _moe_gemm_kernel[(n_blocks, triton.cdiv(inter, t1["BLOCK_N"]))](
        x, w_gate_up, act, sorted_ids, block_expert, w_flat,
        inter, H, E, P, K, x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1), w_gate_up.stride(2), act.stride(0),
        rs1, rs1.stride(0) if scaled else 0,
        A_BY_TOKEN=True, GELU_MUL=True, MUL_W=False, DOT_PRECISION=prec, UPCAST=upcast, ROW_SCALE=scaled, **t1,
    )  # fmt: skip
    y = torch.empty((P, H), dtype=x.dtype, device=x.device)
    _moe_gemm_kernel[(n_blocks, triton.cdiv(H, t2["BLOCK_N"]))](
        act, w_down, y, sorted_ids, block_expert, w_flat,
        H, inter, E, P, K, act.stride(0), w_down.stride(0), w_down.stride(1), w_down.stride(2), y.stride(0),
        rs2, rs2.stride(0) if scaled else 0,
        A_BY_TOKEN=False, GELU_MUL=False, MUL_W=True, DOT_PRECISION=prec, UPCAST=upcast, ROW_SCALE=scaled, **t2,
    )  # fmt: skip
    return y.view(T, K, H).sum(dim=1)


@dataclass(frozen=True)
class QuantExpertWeights:
    """One stacked, quantised expert projection of logical shape [E, N, K] (gate_up: N = 2I, gate rows first).

    fmt "nvfp4": ``values`` uint8 [E, N, K/2] (e2m1 codes, low nibble first), ``block_scale`` float8_e4m3fn
    [E, N, K/16], ``row_scale`` fp32 [E, N] (the global scale, per row: gate and up may differ).
    fmt "fp8": ``values`` float8_e4m3fn [E, N, K], ``block_scale`` None, ``row_scale`` fp32 [E, N] (per channel).
    """

    fmt: str
    values: torch.Tensor
    block_scale: torch.Tensor | None
    row_scale: torch.Tensor

    def __post_init__(self) -> None:
        if self.fmt not in QUANT_EXPERT_FORMATS:
            raise ValueError(f"fmt {self.fmt!r} must be one of {', '.join(QUANT_EXPERT_FORMATS)}")
        E, N, k = self.values.shape
        K = 2 * k if self.fmt == "nvfp4" else k
        if self.fmt == "nvfp4":
            ok = self.values.dtype == torch.uint8 and self.block_scale is not None and K % 16 == 0
            ok = ok and tuple(self.block_scale.shape) == (E, N, K // 16)
        else:
            ok = self.values.dtype == torch.float8_e4m3fn and self.block_scale is None
        if not ok or tuple(self.row_scale.shape) != (E, N):
            raise ValueError(
                f"{self.fmt} expert weights: values {self.values.dtype} {tuple(self.values.shape)}, block_scale "
                f"{None if self.block_scale is None else tuple(self.block_scale.shape)}, row_scale "
                f"{tuple(self.row_scale.shape)} (class doc: the expected layout)"
            )

    @property
    def shape(self) -> tuple[int, int, int]:
        E, N, k = self.values.shape
        return E, N, 2 * k if self.fmt == "nvfp4" else k

    def dequantize(self) -> torch.Tensor:
        """fp32 [E, N, K] (the reference's weights)."""
        if self.fmt == "nvfp4":
            return dequantize_nvfp4(self.values, self.block_scale, self.row_scale)
        return self.values.float() * self.row_scale[..., None]


def quantize_experts(
    gate_up: torch.Tensor, down: torch.Tensor, fmt: str
) -> tuple[QuantExpertWeights, QuantExpertWeights]:
    """gate_up [E, 2I, H] (gate rows first) and down [E, H, I] -> the grouped kernels' formats. NVFP4: gate and up
    get their own global scale (as separate checkpoint tensors would), stored per row; down one per expert. FP8:
    one scale per row (output channel)."""
    E, two_i, H = gate_up.shape
    inter = two_i // 2
    if fmt == "nvfp4":
        q, s, gs = quantize_nvfp4(gate_up.reshape(E, 2, inter, H))  # gs [E, 2]
        gs_rows = gs[:, :, None].expand(E, 2, inter).reshape(E, two_i).contiguous()
        gu = QuantExpertWeights("nvfp4", q.view(E, two_i, H // 2), s.view(E, two_i, H // 16), gs_rows)
        q, s, gs = quantize_nvfp4(down)  # gs [E]
        return gu, QuantExpertWeights("nvfp4", q, s, gs[:, None].expand(E, H).contiguous())
    if fmt == "fp8":
        return QuantExpertWeights("fp8", *_fp8_rows(gate_up)), QuantExpertWeights("fp8", *_fp8_rows(down))
    raise ValueError(f"fmt {fmt!r} must be one of {', '.join(QUANT_EXPERT_FORMATS)}")


def _fp8_rows(w: torch.Tensor) -> tuple[torch.Tensor, None, torch.Tensor]:
    q, scale = quantize_fp8_rowwise(w)
    return q, None, scale


def _moe_gemm_q(
    a: torch.Tensor,
    wq: QuantExpertWeights,
    out: torch.Tensor,
    n: int,
    sorted_ids: torch.Tensor,
    block_expert: torch.Tensor,
    w_flat: torch.Tensor,
    top_k: int,
    tiles: dict[str, int],
    stage: str,
) -> torch.Tensor:
    """One grouped GEMM of the quantised sorted path: stage "gate_up" (rows of tokens, GeGLU fused) or "down"
    (rows of pairs, routing weight fused); ``out`` [P, n]."""
    E, _, kd = wq.shape
    rs = wq.row_scale.to(torch.float32).contiguous()
    if wq.fmt == "nvfp4":
        w, s = _words(wq.values), wq.block_scale.contiguous().view(torch.uint8)
        s_strides = (s.stride(0), s.stride(1))
    else:
        w = s = wq.values.contiguous()
        s_strides = (0, 0)
    gate_up = stage == "gate_up"
    vec = wq.fmt == "nvfp4" and scales_vec_fit(kd, tiles, s)
    _moe_gemm_q_kernel[(block_expert.numel(), triton.cdiv(n, tiles["BLOCK_N"]))](
        a, w, s, rs, out, sorted_ids, block_expert, w_flat,
        n, kd, E, w_flat.numel(), top_k, a.stride(0), w.stride(0), w.stride(1), *s_strides, rs.stride(0),
        out.stride(0), A_BY_TOKEN=gate_up, GELU_MUL=gate_up, MUL_W=not gate_up, NVFP4=wq.fmt == "nvfp4",
        IEEE=a.dtype == torch.float32 or interpreting(), ASM=_asm(),
        **{"SWAP_AB": False, **tiles, "SCALES_VEC": vec},
    )  # fmt: skip
    return out


def scales_vec_fit(kd: int, tiles: dict[str, int], scales: torch.Tensor | None = None) -> bool:
    """Whether the sorted NVFP4 GEMM loads its block scales as 4-byte vectors (``_moe_gemm_q_kernel``'s SCALES_VEC):
    asked for (tile key ``SCALES_VEC``, default ``QUANT_SCALES_VEC``) and possible (``vec_scales_fit``: whole
    steps, a multiple of 64, rows of ``scales`` on 4 bytes)."""
    return bool(tiles.get("SCALES_VEC", QUANT_SCALES_VEC)) and vec_scales_fit(kd, tiles["BLOCK_K"], scales)


def _sorted_tiles(t: dict[str, int], override: dict[str, int] | None, n: int, kd: int) -> dict[str, int]:
    """The quantised sorted GEMM's tiles with a per-call override merged in (BLOCK_M stays the align step's)."""
    if not override:
        return t
    _check_tile_keys(override, (*_TILE_KEYS, "SWAP_AB", "SCALES_VEC"))
    return _fit({**t, **override}, n, kd)


def dequantize_experts(wq: QuantExpertWeights, dtype: torch.dtype) -> torch.Tensor:
    """[E, N, K] in ``dtype`` without the row scale: NVFP4 ``e2m1 * e4m3`` (exact in bf16 / fp16 / fp32; the W4A16
    dequant kernel over the [E*N, K] view), FP8 the e4m3 values (exact). Why: at prefill sizes the grouped GEMMs
    are compute-bound, and the quantised GEMMs, which decode every weight tile in registers once per row block,
    ran 26B-A4B NVFP4 prefill steps at 234 ms against 132 ms for bf16 weights (H200 12-01h, c64); a pass that
    writes the experts out once (N K x 2 bytes, 1.5 GB per 26B-A4B layer, reused from layer to layer) lets the
    bf16 GEMMs run. The row scale stays out so the tiles stay exact; the GEMM applies it in its epilogue."""
    E, N, K = wq.shape
    if wq.fmt == "fp8":
        return wq.values.to(dtype)
    flat = dequantize_nvfp4_triton(wq.values.reshape(E * N, K // 2), wq.block_scale.reshape(E * N, K // 16), dtype)
    return flat.view(E, N, K)


def gather_w4a16_fits(x: torch.Tensor, gate_up: QuantExpertWeights) -> bool:
    """What the NVFP4 gather kernels need: bf16 x with 8-byte-aligned rows; H and I multiples of 32 (each thread
    reads 16-byte chunks of 32 elements)."""
    _, two_i, H = gate_up.shape
    return gate_up.fmt == "nvfp4" and _int64_rows(x) and H % 32 == 0 and (two_i // 2) % 32 == 0


def _wide_tiles(default: dict[str, int], override: dict[str, int] | None, n: int, kd: int) -> dict[str, int]:
    t = _gather_tiles(default, override, n, kd, _TILE_KEYS)  # no PREFETCH / EVICT_FIRST: the bf16 kernels' keys
    t["BLOCK_N"], t["BLOCK_K"] = max(2, t["BLOCK_N"]), max(32, t["BLOCK_K"])  # two row sets; 32-element chunks
    return t


def _nvfp4_operands(wq: QuantExpertWeights) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernels' view of NVFP4 expert weights: int32 words, raw uint8 block scales, fp32 row scales."""
    return _words(wq.values), wq.block_scale.contiguous().view(torch.uint8), wq.row_scale.to(torch.float32).contiguous()


def _fused_moe_gather_w4a16(
    x: torch.Tensor,
    gate_up: QuantExpertWeights,
    down: QuantExpertWeights,
    topk_w: torch.Tensor,
    topk_idx: torch.Tensor,
    gate_up_tiles: dict[str, int] | None = None,
    down_tiles: dict[str, int] | None = None,
) -> torch.Tensor:
    """Decode path with NVFP4 experts: gate_up + GeGLU per pair, down + routing weight per pair (fp32), the K slots
    summed by torch; the weights decoded in registers as in the wide W4A16 gemv, no align / sort.
    ``gather_w4a16_fits``."""
    T, H = x.shape
    inter, K = down.shape[2], topk_idx.shape[1]
    idx = topk_idx.reshape(-1).contiguous()
    topw = topk_w.reshape(-1).contiguous()
    wg, sg, rg = _nvfp4_operands(gate_up)
    t1 = _wide_tiles(GATHER_W4A16_GATE_UP_TILES, gate_up_tiles, inter, H)
    act = torch.empty((T * K, inter), dtype=x.dtype, device=x.device)
    _moe_gather_gate_up_w4a16_kernel[(T * K, triton.cdiv(inter, t1["BLOCK_N"]))](
        x, wg, sg, rg, act, idx, topw, inter, H, K, x.stride(0), wg.stride(0), wg.stride(1), sg.stride(0),
        sg.stride(1), rg.stride(0), act.stride(0), EVEN_K=H % t1["BLOCK_K"] == 0, ASM=_asm(), **t1,
    )  # fmt: skip
    wd, sd, rd = _nvfp4_operands(down)
    t2 = _wide_tiles(GATHER_W4A16_DOWN_TILES, down_tiles, H, inter)
    y = torch.empty((T * K, H), dtype=torch.float32, device=x.device)
    _moe_gather_down_w4a16_kernel[(T * K, triton.cdiv(H, t2["BLOCK_N"]))](
        act, wd, sd, rd, y, idx, topw, H, inter, act.stride(0), wd.stride(0), wd.stride(1), sd.stride(0),
        sd.stride(1), rd.stride(0), y.stride(0), EVEN_K=inter % t2["BLOCK_K"] == 0, ASM=_asm(), **t2,
    )  # fmt: skip
    return y.view(T, K, H).sum(dim=1).to(x.dtype)  # the K slots in fp32, in a fixed order


def fused_moe_quantized(
    x: torch.Tensor,
    gate_up: QuantExpertWeights,
    down: QuantExpertWeights,
    topk_w: torch.Tensor,
    topk_idx: torch.Tensor,
    *,
    block_m: int | None = None,
    path: str = "sorted",
    gate_up_tiles: dict[str, int] | None = None,
    down_tiles: dict[str, int] | None = None,
) -> torch.Tensor:
    """:func:`fused_moe` with NVFP4 or FP8 expert weights (module doc, "Quantised experts"): x [T, H], gate_up
    [E, 2I, H], down [E, H, I] (logical shapes), topk_w / topk_idx [T, K] -> [T, H] in x's dtype. Any T, no host
    sync (CUDA-graph capturable). ``path``: "sorted" (grouped tensor-core GEMMs, any format), "gather" (NVFP4
    with bf16 x: the two gather kernels, for decode-sized T*K; ``gather_w4a16_fits``) or "dequant" (prefill-sized
    T*K: every expert dequantised into an [E, N, K] scratch in x's dtype, then the bf16 path's grouped GEMMs with
    the row scales in their epilogues; ``dequantize_experts``). gate_up_tiles /
    down_tiles: the sorted GEMMs' tiles, any of {BLOCK_N, BLOCK_K, num_warps, num_stages, SWAP_AB, SCALES_VEC}
    over the defaults (``_tiles``; for sweeps and tests)."""
    if path not in QUANT_MOE_PATHS:
        raise ValueError(f"path {path!r} must be one of {', '.join(repr(p) for p in QUANT_MOE_PATHS)}")
    T, H = x.shape
    E, two_i, H2 = gate_up.shape
    inter = two_i // 2
    if gate_up.fmt != down.fmt or H2 != H or down.shape != (E, H, inter) or topk_idx.shape != topk_w.shape:
        raise ValueError(
            f"shapes: x {tuple(x.shape)}, gate_up {gate_up.fmt} {gate_up.shape}, down {down.fmt} {down.shape}, "
            f"w {tuple(topk_w.shape)}, idx {tuple(topk_idx.shape)}"
        )
    K = topk_idx.shape[1]
    if T * K == 0:
        return torch.zeros_like(x)
    x = x if x.stride(-1) == 1 else x.contiguous()
    if path == "gather":
        if not gather_w4a16_fits(x, gate_up):
            raise ValueError(
                f"the gather path needs NVFP4 experts, bf16 x with 8-byte-aligned rows, H and I % 32 == 0; got "
                f"{gate_up.fmt}, {x.dtype}, H {H}, I {inter}"
            )
        return _fused_moe_gather_w4a16(x, gate_up, down, topk_w, topk_idx)
    if path == "dequant":
        gu, dn = dequantize_experts(gate_up, x.dtype), dequantize_experts(down, x.dtype)
        return _fused_moe_sorted(x, gu, dn, topk_w, topk_idx, block_m, row_scales=(gate_up.row_scale, down.row_scale))
    t1, t2, sorted_ids, block_expert, w_flat = _sorted_plan(topk_w, topk_idx, E, inter, H, block_m, quant=True)
    t1, t2 = _sorted_tiles(t1, gate_up_tiles, inter, H), _sorted_tiles(t2, down_tiles, H, inter)
    act = torch.empty((T * K, inter), dtype=x.dtype, device=x.device)
    _moe_gemm_q(x, gate_up, act, inter, sorted_ids, block_expert, w_flat, K, t1, "gate_up")
    y = torch.empty((T * K, H), dtype=x.dtype, device=x.device)
    _moe_gemm_q(act, down, y, H, sorted_ids, block_expert, w_flat, K, t2, "down")
    return y.view(T, K, H).sum(dim=1)


def fused_moe(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_w: torch.Tensor,
    topk_idx: torch.Tensor,
    *,
    path: str = "auto",
    block_m: int | None = None,
    gate_up_tiles: dict[str, int] | None = None,
    down_tiles: dict[str, int] | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """Routed GeGLU experts: x [T, H], w_gate_up [E, 2I, H] (gate rows first), w_down [E, H, I],
    topk_w [T, K] (applied to each expert's output), topk_idx [T, K] (int32 or int64, each in [0, E): not
    checked, a check would sync) -> [T, H] in x's dtype.

    path: "auto" (gather when T*K <= ``MOE_GATHER_MAX_PAIRS``, else sorted), "gather" or "sorted" (module doc).
    block_m: the sorted path's rows per expert block. gate_up_tiles / down_tiles: the gather path's tiles,
    any of {BLOCK_N, BLOCK_K (powers of 2), num_warps, num_stages, PREFETCH, EVICT_FIRST} over
    ``gather_gate_up_defaults`` / ``GATHER_DOWN_TILES`` (for sweeps; without PREFETCH the plain form runs).
    pdl: the gather path's kernels launch with programmatic dependent launch (perfkit/kernels/pdl.py; sm_90+ only);
    the sorted path's never do (it runs above MOE_GATHER_MAX_PAIRS pairs, where its GEMMs take 100+ us and a
    launch's latency is a small part of them)."""
    chosen = select_moe_path(topk_idx.numel(), path)
    T, H = x.shape
    E, two_i, H2 = w_gate_up.shape
    inter = two_i // 2
    if H2 != H or w_down.shape != (E, H, inter) or topk_idx.shape != topk_w.shape or topk_idx.shape[0] != T:
        raise ValueError(
            f"shapes: x {tuple(x.shape)}, gate_up {tuple(w_gate_up.shape)}, down {tuple(w_down.shape)}, "
            f"w {tuple(topk_w.shape)}, idx {tuple(topk_idx.shape)}"
        )
    if T * topk_idx.shape[1] == 0:
        return torch.zeros_like(x)
    x = x if x.stride(-1) == 1 else x.contiguous()
    w_gate_up = w_gate_up.contiguous()
    w_down = w_down.contiguous()
    if chosen == "gather":
        return _fused_moe_gather(x, w_gate_up, w_down, topk_w, topk_idx, gate_up_tiles, down_tiles, pdl)
    return _fused_moe_sorted(x, w_gate_up, w_down, topk_w, topk_idx, block_m)


# --------------------------------------------------------------------------------------------------------------
# References and traffic
# --------------------------------------------------------------------------------------------------------------


def moe_routing_ref(
    logits: torch.Tensor, top_k: int, per_expert_scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's router tail: softmax(fp32) -> topk -> renormalise -> * per_expert_scale (HF order)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    w, idx = torch.topk(probs, top_k, dim=-1)
    w = w / w.sum(dim=-1, keepdim=True)
    return w * per_expert_scale[idx].float(), idx


def fused_moe_ref(
    x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_w: torch.Tensor, topk_idx: torch.Tensor
) -> torch.Tensor:
    """Straight from the definition: out[t] = sum_k w[t,k] * down_e(gelu_tanh(gate_e x_t) * up_e x_t), fp32 math."""
    inter = w_gate_up.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    xf = x.float()
    for e in topk_idx.unique().tolist():
        t, k = (topk_idx == e).nonzero(as_tuple=True)
        gu = xf[t] @ w_gate_up[e].float().T
        act = torch.nn.functional.gelu(gu[:, :inter], approximate="tanh") * gu[:, inter:]
        out.index_add_(0, t, (act @ w_down[e].float().T) * topk_w[t, k].float()[:, None])
    return out.to(x.dtype)


def expected_active_experts(tokens: int, num_experts: int, top_k: int) -> float:
    """E[#distinct experts] for uniform routing: E (1 - (1 - K/E)^T)."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def fused_moe_traffic(
    tokens: int,
    hidden: int,
    inter: int,
    num_experts: int,
    top_k: int,
    elt_bytes: int = 2,
    active_experts: int | None = None,
    path: str = "auto",
    weight_format: str | None = None,
) -> dict[str, int]:
    """Minimum DRAM bytes and FLOPs of :func:`fused_moe` on ``path`` ("auto": the one it would take for T*K
    pairs; routing metadata, O(T K) int32 / fp32, left out). ``weight_format`` "nvfp4" / "fp8": the weights of
    :func:`fused_moe_quantized` (its sorted path; ``path="gather"`` with "nvfp4": its gather kernels, whose down
    kernel writes fp32 per-pair products that a sum reads back), values + block scales + per-row scales per
    expert: NVFP4 3 I H / 2 + 3 I H / 16 + 4 (2 I + H), FP8 3 I H + 4 (2 I + H) bytes (a row scale per gate_up
    row and per down row; ``None``: ``elt_bytes`` per element).

    Weights (both paths): every distinct active expert's gate_up [2I, H] and down [H, I] once (``active_experts``
    default: the uniform-routing expectation, rounded). Activations, sorted path: x [T, H] read, act [T K, I]
    written + read, y [T K, H] written + read, out [T, H] written. Gather path: x read, act written + read, out
    written (the down kernel applies the routing weight and sums the K slots itself: no y).
    At batch > 1 the gather path re-reads an expert's weights once per pair routed to it; those re-reads are
    served by L2 when hot (the pairs sharing an expert stream the same tiles at about the same time), so the
    minimum above holds while they hit; ``gather_weight_bytes`` = T K x 3 I H x elt_bytes is the worst case
    (every pair's expert from DRAM). FLOPs: 2 T K H (2I) + 2 T K I H (+ ~10 per act element for the gelu-mul,
    + 2 per output element for the weight and combine).
    """
    P = tokens * top_k
    if weight_format is not None and weight_format not in QUANT_EXPERT_FORMATS:
        raise ValueError(f"weight_format {weight_format!r} must be None or one of {', '.join(QUANT_EXPERT_FORMATS)}")
    if weight_format is None:
        chosen = select_moe_path(P, path)
    else:
        chosen = "gather" if path == "gather" and weight_format == "nvfp4" else "sorted"
    a = round(expected_active_experts(tokens, num_experts, top_k)) if active_experts is None else active_experts
    n = 3 * inter * hidden  # weight elements per expert
    if weight_format is None:
        per_expert = n * elt_bytes
    else:  # gate_up [2I, H] and down [H, I], each with its own row scales
        gate_up_b = _quant_matrix_bytes(weight_format, 2 * inter, hidden)
        per_expert = gate_up_b + _quant_matrix_bytes(weight_format, hidden, inter)
    weights = a * per_expert
    if chosen == "sorted":
        y_elt = elt_bytes  # per-pair outputs in x's dtype, summed by the launcher
    elif weight_format is None:
        y_elt = 0  # bf16 gather: the down kernel sums the K slots itself
    else:
        y_elt = 4  # NVFP4 gather: fp32 per-pair products, summed by torch
    y = P * hidden * y_elt  # per-pair outputs, written + read
    read = weights + tokens * hidden * elt_bytes + P * inter * elt_bytes + y
    written = P * inter * elt_bytes + y + tokens * hidden * elt_bytes
    flops = 6 * P * hidden * inter + 10 * P * inter + 2 * P * hidden
    return {
        "weight_bytes": weights,
        "gather_weight_bytes": P * per_expert,
        "bytes_read": read,
        "bytes_written": written,
        "total_bytes": read + written,
        "flops": flops,
        "active_experts": a,
    }


# --------------------------------------------------------------------------------------------------------------
# GPU benchmark and sweep
# --------------------------------------------------------------------------------------------------------------

# Gather-path tile variants timed by the sweep: (gate_up tiles, down tiles); "narrow" and "wide" are the two that
# lost to the first defaults (16 x 256 / 8 x 256, 4 warps) in the 12-01 sweep.
GATHER_VARIANTS: dict[str, tuple[dict[str, int] | None, dict[str, int] | None]] = {
    "default": (None, None),
    "narrow": ({"BLOCK_N": 8, "BLOCK_K": 256, "num_warps": 4}, {"BLOCK_N": 4, "BLOCK_K": 256, "num_warps": 4}),
    "wide": ({"BLOCK_N": 32, "BLOCK_K": 256, "num_warps": 8}, {"BLOCK_N": 16, "BLOCK_K": 256, "num_warps": 8}),
}
SWEEP_TOKENS = (1, 2, 4, 8, 16, 64)
QUANT_SWEEP_TOKENS = (1, 2, 4, 8, 16, 32, 48, 64)  # past QuantizedExperts.gather_kernels_max_rows (T 32 at top-8)


def bench_fused_moe(
    T: int,
    path: str = "auto",
    H: int = 2816,
    I: int = 704,  # noqa: E741 (the spec's name)
    E: int = 128,
    K: int = 8,
    dtype: torch.dtype = torch.bfloat16,
    *,
    gate_up_tiles: dict[str, int] | None = None,
    down_tiles: dict[str, int] | None = None,
    seed: int = 0,
    device: str = "cuda",
) -> dict:
    """GPU timing of one MoE layer's experts (:func:`fused_moe`, random weights, softmax top-K routing of random
    logits): median ms of eager calls (triton.testing.do_bench, L2 flushed between reps: includes host launch
    gaps where the host is slower than the GPU) and of CUDA-graph replays (``graph_ms``: the decode step's
    setting); the bandwidth bound (minimum traffic of the path taken, with this routing's distinct experts, over
    ``HBM_BYTES_PER_S``) and the % of it reached; the error against the fp32 reference. Gather path: also each
    kernel alone (``gate_up_ms`` / ``down_ms``, with their own bounds), so tiles can be chosen per kernel."""
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("bench_fused_moe needs CUDA")
    chosen = select_moe_path(T * K, path)
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(T, H, device=device, generator=gen).to(dtype)
    gu = torch.randn(E, 2 * I, H, device=device, generator=gen, dtype=dtype).mul_(0.02)
    dn = torch.randn(E, H, I, device=device, generator=gen, dtype=dtype).mul_(0.02)
    w, idx = moe_routing(torch.randn(T, E, device=device, generator=gen), K, torch.ones(E, device=device))
    kw = {"path": path, "gate_up_tiles": gate_up_tiles, "down_tiles": down_tiles}

    def fn():
        return fused_moe(x, gu, dn, w, idx, **kw)

    out, ref = fn().float(), fused_moe_ref(x, gu, dn, w, idx).float()
    rel = ((out - ref).norm() / ref.norm()).item()
    ms = triton.testing.do_bench(fn, return_mode="median")
    g_ms = graph_ms(fn)
    a = idx.unique().numel()
    elt = x.element_size()
    t = fused_moe_traffic(T, H, I, E, K, elt, active_experts=a, path=chosen)
    bound = t["total_bytes"] / HBM_BYTES_PER_S * 1e3
    res = {
        "T": T,
        "K": K,
        "pairs": T * K,
        "path": chosen,
        "active_experts": a,
        "median_ms": ms,
        "graph_ms": g_ms,
        "bound_ms": bound,
        "pct_of_bound": 100.0 * bound / ms,
        "graph_pct_of_bound": 100.0 * bound / g_ms,
        "achieved_tb_s": t["total_bytes"] / ms / 1e9,
        "rel_err_vs_ref": rel,
    }
    if chosen == "gather":
        res["gather_worst_bound_ms"] = _gather_worst_bound_ms(t)
        ti, tw = idx.reshape(-1).contiguous(), w.reshape(-1).contiguous()
        t1 = _gather_tiles(gather_gate_up_defaults(T * K), gate_up_tiles, I, H)
        t2 = _gather_tiles(GATHER_DOWN_TILES, down_tiles, H, I)
        act = _gather_gate_up(x, gu, ti, tw, K, t1)
        res["gate_up_tiles"], res["down_tiles"] = t1, t2
        res["gate_up_ms"] = graph_ms(lambda: _gather_gate_up(x, gu, ti, tw, K, t1))
        res["down_ms"] = graph_ms(lambda: _gather_down(act, dn, ti, tw, K, t2, x.dtype))
        act_b, tok_b = T * K * I * elt, T * H * elt
        res["gate_up_bound_ms"] = (a * 2 * I * H * elt + tok_b + act_b) / HBM_BYTES_PER_S * 1e3
        res["down_bound_ms"] = (a * I * H * elt + act_b + tok_b) / HBM_BYTES_PER_S * 1e3
    return res


def _gather_worst_bound_ms(traffic: dict[str, int]) -> float:
    """The gather path's bound if no pair reuses another's expert weights from L2 (every pair from DRAM)."""
    worst = traffic["total_bytes"] - traffic["weight_bytes"] + traffic["gather_weight_bytes"]
    return worst / HBM_BYTES_PER_S * 1e3


def _random_quant_experts(
    fmt: str, E: int, H: int, I: int, gen: torch.Generator, device: str  # noqa: E741
) -> tuple[QuantExpertWeights, QuantExpertWeights]:
    """Random expert weights (std 0.05) quantised as the runtime does (:func:`quantize_experts`), for the benches."""
    gate_up = torch.randn(E, 2 * I, H, device=device, generator=gen).mul_(0.05)
    return quantize_experts(gate_up, torch.randn(E, H, I, device=device, generator=gen).mul_(0.05), fmt)


def _random_tokens(
    T: int, H: int, E: int, K: int, gen: torch.Generator, device: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """bf16 x [T, H] and a softmax top-K routing of random logits over E experts: (x, topk_w, topk_idx)."""
    x = torch.randn(T, H, device=device, generator=gen).to(torch.bfloat16)
    w, idx = moe_routing(torch.randn(T, E, device=device, generator=gen), K, torch.ones(E, device=device))
    return x, w, idx


def bench_fused_moe_quantized(
    T: int,
    path: str = "sorted",
    fmt: str = "nvfp4",
    E: int = 128,
    H: int = 2816,
    I: int = 704,  # noqa: E741 (the intermediate size, as in the model config)
    K: int = 8,
    seed: int = 0,
    device: str = "cuda",
) -> dict:
    """GPU timing of one quantised MoE layer (:func:`fused_moe_quantized` on ``path``, random weights quantised as
    the runtime does with :func:`quantize_experts`, bf16 x, softmax top-K routing of random logits; default the
    26B-A4B shapes): CUDA-graph median (L2 flushed), the bound of the path's minimum traffic (each distinct active
    expert read once) and the % of it reached; gather path: also the bound if every pair reads its expert from
    DRAM; the error against the fp32 reference on the dequantised weights. Why: the gather path reads an expert
    once per routed pair (L2 may serve the repeats), the sorted path once per expert, so where they cross decides
    ``QuantizedExperts.gather_kernels_max_rows``."""
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("bench_fused_moe_quantized needs CUDA")
    gen = torch.Generator(device=device).manual_seed(seed)
    gu, dn = _random_quant_experts(fmt, E, H, I, gen, device)
    x, w, idx = _random_tokens(T, H, E, K, gen, device)

    def fn():
        return fused_moe_quantized(x, gu, dn, w, idx, path=path)

    out, ref = fn().float(), fused_moe_ref(x.float(), gu.dequantize(), dn.dequantize(), w, idx)
    g_ms = graph_ms(fn)
    a = idx.unique().numel()
    minimum = "sorted" if path == "dequant" else path  # the bound is the operation's, not the scratch's
    t = fused_moe_traffic(T, H, I, E, K, x.element_size(), active_experts=a, path=minimum, weight_format=fmt)
    bound = t["total_bytes"] / HBM_BYTES_PER_S * 1e3
    res = {
        "T": T,
        "K": K,
        "pairs": T * K,
        "fmt": fmt,
        "path": path,
        "active_experts": a,
        "graph_ms": g_ms,
        "bound_ms": bound,
        "graph_pct_of_bound": 100.0 * bound / g_ms,
        "achieved_tb_s": t["total_bytes"] / g_ms / 1e9,
        "rel_err_vs_ref": ((out - ref).norm() / ref.norm()).item(),
    }
    if path == "gather":
        res["gather_worst_bound_ms"] = _gather_worst_bound_ms(t)
    return res


def quant_sweep(tokens: tuple[int, ...] = QUANT_SWEEP_TOKENS, fmt: str = "nvfp4", file=None, **shape) -> list[dict]:
    """One JSON line per (T, path) of :func:`bench_fused_moe_quantized`: sorted always, gather for NVFP4 (the only
    format it serves) up to 1024 pairs, dequant from 256 pairs (prefill sizes, where it should win: 26B-A4B
    NVFP4 prefill ran 1.78x the bf16 time through the sorted GEMMs, H200 12-01h); ``shape``: E, H, I, K, device
    (the CPU smoke test)."""
    file = file or sys.stdout
    rows = []
    K = shape.get("K", 8)
    for T in tokens:
        paths = ["sorted"] + (["gather"] if fmt == "nvfp4" and T * K <= 1024 else [])
        for path in paths + (["dequant"] if T * K >= 256 else []):
            r = bench_fused_moe_quantized(T, path, fmt, **shape)
            rows.append(r)
            print(json.dumps(r), file=file, flush=True)
    return rows


# Tiles of the quantised sorted GEMMs timed by ``quant_tile_sweep`` (48 per kernel and BLOCK_M). The bf16 decode
# tiles (``_tiles``: 16 rows, N 32 / 64, K 128, 4 warps) are in it at 2 and 4 stages (Triton's default is 3);
# QUANT_DECODE_TILES came from it.
QUANT_TILE_GRID: tuple[dict[str, int], ...] = tuple(
    {"BLOCK_N": n, "BLOCK_K": k, "num_warps": w, "num_stages": st}
    for n in (16, 32, 64, 128)
    for k in (64, 128, 256)
    for w in (4, 8)
    for st in (2, 4)
)
# The next candidates beside the two QUANT_DECODE_TILES they would replace, all with the block scales as vectors
# (12-02; ``--tiles --quant nvfp4 --candidates``, 20 per kernel and BLOCK_M, not yet timed). 12-02's ncu profile had
# the L1 as the limit, and every warp of a 16-row program loads the whole x tile, so: 2 warps (half the copies of
# x; BLOCK_N x BLOCK_K up to 64 x 256, where gate_up stays spill-free at 254 registers in the offline sm_90 compile
# and 128 x 256 spills), 8 warps on the larger tiles (1,024 scales and more: 4 per thread), and the transposed form
# with the vectors (weight rows on the MMA's M side; the 12-01i SWAP_AB tiles loaded their scales byte by byte).
# The candidates of 12-01h (SCALES_AHEAD, SWAP_AB without vectors) lost at T = 64 on 12-01i (gate_up: the best
# swapped tile 345 vs 296 us, the defaults with the scales ahead 40-47 % slower).
_DECODE_TILE_GRID = tuple({k: v for k, v in t.items() if k != "BLOCK_M"} for t in QUANT_DECODE_TILES.values())
QUANT_CANDIDATE_GRID: tuple[dict[str, int], ...] = (
    _DECODE_TILE_GRID
    + tuple(
        {"BLOCK_N": n, "BLOCK_K": k, "num_warps": 2, "num_stages": st, "SCALES_VEC": True}
        for n in (32, 64)
        for k in (128, 256)
        for st in (2, 4)
    )
    + tuple(
        {"BLOCK_N": n, "BLOCK_K": k, "num_warps": 8, "num_stages": st, "SCALES_VEC": True}
        for n, k in ((64, 256), (128, 128), (128, 256))
        for st in (2, 4)
    )
    + tuple(
        {"BLOCK_N": n, "BLOCK_K": 128, "num_warps": 4, "num_stages": st, "SWAP_AB": True, "SCALES_VEC": True}
        for n in (64, 128)
        for st in (2, 4)
    )
)


def _quant_matrix_bytes(fmt: str, n: int, kd: int) -> int:
    """Bytes of one expert's [n, kd] quantised matrix: e2m1 codes + an e4m3 scale per 16 + an fp32 row scale
    (NVFP4), or e4m3 values + an fp32 row scale (FP8)."""
    return n * kd // 2 + n * kd // 16 + 4 * n if fmt == "nvfp4" else n * kd + 4 * n


def quant_tile_sweep(
    tokens: tuple[int, ...] = (16, 64),
    fmt: str = "nvfp4",
    block_ms: tuple[int, ...] = (16, 32),
    grid: tuple[dict[str, int], ...] = QUANT_TILE_GRID,
    file=None,
    E: int = 128,
    H: int = 2816,
    I: int = 704,  # noqa: E741 (the intermediate size, as in the model config)
    K: int = 8,
    seed: int = 0,
    device: str = "cuda",
) -> list[dict]:
    """Each grouped GEMM of the quantised sorted path alone (gate_up with the GeGLU, down with the routing
    weight) over BLOCK_M x ``grid`` at 26B-A4B shapes: one JSON line per (stage, T, tiles) with the CUDA-graph
    median (L2 flushed), the % of the bound of its active experts' weight bytes at HBM_BYTES_PER_S and the
    relative error against the default tiles' output, or the error of a tile that does not compile. Why: above
    ``QuantizedExperts.gather_kernels_max_rows`` decode runs these GEMMs, at ~18 % of their bound with the default
    tiles (H200 12-01g), and ``_tiles`` was never swept."""
    if fmt not in QUANT_EXPERT_FORMATS:
        raise ValueError(f"fmt {fmt!r} must be one of {', '.join(QUANT_EXPERT_FORMATS)}")
    file = file or sys.stdout
    gen = torch.Generator(device=device).manual_seed(seed)
    gu, dn = _random_quant_experts(fmt, E, H, I, gen, device)
    rows = []
    for T in tokens:
        x, w, idx = _random_tokens(T, H, E, K, gen, device)
        active = idx.unique().numel()
        for bm in block_ms:
            t1, t2, sorted_ids, block_expert, w_flat = _sorted_plan(w, idx, E, I, H, bm, quant=True)
            act = _moe_gemm_q(x, gu, torch.empty((T * K, I), dtype=x.dtype, device=device), I, sorted_ids,
                              block_expert, w_flat, K, t1, "gate_up")  # fmt: skip
            y = torch.empty((T * K, H), dtype=x.dtype, device=device)
            ref_y = _moe_gemm_q(act, dn, torch.empty_like(y), H, sorted_ids, block_expert, w_flat, K, t2, "down")
            stages = (("gate_up", x, gu, torch.empty_like(act), I, H, act), ("down", act, dn, y, H, I, ref_y))
            for stage, a, wq, out, n, kd, want in stages:
                bound_ms = active * _quant_matrix_bytes(fmt, wq.shape[1], kd) / HBM_BYTES_PER_S * 1e3
                for tiles in grid:
                    t = _fit(dict(tiles, BLOCK_M=bm), n, kd)
                    r = {"stage": stage, "T": T, "fmt": fmt, "active_experts": active, "tiles": t}
                    run = functools.partial(_moe_gemm_q, a, wq, out, n, sorted_ids, block_expert, w_flat, K, t, stage)
                    try:
                        ms = graph_ms(run)
                    except Exception as exc:  # a tile that does not compile (shared memory, registers)
                        r["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                    else:  # out holds the last replay's result: against the default tiles' (accumulation order)
                        err = ((out.float() - want.float()).norm() / want.float().norm()).item()
                        r |= {"graph_us": round(ms * 1e3, 2), "pct_of_bound": 100.0 * bound_ms / ms,
                              "rel_err_vs_default": err}  # fmt: skip
                    rows.append(r)
                    print(json.dumps(r), file=file, flush=True)
    return rows


def sweep(tokens: tuple[int, ...] = SWEEP_TOKENS, file=None) -> list[dict]:
    """One JSON line per (T, sorted | gather tile variant) for the 26B-A4B expert shapes (bf16) on this GPU."""
    file = file or sys.stdout
    rows = []
    for T in tokens:
        runs = [("sorted", "sorted", None, None)] + [("gather", v, a, b) for v, (a, b) in GATHER_VARIANTS.items()]
        for path, variant, a, b in runs:
            r = {"variant": variant, "device": torch.cuda.get_device_name()}
            r |= bench_fused_moe(T, path, gate_up_tiles=a, down_tiles=b)
            rows.append(r)
            print(json.dumps(r), file=file, flush=True)
    return rows


GATHER_TILE_GRID = tuple(
    {"BLOCK_N": n, "BLOCK_K": k, "num_warps": w} for n in (4, 8, 16, 32) for k in (128, 256, 512) for w in (2, 4, 8)
)
# The prefetching form of the bf16 gather kernels (12-05; timed on 12-06, the defaults since: see
# GATHER_DOWN_TILES). In the 26B-A4B batch-1 profile
# (docs/h200-runs/2026-12-05/6-ab_c1_profile.json) the gather kernels take 19.1 + 12.2 us per layer for 63 + 32 MB
# of expert weights (14.7 + 7.4 us at 4.3 TB/s): the 8 x 128 default tiles are 22 masked steps of 8-byte loads with
# no load in flight across steps. The bf16 GEMV of the same session gained 1.3x from the next step's tile loaded
# before this step's FMAs (qkv 16384 x 5376: 61.9 -> 47.1 us at 4 x 2048); these candidates try that here, with
# 16-byte loads (BLOCK_K >= 8 x 32 x num_warps) and evict-first weight loads as a second key.
GATHER_PREFETCH_GRID = tuple(
    {"BLOCK_N": n, "BLOCK_K": k, "num_warps": w, "PREFETCH": 1, "EVICT_FIRST": e}
    for n in (4, 8, 16) for k in (256, 512, 1024) for w in (2, 4) for e in (0, 1)
)  # fmt: skip
# The down kernel's prefetching form holds all TOP_K slots' tiles at once ([TOP_K, BLOCK_N, BLOCK_K] fp32 partial
# sums plus two bf16 tiles), so it takes smaller tiles: at TOP_K 8 the gate_up grid's 16 x 1024 would be 128 K
# accumulators per program (its compile did not finish in 90 s on 12-06). At most 8 x 256 x 8 = 16 K here.
GATHER_DOWN_PREFETCH_GRID = tuple(
    {"BLOCK_N": n, "BLOCK_K": k, "num_warps": w, "PREFETCH": 1, "EVICT_FIRST": e}
    for n in (2, 4, 8) for k in (128, 256) for w in (4, 8) for e in (0, 1)
)  # fmt: skip


def tile_sweep(
    tokens: tuple[int, ...] = (1, 8),
    file=None,
    grid: tuple[dict[str, int], ...] = GATHER_TILE_GRID,
    down_grid: tuple[dict[str, int], ...] | None = None,
    E: int = 128,
    H: int = 2816,
    I: int = 704,  # noqa: E741 (the intermediate size, as in the model config)
    K: int = 8,
    device: str = "cuda",
) -> list[dict]:
    """Each gather kernel alone over a grid of tiles (26B-A4B shapes, bf16, CUDA-graph replays, L2 flushed): one
    JSON line per (kernel, T, tiles) with the time and the relative error against the default tiles' output (or the
    error of a tile that does not compile), to choose the gather defaults (``gather_gate_up_defaults``,
    GATHER_DOWN_TILES) by measurement. The defaults are timed first in every grid. ``down_grid``: the down kernel's own grid (None: ``grid``); an empty
    one times the down kernel's defaults only."""
    file = file or sys.stdout
    inter = I
    gen = torch.Generator(device=device).manual_seed(0)
    gu = torch.randn(E, 2 * inter, H, device=device, generator=gen).to(torch.bfloat16)
    dn = torch.randn(E, H, inter, device=device, generator=gen).to(torch.bfloat16)
    grids = {"gate_up": ({},) + tuple(grid), "down": ({},) + tuple(grid if down_grid is None else down_grid)}
    rows = []  # {}: the defaults
    for T in tokens:
        x, w, idx = _random_tokens(T, H, E, K, gen, device)
        ti, tw = idx.reshape(-1).contiguous(), w.reshape(-1).contiguous()
        gu_default = gather_gate_up_defaults(T * K)
        act = _gather_gate_up(x, gu, ti, tw, K, _gather_tiles(gu_default, None, inter, H))
        t_down = _gather_tiles(GATHER_DOWN_TILES, None, H, inter)
        want = {"gate_up": act, "down": _gather_down(act, dn, ti, tw, K, t_down, x.dtype)}
        for kernel in ("gate_up", "down"):
            for tiles in grids[kernel]:
                r = {"kernel": kernel, "T": T, "tiles": tiles}
                try:
                    if kernel == "gate_up":
                        r["tiles"] = t = _gather_tiles(gu_default, tiles, inter, H)
                        run = functools.partial(_gather_gate_up, x, gu, ti, tw, K, t)
                    else:
                        r["tiles"] = t = _gather_tiles(GATHER_DOWN_TILES, tiles, H, inter)
                        run = functools.partial(_gather_down, act, dn, ti, tw, K, t, x.dtype)
                    ms = graph_ms(run)
                    got = run()
                except Exception as exc:  # a bad tile, or one that does not compile (registers, shared memory)
                    r["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                else:  # against the default tiles' output (accumulation order)
                    ref = want[kernel].float()
                    r |= {"graph_us": round(ms * 1e3, 2),
                          "rel_err_vs_default": ((got.float() - ref).norm() / ref.norm()).item()}  # fmt: skip
                rows.append(r)
                print(json.dumps(r), file=file, flush=True)
    return rows


def _main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m perfkit.kernels.moe", description="fused MoE kernel sweep")
    ap.add_argument("--sweep", action="store_true", help="time both paths and the gather tile variants (CUDA)")
    ap.add_argument(
        "--tiles", action="store_true",
        help="time each gather kernel over a grid of tiles; with --quant: each sorted quantised GEMM (CUDA)",
    )  # fmt: skip
    ap.add_argument("--tokens", default=None, help="comma-separated batch sizes T")
    ap.add_argument(
        "--candidates", action="store_true",
        help="with --tiles --quant: QUANT_CANDIDATE_GRID (2 / 8 warps, SWAP_AB; SCALES_VEC) beside the defaults; "
        "with --tiles alone: the bf16 gather kernels' prefetching form (GATHER_PREFETCH_GRID; the down kernel: "
        "GATHER_DOWN_PREFETCH_GRID)",
    )  # fmt: skip
    ap.add_argument(
        "--quant", choices=QUANT_EXPERT_FORMATS, default=None,
        help="with --sweep: quantised experts (sorted vs gather for nvfp4) instead of bf16",
    )  # fmt: skip
    args = ap.parse_args(argv)
    if args.candidates and not args.tiles:
        print("--candidates goes with --tiles (the gather kernels' or, with --quant, the sorted GEMMs' tile sweep)",
              file=sys.stderr)  # fmt: skip
        return 2
    if not (args.sweep or args.tiles):
        ap.print_help()
        return 2
    if not torch.cuda.is_available():
        print(f"the {'tile sweep' if args.tiles else 'sweep'} needs a CUDA GPU", file=sys.stderr)
        return 2
    try:
        tokens = _tokens(args.tokens, (16, 64) if args.tiles and args.quant else None)
    except ValueError:
        print(f"--tokens {args.tokens!r}: comma-separated positive integers, e.g. 16,64", file=sys.stderr)
        return 2
    if args.tiles:
        if args.quant:
            quant_tile_sweep(tokens, args.quant, grid=QUANT_CANDIDATE_GRID if args.candidates else QUANT_TILE_GRID)
        else:
            if args.candidates:
                tile_sweep(tokens or (1, 8), grid=GATHER_PREFETCH_GRID, down_grid=GATHER_DOWN_PREFETCH_GRID)
            else:
                tile_sweep(tokens or (1, 8))
        return 0
    if args.quant:
        quant_sweep(tokens or QUANT_SWEEP_TOKENS, args.quant)
    else:
        sweep(tokens or SWEEP_TOKENS)
    return 0


def _tokens(text: str | None, default: tuple[int, ...] | None) -> tuple[int, ...] | None:
    """``--tokens 16,64`` -> (16, 64); ValueError for anything but positive integers."""
    if text is None:
        return default
    tokens = tuple(int(t) for t in text.split(","))
    if any(t < 1 for t in tokens):
        raise ValueError(text)
    return tokens


if __name__ == "__main__":
    sys.exit(_main())
