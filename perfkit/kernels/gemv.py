"""bf16 / fp16 GEMV for batch-1 decode: ``y[M, N] = x[M, K] @ w[N, K]^T`` with one (or a few) rows of x.

Why: at M = 1 a decode step reads every weight once, so each linear should run at the DRAM read rate. cuBLAS picks
its kernel per shape, and on the H200 some of the picks are 10-25 % slower than the weight read (12-05,
``docs/h200-runs/2026-12-05/``, CUDA graphs of 20 calls over distinct weights, M = 1, us):

    shape [N, K]              bound   cuBLAS   this gemv (best tile)
    31B o_proj 5376 x 8192    20.5    25.8     22.4
    31B o_proj 5376 x 16384   41.0    46.1     43.0
    31B down 5376 x 21504     53.8    58.5     56.5
    31B qkv 16384 x 5376      41.0    42.8     45.3   (cuBLAS wins)
    31B gate_up 43008 x 5376  107.5   107.4    109.1  (cuBLAS wins)
    26B-A4B router 128 x 2816  0.2     5.8      2.8

On the long-K shapes cuBLAS splits K and adds a reduce kernel (12-04's profile: 120 split-K reduces per 31B
batch-1 step); this kernel streams each weight row once, with no split and no reduce. Which is faster depends on the
shape and the GPU, so the engine times both on the model's own weights (``time_gemv_choice``, toggle
``decode_gemv=auto``) and routes each shape's M = 1 products to the winner. Only M = 1: at M = 2 cuBLAS won or tied
every 31B shape in the same sweep (o_proj 5376 x 8192: 25.9 vs 26.2 us, qkv 16384 x 5376: 49.3 vs 42.9).

Kernel (``_gemv_kernel``, CUDA cores, no ``tl.dot``): a program owns BLOCK_N weight rows and BLOCK_M rows of x and
walks K in BLOCK_K steps; the weight tile [BLOCK_N, BLOCK_K] loads as 16-byte vectors (8 elements per lane along
K), the next step's tile is loaded before this step's FMAs (a register double buffer: the loop has no dot, so
Triton's pipeliner does not prefetch it), and the fp32 accumulator [BLOCK_M, BLOCK_N, BLOCK_K] is reduced over K
once, after the loop. Only full steps run in the loop (no masks, so the loads stay vectors); a K tail is one masked
step. Rows past N / M are clamped on load and masked on store. ``evict_first`` marks the weight loads as streaming
(each weight byte is read once); it won on the long-K shapes (31B o_proj 5376 x 8192: 22.4 vs 23.8 us) and lost on
the 26B-A4B LM head (356.7 vs 349.9).

Two fused forms, for launches a batch-1 decode step can do without (toggle decode_fusion, 12-07: 26B-A4B c1 TPOT
3.115 -> 3.009 ms): ``glu=True`` takes a merged gate_up output [M, 2I] and applies GeGLU as it loads each x step (the
MLP's down product without the gelu_mul launch), and ``gemv_pair`` runs two independent products of the same K in
one grid (the 26B-A4B router beside the dense gate_up). Both compute each output exactly as the separate launches.
A third, ``gemv_routed`` (toggle decode_routing), gives the launch one more program, which routes a MoE router's
logits (the moe_routing launch) while the others compute the product.

Traffic (``gemv_traffic``): N*K*e weight bytes + M*K*e (x) + M*N*e (out), e = 2 bytes; at M = 1 the weight is
all of it.

Numerics: products and sums in fp32 (a chain per lane along K, then a tree over lanes and warps), one rounding
to x's dtype at the end; ``gemv_ref`` (fp32 matmul) is the reference. cuBLAS's order differs, so the two agree to
rounding, not bit for bit. No host syncs: CUDA-graph capturable.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

import torch
import triton
import triton.language as tl

from perfkit.kernels.gelu_mul import _gelu_tanh_f32, gelu_mul_cat
from perfkit.kernels.launch import interpreting
from perfkit.kernels.moe import _route_row
from perfkit.kernels.pdl import pdl_enter, pdl_launch
from perfkit.kernels.rmsnorm import rmsnorm
from perfkit.kernels.timing import graph_sequence_us
from perfkit.kernels.w4a16_gemm import HBM_BYTES_PER_S

MAX_BLOCK_M = 4  # the most rows of x one program takes (more rows: the weight is streamed once per 4 rows)
TIMING_CALLS = 20  # calls per timed CUDA graph: enough distinct weights in a row that L2 holds none of them
TIMING_REPLAYS = 15
TIMING_AFTER_NORM = True  # time_gemv_choice with pdl: each call after an rmsnorm (False: a plain chain, to 12-08)


@triton.jit
def _x_step(x_ptrs, k0, K, mask, GLU: tl.constexpr):
    """One step's x tile [BM, 1, BK] (x dtype). GLU: gelu_tanh(gate) * up of the step's columns of the two halves
    [0, K) / [K, 2K) of x, in fp32 and rounded once to x's dtype: the value ``gelu_mul`` would have stored, so the
    product is bit-identical to gemv(gelu_mul_cat(x), w). Masked entries are 0 either way (gelu(0) * 0)."""
    if GLU:
        if mask is None:
            g = tl.load(x_ptrs + k0)
            u = tl.load(x_ptrs + K + k0)
        else:
            g = tl.load(x_ptrs + k0, mask=mask, other=0.0)
            u = tl.load(x_ptrs + K + k0, mask=mask, other=0.0)
        return (_gelu_tanh_f32(g.to(tl.float32)) * u.to(tl.float32)).to(g.dtype)
    elif mask is None:
        return tl.load(x_ptrs + k0)
    else:
        return tl.load(x_ptrs + k0, mask=mask, other=0.0)


@triton.jit
def _gemv_kernel(
    x_ptr,  # [M, K] activations, unit stride along K
    w_ptr,  # [N, K] weight, unit stride along K
    out_ptr,  # [M, N], unit stride along N
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    x2_ptr,  # PAIR: the second product's [M, K2 = K] activations, [N2, K] weight and [M, N2] output; program
    w2_ptr,  # columns from n_blocks1 on compute it (same K, same tile)
    out2_ptr,
    N2,
    n_blocks1,  # programs along N of the first product: cdiv(N, BLOCK_N)
    stride_x2m,
    stride_w2n,
    stride_o2m,
    logits_ptr,  # ROUTE: a MoE router's [M, E] logits (an earlier launch's output), row stride stride_lm
    stride_lm,
    E,
    escale_ptr,  # ROUTE: [E] per_expert_scale; the routing weights fp32 [M, TOP_K] and expert ids int32 [M, TOP_K]
    rw_ptr,
    ridx_ptr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVICT: tl.constexpr,  # "evict_first" (streaming weight loads) or ""
    PDL: tl.constexpr = 0,  # launched with launch_pdl (perfkit/kernels/pdl.py): the first weight tile loads first
    PRELOAD: tl.constexpr = 1,  # weight tiles in flight before the wait (1 or 2; 2 keeps three tiles live)
    GLU: tl.constexpr = 0,  # x is [M, 2K] (gate | up): the product's input is gelu_tanh(gate) * up in x's dtype
    PAIR: tl.constexpr = 0,  # a second, independent product in the same launch (x2_ptr ...)
    ROUTE: tl.constexpr = 0,  # one more program on grid axis 0, the last, routes the logits (moe._route_row: the
    TOP_K: tl.constexpr = 1,  # moe_routing launch it replaces) while the others compute the product
    BLOCK_TK: tl.constexpr = 1,
    BLOCK_E: tl.constexpr = 1,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    if PAIR:
        if pid_n >= n_blocks1:  # this program computes rows of the second product
            pid_n -= n_blocks1
            x_ptr, w_ptr, out_ptr, N = x2_ptr, w2_ptr, out2_ptr, N2
            stride_xm, stride_wn, stride_om = stride_x2m, stride_w2n, stride_o2m
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.minimum(offs_n, N - 1).to(tl.int64)  # rows past N / M re-read the last row (never stored): no masks
    rm = tl.minimum(offs_m, M - 1).to(tl.int64)
    k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + (rn * stride_wn)[None, :, None] + k[None, None, :]  # [1, BN, BK]
    x_ptrs = x_ptr + (rm * stride_xm)[:, None, None] + k[None, None, :]  # [BM, 1, BK]
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    k_main = K // BLOCK_K * BLOCK_K  # end of the full steps
    # the first step's tile (all-true mask, or no full step at all); each iteration loads the next one before its
    # FMAs, the last iteration's "next" clamped onto itself (an L2 re-read instead of a mask)
    full = (k < k_main)[None, None, :]
    w = tl.load(w_ptrs, mask=full, other=0.0, eviction_policy=EVICT)
    if PRELOAD == 2:  # the second step's tile too (clamped onto the last full step, like every "next" below)
        w2 = tl.load(w_ptrs + tl.maximum(tl.minimum(BLOCK_K, k_main - BLOCK_K), 0), mask=full, other=0.0,
                     eviction_policy=EVICT)  # fmt: skip
    pdl_enter(PDL)  # x is the predecessor's output; the weight is constant, so its first tiles are already in flight
    k_end = k_main
    if ROUTE:  # the routing program (its rows lie past N: it loaded a clamped tile above and stores nothing below)
        routing = pid_n == tl.num_programs(0) - 1
        if routing & (pid_m == 0):
            for t in range(M):
                _route_row(logits_ptr, t, stride_lm, escale_ptr, rw_ptr, ridx_ptr, E, TOP_K, BLOCK_TK, BLOCK_E)
        k_end = tl.where(routing, 0, k_main)  # and skips the product's loop
    for k0 in range(0, k_end, BLOCK_K):
        x = _x_step(x_ptrs, k0, K, None, GLU)
        if PRELOAD == 2:  # three tiles live: this step's, the next one's and the one after
            w_next = tl.load(w_ptrs + tl.minimum(k0 + 2 * BLOCK_K, k_main - BLOCK_K), eviction_policy=EVICT)
            acc = tl.fma(w.to(tl.float32), x.to(tl.float32), acc)
            w = w2
            w2 = w_next
        else:
            w_next = tl.load(w_ptrs + tl.minimum(k0 + BLOCK_K, k_main - BLOCK_K), eviction_policy=EVICT)
            acc = tl.fma(w.to(tl.float32), x.to(tl.float32), acc)
            w = w_next
    if k_main < K:  # the K tail: one masked step
        km = (k_main + k < K)[None, None, :]
        x = _x_step(x_ptrs, k_main, K, km, GLU)
        w = tl.load(w_ptrs + k_main, mask=km, other=0.0, eviction_policy=EVICT)
        acc = tl.fma(w.to(tl.float32), x.to(tl.float32), acc)
    y = tl.sum(acc, axis=2)  # [BM, BN]
    out = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out, y.to(out_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


@dataclass(frozen=True)
class GemvConfig:
    """One tile of ``_gemv_kernel``: ``block_n`` weight rows per program, ``block_k`` K elements per step (the
    weight tile is block_n x block_k, loaded twice over: this step's and the next), ``num_warps``, and whether the
    weight loads are marked evict-first. Sizes are powers of two (ValueError otherwise)."""

    block_n: int
    block_k: int
    num_warps: int
    evict_first: bool = False
    preload: int = 1  # weight tiles loaded before the PDL wait (and kept in flight): 1, or 2 (a candidate, 12-06)

    def __post_init__(self) -> None:
        if not all(
            isinstance(v, int) and v >= 1 and v & (v - 1) == 0 for v in (self.block_n, self.block_k, self.num_warps)
        ):
            raise ValueError(f"bad GemvConfig {self}: block_n, block_k and num_warps must be powers of two")
        if self.preload not in (1, 2):
            raise ValueError(f"bad GemvConfig {self}: preload must be 1 or 2")

    @property
    def label(self) -> str:
        return (f"{self.block_n}x{self.block_k}w{self.num_warps}{'e' if self.evict_first else ''}"
                f"{'p2' if self.preload == 2 else ''}")  # fmt: skip


# The candidates ``time_gemv_choice`` times per shape: the best tile of each 31B / 26B-A4B shape in 12-05's H200
# sweep (14 tiles x 14 shapes, docs/h200-runs/2026-12-05/3-gemv_sweep.jsonl). 16 x 512 evict-first: long K (31B
# o_proj / down); 8 x 1024 evict-first: 26B-A4B o_proj and router; 4 x 512 on 2 warps: K 2-5K with N up to 43K
# (31B qkv full, gate_up; 26B-A4B gate_up, down); 32 x 256: very many rows (LM head, 26B-A4B qkv full). 32 x 256 with
# preload 2 (two weight tiles in flight before the PDL wait): 26B-A4B qkv sliding 8192 x 2816 12.78 vs 13.35 us for
# the best preload-1 tile, the only shape where a preload-2 candidate won by more than 1.5 % (12-07,
# docs/h200-runs/2026-12-07/1-gemv_preload.jsonl, PDL on).
GEMV_TILES: tuple[GemvConfig, ...] = (
    GemvConfig(16, 512, 4, evict_first=True),
    GemvConfig(8, 1024, 4, evict_first=True),
    GemvConfig(4, 512, 2),
    GemvConfig(32, 256, 4),
    GemvConfig(32, 256, 4, preload=2),
)
# Candidates of 12-06, CPU-tested, never timed: the same tiles with two weight tiles loaded before the PDL wait
# (``preload=2``). With PDL a gemv's CTAs are resident while their predecessor runs; a 26B-A4B layer's small products
# (2816 x 2112: two 1024-wide steps and a tail per row) could then have most of their weight in flight before the
# wait. Timed by ``python3 -m perfkit.kernels.gemv --pdl --preload``.
GEMV_PRELOAD_CANDIDATES: tuple[GemvConfig, ...] = tuple(
    c for c in (replace(t, preload=2) for t in GEMV_TILES) if c not in GEMV_TILES
)
# The CPU interpreter runs one program at a time in Python: one wide tile per problem.
INTERPRETER_TILE = GemvConfig(64, 128, 4)


def default_tile(N: int, K: int) -> GemvConfig:
    """The tile for ``decode_gemv=triton`` (no timing), from the same sweep: long K -> 16 x 512 evict-first, many
    rows per K (the LM head) -> 32 x 256, else 4 x 512 on 2 warps. INTERPRETER_TILE under the CPU interpreter."""
    if interpreting():
        return INTERPRETER_TILE
    if K >= 8192:
        return GEMV_TILES[0]
    if N >= 32 * K:
        return GEMV_TILES[3]
    return GEMV_TILES[2]


def _check_operands(x: torch.Tensor, w: torch.Tensor, k_x: int) -> None:
    """x [M, k_x] and w [N, K] share a dtype, have unit stride along K, and k_x is what x must hold."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != k_x or x.dtype != w.dtype:
        raise ValueError(f"gemv: x {tuple(x.shape)} {x.dtype} and w {tuple(w.shape)} {w.dtype} do not match")
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError("gemv: x and w need unit stride along K")


def gemv(
    x: torch.Tensor, w: torch.Tensor, config: GemvConfig | None = None, out: torch.Tensor | None = None,
    pdl: bool = False, *, glu: bool = False,
):  # fmt: skip
    """x [M, K] @ w[N, K]^T -> [M, N] in x's dtype (``out`` if given). x and w share a dtype and have unit stride
    along K. Meant for M = 1; larger M is correct but streams the weight once per MAX_BLOCK_M rows. pdl: launch
    with programmatic dependent launch (perfkit/kernels/pdl.py; sm_90+ only). glu: x is [M, 2K], the (gate | up)
    output of a merged gate_up product, and the product's input is gelu_tanh(gate) * up rounded to x's dtype: the
    result is bit-identical to ``gemv(gelu_mul_cat(x), w)`` with one launch less (a decode MLP's down product)."""
    K = w.shape[1] if w.dim() == 2 else -1
    _check_operands(x, w, 2 * K if glu else K)
    return _launch(x, w, out, config, pdl, glu=glu)


def gemv_pair(
    x: torch.Tensor, w: torch.Tensor, x2: torch.Tensor, w2: torch.Tensor, config: GemvConfig | None = None,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(x @ w^T, x2 @ w2^T) in one launch: two independent products with the same K (x [M, K], w [N, K],
    x2 [M, K], w2 [N2, K], one dtype), on ``config``'s tile. Each output row is computed exactly as ``gemv`` would
    compute it alone (bit-identical). Why: a 26B-A4B MoE layer's router (128 x 2816, 0.7 MB, ~2.4 us alone on the
    H200, docs/h200-runs/2026-12-07/1-gemv_preload.jsonl, against a 0.17 us weight read) rides in the dense
    gate_up's launch (4224 x 2816), which reads the same residual's norms."""
    K = w.shape[1] if w.dim() == 2 else -1
    _check_operands(x, w, K)
    _check_operands(x2, w2, K)
    if x2.shape[0] != x.shape[0]:
        raise ValueError(f"gemv_pair: x has {x.shape[0]} rows, x2 {x2.shape[0]}")
    if w2.shape[0] < 2:  # a 1-row second product would be a compile-time constant N: launch it alone
        return gemv(x, w, config, pdl=pdl), gemv(x2, w2, config, pdl=pdl)
    out2 = torch.empty(x2.shape[0], w2.shape[0], dtype=x2.dtype, device=x2.device)
    return _launch(x, w, None, config, pdl, pair=(x2, w2, out2)), out2


def gemv_routed(
    x: torch.Tensor, w: torch.Tensor, logits: torch.Tensor, top_k: int, per_expert_scale: torch.Tensor,
    config: GemvConfig | None = None, pdl: bool = False, *, glu: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(``gemv(x, w, config, pdl=pdl, glu=glu)``, routing weights fp32 [M, top_k], expert ids int32 [M, top_k]) in
    one launch: one more program routes a MoE router's logits [M, E] (``moe.moe_routing``'s math) while the others
    compute the product, which is bit-identical to gemv's. The logits must come from an earlier launch. The routing
    weights equal moe_routing's to fp32 rounding on the GPU (the softmax's sums follow this launch's warp layout;
    bit for bit under the interpreter); the expert ids are the same.

    Why: at batch-1 decode the 26B-A4B routing kernel is a launch of its own on the step's critical path (~3.4 us
    per MoE layer, 101 us per step: docs/h200-runs/2026-12-07/1-profile_26b_c1.json) for a few hundred ns of work.
    In the launch of the dense MLP's down product, which does not depend on the routing and runs ~5.7 us, it is off
    the critical path: the experts' gate_up kernel, next, waits for both. On the H200 (docs/h200-runs/2026-12-09/,
    call 3): 26B-A4B c1 TPOT 2.998 -> 2.921 ms. (12-08's form, the routing in the router's own launch after an
    atomic count of its programs, was serial with the product and tied: 12-09 call 1.)"""
    K = w.shape[1] if w.dim() == 2 else -1
    _check_operands(x, w, 2 * K if glu else K)
    E = logits.shape[-1]
    if logits.dim() != 2 or logits.shape[0] != x.shape[0] or logits.stride(1) != 1 or not 1 <= top_k <= E:
        raise ValueError(f"gemv_routed: x {tuple(x.shape)}, logits {tuple(logits.shape)}, top_k {top_k}")
    M = x.shape[0]
    rw = torch.empty(M, top_k, dtype=torch.float32, device=x.device)
    ridx = torch.empty(M, top_k, dtype=torch.int32, device=x.device)
    out = _launch(x, w, None, config, pdl, glu=glu, route=(logits, top_k, per_expert_scale, rw, ridx))
    return out, rw, ridx


def _launch(
    x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None, config: GemvConfig | None, pdl: bool,
    glu: bool = False, pair: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    route: tuple[torch.Tensor, int, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:  # fmt: skip
    """One ``_gemv_kernel`` launch on checked operands (w [N, K]; x [M, K], or [M, 2K] with glu; pair: x2, w2 and
    the second output, whose row blocks follow the first product's on grid axis 0; route, not with pair: the
    logits [M, E], top_k, per_expert_scale and the routing outputs, for one more program at the end of axis 0)."""
    M = x.shape[0]
    N, K = w.shape
    cfg = config or default_tile(N, K)
    bm = min(MAX_BLOCK_M, triton.next_power_of_2(M))
    bn = min(cfg.block_n, triton.next_power_of_2(max(N, 0 if pair is None else pair[1].shape[0])))
    bk = min(cfg.block_k, max(16, triton.next_power_of_2(K)))
    if out is None:
        out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    x2, w2, out2 = (x, w, out) if pair is None else pair
    n_blocks1 = triton.cdiv(N, bn)
    assert pair is None or route is None
    grid = (n_blocks1 + (0 if pair is None else triton.cdiv(w2.shape[0], bn)) + (route is not None), triton.cdiv(M, bm))
    logits, top_k, escale, rw, ridx = (out, 1, out, out, out) if route is None else route
    _gemv_kernel[grid](
        x, w, out, M, N, K, x.stride(0), w.stride(0), out.stride(0),
        x2, w2, out2, w2.shape[0], n_blocks1, x2.stride(0), w2.stride(0), out2.stride(0),
        logits, logits.stride(0), logits.shape[-1], escale, rw, ridx,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, EVICT="evict_first" if cfg.evict_first else "", PRELOAD=cfg.preload,
        GLU=int(glu), PAIR=int(pair is not None), ROUTE=int(route is not None), TOP_K=top_k,
        BLOCK_TK=triton.next_power_of_2(top_k), BLOCK_E=1 if route is None else triton.next_power_of_2(logits.shape[-1]),
        num_warps=cfg.num_warps, **pdl_launch(pdl),
    )  # fmt: skip
    return out


def gemv_ref(x: torch.Tensor, w: torch.Tensor, glu: bool = False) -> torch.Tensor:
    """The reference: fp32 x @ fp32 w^T -> fp32 [M, N]. glu: x [M, 2K] -> gelu_tanh(gate) * up in fp32, rounded
    to x's dtype (what gelu_mul stores), first."""
    if glu:
        g, u = x.float().chunk(2, dim=1)
        x = (torch.nn.functional.gelu(g, approximate="tanh") * u).to(x.dtype)
    return x.float() @ w.float().t()


def gemv_traffic(M: int, N: int, K: int, elem_bytes: int = 2, glu: bool = False) -> dict[str, float]:
    """DRAM bytes of one call (the weight once, x, the output) and their time at HBM_BYTES_PER_S. glu: x holds
    both halves, 2K per row (the separate gelu_mul's write and re-read of M x K are gone)."""
    total = elem_bytes * (N * K + (2 if glu else 1) * M * K + M * N)
    return {"weight_bytes": elem_bytes * N * K, "total_bytes": total, "bound_us": total / HBM_BYTES_PER_S * 1e6}


# --------------------------------------------------------------------------------------------------------------
# Timing: what decode_gemv=auto runs at engine start, and the sweep
# --------------------------------------------------------------------------------------------------------------


def time_gemv_choice(
    weights: Sequence[torch.Tensor],
    tiles: Sequence[GemvConfig] = GEMV_TILES,
    calls: int = TIMING_CALLS,
    replays: int = TIMING_REPLAYS,
    pdl: bool = False,
    glu: bool = False,
) -> dict:
    """Time cuBLAS (``x @ w^T``) and each tile at M = 1 on CUDA ``weights`` (one [N, K] shape and dtype, e.g. the
    same projection of every layer): {"cublas_us", "tiles": {label: us}, "best": label or "cublas", "best_us"}.
    The winner must beat cuBLAS outright; a tile that fails to compile is recorded as its error string. pdl: the
    tiles launch with PDL, as the engine will run them, and every candidate is timed after a short PDL kernel (an
    rmsnorm making its input row), as in the step, where each product follows a norm, a sandwich or the attention
    merge: a gemv's first weight tiles then load while that kernel runs, cuBLAS's cannot. In a plain chain of
    products cuBLAS looked 1-2 us per call faster than it is there (12-08 call 3,
    ``docs/h200-runs/2026-12-08/3-context_probe.jsonl``: 31B down 5376 x 21504, cuBLAS 57.14 vs 58.36 for the
    16 x 512 tile in a chain, 59.64 vs 57.97 after an rmsnorm). The row's "after" names the kernel before each call.

    glu (the MLP's down shapes): also {"glu": {"separate_us", "tiles", "best": label or "separate", "best_us"}},
    each tile's GLU form (GeGLU on load, one launch) against [gelu_mul_cat -> this shape's winner]. Which wins
    depends on the shape: every program applies GeGLU to all of its K columns, so the GLU form's extra work
    grows as N / BLOCK_N x K (12-08, ``docs/h200-runs/2026-12-08/``: on 31B's down, 5376 x 21504, the fused form
    made the whole step 1.7 % slower, and its best GLU tile took 64.95 us against 58.65 for gelu_mul + cuBLAS;
    26B-A4B's 2816 x 2112 gained, 5.68 vs 6.41)."""
    w0 = weights[0]
    if any(w.shape != w0.shape or w.dtype != w0.dtype for w in weights):
        raise ValueError("time_gemv_choice: the weights must share one shape and dtype")
    N, K = w0.shape
    gen = torch.Generator(device=w0.device).manual_seed(0)
    x = (torch.randn(1, 2 * K if glu else K, device=w0.device, generator=gen) * 0.5).to(w0.dtype)
    norm_w = torch.ones(x.shape[1], dtype=w0.dtype, device=w0.device)
    out = torch.empty(1, N, dtype=w0.dtype, device=w0.device)
    row: dict = {"N": N, "K": K, "dtype": str(w0.dtype).removeprefix("torch."), "weights": len(weights), "pdl": pdl,
                 "after": "rmsnorm" if pdl and TIMING_AFTER_NORM else "previous call",
                 "bound_us": round(gemv_traffic(1, N, K, w0.element_size())["bound_us"], 2)}  # fmt: skip

    def row_in() -> torch.Tensor:  # [1, K] (glu: [1, 2K]) the next candidate multiplies
        return rmsnorm(x, norm_w, 1e-6, pdl=True) if pdl and TIMING_AFTER_NORM else x

    row["cublas_us"] = round(
        graph_sequence_us(lambda w: torch.mm(row_in()[:, :K], w.t(), out=out), weights, calls, replays), 2
    )
    row["tiles"], row["best"], row["best_us"] = _time_tiles(
        lambda w, c: gemv(row_in()[:, :K], w, c, out=out, pdl=pdl), weights, tiles, calls, replays,
        ("cublas", row["cublas_us"]),
    )  # fmt: skip
    if glu:
        plain = tile_by_label(row["best"])

        def separate(w: torch.Tensor) -> None:
            h = gelu_mul_cat(row_in(), pdl=pdl)  # [1, K]
            torch.mm(h, w.t(), out=out) if plain is None else gemv(h, w, plain, out=out, pdl=pdl)

        sep_us = round(graph_sequence_us(separate, weights, calls, replays), 2)
        timed = _time_tiles(
            lambda w, c: gemv(row_in(), w, c, out=out, pdl=pdl, glu=True), weights, tiles, calls, replays,
            ("separate", sep_us),
        )  # fmt: skip
        row["glu"] = {"separate_us": sep_us, **dict(zip(("tiles", "best", "best_us"), timed, strict=True))}
    return row


def _time_tiles(
    fn, weights: Sequence[torch.Tensor], tiles: Sequence[GemvConfig], calls: int, replays: int,
    baseline: tuple[str, float],
) -> tuple[dict[str, float | str], str, float]:  # fmt: skip
    """({label: us per call of fn(w, tile)}, the winner's label, its us): the winner must beat ``baseline`` (label,
    us) outright; a tile that fails to compile is recorded as its error string, never chosen."""
    times: dict[str, float | str] = {}
    best, best_us = baseline
    for cfg in tiles:
        try:
            us = round(graph_sequence_us(lambda w, c=cfg: fn(w, c), weights, calls, replays), 2)
        except Exception as exc:  # a tile that does not compile here
            times[cfg.label] = f"{type(exc).__name__}: {exc}"[:200]
            continue
        times[cfg.label] = us
        if us < best_us:
            best, best_us = cfg.label, us
    return times, best, best_us


def tile_by_label(label: str) -> GemvConfig | None:
    """The GEMV_TILES entry with this label (None for "cublas" or "separate")."""
    return next((t for t in GEMV_TILES if t.label == label), None)


# The decode linears of the two large presets as [N, K] (the sweep's shapes).
SWEEP_SHAPES: dict[str, tuple[int, int]] = {
    "31b/qkv_sliding": (16384, 5376), "31b/qkv_full": (18432, 5376), "31b/gate_up": (43008, 5376),
    "31b/down": (5376, 21504), "31b/o_sliding": (5376, 8192), "31b/o_full": (5376, 16384),
    "31b/lm_head": (262144, 5376), "26b-a4b/qkv_sliding": (8192, 2816), "26b-a4b/qkv_full": (9216, 2816),
    "26b-a4b/o_sliding": (2816, 4096), "26b-a4b/o_full": (2816, 8192), "26b-a4b/gate_up": (4224, 2816),
    "26b-a4b/down": (2816, 2112), "26b-a4b/router": (128, 2816), "26b-a4b/lm_head": (262144, 2816),
}  # fmt: skip


def sweep_gemv(
    shapes: dict[str, tuple[int, int]] = SWEEP_SHAPES, out: str | None = None,
    tiles: Sequence[GemvConfig] = GEMV_TILES, pdl: bool = False,
) -> list[dict]:  # fmt: skip
    """``time_gemv_choice`` (of ``tiles``, launched with PDL when ``pdl``) on random bf16 weights at every shape
    (enough copies that 20 calls never re-read one from L2); one JSON line per shape to ``out`` (or stdout)."""
    rows = []
    fh = open(out, "w") if out else None  # closed in the finally below
    try:
        for name, (N, K) in shapes.items():
            copies = max(2, min(TIMING_CALLS, -(-200_000_000 // (2 * N * K))))
            ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
            row = {"shape": name, **time_gemv_choice(ws, tiles, pdl=pdl)}
            rows.append(row)
            print(json.dumps(row), file=fh, flush=True)
            del ws
            torch.cuda.empty_cache()
    finally:
        if fh is not None:
            fh.close()
    return rows


def _main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m perfkit.kernels.gemv",
        description="bf16 GEMV at M = 1: time cuBLAS and every GEMV_TILES tile at the 31B / 26B-A4B decode shapes.",
    )
    parser.add_argument("--out", default=None, help="JSONL file for the rows (default: stdout)")
    parser.add_argument("--pdl", action="store_true", help="launch the gemv tiles with PDL (as pdl=on runs them)")
    parser.add_argument("--preload", action="store_true", help="add GEMV_PRELOAD_CANDIDATES (two tiles before the wait)")
    parser.add_argument("--only", default="", help="the SWEEP_SHAPES whose name starts with this, e.g. 26b-a4b")
    args = parser.parse_args(argv)
    shapes = {k: v for k, v in SWEEP_SHAPES.items() if k.startswith(args.only)}
    if not shapes:
        print(f"--only {args.only!r} matches none of {', '.join(SWEEP_SHAPES)}")
        return 2
    if not torch.cuda.is_available():
        print("perfkit.kernels.gemv needs a CUDA GPU (none visible); nothing timed.")
        return 2
    tiles = GEMV_TILES + (GEMV_PRELOAD_CANDIDATES if args.preload else ())
    rows = sweep_gemv(shapes, out=args.out, tiles=tiles, pdl=args.pdl)
    for r in rows:
        print(f"{r['shape']:<22} bound {r['bound_us']:>7.2f} us  cuBLAS {r['cublas_us']:>7.2f}  best {r['best']} "
              f"{r['best_us']:.2f}")  # fmt: skip
    print(json.dumps({"tiles": [asdict(t) for t in tiles], "pdl": args.pdl}))
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
