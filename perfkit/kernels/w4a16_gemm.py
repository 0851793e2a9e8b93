"""W4A16 GEMM for NVFP4 weights: ``y = x @ dequant(W)^T``, the weights staying 4-bit in memory.

Weight format (NVIDIA ModelOpt NVFP4 checkpoint layout, per linear layer of shape [N, K]):

- ``weight``         uint8 [N, K/2]: e2m1 codes, two per byte, low nibble = element 2i, high nibble = 2i+1.
  A code is ``s e1 e0 m``: sign bit, then an index into the magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6}.
- ``weight_scale``   float8_e4m3fn [N, K/16]: one block scale per 16 consecutive elements along K.
- ``weight_scale_2`` fp32 scalar (here also accepted as a per-output-row vector [N]): the global scale.

``dequant(W)[n, k] = e2m1(code[n, k]) * float(weight_scale[n, k // 16]) * weight_scale_2[n]``.

Decoding (all paths): the packed row is read as int32 words, 8 codes per word (code j at bits 4j..4j+3 = element
8w + j: little-endian bytes). Codes j and j + 4 of a word sit 16 bits apart, so one shift and two masks place both
as fp16 fields at once: ``(a & 0x80008000) | ((a >> 3) & 0x0E000E00)`` with ``a = word << (12 - 4j)`` is two
fp16 whose values are ``e2m1 * 2^-14`` (subnormal fp16 for the codes 0/1, which the fp16 -> fp32 conversion
keeps exact). The e4m3 block scale, read as raw bytes, becomes an fp16 the same way (``(b & 0x7f) << 7`` =
``e4m3 * 2^-8``). ``e2m1 * e4m3`` has at most 6 significant bits and lies in [2^-10, 2688], so it is exact in
fp32, bf16 and fp16: the dequantised tile is exact and the only roundings are fp32 accumulation, the global scale
(per output column, in the epilogue, as vLLM/ModelOpt's ``alpha``) and the output cast.

Three paths (``path=``; ``"auto"`` picks by M with ``GEMV_MAX_M`` / ``DEQUANT_MM_MIN_M``, best guesses until
the H200 sweep, ``python3 -m perfkit.kernels.w4a16_gemm --sweep``, sets them):

- ``gemv`` (decode, M <= GEMV_MAX_M; also the MoE gathered path): CUDA cores, no ``tl.dot``. A program owns
  BLOCK_N weight rows and streams their K: per step a [BLOCK_N, BLOCK_K/16, 2] tile of words (one 16-element
  scale group = 2 contiguous words = 8 bytes per thread: coalesced 64-bit loads), the next step's tile already in
  flight (register double buffer). The tile is decoded once per step into its 8 code planes [BLOCK_N,
  BLOCK_K/16, 2], each multiplied with x's matching elements (loads of [1, BLOCK_K/16, 2], broadcast; fp32 FMA)
  and summed over the group's 16 elements first; then the [BLOCK_N, BLOCK_K/16] group sums times the block scales
  (16x fewer scale multiplies than per element) accumulate per group, and the reduction over groups and the
  global scale come once, in the epilogue. Up to BLOCK_M = 4 rows of x per program reuse each decoded tile (the
  weight is read once per 4 rows; more rows are more programs on the same weight tile, launched next to each other
  so the re-read hits L2). What bounds it at M = 1 is the L1: an ncu profile on the H200 (12-01d) of the form
  with one 2-byte load per x element showed the L1/TEX pipe at 80 % of its throughput, DRAM at 20 %, 0.63 issued
  warps per scheduler. bf16 x is therefore read as int64 words, two 8-byte loads per weight word (GEMV_X64):
  7.3 SASS instructions per weight element instead of 8.0, 6 loads per thread and step instead of 18, and
  9-14 % less time on the 31B decode shapes (5376 x 21504: 47.8 vs 55.7 us). Each extra row adds ~2 instructions
  per element (its FMA, x loads and conversions), which is why larger M goes to the tensor cores. Split-K only when
  the grid has fewer than GEMV_MIN_PROGRAMS_PER_SM programs per SM: fp32 partials [S, M, N] summed in a fixed
  order by one small kernel (deterministic, no atomics).
  At M = 1 with bf16 x (the decode step) the default is the wide form, ``_w4a16_gemv_wide_kernel``: each thread
  owns 32 consecutive K of a row per step (one 16-byte weight load, one 2-byte scale load), and a program's 16
  rows are two sets of 8 in one layout, so each thread's x is loaded and converted once for two rows (5.8
  instructions per weight element instead of 7.3); whole last steps re-read a clamped step instead of masking
  the prefetch. Timed on the H200 (12-01e) it is 10-19 % faster on the 31B projections, where the narrow form's
  ncu profile had shown long-scoreboard stalls first (too few bytes in flight per warp) and a saturated issue
  slot second; the 26B-A4B's 2816-row projections, 176 programs of 16 rows, stay narrow (``pick_config``).
  On sm_90+ the large M = 1 products (GEMV_TC_MIN_ELEMENTS) run ``_w4a16_gemv_tc_kernel`` instead: the weight
  rows as a warpgroup MMA's M side and x as its N side (16 columns, one used), because on CUDA cores the fp16 ->
  fp32 conversion and the FMA alone cost 2 of the wide form's 5.8 instructions per element and the loop is
  instruction-bound (a TMA-fed form with deep stages tied it, 12-14). No repacking: the MMA sums K in any order,
  so its logical K is a permutation of the physical elements in which each thread's A-fragment registers are the
  bf16x2 pairs its own words decode to (codes j and j + 4 of a word, 16 bits apart, placed as bf16 bits:
  ``e2m1 * 2^-126``, times the block scale as ``e4m3 * 2^118`` in one bf16x2 multiply: exact), and x is gathered
  in that order into the B tile. 3.7 instructions per weight element; split over K into enough programs, the
  last split of each row block summing the partials in a fixed order in the same launch (a caller-owned counter,
  ``split_counter``). The same kernel takes M up to 64 rows of bf16 x (GEMV_TC_MAX_M; ``w4a16_gemm``'s auto path
  routes them there from the dot path): row m of x in column m of the MMA's B tile, so the weight is streamed
  once for all of them; beyond 16 rows 32 rows of x per program (``tc_cols``, 12-19), two such programs of a row
  block neighbours in the grid above 32.
- ``dot`` (M between): the same decoded planes, times their block scales, joined in-thread into an exact fp32
  [BLOCK_N, BLOCK_K] tile in K order (the scales broadcast as [BLOCK_N, BLOCK_K/16, 1]: no reshape), cast to x's
  dtype and fed to a tensor-core ``tl.dot`` (fp32 accumulate; BLOCK_M >= 64 compiles to wgmma with the tile staged
  through shared memory, ~6.7-7.8 instructions per weight element per row tile, no spills); the x tiles and words
  are cp.async-pipelined (num_stages). Grouped launch order (GROUP_M row tiles per weight tile) for L2 reuse,
  split-K as above. ``scale_mode="gather"`` loads one scale per word instead of broadcasting (an A/B fallback;
  same result).
- ``dequant_mm`` (prefill, M >= DEQUANT_MM_MIN_M): one Triton pass writes the exact ``e2m1 * e4m3`` weights in x's
  dtype to a scratch [N, K] (reads 0.56 B, writes 2 B per element: ~70 µs for 21504 x 5376 on an H200), then
  cuBLAS multiplies (fp32 output) and one elementwise op applies the global scale and casts. Large M is
  compute-bound, where cuBLAS's tiles beat an in-kernel dequantising GEMM; the scratch costs N*K*2 bytes
  (0.46 GB for the 31B fused gate/up projection) while the call runs. With the global scale as host runs
  (``gs_runs``, which ``Nvfp4Linear`` caches; 12-01h, on by default since 12-01i: -18 % at the 31B gate|up with
  8K tokens) cuBLAS applies each run as its alpha and
  writes x's dtype: the same single rounding, without the fp32 [M, N] written and read back (10 bytes per output
  instead of 2; at 8K tokens ~4.6 GB per 31B layer, which would be ~64 ms of the 880 ms NVFP4 prefill step at
  4.3 TB/s, against 740 ms for bf16 weights, H200 12-01h).

``w4a16_gemm_ref`` (dequantise in torch, fp32 matmul) is the single source of truth; ``w4a16_gemm_traffic`` gives
the minimum DRAM bytes and FLOPs. On CPU the kernels run under ``TRITON_INTERPRET=1`` (set before importing
triton), where the dot path multiplies in fp32 (the interpreter's bf16 ``tl.dot`` is wrong).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass

import torch
import triton
import triton.language as tl

from perfkit.kernels.launch import capability, interpreting, sm_count
from perfkit.kernels.pdl import pdl_enter, pdl_launch
from perfkit.kernels.stream import chain_args, chain_columns, stream_chain_us, stream_read_ms
from perfkit.kernels.timing import graph_ms

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitudes of codes 0..7; code | 8 is the negative
FP4_MAX = 6.0
FP8_E4M3_MAX = 448.0
BLOCK_SIZE = 16  # NVFP4 elements per block scale
HBM_BYTES_PER_S = 4.3e12  # achievable H200 DRAM bandwidth used for "% of bound"

PATHS = ("auto", "gemv", "dot", "dequant_mm")
SCALE_MODES = ("broadcast", "gather", "reshape")  # "reshape": the old name of "broadcast"
# path="auto": gemv for M <= GEMV_MAX_M, dequant_mm for M >= DEQUANT_MM_MIN_M, dot in between. Set from the H200
# sweep (docs/h200-runs/2026-12-01b/4-w4a16_sweep.jsonl, CUDA-graph medians, 31B shapes): at M=1 gemv beats dot by
# 1.43x (geomean of 5 shapes); at M=4 dot beats gemv by 2.0x; at M=64 dot 133 us vs dequant_mm 151 us; at M=256
# dequant_mm 187 us vs dot 391 us (M=2048: 868 vs 2053 us, bf16 cuBLAS 617 us). Since DOT_LARGE_CONFIG took the
# swapped tile (12-02, docs/h200-runs/2026-12-02/1-w4a16_large.jsonl, four 31B shapes): at M = 128 dot beats
# dequant_mm on all four (149.1 vs 158.9 us at 5376 x 21504, 271.3 vs 303.3, 102.5 vs 125.5, 111.6 vs 127.2), at
# M = 256 dequant_mm wins all four (177.2 vs 269.4 ...). 144 is interpolated: the lines through the two points
# cross at M 140-166 per shape.
GEMV_MAX_M = 1
DEQUANT_MM_MIN_M = 144
GEMV_MAX_ROWS = 4  # rows of x per gemv program (BLOCK_M is capped here and at M's next power of two)
GEMV_MIN_PROGRAMS_PER_SM = 2  # below this many programs per SM the gemv / dot paths split K
MAX_SPLIT_K = 8
DOT_GROUP_M = 8  # dot path: row tiles launched together per weight tile
GEMV_X64 = True  # gemv: bf16 x read as int64 words (4 elements per load) when aligned; False: one load per element
INLINE_ASM_CVT = True  # GPU: convert decoded fp16 pairs with inline PTX (False: the interpreter's pure-Triton ops)

# --------------------------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------------------------


@triton.jit
def _e4m3_times_2m8(b):
    """uint8 raw e4m3fn byte (non-negative scale) -> fp32 value * 2^-8, via fp16 bit placement (exact)."""
    bits = (b.to(tl.int16) & 0x7F) << 7
    return bits.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _rotl(w, N: tl.constexpr):
    """uint32 words rotated left by N (1..31): one funnel shift."""
    return (w << N) | (w >> (32 - N))


@triton.jit
def _rp_pair(w, J: tl.constexpr):
    """Repacked uint32 words (``repack_words``) -> pair J (codes J, J + 4) as bf16x2 bit patterns before the mask
    ``0x81C081C0``: each pair's signs at bits 15 / 31 and ``e1 e0 m`` at 8..6 / 24..22, the other bits garbage.
    Pairs 0-2 by a rotation (6, 3, none); pair 3 isolated, rotated by 25 and multiplied by 1 + 2^5 + 2^11 (three
    shifted copies that do not overlap, so the sum is their OR)."""
    if J == 0:
        p = _rotl(w, 6)
    elif J == 1:
        p = _rotl(w, 3)
    elif J == 2:
        p = w
    else:
        p = _rotl(w & 0x6C006C00, 25) * 2081
    return p


@triton.jit
def _e2m1_decode(w, ASM: tl.constexpr, RP: tl.constexpr):
    """uint32 words (code j of 8 at bits 4j..4j+3) -> fp32 ``lo_j, hi_j`` = codes (j, j + 4) * 2^-14 for j = 0..3,
    returned as lo0, hi0, lo1, hi1, lo2, hi2, lo3, hi3. Codes j and j + 4 sit 16 bits apart, so one shift and two
    masks place both as the fp16 halves of a word; each half then converts exactly. The 4 shifted copies are
    joined in-thread, so each op runs once for all pairs. ASM (GPU): convert both halves of a word in place
    (without it LLVM re-pairs halves of different words first: ~8 % more SASS)."""
    if RP:  # repacked words: the bf16 placement of each pair, its e1 e0 m 3 bits higher
        a = tl.join(tl.join(_rp_pair(w, 0), _rp_pair(w, 1)), tl.join(_rp_pair(w, 2), _rp_pair(w, 3)))
        bits = (a & 0x80008000) | ((a << 3) & 0x0E000E00)
    else:
        a = tl.join(tl.join(w << 12, w << 8), tl.join(w << 4, w))  # [..., 2, 2]: pair j at [..., j % 2, j // 2]
        bits = (a & 0x80008000) | ((a >> 3) & 0x0E000E00)  # signs -> bits 15 / 31, e1 e0 m -> 11..9 / 27..25
    if ASM:
        lo, hi = tl.inline_asm_elementwise(
            "{ .reg .b16 l, h; mov.b32 {l, h}, $2; cvt.f32.f16 $0, l; cvt.f32.f16 $1, h; }",
            "=r,=r,r",
            [bits],
            dtype=(tl.float32, tl.float32),
            is_pure=True,
            pack=1,
        )
    else:
        lo = (bits & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (bits >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    lo01, lo23 = tl.split(lo)
    hi01, hi23 = tl.split(hi)
    lo0, lo1 = tl.split(lo01)
    lo2, lo3 = tl.split(lo23)
    hi0, hi1 = tl.split(hi01)
    hi2, hi3 = tl.split(hi23)
    return lo0, hi0, lo1, hi1, lo2, hi2, lo3, hi3


@triton.jit
def _dequant_tile(w, sf, ASM: tl.constexpr, RP: tl.constexpr):
    """Words [BN, G, 2] (G scale groups of 2 words) and scale factors ``e4m3 * 2^14`` broadcastable to them
    ([BN, G, 1] or [BN, G, 2]) -> the exact fp32 ``e2m1 * e4m3`` tile [BN, 16 G] in K order: element
    16g + 8h + 4t + j (word h, pair j, half t) placed by joins, in-thread."""
    lo0, hi0, lo1, hi1, lo2, hi2, lo3, hi3 = _e2m1_decode(w, ASM, RP)
    y0 = tl.join(lo0 * sf, hi0 * sf)  # [BN, G, 2 (h), 2 (t)]
    y1 = tl.join(lo1 * sf, hi1 * sf)
    y2 = tl.join(lo2 * sf, hi2 * sf)
    y3 = tl.join(lo3 * sf, hi3 * sf)
    f = tl.join(tl.join(y0, y2), tl.join(y1, y3))  # [BN, G, 2 (h), 2 (t), 2 (j // 2), 2 (j % 2)]
    return tl.reshape(f, (f.shape[0], f.shape[1] * 16))


@triton.jit
def _gemv_tile(w_ptrs, s_ptrs, k0, k_hi, g):
    """Words [BN, G, 2] and raw scales [BN, G] of the step at k0; zeros past k_hi (the K tail, and the prefetch
    after the last step)."""
    g_ok = (k0 // 16 + g) < k_hi // 16
    w = tl.load(w_ptrs, mask=g_ok[None, :, None], other=0)
    s = tl.load(s_ptrs, mask=g_ok[None, :], other=0)
    return w, s


@triton.jit
def _bf16_pair(v):
    """int32 holding two bf16 (element 2i low, 2i+1 high) -> the two as fp32 (a bf16 is the top half of its fp32)."""
    return (v << 16).to(tl.float32, bitcast=True), (v & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _x_elems(a, b):
    """Two int64 words of bf16 x (elements 0-3 and 4-7 of one weight word's span) -> its 8 elements as fp32."""
    x0, x1 = _bf16_pair(a.to(tl.int32))
    x2, x3 = _bf16_pair((a >> 32).to(tl.int32))
    x4, x5 = _bf16_pair(b.to(tl.int32))
    x6, x7 = _bf16_pair((b >> 32).to(tl.int32))
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _word_sums(l0, h0, l1, h1, l2, h2, l3, h3, x0, x1, x2, x3, x4, x5, x6, x7):
    """The 8 products of each weight word (decoded planes ``_e2m1_decode``) with its x elements, summed: one FMA
    chain per word, in the order of the 2-byte form (same sums, bit for bit)."""
    part = l0 * x0
    part += h0 * x4
    part += l1 * x1
    part += h1 * x5
    part += l2 * x2
    part += h2 * x6
    part += l3 * x3
    part += h3 * x7
    return part


@triton.jit
def _gemv_row(acc, l0, h0, l1, h1, l2, h2, l3, h3, sf, xp, x_mask, x_other, X64: tl.constexpr):
    """acc [BN, G] + one row of x against the decoded words (``_e2m1_decode``, [BN, G, 2] each): the 16 products
    of each group summed, times the group's scale factor ``sf`` [BN, G]. ``xp`` [1, G, 2]: pointers to x at each
    word's code 0, issued in the weight tile's layout (no shared-memory shuffle). X64 (bf16 x): ``xp`` points to
    int64 words of x, and the word's 8 elements arrive as two 8-byte loads instead of eight 2-byte ones. The loads
    are what bound this loop: the H200 profile of the 2-byte form (12-01d, ncu) showed the L1 at 80 % of its
    throughput with DRAM at 20 %, one L1 request per x element."""
    if X64:
        a = tl.load(xp, mask=x_mask, other=x_other)  # codes 0-3 of each word
        b = tl.load(xp + 1, mask=x_mask, other=x_other)  # codes 4-7
        x0, x1, x2, x3, x4, x5, x6, x7 = _x_elems(a, b)
    else:
        x0 = tl.load(xp, mask=x_mask, other=x_other).to(tl.float32)
        x1 = tl.load(xp + 1, mask=x_mask, other=x_other).to(tl.float32)
        x2 = tl.load(xp + 2, mask=x_mask, other=x_other).to(tl.float32)
        x3 = tl.load(xp + 3, mask=x_mask, other=x_other).to(tl.float32)
        x4 = tl.load(xp + 4, mask=x_mask, other=x_other).to(tl.float32)
        x5 = tl.load(xp + 5, mask=x_mask, other=x_other).to(tl.float32)
        x6 = tl.load(xp + 6, mask=x_mask, other=x_other).to(tl.float32)
        x7 = tl.load(xp + 7, mask=x_mask, other=x_other).to(tl.float32)
    part = _word_sums(l0, h0, l1, h1, l2, h2, l3, h3, x0, x1, x2, x3, x4, x5, x6, x7)
    return acc + tl.sum(part, axis=2) * sf


@triton.jit
def _gemv_store(acc, gs, out_n, row, M, stride_om, offs_n, N):
    y = tl.sum(acc, axis=1) * gs
    n_end = tl.where(row < M, N, 0)  # (a tensor & scalar mask trips the interpreter)
    tl.store(out_n + row.to(tl.int64) * stride_om, y.to(out_n.dtype.element_ty), mask=offs_n < n_end)


@triton.jit
def _w4a16_gemv_kernel(
    x_ptr,  # [M, K] activations (bf16 / fp16 / fp32), unit stride along K
    w_ptr,  # [N, K/8] int32: the packed weight as words (PER_ROW_EXPERT: stacked [E, N, K/8])
    s_ptr,  # [N, K/16] uint8 raw e4m3 block scales ([E, N, K/16])
    gs_ptr,  # fp32 global scale: [1] / [N] (gs_stride 0 / 1); PER_ROW_EXPERT: [E] / [E, N]
    out_ptr,  # [M, N] output, or [SPLIT, M, N] fp32 partials (split-K)
    eid_ptr,  # PER_ROW_EXPERT: [M] expert of each row; else unused
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_os,
    stride_om,
    stride_on,
    gs_stride,
    stride_we,
    stride_se,
    stride_ge,
    k_per_split,  # multiple of BLOCK_K
    BLOCK_M: tl.constexpr,  # rows of x per program: 1, 2 or 4 (1 with PER_ROW_EXPERT)
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no K masks
    PER_ROW_EXPERT: tl.constexpr,
    ASM: tl.constexpr,  # inline-PTX fp16 -> fp32 of the decoded pairs (GPU; not the interpreter)
    PREFETCH: tl.constexpr,  # weight steps in flight while one is decoded: 1 or 2 (register buffers)
    X64: tl.constexpr,  # bf16 x read as int64 words (x 8-byte aligned, stride_xm % 4 == 0): see _gemv_row
    RP: tl.constexpr = 0,  # repacked words (``repack_words``)
):
    pid_m = tl.program_id(0)  # fastest: the programs sharing a weight tile run together (L2)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    G: tl.constexpr = BLOCK_K // 16
    if PER_ROW_EXPERT:  # row pid_m against its own expert's weight (MoE decode, no host sync)
        e = tl.load(eid_ptr + pid_m).to(tl.int64)
        s_ptr += e * stride_se
        gs_ptr += e * stride_ge
    m0 = pid_m * BLOCK_M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn = tl.minimum(offs_n, N - 1).to(tl.int64)  # rows past N re-read row N - 1 (not stored): no load masks
    g = tl.arange(0, G)
    h = tl.arange(0, 2)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    # K % 16 == 0 (so N * K / 8 words per expert is even too): rows start on 8-byte word pairs, 64-bit loads
    if PER_ROW_EXPERT:
        w_rows = tl.multiple_of(e * stride_we + rn * stride_wn, 2)
    else:
        w_rows = tl.multiple_of(rn * stride_wn, 2)  # (a "+ 0" would be folded away with the hint)
    w_ptrs = w_ptr + w_rows[:, None, None] + (k_lo // 8 + 2 * g[:, None] + h[None, :])[None, :, :]
    s_ptrs = s_ptr + rn[:, None] * stride_sn + (k_lo // 16 + g)[None, :]
    x_off = (k_lo + 16 * g[:, None] + 8 * h[None, :])[None, :, :]  # [1, G, 2]: x element of each word's code 0
    if X64:  # the same positions in int64 words of x (4 elements each)
        XW: tl.constexpr = 4
        xb = x_ptr.to(tl.pointer_type(tl.int64), bitcast=True)
    else:
        XW: tl.constexpr = 1
        xb = x_ptr
    # rows past M re-read row M - 1 (not stored)
    xp0 = xb + (tl.minimum(m0, M - 1).to(tl.int64) * stride_xm + x_off) // XW
    acc0 = tl.zeros((BLOCK_N, G), dtype=tl.float32)
    if BLOCK_M > 1:
        xp1 = xb + (tl.minimum(m0 + 1, M - 1).to(tl.int64) * stride_xm + x_off) // XW
        acc1 = tl.zeros((BLOCK_N, G), dtype=tl.float32)
    if BLOCK_M > 2:
        xp2 = xb + (tl.minimum(m0 + 2, M - 1).to(tl.int64) * stride_xm + x_off) // XW
        xp3 = xb + (tl.minimum(m0 + 3, M - 1).to(tl.int64) * stride_xm + x_off) // XW
        acc2 = tl.zeros((BLOCK_N, G), dtype=tl.float32)
        acc3 = tl.zeros((BLOCK_N, G), dtype=tl.float32)

    w, s = _gemv_tile(w_ptrs, s_ptrs, k_lo, k_hi, g)
    if PREFETCH == 2:
        w_ptrs += BLOCK_K // 8
        s_ptrs += G
        w1, s1 = _gemv_tile(w_ptrs, s_ptrs, k_lo + BLOCK_K, k_hi, g)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        w_ptrs += BLOCK_K // 8
        s_ptrs += G
        w_next, s_next = _gemv_tile(w_ptrs, s_ptrs, k0 + PREFETCH * BLOCK_K, k_hi, g)  # in flight meanwhile
        sf = _e4m3_times_2m8(s) * 4194304.0  # 2^22 undoes 2^-14 * 2^-8
        l0, h0, l1, h1, l2, h2, l3, h3 = _e2m1_decode(w.to(tl.uint32, bitcast=True), ASM, RP)  # once for all rows
        if EVEN_K:  # no x masks (a load with other= needs a mask)
            x_mask = None
            x_other = None
        else:
            x_mask = ((k0 // 16 + g) < k_hi // 16)[None, :, None]
            x_other = 0.0
        acc0 = _gemv_row(acc0, l0, h0, l1, h1, l2, h2, l3, h3, sf, xp0, x_mask, x_other, X64)
        xp0 += BLOCK_K // XW
        if BLOCK_M > 1:
            acc1 = _gemv_row(acc1, l0, h0, l1, h1, l2, h2, l3, h3, sf, xp1, x_mask, x_other, X64)
            xp1 += BLOCK_K // XW
        if BLOCK_M > 2:
            acc2 = _gemv_row(acc2, l0, h0, l1, h1, l2, h2, l3, h3, sf, xp2, x_mask, x_other, X64)
            acc3 = _gemv_row(acc3, l0, h0, l1, h1, l2, h2, l3, h3, sf, xp3, x_mask, x_other, X64)
            xp2 += BLOCK_K // XW
            xp3 += BLOCK_K // XW
        if PREFETCH == 2:
            w = w1
            s = s1
            w1 = w_next
            s1 = s_next
        else:
            w = w_next
            s = s_next

    gs = tl.load(gs_ptr + rn * gs_stride)
    out_n = out_ptr + pid_k.to(tl.int64) * stride_os + offs_n.to(tl.int64) * stride_on
    _gemv_store(acc0, gs, out_n, m0, M, stride_om, offs_n, N)
    if BLOCK_M > 1:
        _gemv_store(acc1, gs, out_n, m0 + 1, M, stride_om, offs_n, N)
    if BLOCK_M > 2:
        _gemv_store(acc2, gs, out_n, m0 + 2, M, stride_om, offs_n, N)
        _gemv_store(acc3, gs, out_n, m0 + 3, M, stride_om, offs_n, N)


@triton.jit
def _wide_step(w_base, s_base, k0, K, c, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """Words [H, C, 4] (one 16-byte load per thread) and raw scales [H, C, 2] (2 bytes) of the step at k0. EVEN_K:
    a step past the end re-reads the last one (clamped, never used), so the loads need no masks; else zeros past
    K, per 32-element chunk."""
    if EVEN_K:
        kk = tl.minimum(k0, K - BLOCK_K)
        w = tl.load(w_base + tl.multiple_of(kk // 8, 4))
        s = tl.load(s_base + tl.multiple_of(kk // 16, 2))
    else:
        ok = ((k0 + 32 * c) < K)[None, :, None]
        w = tl.load(w_base + k0 // 8, mask=ok, other=0)
        s = tl.load(s_base + k0 // 16, mask=ok, other=0)
    return w, s


@triton.jit
def _wide_rows(acc, w, s, x0, x1, x2, x3, x4, x5, x6, x7, ASM: tl.constexpr, RP: tl.constexpr):
    """acc [H, C, 2] (per scale group) + one row set's words [H, C, 4] against x's elements [1, C, 4] each."""
    H: tl.constexpr = w.shape[0]
    C: tl.constexpr = w.shape[1]
    sf = _e4m3_times_2m8(s) * 4194304.0  # [H, C, 2]; 2^22 undoes 2^-14 * 2^-8
    l0, h0, l1, h1, l2, h2, l3, h3 = _e2m1_decode(w.to(tl.uint32, bitcast=True), ASM, RP)
    part = _word_sums(l0, h0, l1, h1, l2, h2, l3, h3, x0, x1, x2, x3, x4, x5, x6, x7)  # [H, C, 4]
    even, odd = tl.split(tl.reshape(part, (H, C, 2, 2)))  # words (0, 2) and (1, 3) of each chunk
    return acc + (even + odd) * sf  # group sums times their scales


@triton.jit
def _wide_x_step(xp, k0, K, c, EVEN_K: tl.constexpr):
    """x's 8 elements per word of the step at k0, as fp32 [1, C, 4] each (zeros past K unless EVEN_K)."""
    if EVEN_K:
        a = tl.load(xp + k0 // 4)  # elements 0-3 of each word
        b = tl.load(xp + k0 // 4 + 1)  # 4-7
    else:
        x_ok = ((k0 + 32 * c) < K)[None, :, None]
        a = tl.load(xp + k0 // 4, mask=x_ok, other=0)
        b = tl.load(xp + k0 // 4 + 1, mask=x_ok, other=0)
    return _x_elems(a, b)


@triton.jit
def _wide_loop(wa, sa, wb, sb, xp, k_end, K, c, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr, ASM: tl.constexpr,
               RP: tl.constexpr):  # fmt: skip
    """Two row sets' accumulators [H, C, 2] over K in [0, k_end) (k_end = K, or 0: nothing read): ``wa`` / ``wb``
    [H, C, 4] word pointers and ``sa`` / ``sb`` [H, C, 2] scale pointers of each set's rows at k = 0, ``xp``
    [1, C, 4] int64 pointers to x at each word's element 0. Two steps in flight; x loaded and converted once per
    step for both sets."""
    H: tl.constexpr = wa.shape[0]
    C: tl.constexpr = wa.shape[1]
    acc_a = tl.zeros((H, C, 2), dtype=tl.float32)
    acc_b = tl.zeros((H, C, 2), dtype=tl.float32)
    w_a, s_a = _wide_step(wa, sa, 0, K, c, EVEN_K, BLOCK_K)
    w_b, s_b = _wide_step(wb, sb, 0, K, c, EVEN_K, BLOCK_K)
    w_a1, s_a1 = _wide_step(wa, sa, BLOCK_K, K, c, EVEN_K, BLOCK_K)
    w_b1, s_b1 = _wide_step(wb, sb, BLOCK_K, K, c, EVEN_K, BLOCK_K)
    for k0 in range(0, k_end, BLOCK_K):
        w_a2, s_a2 = _wide_step(wa, sa, k0 + 2 * BLOCK_K, K, c, EVEN_K, BLOCK_K)  # in flight meanwhile
        w_b2, s_b2 = _wide_step(wb, sb, k0 + 2 * BLOCK_K, K, c, EVEN_K, BLOCK_K)
        x0, x1, x2, x3, x4, x5, x6, x7 = _wide_x_step(xp, k0, K, c, EVEN_K)
        acc_a = _wide_rows(acc_a, w_a, s_a, x0, x1, x2, x3, x4, x5, x6, x7, ASM, RP)
        acc_b = _wide_rows(acc_b, w_b, s_b, x0, x1, x2, x3, x4, x5, x6, x7, ASM, RP)
        w_a, s_a, w_a1, s_a1 = w_a1, s_a1, w_a2, s_a2
        w_b, s_b, w_b1, s_b1 = w_b1, s_b1, w_b2, s_b2
    return acc_a, acc_b


@triton.jit
def _wide_ptrs(w_ptr, s_ptr, rows, stride_wn, stride_sn, c):
    """[H, C, 4] word and [H, C, 2] scale pointers of ``rows`` (int64 [H], base pointers already at the expert)
    at k = 0: each thread's 4 words (16 bytes) and 2 scale bytes of one 32-element chunk."""
    wcol = (4 * c[:, None] + tl.arange(0, 4)[None, :])[None, :, :]
    scol = (2 * c[:, None] + tl.arange(0, 2)[None, :])[None, :, :]
    w = w_ptr + tl.multiple_of(rows * stride_wn, 4)[:, None, None] + wcol
    s = s_ptr + tl.multiple_of(rows * stride_sn, 2)[:, None, None] + scol
    return w, s


@triton.jit
def _wide_x(x_ptr, c):
    """[1, C, 4] int64 pointers to bf16 x at element 0 of each word of a thread's chunk (x 8-byte aligned)."""
    return (
        x_ptr.to(tl.pointer_type(tl.int64), bitcast=True) + (8 * c[:, None] + 2 * tl.arange(0, 4)[None, :])[None, :, :]
    )


@triton.jit
def _wide_sum(acc):
    """[H, C, 2] group accumulators -> the rows' dot products [H]."""
    return tl.sum(tl.sum(acc, axis=2), axis=1)


@triton.jit
def _wide_gemv(x_ptr, w_ptr, s_ptr, row0, N, K, k_end, stride_wn, stride_sn, H: tl.constexpr,
               BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, ASM: tl.constexpr, RP: tl.constexpr):  # fmt: skip
    """Rows [row0, row0 + 2 H) of one weight (``w_ptr`` / ``s_ptr`` at its row 0) against one row of bf16 x, as
    two row sets of H: per set its row offsets [H], the rows read (clamped to N - 1: rows past N re-read the last,
    not to be stored) and the dot products before the global scale."""
    c = tl.arange(0, BLOCK_K // 32)  # chunks of 32 elements: one per thread and row set
    offs_a = row0 + tl.arange(0, H)
    offs_b = offs_a + H
    ra = tl.minimum(offs_a, N - 1).to(tl.int64)
    rb = tl.minimum(offs_b, N - 1).to(tl.int64)
    wa, sa = _wide_ptrs(w_ptr, s_ptr, ra, stride_wn, stride_sn, c)
    wb, sb = _wide_ptrs(w_ptr, s_ptr, rb, stride_wn, stride_sn, c)
    acc_a, acc_b = _wide_loop(wa, sa, wb, sb, _wide_x(x_ptr, c), k_end, K, c, EVEN_K, BLOCK_K, ASM, RP)
    return offs_a, ra, _wide_sum(acc_a), offs_b, rb, _wide_sum(acc_b)


@triton.jit
def _w4a16_gemv_wide_kernel(
    x_ptr,  # [1, K] bf16 activations, 8-byte aligned, read as int64 words
    w_ptr,  # [N, K/8] int32 packed weight, K % 32 == 0 (rows of 16-byte chunks)
    s_ptr,  # [N, K/16] uint8 raw e4m3 block scales
    gs_ptr,  # fp32 global scale: [1] / [N] (gs_stride 0 / 1)
    out_ptr,  # [1, N]
    N,
    K,
    stride_wn,
    stride_sn,
    gs_stride,
    H: tl.constexpr,  # rows per set; a program owns 2 H rows
    BLOCK_K: tl.constexpr,  # >= 32
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: clamped prefetch, no masks
    ASM: tl.constexpr,
    PDL: tl.constexpr = 0,  # launched with launch_pdl (perfkit/kernels/pdl.py)
    RP: tl.constexpr = 0,  # repacked words (``repack_words``)
):
    """The M = 1 gemv in the wide form (``W4A16Config.wide``): each thread owns 32 consecutive K of a row per step
    (4 words = 2 scale groups: one 16-byte load, one 2-byte scale load), and the program's rows are two sets of H
    in the same layout, so each thread loads and converts its 32 x elements once for two weight rows. Two steps
    in flight as in the narrow kernel. Per weight element: 5.8 SASS instructions in the loop (narrow: 7.3), no
    shared memory (sm_90, Triton 3.9 offline compile, 16 x 1024 x 8 warps and 16 x 512 x 4 warps)."""
    pdl_enter(PDL)
    row0 = tl.program_id(0) * 2 * H
    offs_a, ra, ya, offs_b, rb, yb = _wide_gemv(x_ptr, w_ptr, s_ptr, row0, N, K, K, stride_wn, stride_sn, H,
                                                BLOCK_K, EVEN_K, ASM, RP)  # fmt: skip
    ya = ya * tl.load(gs_ptr + ra * gs_stride)
    yb = yb * tl.load(gs_ptr + rb * gs_stride)
    tl.store(out_ptr + offs_a, ya.to(out_ptr.dtype.element_ty), mask=offs_a < N)
    tl.store(out_ptr + offs_b, yb.to(out_ptr.dtype.element_ty), mask=offs_b < N)


@triton.jit
def _tc_pair_bits(w, SH: tl.constexpr):
    """uint32 words -> bf16x2 bit patterns of codes (j, j + 4), j = (12 - SH) / 4: each sign to bit 15 / 31, each
    ``e1 e0 m`` to bits 8..6 / 24..22, so each half is ``e2m1 * 2^-126`` (a bf16 subnormal for the code 0.5)."""
    s = w << SH  # SH in (12, 8, 4, 0)
    if SH >= 6:
        m = w << (SH - 6)
    else:
        m = w >> (6 - SH)
    return (s & 0x80008000) | (m & 0x01C001C0)


@triton.jit
def _tc_pair_f32(w, sf, SH: tl.constexpr, RP: tl.constexpr):
    """The interpreter's form of ``_tc_pair_asm``: the same bf16 bit patterns widened to fp32 (a bf16 is the top half
    of an fp32) times the fp32 scale: the same exact values, [..., 2 (low, high half)] (the interpreter's bf16
    arithmetic is not IEEE)."""
    if RP:  # repacked words: pair (12 - SH) / 4's bits, as ``_tc_pair_bits`` makes them from the standard word
        pr = _rp_pair(w, (12 - SH) // 4) & 0x81C081C0
    else:
        pr = _tc_pair_bits(w, SH)
    lo = (pr << 16).to(tl.float32, bitcast=True)
    hi = (pr & 0xFFFF0000).to(tl.float32, bitcast=True)
    return tl.join(lo, hi) * sf[:, :, :, :, None]


@triton.jit
def _tc_asm(w, sf, TEXT: tl.constexpr):
    """One PTX block per word and its bf16 scale, the (low, high) pair as bf16 [..., 2]: the word and the scale are
    each joined with themselves so that ``pack=2`` hands one instance the word ($1) and the scale's bf16x2 ($3): its
    one output register is the pair in place, which is the MMA operand's register (as separate halves, Triton
    extracts and re-packs them: 2 PRMT per pair, 12-14)."""
    ws = tl.join(w, w)
    ss = tl.join(sf, sf)
    return tl.inline_asm_elementwise(TEXT, "=r,r,r,r", [ws, ss], dtype=tl.bfloat16, is_pure=True, pack=2)


@triton.jit
def _tc_pair_asm(w, sf, SH: tl.constexpr):
    """GPU: ``_tc_pair_bits`` times the bf16 scale in one PTX block (``_tc_asm``). The PTX text is passed explicitly
    (a defaulted str constexpr failed on the device's Triton 3.6, 12-08)."""
    if SH == 12:
        y = _tc_asm(w, sf, "{ .reg .b32 s, m, d; shl.b32 s, $1, 12; shl.b32 m, $1, 6; and.b32 s, s, 0x80008000; "
                            "and.b32 m, m, 0x01C001C0; or.b32 d, s, m; mul.rn.bf16x2 $0, d, $3; }")  # fmt: skip
    elif SH == 8:
        y = _tc_asm(w, sf, "{ .reg .b32 s, m, d; shl.b32 s, $1, 8; shl.b32 m, $1, 2; and.b32 s, s, 0x80008000; "
                            "and.b32 m, m, 0x01C001C0; or.b32 d, s, m; mul.rn.bf16x2 $0, d, $3; }")  # fmt: skip
    elif SH == 4:
        y = _tc_asm(w, sf, "{ .reg .b32 s, m, d; shl.b32 s, $1, 4; shr.b32 m, $1, 2; and.b32 s, s, 0x80008000; "
                            "and.b32 m, m, 0x01C001C0; or.b32 d, s, m; mul.rn.bf16x2 $0, d, $3; }")  # fmt: skip
    else:
        y = _tc_asm(w, sf, "{ .reg .b32 m, d; shr.b32 m, $1, 6; and.b32 d, $1, 0x80008000; "
                            "and.b32 m, m, 0x01C001C0; or.b32 d, d, m; mul.rn.bf16x2 $0, d, $3; }")  # fmt: skip
    return y


@triton.jit
def _tc_rp_asm(w, sf, J: tl.constexpr):
    """GPU: ``_tc_pair_asm`` on repacked words (``repack_words``): pair J by one rotation and one mask (pair 3: an
    isolate, a rotation, a multiply and a mask), then the bf16x2 scale multiply. 9 instead of 15 instructions per
    word before the 4 multiplies (sm_90 loop 476 -> 383 SASS per thread and step)."""
    if J == 0:
        y = _tc_asm(w, sf, "{ .reg .b32 r; shf.l.wrap.b32 r, $1, $1, 6; and.b32 r, r, 0x81C081C0; "
                            "mul.rn.bf16x2 $0, r, $3; }")  # fmt: skip
    elif J == 1:
        y = _tc_asm(w, sf, "{ .reg .b32 r; shf.l.wrap.b32 r, $1, $1, 3; and.b32 r, r, 0x81C081C0; "
                            "mul.rn.bf16x2 $0, r, $3; }")  # fmt: skip
    elif J == 2:
        y = _tc_asm(w, sf, "{ .reg .b32 r; and.b32 r, $1, 0x81C081C0; mul.rn.bf16x2 $0, r, $3; }")
    else:
        y = _tc_asm(w, sf, "{ .reg .b32 r; and.b32 r, $1, 0x6C006C00; shf.l.wrap.b32 r, r, r, 25; "
                            "mul.lo.u32 r, r, 2081; and.b32 r, r, 0x81C081C0; mul.rn.bf16x2 $0, r, $3; }")  # fmt: skip
    return y


@triton.jit
def _tc_k_order(v0, v1, v2, v3, BN: tl.constexpr, BK: tl.constexpr):
    """The four pair planes j = 0..3 of a step, each [BN, C, t, w, 2 (p)], as the MMA's A tile [BN, BK] in the
    permuted K order (logical k 16 (2 w + j // 2) + 8 (j % 2) + 2 t + p): the NVFP4 and the FP8 tiles share it, and
    with it ``_tc_x_tile``."""
    v = tl.join(tl.join(v0, v1), tl.join(v2, v3))  # [BN, C, t, w, p, j % 2, j // 2]
    return tl.reshape(tl.permute(v, (0, 1, 3, 6, 5, 2, 4)), (BN, BK))  # [BN, C, w, j // 2, j % 2, t, p]


@triton.jit
def _tc_tile(w_ptr, s_ptr, rr, stride_wn, stride_sn, k0, K, BN: tl.constexpr, BK: tl.constexpr,
             EVEN_K: tl.constexpr, INTERP: tl.constexpr, RP: tl.constexpr):  # fmt: skip
    """The step at k0 of rows ``rr`` as the MMA's A operand [BN, BK] in the permuted K order of
    ``_w4a16_gemv_tc_kernel``: words [BN, C, 4 (t), 2 (w)] (C = BK / 64), scale groups [BN, C, 4 (t)]; the code pair
    j of word (t, w) is logical k 16 (2 w + j // 2) + 8 (j % 2) + 2 t + (0, 1). Exact ``e2m1 * e4m3 * 2^-8``
    (bf16; fp32 under the interpreter)."""
    C: tl.constexpr = BK // 64
    wofs = k0 // 8 + tl.arange(0, BK // 8)
    sofs = k0 // 16 + tl.arange(0, BK // 16)
    wp = w_ptr + rr[:, None] * stride_wn + wofs[None, :]
    sp = s_ptr + rr[:, None] * stride_sn + sofs[None, :]
    if EVEN_K:
        words = tl.load(wp)
        sc = tl.load(sp)
    else:
        words = tl.load(wp, mask=wofs[None, :] < K // 8, other=0)
        sc = tl.load(sp, mask=sofs[None, :] < K // 16, other=0)
    sf = sc.to(tl.float8e4nv, bitcast=True).to(tl.float32) * 3.3230699894622794e35  # e4m3 * 2^118 (< 2^127)
    w = tl.reshape(words.to(tl.uint32, bitcast=True), (BN, C, 4, 2))
    if INTERP:
        sf = tl.reshape(sf, (BN, C, 4, 1))
        v0 = _tc_pair_f32(w, sf, 12, RP)  # j = 0: [BN, C, t, w, 2]
        v1 = _tc_pair_f32(w, sf, 8, RP)
        v2 = _tc_pair_f32(w, sf, 4, RP)
        v3 = _tc_pair_f32(w, sf, 0, RP)
    else:
        sfb = tl.broadcast_to(tl.reshape(sf.to(tl.bfloat16), (BN, C, 4, 1)), (BN, C, 4, 2))
        if RP:
            v0 = _tc_rp_asm(w, sfb, 0)
            v1 = _tc_rp_asm(w, sfb, 1)
            v2 = _tc_rp_asm(w, sfb, 2)
            v3 = _tc_rp_asm(w, sfb, 3)
        else:
            v0 = _tc_pair_asm(w, sfb, 12)
            v1 = _tc_pair_asm(w, sfb, 8)
            v2 = _tc_pair_asm(w, sfb, 4)
            v3 = _tc_pair_asm(w, sfb, 0)
    return _tc_k_order(v0, v1, v2, v3, BN, BK)


@triton.jit
def _tc_e4m3_asm(a, b, TEXT: tl.constexpr):
    """One PTX block per pair of FP8 words, its bf16x2 result in place (each word joined with itself as in
    ``_tc_asm``, pack=2: $1 and $3 are the words, $0 the MMA operand's register)."""
    return tl.inline_asm_elementwise(TEXT, "=r,r,r,r,r", [tl.join(a, a), tl.join(b, b)], dtype=tl.bfloat16,
                                     is_pure=True, pack=2)  # fmt: skip


@triton.jit
def _tc_e4m3_pair_asm(a, b, J: tl.constexpr):
    """GPU, FP8 words: byte J of word ``a`` (low half) and of word ``b`` (high half) as one bf16x2, exact: one
    ``prmt`` puts the bytes at bits 8..15 / 24..31, each sign stays at bit 15 / 31 and ``eeee mmm`` moves to bits
    4..10 / 20..26 (a bf16 of value ``e4m3 * 2^-120``, subnormal for e4m3's subnormals), then one bf16x2 multiply by
    2^120 (0x7B80) makes each half the e4m3 value itself, a normal bf16. The PTX differs only in prmt's selector."""
    if J == 0:
        y = _tc_e4m3_asm(a, b, "{ .reg .b32 t, u, c; prmt.b32 t, $1, $3, 0x4000; shr.b32 u, t, 4; "
                               "and.b32 u, u, 0x07F007F0; and.b32 t, t, 0x80008000; or.b32 t, t, u; "
                               "mov.b32 c, 0x7B807B80; mul.rn.bf16x2 $0, t, c; }")  # fmt: skip
    elif J == 1:
        y = _tc_e4m3_asm(a, b, "{ .reg .b32 t, u, c; prmt.b32 t, $1, $3, 0x5010; shr.b32 u, t, 4; "
                               "and.b32 u, u, 0x07F007F0; and.b32 t, t, 0x80008000; or.b32 t, t, u; "
                               "mov.b32 c, 0x7B807B80; mul.rn.bf16x2 $0, t, c; }")  # fmt: skip
    elif J == 2:
        y = _tc_e4m3_asm(a, b, "{ .reg .b32 t, u, c; prmt.b32 t, $1, $3, 0x6020; shr.b32 u, t, 4; "
                               "and.b32 u, u, 0x07F007F0; and.b32 t, t, 0x80008000; or.b32 t, t, u; "
                               "mov.b32 c, 0x7B807B80; mul.rn.bf16x2 $0, t, c; }")  # fmt: skip
    else:
        y = _tc_e4m3_asm(a, b, "{ .reg .b32 t, u, c; prmt.b32 t, $1, $3, 0x7030; shr.b32 u, t, 4; "
                               "and.b32 u, u, 0x07F007F0; and.b32 t, t, 0x80008000; or.b32 t, t, u; "
                               "mov.b32 c, 0x7B807B80; mul.rn.bf16x2 $0, t, c; }")  # fmt: skip
    return y


@triton.jit
def _tc_e4m3_pair_f32(a, b, J: tl.constexpr):
    """The interpreter's form of ``_tc_e4m3_pair_asm``: byte J of ``a`` and of ``b`` as exact fp32, [..., 2]."""
    lo = ((a >> (8 * J)) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    hi = ((b >> (8 * J)) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return tl.join(lo, hi)


@triton.jit
def _tc_e4m3_tile(w_ptr, rr, stride_wn, k0, K, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
                  INTERP: tl.constexpr):  # fmt: skip
    """``_tc_tile`` for FP8 (e4m3) weights read as int32 words [N, K/4], in the same permuted K order, so that
    ``_tc_x_tile`` serves both: thread t's 16 bytes of a 64-wide chunk are words (t, 2 w + p), and byte j of words
    2 w and 2 w + 1 is the pair of logical k 16 (2 w + j // 2) + 8 (j % 2) + 2 t + (0, 1) (the W4A16 word's codes j
    and j + 4 sit at the same physical offsets, 4 apart). The values are the e4m3 values themselves (the per-row
    scale is the kernel's epilogue), exact in bf16 (fp32 under the interpreter)."""
    C: tl.constexpr = BK // 64
    wofs = k0 // 4 + tl.arange(0, BK // 4)
    wp = w_ptr + rr[:, None] * stride_wn + wofs[None, :]
    if EVEN_K:
        words = tl.load(wp)
    else:
        words = tl.load(wp, mask=wofs[None, :] < K // 4, other=0)
    a, b = tl.split(tl.reshape(words.to(tl.uint32, bitcast=True), (BN, C, 4, 2, 2)))  # [BN, C, t, w] for p = 0, 1
    if INTERP:
        v0 = _tc_e4m3_pair_f32(a, b, 0)  # j = 0: [BN, C, t, w, 2 (p)]
        v1 = _tc_e4m3_pair_f32(a, b, 1)
        v2 = _tc_e4m3_pair_f32(a, b, 2)
        v3 = _tc_e4m3_pair_f32(a, b, 3)
    else:
        v0 = _tc_e4m3_pair_asm(a, b, 0)
        v1 = _tc_e4m3_pair_asm(a, b, 1)
        v2 = _tc_e4m3_pair_asm(a, b, 2)
        v3 = _tc_e4m3_pair_asm(a, b, 3)
    return _tc_k_order(v0, v1, v2, v3, BN, BK)


@triton.jit
def _tc_x_tile(x_ptr, stride_xm, M, k0, K, BK: tl.constexpr, ROWS: tl.constexpr, NC: tl.constexpr):
    """x's elements of the step at k0 in ``_tc_tile``'s K order, as the MMA's B operand [BK, 16] (the dot needs
    N >= 16): ROWS 1, x's one row in every column (column 0 is used); ROWS 2-16, row m of x in column m < M.
    Zeros past K."""
    k = tl.arange(0, BK)
    b = (k // 16) % 4
    phys = k0 + 64 * (k // 64) + 16 * ((k // 2) % 4) + 8 * (b // 2) + 2 * (b % 2) + (k // 8) % 2 + 4 * (k % 2)
    if ROWS == 1:
        xv = tl.load(x_ptr + phys, mask=phys < K, other=0.0)
        return tl.broadcast_to(xv[:, None], (BK, NC))
    # ROWS > 1: ROWS rows (M <= ROWS; rows past M re-read row M - 1, whose products are never stored) loaded in
    # memory order (16-byte vectors), then put in the K order above, a permutation of the bits of k within each 64:
    # logical (b1, b0, k3, k1, k0) holds physical 16 k1 + 8 b1 + 4 k0 + 2 b0 + k3. Column c holds row c % ROWS, so
    # columns < M are rows 0..M-1; loading ROWS rows, not 16, keeps x's L2 traffic per step at what M needs.
    C: tl.constexpr = BK // 64
    kk = k0 + tl.arange(0, BK)
    xp = x_ptr + tl.minimum(tl.arange(0, ROWS), M - 1)[:, None] * stride_xm + kk[None, :]
    xn = tl.load(xp, mask=(kk < K)[None, :], other=0.0)  # [ROWS (m), BK] in memory order
    v = tl.permute(tl.reshape(xn, (ROWS, C, 4, 2, 2, 2, 2)), (0, 1, 3, 5, 6, 2, 4))  # [m, C, b1, b0, k3, k1, k0]
    v = tl.reshape(v, (ROWS, BK))
    if ROWS < NC:
        v = tl.reshape(tl.broadcast_to(v[None, :, :], (NC // ROWS, ROWS, BK)), (NC, BK))
    return tl.trans(v)


@triton.jit
def _w4a16_gemv_tc_kernel(
    x_ptr,  # [M, K] bf16, M <= NC * MG
    w_ptr,  # [N, K/8] int32 packed weight
    s_ptr,  # [N, K/16] uint8 raw e4m3 block scales
    gs_ptr,  # fp32 global scale: [1] / [N] (gs_stride 0 / 1)
    out_ptr,  # [M, N]
    part_ptr,  # SPLIT > 1: fp32 [SPLIT, M, N] partials
    count_ptr,  # FUSED: int32 [cdiv(N, BN)], 0 between launches
    M,
    stride_xm,
    N,
    K,
    steps,  # K steps of BK in all: split i takes steps [i * steps // SPLIT, (i + 1) * steps // SPLIT)
    stride_wn,
    stride_sn,
    gs_stride,
    BN: tl.constexpr,  # weight rows per program: the MMA's M (64 = one Hopper warpgroup MMA)
    BK: tl.constexpr,  # K per step, a multiple of 64
    SPLIT: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BK == 0: no masks
    FUSED: tl.constexpr,  # SPLIT > 1: the split of a row block that counts last sums the partials
    INTERP: tl.constexpr,
    PDL: tl.constexpr = 0,  # launched with launch_pdl (perfkit/kernels/pdl.py)
    RP: tl.constexpr = 0,  # repacked words (``repack_words``)
    ROWS: tl.constexpr = 1,  # 1: M = 1, x broadcast to the MMA's 16 columns; 2-16: M <= ROWS rows (a power of 2)
    FP8: tl.constexpr = 0,  # 1: e4m3 weights, w_ptr int32 [N, K/4], gs_ptr their fp32 per-row scales, s_ptr unused
    MG: tl.constexpr = 1,  # NC-row groups of x (M <= NC MG): program g of a row block takes rows [NC g, NC g + NC)
    NC: tl.constexpr = 16,  # the MMA's columns (rows of x) per program: 16, or 32 (``W4A16Config.tc_cols``)
):
    """The small-M gemv on the tensor cores (``W4A16Config.tc``): rows [(pid // MG) * BN, + BN) over split pid_k's
    share of the K steps, weights on the MMA's M side and x's rows as its N side (``_tc_x_tile``, 16 per program).
    The splits differ by at most one step (12-15's splits of ceil(steps / SPLIT) left the last one short: 5376 x 8192
    ran 6, 6, 6, 6, 6, 2 steps, now 5 and 6; chained with PDL 14.78 -> 14.09-14.39 us, the other 31B shapes within
    noise; H200 12-16 ``split_probe.py``). Each step's A operand
    comes straight from the words a thread loads (``_tc_tile``: the K order is permuted to the MMA fragment's, x
    gathered in the same order), so the multiply-add costs nothing per element; what is left is ~2.5 instructions per
    element of decode and block scale (3.7 per element in the loop against the wide CUDA-core gemv's 5.8, sm_90
    compile). With PDL the wait is at the top: asking L2 for the program's first weight steps before it tied (2 steps)
    or made the chained launch slower (4-8 steps; H200 12-15, ``h200-runs/2026-12-15/pdl_probe.py``). FP8: the same
    loop on e4m3 words (``_tc_e4m3_tile``, in the same K order), the per-row scale in the epilogue: the weight-only
    FP8 gemv of ``perfkit.kernels.fp8_gemv``. More than 16 rows of x (MG groups): the MG programs of a row block are
    neighbours in the grid (program id = block * MG + group), so they run together and the weight tile they each
    read and decode comes from DRAM about once (the others hit L2); the decode is paid once per group."""
    pdl_enter(PDL)
    pid = tl.program_id(0)
    k_lo = tl.multiple_of((tl.program_id(1) * steps // SPLIT) * BK, BK)
    k_hi = tl.minimum(((tl.program_id(1) + 1) * steps // SPLIT) * BK, K)
    rows = (pid // MG) * BN + tl.arange(0, BN)
    rr = tl.minimum(rows, N - 1).to(tl.int64)
    m0 = (pid % MG) * NC  # this program's first row of x
    col = tl.arange(0, NC)
    acc = tl.zeros((BN, NC), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        if FP8:
            a = _tc_e4m3_tile(w_ptr, rr, stride_wn, k0, K, BN, BK, EVEN_K, INTERP)
        else:
            a = _tc_tile(w_ptr, s_ptr, rr, stride_wn, stride_sn, k0, K, BN, BK, EVEN_K, INTERP, RP)
        xb = _tc_x_tile(x_ptr + m0 * stride_xm, stride_xm, M - m0, k0, K, BK, ROWS, NC)
        if INTERP:
            acc = tl.dot(a, xb.to(tl.float32), acc)
        else:
            acc = tl.dot(a, xb, acc)
    if FP8:
        y = acc * tl.load(gs_ptr + rr * gs_stride)[:, None]  # [BN, NC]: column m is row m0 + m of the output
    else:
        y = acc * 256.0 * tl.load(gs_ptr + rr * gs_stride)[:, None]  # the tile's 2^-8 undone with the global scale
    offs = (m0 + col)[None, :] * N + rows[:, None]  # [M, N] (and each split's [M, N] of partials)
    ok = (rows < N)[:, None] & (col < M - m0)[None, :]
    if SPLIT == 1:
        tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=ok)
    else:
        tl.store(part_ptr + tl.program_id(1) * M * N + offs, y, mask=ok)
        if FUSED:  # the last split of the row block to count sums all partials in a fixed order, then resets
            tl.debug_barrier()  # every thread's partial stored before the release half of the count
            if tl.atomic_add(count_ptr + pid, 1, sem="acq_rel", scope="gpu") == SPLIT - 1:
                tot = tl.zeros((BN, NC), dtype=tl.float32)
                for i in tl.static_range(SPLIT):  # unrolled: the loads in flight together
                    tot += tl.load(part_ptr + i * M * N + offs, mask=ok, other=0.0, cache_modifier=".cg")
                tl.store(out_ptr + offs, tot.to(out_ptr.dtype.element_ty), mask=ok)
                tl.atomic_xchg(count_ptr + pid, 0, sem="relaxed", scope="gpu")


@triton.jit
def _w4a16_splitk_reduce_kernel(
    part_ptr,  # [SPLIT, MN] fp32 partials
    out_ptr,  # [MN] output
    MN,
    SPLIT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """out = sum of the SPLIT partials, in order 0..SPLIT-1 (bit-reproducible), cast to the output dtype."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    acc = tl.load(part_ptr + offs, mask=ok, other=0.0)
    for _ in tl.static_range(1, SPLIT):
        part_ptr += MN  # (pointer arithmetic: no int32 overflow of i * MN)
        acc += tl.load(part_ptr + offs, mask=ok, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _dot_scales(s_ptrs, k0, k_hi, g, GATHER_SCALES: tl.constexpr):
    """Raw e4m3 block scales of the K step at k0: [BN, G] (or [BN, G, 2] with GATHER_SCALES), zeros past k_hi (the
    K tail, and the look-ahead past the last step). The dot path's and the quantised MoE GEMM's (``moe``)."""
    g_ok = (k0 // 16 + g) < k_hi // 16
    if GATHER_SCALES:
        return tl.load(s_ptrs, mask=g_ok[None, :, None], other=0)
    return tl.load(s_ptrs, mask=g_ok[None, :], other=0)


@triton.jit
def _vec_scales(s0_ptrs, k0, k_hi, g):
    """Raw e4m3 block scales [BN, G] of the whole K step at k0, zeros if k0 >= k_hi: ``s0_ptrs`` point at K = 0 of
    rows that start on 4 bytes and k0 is a multiple of 64, so each row's G scales load as 4-byte vectors (one mask
    per step, a splat, keeps them whole), which the pipeliner can stage by cp.async. The dot path's and the
    quantised MoE GEMM's (``scales_vec``, ``SCALES_VEC``)."""
    uniform = (tl.zeros_like(g) + k0) < k_hi
    return tl.load(s0_ptrs + tl.multiple_of(k0 // 16, 4), mask=uniform[None, :], other=0)


@triton.jit
def _w4a16_dot_kernel(
    x_ptr,  # [M, K] activations, unit stride along K
    w_ptr,  # [N, K/8] int32 words of the packed weight
    s_ptr,  # [N, K/16] uint8 raw e4m3 block scales
    gs_ptr,  # fp32 global scale [1] / [N] (gs_stride 0 / 1)
    out_ptr,  # [M, N] output, or [SPLIT, M, N] fp32 partials
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_os,
    stride_om,
    stride_on,
    gs_stride,
    k_per_split,  # multiple of BLOCK_K
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    GATHER_SCALES: tl.constexpr,
    IEEE: tl.constexpr,
    ASM: tl.constexpr,
    SWAP_AB: tl.constexpr,  # out^T [BN, BM] = W x^T: the weight tile on the dot's M side (W4A16Config.swap_ab)
    SCALES_AHEAD: tl.constexpr,  # the next step's block scales loaded a step ahead (W4A16Config.scales_ahead)
    SCALES_VEC: tl.constexpr,  # 4-byte scale vectors indexed by the loop (W4A16Config.scales_vec; EVEN_K)
    ROW_MASK: tl.constexpr,  # rows past M masked (no load) instead of re-reading row M - 1 (DOT_ROW_MASK)
    RP: tl.constexpr = 0,  # repacked words (``repack_words``)
):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_n  # grouped order: GROUP_M row tiles walk the weight tiles together (L2 reuse)
    first_m = (pid // width) * GROUP_M
    group_size = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group_size
    pid_n = (pid % width) // group_size
    G: tl.constexpr = BLOCK_K // 16

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.minimum(offs_m, M - 1).to(tl.int64)  # clamped rows / columns are computed, not stored
    rn = tl.minimum(offs_n, N - 1).to(tl.int64)
    g = tl.arange(0, G)
    h = tl.arange(0, 2)
    kk = tl.arange(0, BLOCK_K)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    w_rows = tl.multiple_of(rn * stride_wn, 2)  # K % 16 == 0: rows start on 8-byte word pairs (64-bit loads)
    w_ptrs = w_ptr + w_rows[:, None, None] + (k_lo // 8 + 2 * g[:, None] + h[None, :])[None, :, :]
    if GATHER_SCALES:  # one (redundant) scale per word: [BN, G, 2]
        s_ptrs = s_ptr + rn[:, None, None] * stride_sn + (k_lo // 16 + g[:, None] + 0 * h[None, :])[None, :, :]
    elif SCALES_VEC:  # [BN, G] at K = 0 of rows on 4 bytes (the host checked stride_sn); the loop adds k0 / 16
        s0_ptrs = s_ptr + tl.multiple_of(rn * stride_sn, 4)[:, None] + g[None, :]
    else:  # [BN, G], broadcast over the group's 2 words
        s_ptrs = s_ptr + rn[:, None] * stride_sn + (k_lo // 16 + g)[None, :]
    x_ptrs = x_ptr + rm[:, None] * stride_xm + (k_lo + kk)[None, :]

    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if SCALES_AHEAD:  # the first step's scales; each step then loads the next one's before its own math
        if SCALES_VEC:
            s_next = _vec_scales(s0_ptrs, k_lo, k_hi, g)
        else:
            s_next = _dot_scales(s_ptrs, k_lo, k_hi, g, GATHER_SCALES)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs)
            if ROW_MASK:
                x = tl.load(x_ptrs, mask=(offs_m < M)[:, None], other=0.0)
            else:
                x = tl.load(x_ptrs)
        else:
            g_ok = (k0 // 16 + g) < k_hi // 16
            w = tl.load(w_ptrs, mask=g_ok[None, :, None], other=0)
            x_ok = (k0 + kk < k_hi)[None, :]
            if ROW_MASK:
                x_ok = x_ok & (offs_m < M)[:, None]
            x = tl.load(x_ptrs, mask=x_ok, other=0.0)
        if SCALES_AHEAD:
            s = s_next
            if SCALES_VEC:
                s_next = _vec_scales(s0_ptrs, k0 + BLOCK_K, k_hi, g)  # zeros past k_hi
            else:
                s_next = _dot_scales(s_ptrs + G, k0 + BLOCK_K, k_hi, g, GATHER_SCALES)  # zeros past k_hi
        elif SCALES_VEC:
            s = _vec_scales(s0_ptrs, k0, k_hi, g)
        elif EVEN_K:
            s = tl.load(s_ptrs)
        else:
            s = _dot_scales(s_ptrs, k0, k_hi, g, GATHER_SCALES)
        sf = _e4m3_times_2m8(s) * 4194304.0
        if not GATHER_SCALES:
            sf = sf[:, :, None]
        tile = _dequant_tile(w.to(tl.uint32, bitcast=True), sf, ASM, RP)  # [BN, BK] fp32, exact
        if IEEE:  # fp32 activations, or the CPU interpreter (whose bf16 tl.dot is wrong): fp32 dot
            xf = x.to(tl.float32)
            if SWAP_AB:
                acc = tl.dot(tile, tl.trans(xf), acc, input_precision="ieee")
            else:
                acc = tl.dot(xf, tl.trans(tile), acc, input_precision="ieee")
        else:  # the tile is exact in x's dtype: tensor-core dot, fp32 accumulate
            t = tile.to(x.dtype)
            if SWAP_AB:
                acc = tl.dot(t, tl.trans(x), acc)
            else:
                acc = tl.dot(x, tl.trans(t), acc)
        w_ptrs += BLOCK_K // 8
        if not SCALES_VEC:
            s_ptrs += G
        x_ptrs += BLOCK_K

    if SWAP_AB:  # [BN, BM] -> [BM, BN], once per program
        acc = tl.trans(acc)
    gs = tl.load(gs_ptr + rn * gs_stride)
    acc = acc * gs[None, :]
    out = (
        out_ptr
        + pid_k.to(tl.int64) * stride_os
        + offs_m[:, None].to(tl.int64) * stride_om
        + offs_n[None, :] * stride_on
    )
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


@triton.jit
def _w4a16_dequant_kernel(
    w_ptr,  # [N, K/8] int32 words of the packed weight
    s_ptr,  # [N, K/16] uint8 raw e4m3 block scales
    out_ptr,  # [N, K] bf16 / fp16 / fp32: e2m1 * e4m3 (no global scale), exact
    N,
    K,
    stride_wn,
    stride_sn,
    stride_on,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    ASM: tl.constexpr,
    RP: tl.constexpr = 0,  # repacked words (``repack_words``)
):
    pid_k = tl.program_id(0)  # fastest: consecutive programs write consecutive stretches of a row block
    pid_n = tl.program_id(1)
    G: tl.constexpr = BLOCK_K // 16
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn = tl.minimum(offs_n, N - 1).to(tl.int64)
    g = tl.arange(0, G)
    h = tl.arange(0, 2)
    k0 = pid_k * BLOCK_K
    w_rows = tl.multiple_of(rn * stride_wn, 2)  # K % 16 == 0: rows start on 8-byte word pairs (64-bit loads)
    w_ptrs = w_ptr + w_rows[:, None, None] + (k0 // 8 + 2 * g[:, None] + h[None, :])[None, :, :]
    s_ptrs = s_ptr + rn[:, None] * stride_sn + (k0 // 16 + g)[None, :]
    if EVEN_K:
        w = tl.load(w_ptrs)
        s = tl.load(s_ptrs)
    else:
        g_ok = (k0 // 16 + g) < K // 16
        w = tl.load(w_ptrs, mask=g_ok[None, :, None], other=0)
        s = tl.load(s_ptrs, mask=g_ok[None, :], other=0)
    sf = (_e4m3_times_2m8(s) * 4194304.0)[:, :, None]
    tile = _dequant_tile(w.to(tl.uint32, bitcast=True), sf, ASM, RP)
    kk = k0 + tl.arange(0, BLOCK_K)
    out = out_ptr + offs_n[:, None].to(tl.int64) * stride_on + kk[None, :]
    tl.store(out, tile.to(out_ptr.dtype.element_ty), mask=(offs_n < N)[:, None] & (kk < K)[None, :])


# --------------------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class W4A16Config:
    """One tile of one path (no autotune: sweep them on the GPU, ``sweep_w4a16``). Sizes are powers of two.

    - gemv: ``block_m`` rows of x per program (capped at GEMV_MAX_ROWS and at M's next power of two), ``block_n``
      weight rows, ``block_k`` (>= 16) per step. Keep ``block_k <= 128 * num_warps``: then each x load has fewer
      elements than the program has threads, and Triton issues it in the weight tile's layout (no shared-memory
      shuffle per step).
    - dot: ``block_m`` x ``block_n`` output tile (both >= 16), ``block_k`` (>= 16).
    - dequant_mm: ``block_n`` x ``block_k`` of the dequantise kernel (``block_m``, ``split_k`` unused).

    ``split_k``: None = chosen from the grid and the SM count (gemv, dot), 1 = never. ``prefetch`` (gemv): weight
    steps loaded ahead of the one being decoded, in registers (2 doubles the bytes in flight per program; it
    beat one step ahead by 8-14 % on the 12-01c sweep). ``wide`` (gemv): at M = 1 with bf16 x and K % 32 == 0,
    ``_w4a16_gemv_wide_kernel`` (16-byte weight loads, two row sets of ``block_n / 2`` sharing each thread's x,
    always two steps ahead, no split-K; ``block_n >= 2``, ``block_k >= 32``); other problems run the narrow
    kernel with the same tile. ``swap_ab`` (dot): the transposed product, out^T = W x^T, so the weight tile is the
    MMA's first operand (``block_n`` >= 64 fills a Hopper warpgroup MMA) and the few decode rows its N side, as
    Marlin / machete do for skinny W4A16 GEMMs; the accumulator is transposed once, in the epilogue.
    ``scales_ahead`` (dot): each K step loads the next step's block scales into registers before its own decode.
    Why: Triton's pipeliner moves the weight words and x through cp.async stages, but leaves the 1-byte scale
    loads in the loop (cp.async moves 4 bytes or more; the sm_90 TTGIR of 12-01h shows them as a plain
    ``tt.load``), so without it every step waits a global-memory latency for its scales before it can decode.
    ``scales_vec`` (dot; ``block_k`` a multiple of 64, K of ``block_k``, rows of scales on 4 bytes, else ignored):
    each step's scales addressed from the loop index, so a row's ``block_k / 16`` scales load as one 4-byte vector
    that the pipeliner stages by cp.async (the loop-carried pointers lose the alignment; the quantised MoE GEMMs'
    SCALES_VEC, which ncu motivated). It needs at least 4 scales per thread: ``block_n * block_k / 16 >=
    128 * num_warps``.
    ``tc`` (gemv; up to 64 rows of bf16 x, else the narrow kernel with the same tile): ``_w4a16_gemv_tc_kernel`` on
    the tensor cores, ``block_n`` weight rows per program as the MMA's M (>= 16; 64 fills a Hopper warpgroup MMA),
    ``block_k`` a multiple of 64; ``split_k`` None = enough splits for GEMV_TC_PROGRAMS_PER_SM programs per SM.
    ``tc_cols``: rows of x per program above 16 rows, as the MMA's N: 16 (one program per 16-row group, each
    decoding the weight tile) or 32 (one program decodes it once for 32 rows: 127 registers at 128-wide steps in the
    sm_90 compile, 167 at 256-wide; GEMV_TC_COLS_CONFIG, the default tile above 16 rows since 12-19)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int | None = None
    prefetch: int = 1
    wide: bool = False
    swap_ab: bool = False
    scales_ahead: bool = False
    scales_vec: bool = False
    tc: bool = False
    tc_cols: int = 16


# gemv: 4 weight rows x 512 K = 1 KB of weight per program and step, two more steps in flight (prefetch=2):
# 38 registers (sm_90 compile, no spills), many programs per SM. On the H200 sweep of 12-01c it beat the previous
# default (8 x 512, one step ahead) on all five 31B shapes, by 8-14 %. With int64 x (12-01d) it stays the best
# or within 3 % of it: 8 rows, 2-4 rows per thread, split-K and 1024-wide steps were timed beside it
# (docs/h200-runs/2026-12-01d/9-w4a16_x64_ab.jsonl).
# dot: wgmma tiles (BLOCK_M >= 64), no spills at 128 registers; decode-sized M wastes MMA rows, which are cheap
# next to the dequantisation. dot 16 x 64 x 128 (M 2-16) and 64 x 64 x 128 (M 17-64),
# 3 stages; the 128 x 128 x 64 tile for larger M (dot loses to dequant_mm there): the 12-01b sweep's best.
GEMV_CONFIG = W4A16Config(block_m=4, block_n=4, block_k=512, num_warps=4, num_stages=1, prefetch=2)
# M = 1, bf16 x: the wide kernel, 16 rows per program, its tile by grid size (``pick_config`` with N). The H200
# sweep of 12-01e (docs/h200-runs/2026-12-01e/5-w4a16_wide_sweep.jsonl, narrow -> wide, % of the measured read
# ceiling): 5376 x 21504 55.0 -> 61.0 % (47.5 -> 42.8 us, 1024 x 8 warps), 43008 x 5376 51.6 -> 63.4 % (85.2 ->
# 69.3 us, 512 x 4 warps), 16384 x 5376 55.4 -> 61.3 %, 5376 x 16384 55.9 -> 59.2 %. Below
# GEMV_WIDE_MIN_PROGRAMS_PER_SM programs of 16 rows per SM (the 26B-A4B's 2816-row projections) the narrow
# GEMV_CONFIG stays ahead (8.9 vs 10.3 us at 2816 x 2048); up to GEMV_WIDE_DEEP_PROGRAMS_PER_SM the 1024-wide
# 8-warp steps win (few rows, long K); up to GEMV_WIDE_SHORT_PROGRAMS_PER_SM 256-wide steps on 4 warps (16384 x
# 5376, 7.8 per SM on 132 SMs: 33.2 vs 35.3 us = 65.0 vs 61.3 %, in both the call-5 sweep and the call-6 tile
# pass); beyond them 512 x 4 warps (43008 x 5376, 20 per SM: 69.2 us, 256 x 2 warps 70.6). The 31B's full-layer
# qkv (18432 x 5376, 8.7 per SM) falls in the 256-wide tier without having been timed there.
GEMV_WIDE_CONFIG = W4A16Config(block_m=1, block_n=16, block_k=512, num_warps=4, num_stages=1, prefetch=2, wide=True)
GEMV_WIDE_DEEP_CONFIG = W4A16Config(1, 16, 1024, num_warps=8, num_stages=1, prefetch=2, wide=True)
GEMV_WIDE_SHORT_CONFIG = W4A16Config(1, 16, 256, num_warps=4, num_stages=1, prefetch=2, wide=True)
GEMV_WIDE_MIN_PROGRAMS_PER_SM = 2
GEMV_WIDE_DEEP_PROGRAMS_PER_SM = 4
GEMV_WIDE_SHORT_PROGRAMS_PER_SM = 12
# M = 1 (to GEMV_TC_MAX_M), bf16 x, sm_90+, N * K >= GEMV_TC_MIN_ELEMENTS and K >= GEMV_TC_MIN_K: the tensor-core
# gemv, split over K (``tc_split``), the splits summed in the same launch when the caller passes a counter. H200 12-14
# (docs/h200-runs/2026-12-14/6-split.jsonl, chained launches over distinct weights, us, wide gemv -> this tile at
# the split tc_split picks): 5376 x 21504 36.14 -> 28.72, 43008 x 5376 60.13 -> 53.36, 16384 x 5376 26.86 ->
# 22.59, 5376 x 16384 29.12 -> 24.24, 5376 x 8192 16.90 -> 15.12, 8192 x 5376 16.98 -> 13.87, 5376 x 4096 11.03
# -> 9.90, 18432 x 5376 30.64 -> 26.33; the 26B-A4B's 4224 x 2816 lost (6.65 -> 7.56: 11 steps of K), so
# K < 4096 stays on CUDA cores.
# GEMV_TC_PROGRAMS_PER_SM is the kernel's residency (127 registers x 128 threads: 4 programs per SM).
GEMV_TC_CONFIG = W4A16Config(block_m=1, block_n=64, block_k=256, num_warps=4, num_stages=3, tc=True)
GEMV_TC_PROGRAMS_PER_SM = 4
GEMV_TC_MIN_STEPS_PER_SPLIT = 4
GEMV_TC_FILL_SLACK = 0.15
GEMV_TC_MIN_ELEMENTS = 16 * 1024 * 1024
GEMV_TC_MIN_K = 4096
# M 2-16 with bf16 x on the same shapes: the same kernel with row m of x in column m of the MMA's B operand (M = 1
# broadcasts its row to the 16 columns the MMA computes anyway), so the weight is streamed once for all rows, as at
# M = 1. The dot path it replaces re-decodes the weight tile for its 16-row x tile at ~0.7 TB/s (H200 12-17 call
# 3: 5376 x 21504 at M 2-16 84-85 us, against 28 us for M = 1 on this kernel). Beyond 16 rows (12-18): one program
# per 16-row group of x and row block, the groups of a row block side by side in the grid so the weight tile comes
# from DRAM about once (up to GEMV_TC_MAX_ROW_GROUPS groups, M <= 64; the split counters are sized for it). Each
# group decodes the tile again, so the time grows with the groups (H200 12-18 ``7-groups.jsonl``, chained us, tc /
# dot: M = 32 5376 x 21504 65.68 / 109.73, 43008 x 5376 125.32 / 176.64, 5376 x 8192 28.60 / 45.84; M = 64 125.54 /
# 109.82, 234.34 / 175.25, 53.55 / 47.47): the auto path takes it up to 32 rows. 31B NVFP4 c32 forward_decode
# device mean 33.16 -> 25.09 ms (``7-e_nv_*.json``).
# Since 12-19 the rows above 16 run 32 to a program (``tc_cols`` 32, 128-wide K steps: the tile decoded once for the
# MMA's 32 columns; at 48 / 64 rows two such programs), up to 64 rows. H200 12-19 (``h200-runs/2026-12-19/
# 3-cols.jsonl``, chained us, 32-row programs / 16-row groups / dot path): M = 32 5376 x 21504 41.8 / 65.3 / 109.9,
# 43008 x 5376 80.6 / 126.1 / 176.9, 5376 x 8192 20.2 / 29.2 / 46.1; M = 64 75.9 / 125.7 / 109.8, 143.2 / 235.0 /
# 176.1, 33.6 / 53.3 / 47.4 (M = 17 and 48 alike); 256-wide steps at 32 columns were slower than 16-row groups
# (85.8 / 74.6 us at 5376 x 21504: 167 registers capped at 128 spill). 31B NVFP4 forward_decode device mean
# (``4-e_nv_*.json``): c32 24.77 -> 20.08 ms (TPOT 29.83 -> 27.83), c64 39.88 -> 35.68 ms (TPOT 57.77 -> 53.67).
GEMV_TC_MAX_M = 64
GEMV_TC_MAX_ROW_GROUPS = 4
GEMV_TC_COLS_CONFIG = W4A16Config(block_m=1, block_n=64, block_k=128, num_warps=4, num_stages=3, tc=True, tc_cols=32)
# ... and only for products of GEMV_TC_GROUPS_MIN_ELEMENTS weight elements (the 31B's, 44-231 M, timed above): the
# 26B-A4B's dense products (<= 26 M elements) take 0.57-0.88x the dot path's time at M = 16 (12-17 call 9), so two
# groups, each decoding the tile, would lose to it.
GEMV_TC_GROUPS_MIN_ELEMENTS = 32 * 1024 * 1024
# At M 2-16 the alternative is the dot path, not the wide gemv that keeps the small products (26B-A4B's K 2816)
# off the tensor cores at M = 1: every shape of whole 256-wide K steps takes the tensor-core gemv there
# (GEMV_TC_ROWS_ANY_SHAPE). H200 12-17 call 9 (``9-rows26.jsonl``, chained us, tc / dot at M = 2-16): 8192 x 2816
# 10.5-12.2 / 19.0-19.3, 9216 x 2816 12.8-15.0 / 26.2-26.4, 4224 x 2816 9.9-11.2 / 12.7-12.8, 2816 x 4096 8.3-9.2 /
# 12.5-12.7, 2816 x 8192 12.0-13.8 / 20.2-20.4; but 2816 x 2112 (a masked last step) 34.4-37.7 / 8.3-8.7: K not a
# multiple of 256 stays on the dot path (its masked loop keeps 16 plain LDG besides the cp.async loads: 678 SASS
# against 504, sm_90 compile).
GEMV_TC_ROWS_ANY_SHAPE = True
# Rows > 1 load x as 16-byte vectors (``_tc_x_tile``, staged by cp.async like the weights: the loop 491 SASS against
# 487 at M = 1) but the compiler then takes 151-153 registers (sm_90, Triton 3.9): 3 programs per SM where
# ``tc_split`` plans 4. Capped at 128 it compiles without spills.
GEMV_TC_ROWS_MAX_REGISTERS = 128
DOT_TINY_CONFIG = W4A16Config(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=3)
# M 17-64: the swapped tile (weight rows on the wgmma's M side) with the scales a step ahead. H200 12-01i
# (docs/h200-runs/2026-12-01i/1-w4a16_dot.jsonl, M 32 and 64 x four 31B shapes): geomean 1.055x the per-shape
# best against 1.185x for the previous 64 x 64 x 128; 43008 x 5376 at M = 32 207.7 vs 318.1 us, at M = 64 191.5
# vs 254.0 us; slower on three of the eight (shape, M): 5376 x 16384 at M = 32 (+11.6 %), 5376 x 21504 and
# 16384 x 5376 at M = 64 (+5.4 %, +4.7 %). At M = 16 the 16 x 64 x 128 tile stays ahead (1.07x against 1.16x
# for the best swapped tile).
# Since 12-02 its scales load as 4-byte vectors staged by cp.async (scales_vec) instead of a step ahead in
# registers (docs/h200-runs/2026-12-02/5-w4a16_vec.jsonl, M 32 / 48 / 64 x the four shapes): geomean 1.002x the
# per-shape best against 1.070x (5376 x 21504 at M = 32: 113.1 vs 121.3 us; with both 1.023x); the 31B NVFP4 c64
# decode step 42.69 -> 40.90 ms (5-compare_31b.md).
DOT_SMALL_CONFIG = W4A16Config(
    block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=3, swap_ab=True, scales_vec=True
)
# M 65-143: the swapped 128 x 64 x 64 tile with the scales ahead. H200 12-02 (1-w4a16_large.jsonl, M 96 and 128
# x four 31B shapes): geomean 1.039x the per-shape best, the previous plain 128 x 128 x 64 on 8 warps 1.39x
# (5376 x 21504 at M = 128: 149.1 vs 216.8 us; 43008 x 5376: 271.3 vs 402.6 us). At M = 96 the swapped 128 x 128
# x 64 on 8 warps is 1.07x against this tile's 1.08x.
DOT_LARGE_CONFIG = W4A16Config(
    block_m=128, block_n=64, block_k=64, num_warps=4, num_stages=3, swap_ab=True, scales_ahead=True
)
# The dot path's rows past M (the last row tile's padding): masked, so they load nothing, instead of clamped to
# row M - 1. Why: the 128-row tile got slower as M fell with the same grid and work (12-02, 5-w4a16_vec.jsonl,
# 43008 x 5376: 271.8 us at M = 128, 375.9 at 96, 538.5 at 32): every program re-read row M - 1 for each padding
# row. Masked, the time no longer depends on M (H200 12-03, docs/h200-runs/2026-12-03/1-rowmask.jsonl, DOT_LARGE_
# CONFIG at 43008 x 5376: M 32 532.8 -> 271.6 us, M 96 373.3 -> 270.2, M 128 272.8 -> 273.5 (no padding rows)).
DOT_ROW_MASK = True
DOT_FP32_CONFIG = W4A16Config(block_m=64, block_n=64, block_k=32, num_warps=8, num_stages=2)  # fp32 FMA dot
DEQUANT_CONFIG = W4A16Config(block_m=1, block_n=16, block_k=512, num_warps=4, num_stages=1)
# The CPU interpreter runs one program at a time in Python (cost ~ programs x ops): one wide tile per problem.
INTERPRETER_CONFIG = W4A16Config(block_m=64, block_n=256, block_k=256, num_warps=4, num_stages=1)


def pick_path(M: int, path: str = "auto") -> str:
    """The path ``w4a16_gemm`` takes for M rows: ``path`` itself, or for "auto" gemv (M <= GEMV_MAX_M), dot, or
    dequant_mm (M >= DEQUANT_MM_MIN_M)."""
    if path not in PATHS:
        raise ValueError(f"path {path!r}: allowed values are {', '.join(PATHS)}")
    if path != "auto":
        return path
    if M <= GEMV_MAX_M:
        return "gemv"
    return "dequant_mm" if M >= DEQUANT_MM_MIN_M else "dot"


def pick_config(
    M: int,
    path: str = "auto",
    dtype: torch.dtype = torch.bfloat16,
    N: int | None = None,
    sms: int | None = None,
    K: int | None = None,
    tensor_cores: bool = False,
) -> W4A16Config:
    """The fixed default tile of ``path`` (resolved by M for "auto") for activations of ``dtype``; the dot path's
    by M: 16-row tiles up to M = 16, 64-row up to 64, 128-row beyond (fp32 activations: a smaller FMA tile); the
    gemv's with bf16 x, given N and the SM count: the tensor-core tile (``tensor_cores``: an sm_90+ GPU) at M = 1
    from GEMV_TC_MIN_ELEMENTS weight elements and K >= GEMV_TC_MIN_K, at M 2..GEMV_TC_MAX_M for every K of whole
    steps (GEMV_TC_ROWS_ANY_SHAPE; above 16 rows from GEMV_TC_GROUPS_MIN_ELEMENTS), else at M = 1 a wide tile by
    programs per SM (GEMV_WIDE_*). Under
    the CPU interpreter: INTERPRETER_CONFIG, clipped to the problem."""
    path = pick_path(M, path)
    if interpreting():
        return INTERPRETER_CONFIG
    if path == "gemv":
        if M > GEMV_TC_MAX_M or dtype != torch.bfloat16 or N is None or sms is None:
            return GEMV_CONFIG
        if M > 16:  # 32 rows of x per program (GEMV_TC_COLS_CONFIG), where the products pay for it
            cols = K is not None and tc_groups_pay(M, N, K) and K % GEMV_TC_COLS_CONFIG.block_k == 0
            return GEMV_TC_COLS_CONFIG if tensor_cores and cols else GEMV_CONFIG
        big = K is not None and K >= GEMV_TC_MIN_K and N * K >= GEMV_TC_MIN_ELEMENTS
        rows = M > 1 and GEMV_TC_ROWS_ANY_SHAPE and K is not None and K % GEMV_TC_CONFIG.block_k == 0
        if tensor_cores and (big or rows):
            return GEMV_TC_CONFIG
        if M != 1:
            return GEMV_CONFIG
        per_sm = triton.cdiv(N, GEMV_WIDE_CONFIG.block_n) / sms
        if per_sm < GEMV_WIDE_MIN_PROGRAMS_PER_SM:
            return GEMV_CONFIG
        if per_sm <= GEMV_WIDE_DEEP_PROGRAMS_PER_SM:
            return GEMV_WIDE_DEEP_CONFIG
        return GEMV_WIDE_SHORT_CONFIG if per_sm <= GEMV_WIDE_SHORT_PROGRAMS_PER_SM else GEMV_WIDE_CONFIG
    if path == "dequant_mm":
        return DEQUANT_CONFIG
    if dtype == torch.float32:
        return DOT_FP32_CONFIG
    return DOT_TINY_CONFIG if M <= 16 else DOT_SMALL_CONFIG if M <= 64 else DOT_LARGE_CONFIG


def _validate_config(cfg: W4A16Config, path: str) -> None:
    def pow2(v: int) -> bool:
        return v >= 1 and v & (v - 1) == 0

    lo = 16 if path == "dot" else 1
    ok = pow2(cfg.block_n) and pow2(cfg.block_k) and cfg.block_k >= 16 and cfg.block_n >= lo
    ok = ok and pow2(cfg.block_m) and (path != "dot" or cfg.block_m >= 16) and pow2(cfg.num_warps)
    ok = ok and (cfg.split_k is None or cfg.split_k >= 1) and cfg.num_stages >= 1 and cfg.prefetch in (1, 2)
    ok = ok and (not cfg.wide or (path == "gemv" and cfg.block_n >= 2 and cfg.block_k >= 32))
    ok = ok and (not (cfg.swap_ab or cfg.scales_ahead or cfg.scales_vec) or path == "dot")
    tc_ok = path == "gemv" and not cfg.wide and cfg.block_n >= 16 and cfg.block_k >= 64 and cfg.tc_cols in (16, 32)
    ok = ok and (not cfg.tc or tc_ok)
    if not ok:
        raise ValueError(
            f"bad {path} config {cfg}: block sizes must be powers of two, block_k >= 16, prefetch 1 or 2"
            + (", block_m and block_n >= 16" if path == "dot" else "")
            + ("; wide: the gemv path only, block_n >= 2, block_k >= 32" if cfg.wide else "")
            + (
                "; swap_ab / scales_ahead / scales_vec: the dot path only"
                if cfg.swap_ab or cfg.scales_ahead or cfg.scales_vec
                else ""
            )
            + ("; tc: the gemv path only, not wide, block_n >= 16, block_k >= 64, tc_cols 16 or 32" if cfg.tc else "")
        )


def _asm() -> bool:
    return INLINE_ASM_CVT and not interpreting()


def tensor_cores_for_gemv(device: torch.device) -> bool:
    """Whether the tensor-core M = 1 gemv can run on ``device``: a CUDA GPU of compute capability 9.0+ (its PTX
    multiplies bf16x2, an sm_90 instruction; the form was timed on Hopper), not under the interpreter."""
    return not interpreting() and capability(device) >= (9, 0)


def _fit(cfg: W4A16Config, path: str, M: int, N: int, K: int) -> W4A16Config:
    """The tile clipped to the problem (powers of two >= N, K; the interpreter also clips the dot path's rows):
    no change at real model shapes, much less wasted work at the tiny ones the CPU tests run."""
    lo = 16 if path == "dot" or cfg.tc else 2 if cfg.wide else 1
    bn = min(cfg.block_n, max(lo, triton.next_power_of_2(N)))
    bk = min(cfg.block_k, max(64 if cfg.tc else 32 if cfg.wide else 16, triton.next_power_of_2(K)))
    bm = cfg.block_m
    if path == "dot" and interpreting():
        bm = min(bm, max(16, triton.next_power_of_2(M)))
    return dataclasses.replace(cfg, block_m=bm, block_n=bn, block_k=bk)


def _split_k(cfg: W4A16Config, device: torch.device, programs: int, K: int) -> tuple[int, int]:
    """(splits, K per split): split K only while the grid has fewer than GEMV_MIN_PROGRAMS_PER_SM programs per SM."""
    steps = triton.cdiv(K, cfg.block_k)
    split = cfg.split_k
    if split is None:
        target = GEMV_MIN_PROGRAMS_PER_SM * sm_count(device)
        split = 1 if programs >= target else triton.cdiv(target, max(programs, 1))
    split = max(1, min(split, steps, MAX_SPLIT_K))
    k_per_split = triton.cdiv(steps, split) * cfg.block_k
    return triton.cdiv(K, k_per_split), k_per_split


def _check(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> tuple[int, int, int]:
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [M, K], got {tuple(x.shape)}")
    M, K = x.shape
    N = weight.shape[-2]
    if weight.dtype != torch.uint8 or tuple(weight.shape[-2:]) != (N, K // 2) or K % BLOCK_SIZE:
        raise ValueError(
            f"weight must be uint8 [..., N, K/2] with K % 16 == 0; got {weight.dtype} {tuple(weight.shape)}, K={K}"
        )
    if tuple(weight_scale.shape[-2:]) != (N, K // BLOCK_SIZE) or weight_scale.dim() != weight.dim():
        raise ValueError(
            f"weight_scale must be [..., N, K/16] = [{N}, {K // BLOCK_SIZE}], got {tuple(weight_scale.shape)}"
        )
    return M, N, K


def _words(weight: torch.Tensor) -> torch.Tensor:
    """uint8 [..., N, K/2] -> int32 [..., N, K/8], the same bytes (a view when the storage offset allows)."""
    w = weight.contiguous()
    try:
        return w.view(torch.int32)
    except RuntimeError:  # storage offset not a multiple of 4 bytes
        return w.clone().view(torch.int32)


def _int64_rows(x: torch.Tensor) -> bool:
    """bf16 x whose rows can be read as int64 words (4 elements each): 8-byte-aligned rows."""
    return x.dtype == torch.bfloat16 and x.data_ptr() % 8 == 0 and x.stride(0) % 4 == 0


def _x64(x: torch.Tensor) -> bool:
    """The gemv reads bf16 x as int64 words (``_gemv_row``, the wide kernel): ``_int64_rows``. ``GEMV_X64`` off:
    the 2-byte loads (the A/B baseline)."""
    return GEMV_X64 and _int64_rows(x)


def _unit_k(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(1) == 1 else x.contiguous()


def _finish_split(target: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """[S, M, N] fp32 partials -> ``out`` [M, N]: one kernel, fixed summation order."""
    split, MN = target.shape[0], out.numel()
    block = 1024
    _w4a16_splitk_reduce_kernel[(triton.cdiv(MN, block),)](target, out, MN, SPLIT=split, BLOCK=block, num_warps=4)
    return out


def _launch_gemv(
    x: torch.Tensor,
    words: torch.Tensor,
    scales: torch.Tensor,
    gs: torch.Tensor,
    gs_stride: int,
    expert_ids: torch.Tensor | None,
    out_dtype: torch.dtype,
    cfg: W4A16Config,
    split_counter: torch.Tensor | None = None,
    pdl: bool = False,
    repacked: bool = False,
) -> torch.Tensor:
    M, K = x.shape
    N = words.shape[-2]
    cfg = _fit(cfg, "gemv", M, N, K)
    per_row = expert_ids is not None
    if cfg.tc and not per_row and tc_rows_fit(M, x.dtype):
        return _launch_gemv_tc(x, words, scales, gs, gs_stride, out_dtype, cfg, split_counter, pdl, repacked)
    if cfg.wide and M == 1 and not per_row and _x64(x) and K % 32 == 0:
        return _launch_gemv_wide(x, words, scales, gs, gs_stride, out_dtype, cfg, pdl, repacked)
    bm = 1 if per_row else min(cfg.block_m, GEMV_MAX_ROWS, triton.next_power_of_2(M))
    grid_m = M if per_row else triton.cdiv(M, bm)
    grid_n = triton.cdiv(N, cfg.block_n)
    split, k_per_split = _split_k(cfg, x.device, grid_m * grid_n, K)
    out = torch.empty((M, N), dtype=out_dtype, device=x.device)
    target = out if split == 1 else torch.empty((split, M, N), dtype=torch.float32, device=x.device)
    stride_os = 0 if split == 1 else target.stride(0)
    stride_we, stride_se, stride_ge = (words.stride(0), scales.stride(0), gs.stride(0)) if per_row else (0, 0, 0)
    _w4a16_gemv_kernel[(grid_m, grid_n, split)](
        x, words, scales, gs, target, expert_ids if per_row else gs,
        M, N, K,
        x.stride(0), words.stride(-2), scales.stride(-2), stride_os, N, 1,
        gs_stride, stride_we, stride_se, stride_ge, k_per_split,
        BLOCK_M=bm, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_K=K % cfg.block_k == 0,
        PER_ROW_EXPERT=per_row, ASM=_asm(), PREFETCH=cfg.prefetch, X64=_x64(x), RP=int(repacked),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out if split == 1 else _finish_split(target, out)


def _launch_gemv_wide(
    x: torch.Tensor,
    words: torch.Tensor,
    scales: torch.Tensor,
    gs: torch.Tensor,
    gs_stride: int,
    out_dtype: torch.dtype,
    cfg: W4A16Config,
    pdl: bool = False,
    repacked: bool = False,
) -> torch.Tensor:
    K = x.shape[1]
    N = words.shape[0]
    out = torch.empty((1, N), dtype=out_dtype, device=x.device)
    _w4a16_gemv_wide_kernel[(triton.cdiv(N, cfg.block_n),)](
        x, words, scales, gs, out, N, K, words.stride(0), scales.stride(0), gs_stride,
        H=cfg.block_n // 2, BLOCK_K=cfg.block_k, EVEN_K=K % cfg.block_k == 0, ASM=_asm(), RP=int(repacked),
        num_warps=cfg.num_warps, **pdl_launch(pdl),
    )  # fmt: skip
    return out


def tc_rows_fit(M: int, dtype: torch.dtype) -> bool:
    """Whether the tensor-core gemv's kernel takes M rows of x of ``dtype``: bf16 (the MMA's B operand), at most
    GEMV_TC_MAX_ROW_GROUPS groups of 16 rows (where it is the default: ``pick_config``)."""
    return dtype == torch.bfloat16 and M <= 16 * GEMV_TC_MAX_ROW_GROUPS


def tc_groups_pay(M: int, N: int, K: int) -> bool:
    """Whether M rows of x against an N x K weight may take the tensor-core gemv by default as far as its rows above
    16 go: up to 16 rows always, above only for products of GEMV_TC_GROUPS_MIN_ELEMENTS (the 31B's, where it was
    timed; the 26B-A4B's smaller dense products lost to the dot path at 16 rows already). The W4A16 and the FP8 rule
    (``pick_config`` in both modules)."""
    return M <= 16 or N * K >= GEMV_TC_GROUPS_MIN_ELEMENTS


def tc_grid(M: int, N: int, K: int, cfg: W4A16Config, sms: int) -> tuple[int, int, int]:
    """(rows of x per program, programs per row block, K splits) of a tensor-core gemv launch: above 16 rows
    ``cfg.tc_cols`` rows per program (the MMA's N), one program per group of them."""
    cols = cfg.tc_cols if M > 16 else 16
    groups = triton.cdiv(M, cols)
    return cols, groups, tc_split(N, K, cfg, sms, groups)


def tc_split(N: int, K: int, cfg: W4A16Config, sms: int, groups: int = 1) -> int:
    """The number of K splits of the tensor-core gemv (at most one per step): ``cfg.split_k``, or the fewest splits
    (each at least GEMV_TC_MIN_STEPS_PER_SPLIT steps) whose grid fills its waves of GEMV_TC_PROGRAMS_PER_SM programs per
    SM within GEMV_TC_FILL_SLACK of the best fill. Why waves: the programs are short and alike, so a partial last wave
    is time lost (12-14 ``6-split.jsonl``: 5376 x 21504 at 6 splits, one wave of 504 programs, 28.72 us; at 7, 588
    programs, 34.51); why the fewest: every split adds partials to sum and shortens the programs (18432 x 5376 at 3
    splits, 82 % fill, 26.33 us; at 5, 91 %, 27.70 in call 7; 43008 x 5376 at 2 splits 53.36, at 3 53.93). ``groups``:
    programs per row block (groups of x's rows: ``tc_grid``)."""
    steps = triton.cdiv(K, cfg.block_k)
    split = cfg.split_k
    if split is None:
        blocks, slots = triton.cdiv(N, cfg.block_n) * groups, GEMV_TC_PROGRAMS_PER_SM * sms

        def fill(s: int) -> float:
            return blocks * s / (triton.cdiv(blocks * s, slots) * slots)

        cands = range(1, max(1, steps // GEMV_TC_MIN_STEPS_PER_SPLIT) + 1)
        best = max(fill(s) for s in cands)
        split = min(s for s in cands if fill(s) >= best - GEMV_TC_FILL_SLACK)
    return max(1, min(split, steps))


def new_split_counter(N: int, device: torch.device | str) -> torch.Tensor:
    """A ``split_counter`` for a weight of N rows: int32 zeros, one per program of the smallest tc tile (16 rows) at
    the most rows of x (GEMV_TC_MAX_ROW_GROUPS groups of 16)."""
    return torch.zeros(triton.cdiv(N, 16) * GEMV_TC_MAX_ROW_GROUPS, dtype=torch.int32, device=device)


def _launch_gemv_tc(
    x: torch.Tensor,
    words: torch.Tensor,
    scales: torch.Tensor,
    gs: torch.Tensor,
    gs_stride: int,
    out_dtype: torch.dtype,
    cfg: W4A16Config,
    counter: torch.Tensor | None,
    pdl: bool = False,
    repacked: bool = False,
    fp8: bool = False,
) -> torch.Tensor:
    """The tensor-core gemv; with ``counter`` (int32, zeros, one per row block) the splits are summed in the same
    launch, else by ``_finish_split`` after it (a plain launch). pdl: launched with PDL. fp8: ``words`` are e4m3
    weights as int32 [N, K/4], ``gs`` their per-row scales (gs_stride 1), ``scales`` unused."""
    M, K = x.shape
    N = words.shape[0]
    if M > 16 * GEMV_TC_MAX_ROW_GROUPS:
        raise ValueError(f"the tensor-core gemv takes at most {16 * GEMV_TC_MAX_ROW_GROUPS} rows of x, got {M}")
    cols, groups, split = tc_grid(M, N, K, cfg, sm_count(x.device))  # cols rows of x per program, the MMA's N
    blocks = triton.cdiv(N, cfg.block_n) * groups
    fused = split > 1 and counter is not None
    if fused and (counter.dtype != torch.int32 or counter.numel() < blocks or counter.device != x.device):
        raise ValueError(f"split_counter must be int32 on {x.device} with >= {blocks} elements (zeros)")
    out = torch.empty((M, N), dtype=out_dtype, device=x.device)
    part = torch.empty((split, M, N), dtype=torch.float32, device=x.device) if split > 1 else out
    _w4a16_gemv_tc_kernel[(blocks, split)](
        x, words, scales, gs, out, part, counter if fused else words, M, x.stride(0), N, K,
        triton.cdiv(K, cfg.block_k), words.stride(0), scales.stride(0), gs_stride, BN=cfg.block_n, BK=cfg.block_k,
        SPLIT=split, EVEN_K=K % cfg.block_k == 0, FUSED=fused, INTERP=interpreting(), RP=int(repacked),
        ROWS=triton.next_power_of_2(min(M, cols)), FP8=int(fp8), MG=groups, NC=cols, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **pdl_launch(pdl),
        **({"maxnreg": GEMV_TC_ROWS_MAX_REGISTERS} if M > 1 and not interpreting() else {}),
    )  # fmt: skip
    return out if split == 1 or fused else _finish_split(part, out)


def vec_scales_fit(k: int, block_k: int, scales: torch.Tensor | None = None) -> bool:
    """Whether ``_vec_scales`` can load each K step's block scales as 4-byte vectors: the step a multiple of 64 and
    K of the step (every step whole), and, given the raw scales [..., rows, K / 16], every row starting on 4 bytes
    (a view may start anywhere). The dot path's ``scales_vec`` and the quantised MoE GEMMs' SCALES_VEC."""
    whole = block_k % 64 == 0 and k % block_k == 0
    return whole and (scales is None or (scales.stride(-2) % 4 == 0 and scales.data_ptr() % 4 == 0))


def _launch_dot(
    x: torch.Tensor,
    words: torch.Tensor,
    scales: torch.Tensor,
    gs: torch.Tensor,
    gs_stride: int,
    out_dtype: torch.dtype,
    cfg: W4A16Config,
    gather_scales: bool,
    repacked: bool = False,
) -> torch.Tensor:
    M, K = x.shape
    N = words.shape[-2]
    cfg = _fit(cfg, "dot", M, N, K)
    vec = cfg.scales_vec and not gather_scales and vec_scales_fit(K, cfg.block_k, scales)
    tiles = triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n)
    split, k_per_split = _split_k(cfg, x.device, tiles, K)
    out = torch.empty((M, N), dtype=out_dtype, device=x.device)
    target = out if split == 1 else torch.empty((split, M, N), dtype=torch.float32, device=x.device)
    stride_os = 0 if split == 1 else target.stride(0)
    _w4a16_dot_kernel[(tiles, split)](
        x, words, scales, gs, target,
        M, N, K,
        x.stride(0), words.stride(0), scales.stride(0), stride_os, N, 1, gs_stride, k_per_split,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=DOT_GROUP_M,
        EVEN_K=K % cfg.block_k == 0, GATHER_SCALES=gather_scales,
        IEEE=x.dtype == torch.float32 or interpreting(), ASM=_asm(), SWAP_AB=cfg.swap_ab,
        SCALES_AHEAD=cfg.scales_ahead, SCALES_VEC=vec, ROW_MASK=DOT_ROW_MASK and M % cfg.block_m != 0,
        RP=int(repacked), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out if split == 1 else _finish_split(target, out)


def _dequant_into(
    words: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, cfg: W4A16Config, repacked: bool = False
) -> torch.Tensor:
    N, K = out.shape
    cfg = _fit(cfg, "dequant_mm", 1, N, K)
    grid = (triton.cdiv(K, cfg.block_k), triton.cdiv(N, cfg.block_n))
    _w4a16_dequant_kernel[grid](
        words, scales, out, N, K, words.stride(0), scales.stride(0), out.stride(0),
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_K=K % cfg.block_k == 0, ASM=_asm(), RP=int(repacked),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out


def dequantize_nvfp4_triton(
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
    config: W4A16Config | None = None,
) -> torch.Tensor:
    """uint8 [N, K/2] + e4m3 [N, K/16] -> [N, K] ``e2m1 * e4m3`` in ``dtype`` (bf16 / fp16 / fp32, exact in each),
    without the global scale: the Triton kernel of the dequant_mm path."""
    N, half = weight.shape
    K = 2 * half
    if weight.dtype != torch.uint8 or K % BLOCK_SIZE or tuple(weight_scale.shape) != (N, K // BLOCK_SIZE):
        raise ValueError(
            f"want uint8 [N, K/2] and [N, K/16] with K % 16 == 0, got {weight.shape}, {weight_scale.shape}"
        )
    cfg = config or pick_config(1, "dequant_mm")
    _validate_config(cfg, "dequant_mm")
    out = torch.empty((N, K), dtype=dtype, device=weight.device)
    if N == 0 or K == 0:
        return out
    return _dequant_into(_words(weight), weight_scale.contiguous().view(torch.uint8), out, cfg)


_MM_FP32_OUT = {"ok": True}  # torch.mm(..., out_dtype=torch.float32) on CUDA (torch >= 2.8); cleared if it fails


def _mm_f32(x: torch.Tensor, wd: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ wd [N, K]^T -> fp32 [M, N], fp32 accumulation (cuBLAS on CUDA)."""
    if x.dtype == torch.float32:
        return torch.mm(x, wd.t())
    if x.is_cuda:
        if _MM_FP32_OUT["ok"]:
            try:
                return torch.mm(x, wd.t(), out_dtype=torch.float32)
            except (RuntimeError, TypeError):
                _MM_FP32_OUT["ok"] = False
        return torch.mm(x, wd.t()).float()  # older torch: the product is rounded to x's dtype once more
    return torch.mm(x.float(), wd.t().float())  # CPU


def _launch_dequant_mm(
    x: torch.Tensor,
    words: torch.Tensor,
    scales: torch.Tensor,
    gs: torch.Tensor,
    out_dtype: torch.dtype,
    cfg: W4A16Config,
    gs_runs: Sequence[tuple[int, int, float]] | None = None,
    repacked: bool = False,
) -> torch.Tensor:
    N, K = words.shape[0], x.shape[1]
    wd = _dequant_into(words, scales, torch.empty((N, K), dtype=x.dtype, device=x.device), cfg, repacked)
    if gs_runs is not None and x.is_cuda and x.dtype != torch.float32 and out_dtype == x.dtype:
        return _mm_alpha_runs(x, wd, gs_runs)
    y = _mm_f32(x, wd)  # [M, N] fp32
    del wd
    if out_dtype == torch.float32:
        return y.mul_(gs)
    return torch.mul(y, gs, out=torch.empty(y.shape, dtype=out_dtype, device=x.device))  # one rounding


def _mm_alpha_runs(x: torch.Tensor, wd: torch.Tensor, gs_runs: Sequence[tuple[int, int, float]]) -> torch.Tensor:
    """x [M, K] @ wd [N, K]^T with each run's global scale as cuBLAS's alpha, written in x's dtype: cuBLAS scales
    the fp32 accumulator and rounds once, as the fp32 path's epilogue does, without writing and reading back an
    fp32 [M, N] (10 bytes per output instead of 2: ~4.6 GB per 31B layer at 8K tokens). A run writes its columns
    of the output in place (a view with the output's row stride, which cuBLAS takes as its leading dimension)."""
    out = torch.empty((x.shape[0], wd.shape[0]), dtype=x.dtype, device=x.device)
    for lo, hi, alpha in gs_runs:
        view = out[:, lo:hi]
        torch.addmm(view, x, wd[lo:hi].t(), beta=0, alpha=alpha, out=view)
    return out


def global_scale_runs(gs: torch.Tensor, n: int) -> tuple[tuple[int, int, float], ...]:
    """A global scale of ``n`` rows, scalar or [n], as host runs (row start, row stop, value) of equal values: one
    run for a plain NVFP4 linear, one per merged module for q|k|v or gate|up. Reads the device once (a sync):
    callers cache it (``Nvfp4Linear``)."""
    vals = gs.detach().float().reshape(-1).tolist()
    if len(vals) == 1:
        return ((0, n, vals[0]),)
    if len(vals) != n:
        raise ValueError(f"global scale must have 1 or n={n} elements, got {len(vals)}")
    runs, lo = [], 0
    for i in range(1, len(vals) + 1):
        if i == len(vals) or vals[i] != vals[lo]:
            runs.append((lo, i, vals[lo]))
            lo = i
    return tuple(runs)


def w4a16_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    global_scale: torch.Tensor | float,
    out_dtype: torch.dtype | None = None,
    config: W4A16Config | None = None,
    scale_mode: str = "broadcast",
    path: str = "auto",
    gs_runs: Sequence[tuple[int, int, float]] | None = None,
    split_counter: torch.Tensor | None = None,
    pdl: bool = False,
    repacked: bool = False,
) -> torch.Tensor:
    """``x [M, K] @ dequant(weight [N, K/2])^T -> [M, N]`` (format and paths: module docstring). ``global_scale``:
    scalar or per output row [N]. No host sync (the global scale is read on the device): CUDA-graph safe.
    ``path``: auto | gemv | dot | dequant_mm; ``config``: a tile of that path (default: ``pick_config``).
    ``scale_mode`` (dot path): broadcast | gather (how block scales reach the tile; same result). ``gs_runs``:
    the same global scale as host runs (``global_scale_runs``, cached by the caller); dequant_mm with a CUDA bf16 /
    fp16 x in and out then applies each run as cuBLAS's alpha instead of an fp32 epilogue pass. ``split_counter``
    (the tensor-core gemv's split-K sum in its own launch): ``new_split_counter(N, device)``, owned by the
    caller, never used by two launches at once; the kernel leaves it at zero. Without it a second launch sums.
    ``pdl``: the decode-sized gemv kernels (tensor-core up to GEMV_TC_MAX_M rows, wide at M = 1) launch with PDL
    (perfkit/kernels/pdl.py; sm_90+ only, the caller checks); the other paths launch plainly. ``repacked``: the
    weight's words are in ``repack_words``' bit order (every path reads it; the same result bit for bit)."""
    M, N, K = _check(x, weight, weight_scale)
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [N, K/2], got {tuple(weight.shape)}")
    chosen = pick_path(M, path)
    if scale_mode not in SCALE_MODES:
        raise ValueError(f"scale_mode {scale_mode!r}: allowed values are {', '.join(SCALE_MODES)}")
    cfg = config
    if cfg is None:
        sms, tc = sm_count(x.device), tensor_cores_for_gemv(x.device)
        if path == "auto" and chosen == "dot" and M <= GEMV_TC_MAX_M:  # the tensor-core gemv's rows, where it runs
            rows = pick_config(M, "gemv", x.dtype, N, sms, K, tc)
            if rows.tc:
                chosen, cfg = "gemv", rows
        cfg = cfg or pick_config(M, chosen, x.dtype, N, sms, K, tc)
    _validate_config(cfg, chosen)
    gs = torch.as_tensor(global_scale, dtype=torch.float32, device=x.device).reshape(-1)
    if gs.numel() not in (1, N):
        raise ValueError(f"global scale must have 1 or N={N} elements, got {gs.numel()}")
    out_dtype = out_dtype or x.dtype
    if M == 0 or N == 0:
        return torch.empty((M, N), dtype=out_dtype, device=x.device)
    x, words, scales, gs = _unit_k(x), _words(weight), weight_scale.contiguous().view(torch.uint8), gs.contiguous()
    if chosen == "gemv":
        gs_stride = 0 if gs.numel() == 1 else 1
        return _launch_gemv(x, words, scales, gs, gs_stride, None, out_dtype, cfg, split_counter, pdl, repacked)
    if chosen == "dot":
        gs_stride = 0 if gs.numel() == 1 else 1
        return _launch_dot(x, words, scales, gs, gs_stride, out_dtype, cfg, scale_mode == "gather", repacked)
    if gs_runs is not None and (gs_runs[0][0] != 0 or gs_runs[-1][1] != N):
        raise ValueError(f"gs_runs must cover rows 0..{N}, got {gs_runs[0][0]}..{gs_runs[-1][1]}")
    return _launch_dequant_mm(x, words, scales, gs, out_dtype, cfg, gs_runs, repacked)


def w4a16_gemm_gathered(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    global_scale: torch.Tensor,
    expert_ids: torch.Tensor,
    out_dtype: torch.dtype | None = None,
    config: W4A16Config | None = None,
) -> torch.Tensor:
    """Row r of ``x [R, K]`` times expert ``expert_ids[r]``'s weight: stacked ``weight [E, N, K/2]``,
    ``weight_scale [E, N, K/16]``, ``global_scale [E]`` or ``[E, N]`` -> ``[R, N]``. The gemv path, one row per
    program (``config.block_m`` unused): each row streams its expert's weight (MoE decode: few rows, no host
    sync); all rows of an N tile are launched together, so rows that share an expert re-read its tile from L2."""
    M, N, K = _check(x, weight, weight_scale)
    E = weight.shape[0]
    if weight.dim() != 3 or expert_ids.shape != (M,):
        raise ValueError(
            f"weight must be [E, N, K/2] and expert_ids [R]; got {tuple(weight.shape)}, {tuple(expert_ids.shape)}"
        )
    gs = global_scale.to(device=x.device, dtype=torch.float32)
    if gs.shape == (E,):
        gs_stride = 0
    elif gs.shape == (E, N):
        gs_stride = 1
    else:
        raise ValueError(f"global_scale must be [E] or [E, N] = [{E}, {N}], got {tuple(gs.shape)}")
    cfg = config or pick_config(1, "gemv")
    _validate_config(cfg, "gemv")
    out_dtype = out_dtype or x.dtype
    if M == 0 or N == 0:
        return torch.empty((M, N), dtype=out_dtype, device=x.device)
    return _launch_gemv(
        _unit_k(x), _words(weight), weight_scale.contiguous().view(torch.uint8), gs.contiguous(), gs_stride,
        expert_ids.contiguous(), out_dtype, cfg,
    )  # fmt: skip


# --------------------------------------------------------------------------------------------------------------
# Reference, dequantisation, quantisation (torch)
# --------------------------------------------------------------------------------------------------------------


def _e2m1_table(device: torch.device) -> torch.Tensor:
    mags = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
    return torch.cat([mags, -mags])  # index = 4-bit code


# repack_words: the new bit of each field (m, e0, e1, s) of code i of a word (pair j = i % 4; + 16 for i >= 4). Pairs
# 0-2: magnitudes at 3 j .. 3 j + 2 and the sign 9 bits above (mod 16), so one rotation by 6 - 3 j puts the pair
# where a bf16x2 of ``e2m1 * 2^-126`` has it; pair 3 takes the four bits left (``_rp_pair``).
_RP_FIELDS = ((0, 1, 2, 9), (3, 4, 5, 12), (6, 7, 8, 15), (13, 14, 10, 11))


def _rp_bit_map() -> list[tuple[int, int]]:
    """(standard bit, repacked bit) for the 32 bits of a word."""
    return [(4 * i + f, _RP_FIELDS[i % 4][f] + 16 * (i // 4)) for i in range(8) for f in range(4)]


def _permute_bits(words: torch.Tensor, pairs: list[tuple[int, int]]) -> torch.Tensor:
    u = words.to(torch.int64) & 0xFFFFFFFF
    out = torch.zeros_like(u)
    for src, dst in pairs:
        out |= ((u >> src) & 1) << dst
    return (out - ((out >> 31) << 32)).to(torch.int32)  # back to signed int32, same bits


def repack_words(weight: torch.Tensor) -> torch.Tensor:
    """uint8 [..., N, K/2] packed NVFP4 (two codes per byte, low nibble first) -> the same codes with each int32
    word's bits permuted (``_RP_FIELDS``), as uint8 of the same shape: the tensor-core gemv decodes a pair of this
    word with one rotation and one mask instead of two shifts and two masks (9 instead of 15 instructions per word;
    H200 12-16 / 12-17: 5-7 % faster chained where the grid is one wave of programs, 1.5-4 % slower where it is
    more: ``repack_pays``). Every path reads it with ``repacked=True``, the dot path 1-5 % slower at the same
    SASS length (12-17 call 3, M 2-16, which now take the tensor-core gemv, as M 17-32 do since 12-18; in the
    engine c32 / c64 showed no loss); ``unrepack_words`` undoes it."""
    return _permute_bits(_words(weight), _rp_bit_map()).view(torch.uint8).view(weight.shape)


def repack_pays(N: int, K: int, device: torch.device | str) -> bool:
    """Whether an N x K weight's batch-1 product is faster on repacked words on ``device``: where it runs the
    tensor-core gemv in one wave of programs (at most GEMV_TC_PROGRAMS_PER_SM per SM). H200 12-17 ``rp_probe.py``,
    chained with PDL: the four 31B shapes of one wave 4.8-7.2 % faster (5376 x 8192 14.24 -> 13.56 us), the two of
    more waves 1.6-3.7 % slower (18432 x 5376, 1.6 waves: 25.51 -> 26.41 us). ncu, one launch: 19 % fewer
    instructions on both kinds; at one wave (16384 x 5376) the SMs' active cycles fall 6.7 % and the launch 6 %; at
    1.6 waves (18432 x 5376) the active cycles stay about the same and the launch grows 5 %: more of it with SMs
    idle (the later waves' programs start as slots free, and their ends spread). The other paths decode a word with
    shifts either way."""
    device = torch.device(device)
    if device.type != "cuda" or interpreting() or not tensor_cores_for_gemv(device):
        return False
    sms = sm_count(device)
    cfg = pick_config(1, "gemv", torch.bfloat16, N, sms, K, tensor_cores=True)
    if not cfg.tc:
        return False
    return triton.cdiv(N, cfg.block_n) * tc_split(N, K, cfg, sms) <= GEMV_TC_PROGRAMS_PER_SM * sms


def unrepack_words(weight: torch.Tensor) -> torch.Tensor:
    """``repack_words``' inverse: uint8 [..., N, K/2] in the standard packing."""
    inverse = [(dst, src) for src, dst in _rp_bit_map()]
    return _permute_bits(_words(weight), inverse).view(torch.uint8).view(weight.shape)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> fp32 [..., K] e2m1 values (low nibble first)."""
    table = _e2m1_table(packed.device)
    lo = table[(packed & 0xF).long()]
    hi = table[(packed >> 4).long()]
    return torch.stack([lo, hi], dim=-1).flatten(-2)


def dequantize_nvfp4(
    weight: torch.Tensor, weight_scale: torch.Tensor, global_scale: torch.Tensor | float
) -> torch.Tensor:
    """[..., N, K/2] packed + [..., N, K/16] e4m3 + global (scalar, [...], or [..., N]) -> fp32 [..., N, K]."""
    vals = unpack_e2m1(weight)
    s = weight_scale.float().repeat_interleave(BLOCK_SIZE, dim=-1)
    gs = torch.as_tensor(global_scale, dtype=torch.float32, device=weight.device)
    if gs.dim() == weight.dim() - 1 and gs.shape[-1] == weight.shape[-2]:  # per row
        gs = gs[..., None]
    elif gs.dim() > 0:  # one per matrix of a stack
        gs = gs.reshape(*gs.shape, *([1] * (weight.dim() - gs.dim())))
    return vals * s * gs


def w4a16_gemm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    global_scale: torch.Tensor | float,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Dequantise in torch (fp32), multiply in fp32, cast to ``out_dtype`` (default x's dtype)."""
    w = dequantize_nvfp4(weight, weight_scale, global_scale)
    return (x.float() @ w.T).to(out_dtype or x.dtype)


def round_to_e2m1(v: torch.Tensor) -> torch.Tensor:
    """fp32 values (already clamped to [-6, 6]) -> 4-bit codes (uint8), round to nearest, ties to even code."""
    mags = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=v.device)
    mid = (mags[1:] + mags[:-1]) / 2  # 7 decision points
    a = v.abs()
    idx = torch.bucketize(a, mid, right=False)  # a == mid -> lower index
    # ties: bucketize(right=False) sends a tie to the lower code; move it up when the lower code is odd (odd
    # codes have mantissa 1), so ties go to the even mantissa as in IEEE round-half-even
    tie = (idx < 7) & (a == mid[idx.clamp(max=6)]) & (idx % 2 == 1)
    idx = idx + tie.long()
    sign = ((v < 0) & (idx > 0)).to(torch.uint8) << 3
    return idx.to(torch.uint8) | sign


def w4a16_gemm_gathered_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    global_scale: torch.Tensor,
    expert_ids: torch.Tensor,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Gather the rows' experts, dequantise them in torch (fp32) and multiply row by row."""
    w = dequantize_nvfp4(weight[expert_ids], weight_scale[expert_ids], global_scale[expert_ids])  # [R, N, K]
    return (w @ x.float()[:, :, None])[:, :, 0].to(out_dtype or x.dtype)


def quantize_nvfp4(
    w: torch.Tensor, global_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[..., N, K] float -> (uint8 [..., N, K/2], float8_e4m3fn [..., N, K/16], fp32 global scale [...]).

    ModelOpt recipe, one global scale per [N, K] matrix: ``global = amax(|W|) / (6 * 448)``, block scale
    ``= e4m3(amax_block / 6 / global)``, codes ``= round_e2m1(w / (block_scale * global))`` (clamped to +-6).
    """
    *lead, N, K = w.shape
    if K % BLOCK_SIZE:
        raise ValueError(f"NVFP4 needs K % 16 == 0, got K={K}")
    wf = w.float()
    if global_scale is None:
        global_scale = (wf.abs().amax(dim=(-2, -1)) / (FP4_MAX * FP8_E4M3_MAX)).clamp(min=1e-12)
    gs = torch.as_tensor(global_scale, dtype=torch.float32, device=w.device).expand(lead).contiguous()
    blocks = wf.view(*lead, N, K // BLOCK_SIZE, BLOCK_SIZE)
    block_amax = blocks.abs().amax(dim=-1)
    g = gs[..., None, None]
    scale = (block_amax / FP4_MAX / g).clamp(max=FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    denom = (scale.float() * g)[..., None]
    q = torch.where(denom > 0, blocks / denom, torch.zeros_like(blocks))
    codes = round_to_e2m1(q.clamp(-FP4_MAX, FP4_MAX)).view(*lead, N, K)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.contiguous(), scale, gs


# --------------------------------------------------------------------------------------------------------------
# Traffic and timing
# --------------------------------------------------------------------------------------------------------------


def w4a16_gemm_traffic(M: int, N: int, K: int, act_bytes: int = 2, out_bytes: int = 2) -> dict[str, float]:
    """Minimum DRAM bytes (weight N*K/2 + scales N*K/16 + global 4 + x M*K + out M*N) and FLOPs (2MNK).
    ``bound_ms`` = bytes / 4.3 TB/s (H200 achievable): the decode target."""
    weight = N * K // 2 + N * K // BLOCK_SIZE + 4
    total = weight + M * K * act_bytes + M * N * out_bytes
    return {
        "weight_bytes": weight,
        "bytes_read": weight + M * K * act_bytes,
        "bytes_written": M * N * out_bytes,
        "total_bytes": total,
        "flops": 2 * M * N * K,
        "bound_ms": total / HBM_BYTES_PER_S * 1e3,
    }


def _bench_weights(N: int, K: int, dtype: torch.dtype, seed: int, device: str):
    gen = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(N, K, device=device, generator=gen) * 0.02
    packed, scale, gs = quantize_nvfp4(w)
    w_dense = w.to(dtype)
    del w
    return packed, scale, gs, w_dense, gen


def _bench_case(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    gs: torch.Tensor,
    ref: torch.Tensor,
    path: str,
    config: W4A16Config | None,
    scale_mode: str,
    dense_ms: float,
    stream_ms: float,
    warmup: int,
    rep: int,
    chain: tuple[Sequence[tuple[torch.Tensor, ...]], float] | None = None,
    pdl: bool = False,
) -> dict:
    """One (path, tile) timed three ways: eager (do_bench), one launch per CUDA-graph replay (``graph_ms``), and,
    with ``chain = (weights, stream_chain_us)`` (CUDA), CHAIN_CALLS launches back to back over those distinct
    (packed, scale, global scale) weights, against the load-only chain of the same bytes: the decode step's
    condition, without the fixed cost of a lone launch that flatters ``graph_pct_of_stream``
    (``perfkit.kernels.stream.stream_chain_us``). pdl: every launch with PDL (``w4a16_gemm(pdl=)``), the chain's
    load-only ceiling too."""
    M, K = x.shape
    N = packed.shape[0]
    chosen = pick_path(M, path)
    cfg = config or pick_config(M, chosen, x.dtype, N, sm_count(x.device), K, tensor_cores_for_gemv(x.device))
    counters: dict[int, torch.Tensor] = {}  # per weight, as Nvfp4Linear keeps one (made before any capture)

    def call(w: tuple[torch.Tensor, ...]) -> torch.Tensor:
        counter = None
        if chosen == "gemv" and M == 1 and x.is_cuda:
            counter = counters.get(w[0].data_ptr())
            if counter is None:
                counter = counters[w[0].data_ptr()] = new_split_counter(N, x.device)
        return w4a16_gemm(x, *w, config=cfg, scale_mode=scale_mode, path=chosen, split_counter=counter, pdl=pdl)

    def fn():
        return call((packed, scale, gs))

    out = fn()
    rel = ((out.float() - ref).norm() / ref.norm()).item()
    ms = triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")
    g_ms = graph_ms(fn, warmup, rep)
    t = w4a16_gemm_traffic(M, N, K, x.element_size(), x.element_size())
    return {
        "M": M,
        "N": N,
        "K": K,
        "path": chosen,
        "config": asdict(cfg),
        "pdl": pdl,
        "median_ms": ms,
        "graph_ms": g_ms,
        "bound_ms": t["bound_ms"],
        "pct_of_bound": 100.0 * t["bound_ms"] / ms,
        "graph_pct_of_bound": 100.0 * t["bound_ms"] / g_ms,
        "stream_ms": stream_ms,
        "graph_pct_of_stream": 100.0 * stream_ms / g_ms,
        "achieved_tb_s": t["total_bytes"] / ms / 1e9,
        "bf16_cublas_ms": dense_ms,
        "speedup_vs_bf16": dense_ms / ms,
        "rel_err_vs_ref": rel,
        **({} if chain is None else chain_columns(call, *chain)),
    }


def _chain_weights(
    N: int, K: int, first: tuple[torch.Tensor, ...], dtype: torch.dtype, device: str
) -> list[tuple[torch.Tensor, ...]] | None:
    """Distinct weights of one shape for the chained timing (built once per shape) on CUDA; None elsewhere (the CPU
    smoke runs). ``first`` is the bench's own weight; the others are fresh random ones of its shape."""
    if not str(device).startswith("cuda"):
        return None
    nbytes = w4a16_gemm_traffic(1, N, K)["weight_bytes"]
    return chain_args(first, lambda i: _bench_weights(N, K, dtype, 1000 + i, device)[:3], nbytes)


def _chain_setup(
    M: int, N: int, K: int, weights: list[tuple[torch.Tensor, ...]] | None, dtype: torch.dtype, device: str,
    pdl: bool = False,
) -> tuple[list[tuple[torch.Tensor, ...]], float] | None:
    """``_bench_case``'s ``chain`` for M rows: the shape's weights and the load-only chain of the GEMM's bytes at
    this M (launched with PDL when ``pdl``); None without weights."""
    if weights is None:
        return None
    nbytes = int(w4a16_gemm_traffic(M, N, K, torch.empty((), dtype=dtype).element_size())["total_bytes"])
    return weights, stream_chain_us(nbytes, device, pdl=pdl)["stream_chain_us"]


def bench_w4a16(
    M: int,
    N: int,
    K: int,
    config: W4A16Config | None = None,
    scale_mode: str = "broadcast",
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    path: str = "auto",
    device: str = "cuda",
    pdl: bool = False,
) -> dict:
    """GPU timing of one W4A16 GEMM (random weights, NVFP4-quantised): median ms of eager calls
    (triton.testing.do_bench, L2 flushed between reps) and of CUDA-graph replays (``graph_ms``), us per launch in a
    back-to-back chain (``chain_us``), the bandwidth bound and the % of it reached, the load-only ceilings of the
    same bytes (one launch, chained), the dense cuBLAS GEMM of the same shape, the error against the reference,
    the path taken and its tile. pdl: every launch with PDL, the load-only chain too (``_bench_case``)."""
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("bench_w4a16 needs CUDA")
    packed, scale, gs, w_dense, gen = _bench_weights(N, K, dtype, seed, device)
    x = torch.randn(M, K, device=device, dtype=dtype, generator=gen)
    ref = w4a16_gemm_ref(x, packed, scale, gs, out_dtype=torch.float32)
    dense_ms = triton.testing.do_bench(lambda: x @ w_dense.T, return_mode="median")
    stream_ms = _stream_ms(M, N, K, x.element_size(), device, 25, 100)
    chain = _chain_setup(M, N, K, _chain_weights(N, K, (packed, scale, gs), dtype, device), dtype, device, pdl)
    return _bench_case(x, packed, scale, gs, ref, path, config, scale_mode, dense_ms, stream_ms, 25, 100, chain, pdl)


def _stream_ms(M: int, N: int, K: int, act_bytes: int, device: str, warmup: int, rep: int) -> float:
    """The measured read ceiling (``perfkit.kernels.stream``) for the bytes the GEMM must move: at decode sizes
    well below the spec rate the bound assumes, so the benches report the distance to both."""
    t = w4a16_gemm_traffic(M, N, K, act_bytes, act_bytes)
    return stream_read_ms(int(t["total_bytes"]), device=device, warmup=warmup, rep=rep)["stream_ms"]


# The 31B decode shapes (q/kv/o, gate/up, down projections at M = 1, 4, 16), then M = 64 .. 2048 rows of the
# 21504 x 5376 projection: a small batch and prefill chunks around the dot / dequant_mm crossover.
SWEEP_SHAPES: tuple[tuple[int, int, int], ...] = tuple(
    (m, n, k) for m in (1, 4, 16) for n, k in ((5376, 21504), (43008, 5376), (16384, 5376), (5376, 16384), (5376, 8192))
) + tuple((m, 21504, 5376) for m in (64, 256, 512, 2048))
SWEEP_PATHS = ("gemv", "dot", "dequant_mm")
# Tiles timed per path (None = the default tile). gemv: 8-32 weight rows per program, 2-16 KB of weight per
# program and step (the next step in flight meanwhile), split-K forced on one; the wide kernel's 16-row tiles
# (at M = 1 with bf16 x; the narrow kernel elsewhere). dot: mma.sync 16-row tiles, and wgmma 64- and 128-row
# ones. All compile for sm_90 without spills.
SWEEP_CONFIGS: dict[str, tuple[W4A16Config | None, ...]] = {
    "gemv": (
        None,  # pick_config: GEMV_CONFIG (4 x 512, 4 warps, prefetch 2), or a wide / tensor-core tile at M = 1
        GEMV_CONFIG,
        GEMV_TC_CONFIG,
        W4A16Config(block_m=1, block_n=64, block_k=128, num_warps=4, num_stages=4, tc=True),
        GEMV_WIDE_CONFIG,
        GEMV_WIDE_DEEP_CONFIG,
        GEMV_WIDE_SHORT_CONFIG,
        W4A16Config(block_m=1, block_n=16, block_k=256, num_warps=2, num_stages=1, prefetch=2, wide=True),
        W4A16Config(block_m=4, block_n=8, block_k=512, num_warps=4, num_stages=1),
        W4A16Config(block_m=4, block_n=16, block_k=512, num_warps=4, num_stages=1),
        W4A16Config(block_m=4, block_n=32, block_k=512, num_warps=4, num_stages=1),
        W4A16Config(block_m=4, block_n=32, block_k=1024, num_warps=8, num_stages=1),
        W4A16Config(block_m=4, block_n=32, block_k=512, num_warps=4, num_stages=1, split_k=2),
        W4A16Config(block_m=4, block_n=8, block_k=512, num_warps=4, num_stages=1, prefetch=2),
        W4A16Config(block_m=4, block_n=8, block_k=256, num_warps=2, num_stages=1, prefetch=2),
        W4A16Config(block_m=4, block_n=4, block_k=512, num_warps=4, num_stages=1, prefetch=2),
        W4A16Config(block_m=4, block_n=8, block_k=512, num_warps=4, num_stages=2),
    ),
    "dot": (
        None,  # DOT_SMALL_CONFIG (M <= 64) / DOT_LARGE_CONFIG
        W4A16Config(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3),  # DOT_LARGE_CONFIG to 12-01i
        W4A16Config(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=3),
        W4A16Config(block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=3),
        W4A16Config(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3, split_k=1),
        # 12-01h, timed on 12-01i (h200-runs/2026-12-01i/1-w4a16_dot.jsonl): the default tiles with their scales a
        # step ahead (scales_ahead), and the transposed form (swap_ab, weight rows on the wgmma's M side) with and
        # without it; 64 x 128 x 64 swapped with the scales ahead became DOT_SMALL_CONFIG
        W4A16Config(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=3, scales_ahead=True),
        W4A16Config(block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=3, scales_ahead=True),
        W4A16Config(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=3, swap_ab=True),
        W4A16Config(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=3, swap_ab=True, scales_ahead=True),
        W4A16Config(block_m=16, block_n=128, block_k=128, num_warps=4, num_stages=3, swap_ab=True),
        W4A16Config(block_m=32, block_n=128, block_k=64, num_warps=4, num_stages=3, swap_ab=True),
        W4A16Config(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=3, swap_ab=True),
        W4A16Config(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=3, swap_ab=True, scales_ahead=True),
        W4A16Config(block_m=64, block_n=128, block_k=128, num_warps=8, num_stages=3, swap_ab=True),
        # 12-01i, timed on 12-02 (h200-runs/2026-12-02/1-w4a16_large.jsonl): swapped tiles for M 65-512; the second
        # became DOT_LARGE_CONFIG. Offline sm_90 compile (triton 3.6): 128 registers, no stack, for the first two;
        # 174 for the third; all wgmma
        W4A16Config(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3, swap_ab=True, scales_ahead=True),
        W4A16Config(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=3, swap_ab=True, scales_ahead=True),
        # 12-02, timed (5-w4a16_vec.jsonl): the scales as 4-byte vectors (scales_vec) on the 64-row swapped tile (it
        # became DOT_SMALL_CONFIG; the 12-01i default, scales ahead, is above) and on DOT_LARGE_CONFIG's rows with
        # 128-wide steps (64-wide ones give 2 scales per thread: too few for a vector), with and without the scales
        # ahead (ahead, the pipeliner leaves them in registers; alone, it stages them by cp.async: sm_90 TTGIR)
        W4A16Config(64, 128, 64, num_warps=4, num_stages=3, swap_ab=True, scales_ahead=True, scales_vec=True),
        W4A16Config(block_m=128, block_n=64, block_k=128, num_warps=4, num_stages=3, swap_ab=True, scales_vec=True),
        W4A16Config(128, 64, 128, num_warps=4, num_stages=3, swap_ab=True, scales_ahead=True, scales_vec=True),
    ),
    "dequant_mm": (None,),
}
SWEEP_GEMV_MAX_M = 64  # the sweep skips gemv beyond this M (one FMA per weight element per row: hopeless)


def _m_range(M: int) -> str:
    for hi, name in ((1, "1"), (4, "2-4"), (16, "5-16"), (127, "17-127")):
        if M <= hi:
            return name
    return ">=128"


def _sweep_summary(results: Sequence[dict]) -> list[dict]:
    """Best tile per (M range, path) by the geometric mean over shapes of graph-replay time relative to the best
    of that shape, then the fastest path per M (the thresholds for ``path="auto"``)."""
    ok = [r for r in results if "graph_ms" in r]
    best_of_shape: dict[tuple[int, int, int], float] = {}
    for r in ok:
        key = (r["M"], r["N"], r["K"])
        best_of_shape[key] = min(best_of_shape.get(key, math.inf), r["graph_ms"])
    groups: dict[tuple[str, str, str], list[float]] = {}
    for r in ok:
        key = (_m_range(r["M"]), r["path"], json.dumps(r["config"], sort_keys=True))
        groups.setdefault(key, []).append(r["graph_ms"] / best_of_shape[(r["M"], r["N"], r["K"])])
    best: dict[tuple[str, str], tuple[float, str, int]] = {}
    for (rng, path, cfg), rels in groups.items():
        score = math.exp(sum(math.log(v) for v in rels) / len(rels))
        if (rng, path) not in best or score < best[(rng, path)][0]:
            best[(rng, path)] = (score, cfg, len(rels))
    summary = [
        {"summary": "best_config", "m_range": rng, "path": path, "config": json.loads(cfg), "shapes": n,
         "geomean_time_vs_best": round(score, 3)}
        for (rng, path), (score, cfg, n) in sorted(best.items())
    ]  # fmt: skip
    per_shape: dict[tuple[int, str, tuple[int, int]], float] = {}  # (M, path, (N, K)) -> its best tile's time
    for r in ok:
        key = (r["M"], r["path"], (r["N"], r["K"]))
        per_shape[key] = min(per_shape.get(key, math.inf), r["graph_ms"] / best_of_shape[(r["M"], r["N"], r["K"])])
    per_m: dict[int, dict[str, list[float]]] = {}
    for (M, path, _), v in per_shape.items():
        per_m.setdefault(M, {}).setdefault(path, []).append(v)
    for M, paths in sorted(per_m.items()):
        scores = {p: math.exp(sum(math.log(v) for v in rels) / len(rels)) for p, rels in paths.items()}
        summary.append({"summary": "best_path", "M": M, "path": min(scores, key=scores.get),
                        "geomean_time_vs_best": {p: round(v, 3) for p, v in sorted(scores.items())}})  # fmt: skip
    return summary


def sweep_w4a16(
    shapes: Sequence[tuple[int, int, int]] = SWEEP_SHAPES,
    paths: Sequence[str] = SWEEP_PATHS,
    configs: Mapping[str, Sequence[W4A16Config | None]] | Sequence[W4A16Config | None] | None = None,
    dtype: torch.dtype = torch.bfloat16,
    warmup: int = 5,
    rep: int = 20,
    log: Callable[[str], None] | None = print,
    device: str = "cuda",
) -> list[dict]:
    """Time every (shape, path, tile): one dict per measurement (``bench_w4a16``'s keys; ``error`` instead of the
    timings when a tile fails), followed by the summary dicts (``_sweep_summary``). ``configs``: tiles per path
    (default ``SWEEP_CONFIGS``; a plain sequence is the gemv tiles, the other paths their default). ``log`` gets
    one JSON line per dict as it is measured. Weights are built once per (N, K)."""
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("sweep_w4a16 needs CUDA")
    for p in paths:
        pick_path(1, p)
    if configs is None:
        configs = SWEEP_CONFIGS
    elif not isinstance(configs, Mapping):
        configs = {"gemv": tuple(configs)}
    results: list[dict] = []

    def emit(d: dict) -> None:
        results.append(d)
        if log is not None:
            log(json.dumps(d))

    by_nk: dict[tuple[int, int], list[int]] = {}
    for M, N, K in shapes:
        by_nk.setdefault((N, K), []).append(M)
    for (N, K), ms in by_nk.items():
        packed, scale, gs, w_dense, gen = _bench_weights(N, K, dtype, 0, device)
        weights = _chain_weights(N, K, (packed, scale, gs), dtype, device)
        for M in ms:
            x = torch.randn(M, K, device=device, dtype=dtype, generator=gen)
            ref = w4a16_gemm_ref(x, packed, scale, gs, out_dtype=torch.float32)
            dense_ms = triton.testing.do_bench(
                lambda x=x, w=w_dense: x @ w.T, warmup=warmup, rep=rep, return_mode="median"
            )
            stream_ms = _stream_ms(M, N, K, x.element_size(), device, warmup, rep)
            chain = _chain_setup(M, N, K, weights, dtype, device)
            for p in paths:
                if p == "gemv" and M > SWEEP_GEMV_MAX_M:
                    continue
                for cfg in configs.get(p, (None,)):
                    try:
                        case = (x, packed, scale, gs, ref, p, cfg, "broadcast", dense_ms, stream_ms, warmup, rep, chain)
                        emit(_bench_case(*case))
                    except Exception as exc:  # a tile that does not compile or fit: record it, keep sweeping
                        emit({"M": M, "N": N, "K": K, "path": p, "config": asdict(cfg or pick_config(M, p, dtype, N, sm_count(x.device), K)),
                              "error": f"{type(exc).__name__}: {exc}"[:300]})  # fmt: skip
            del ref, chain
        del packed, scale, gs, w_dense, weights
        if device == "cuda":
            torch.cuda.empty_cache()
    for d in _sweep_summary(results):
        emit(d)
    return results


def _main(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python3 -m perfkit.kernels.w4a16_gemm",
        description="W4A16 (NVFP4) GEMM: time paths and tiles on a CUDA GPU.",
    )
    parser.add_argument("--sweep", action="store_true", help="time SWEEP_SHAPES x paths x SWEEP_CONFIGS")
    args = parser.parse_args(argv)
    if not args.sweep:
        parser.print_help()
        return 0
    if not torch.cuda.is_available():
        print("w4a16_gemm --sweep needs a CUDA GPU (none visible); nothing timed.")
        return 2
    sweep_w4a16()
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
