"""The 26B-A4B feed-forward block at batch-1 decode in two launches (toggle ``decode_moe_ffn``).

Gemma4's MoE layer (``reference/gemma4.md`` §3) runs a dense GeGLU MLP and the routed experts side by side on the
same residual r: ``m = down_d(gelu(gate_d x) * up_d x)`` with ``x = pre_ff(r)``, ``e = sum_k w_k down_k(gelu(gate_k
x2) * up_k x2)`` with ``x2 = pre_ff_2(r)`` and (w, k) the router's top-k of ``proj(norm(r) * scale * H^-0.5)``.
Neither branch needs the other. At batch 1 the separate path chains five launches after the attention sandwich:
[dense gate_up + router], [dense down + routing], [experts' gate_up], [experts' down], then the next sandwich.
Each launch of this chain is a few us of ramp and tail around a weight read (12-07's probe: a link costs its own
chain time, PDL hides the launch, not the work). Here the router's product rides in the sandwich's launch
(``sandwich_rmsnorm(router=)``), and the two branches share two launches::

    gate_up   programs [0, nb_d):           h_d[n] = gelu_tanh(x . Wg_d[n]) * (x . Wu_d[n])           h_d [I_d]
              programs [nb_d, nb_d + K nb_e): slot k = q // nb_e, rows of block q % nb_e:
                                            (w, ids) = top-k(logits) in every program (128 logits, cheap),
                                            act[k, n] = gelu_tanh(x2 . Wg_ids[k][n]) * (x2 . Wu_ids[k][n])
                                            the first block of slot k stores (w[k], ids[k])
    down      programs [0, nb):             m[n] = Wd_d[n] . h_d     (the row as K column slots, like the experts')
              programs [nb, 2 nb):          e[n] = sum_k w[k] * (act[k] . Wd_ids[k][n])

Dense programs load their first weight tiles before the PDL wait (their weights are constant and their rows do
not depend on the routing); expert programs wait first, since the routing picks their weights. The per-program
bodies are the bf16 gather kernels' (``moe._gate_up_*`` / ``moe._down_*``), so the experts' products
equal ``fused_moe``'s gather path bit for bit given the same routing, and the routing equals ``moe_routing``'s
(``moe._topk_row``). The dense branch rounds once (gelu(g) * u from fp32 g, u, stored in x's dtype) where the
separate path rounds g and u first: about one bf16 ulp apart.

Launches per MoE layer's FFN: 3 (sandwich + router, gate_up, down) against 5; the weights read are the same.
Reference: :func:`moe_ffn_ref`; traffic: :func:`moe_ffn_traffic`.

Measured on the H200 (docs/h200-runs/2026-12-11/): 1.4 us per layer faster than the separate chain in a CUDA-graph
probe, but slower in the engine (26B-A4B c1 TPOT 2.914 -> 2.970 ms), whose profile shows each merged kernel as long
as the kernels it replaces put together (the gate_up launch streams 87 MB at 3.05 TB/s, the experts' gather alone
63 MB at 3.5 TB/s). So this form is off; since 12-12 the toggle's default is ``branches`` (perfkit/runtime/model.py,
``Gemma4DecoderLayer._ffn_branches``): each kernel stays what it is and the two branches run side by side on two
CUDA streams, which hides each launch's ramp and tail behind the other branch (26B-A4B c1 TPOT 2.896 -> 2.750 ms,
docs/h200-runs/2026-12-12/).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from perfkit.kernels.moe import (
    _down_first,
    _down_rest,
    _gate_up_first,
    _gate_up_ptrs,
    _gate_up_rest,
    _topk_row,
    fused_moe_ref,
    moe_routing_ref,
)
from perfkit.kernels.pdl import pdl_enter, pdl_launch

# The gather kernels' batch-1 tiles (moe.GATHER_GATE_UP_PREFETCH_TILES / GATHER_DOWN_TILES: the H200 sweep of 12-06)
GATE_UP_TILES = {"BLOCK_N": 8, "BLOCK_K": 256, "num_warps": 2}
DOWN_TILES = {"BLOCK_N": 8, "BLOCK_K": 128, "num_warps": 4}


@triton.jit
def _moe_ffn_gate_up_kernel(
    xd_ptr,  # [H] dense MLP input (pre_feedforward_layernorm of the residual)
    xe_ptr,  # [H] experts' input (pre_feedforward_layernorm_2)
    wd_ptr,  # [2 I_d, H] dense gate_up (gate rows, then up); contiguous along H
    we_ptr,  # [E, 2 I_e, H] experts' gate_up_proj
    hd_ptr,  # [I_d] out: gelu(gate) * up of the dense MLP, x's dtype
    act_ptr,  # [K, I_e] out: the same per routed slot
    logits_ptr,  # [E] router logits
    scale_ptr,  # [E] per_expert_scale
    rw_ptr,  # [K] out: routing weights, fp32
    ridx_ptr,  # [K] out: expert ids, int32
    I_d,
    I_e,
    H,
    E,
    stride_wd,
    stride_we,
    stride_wen,
    stride_act,
    TOP_K: tl.constexpr,
    BLOCK_TOPK: tl.constexpr,  # next power of 2 of TOP_K
    BLOCK_E: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROUTED: tl.constexpr = 1,  # 1: route in every expert program; 0: (rw, ridx) given by a routing launch before
    PDL: tl.constexpr = 0,  # launched with launch_pdl (perfkit/kernels/pdl.py)
):
    pid = tl.program_id(0)
    nb_d = tl.cdiv(I_d, BLOCK_N)
    dense = pid < nb_d
    offs_k = tl.arange(0, BLOCK_K)
    lanes = tl.arange(0, BLOCK_N)
    # a dense program's first weight tiles in flight before the wait (constant); an expert program loads none here
    offs_d = pid * BLOCK_N + lanes
    gd_ptrs, ud_ptrs = _gate_up_ptrs(wd_ptr, I_d, stride_wd, offs_d, offs_k)
    gd, ud = _gate_up_first(gd_ptrs, ud_ptrs, H * dense.to(tl.int32), offs_k, BLOCK_K, 1)
    pdl_enter(PDL)  # x, x2 and the logits come from the sandwich just before
    if dense:
        a = _gate_up_rest(gd, ud, xd_ptr + offs_k, gd_ptrs, ud_ptrs, H, offs_k, BLOCK_N, BLOCK_K, 1)
        tl.store(hd_ptr + offs_d, a.to(hd_ptr.dtype.element_ty), mask=offs_d < I_d)
    else:  # one routed slot's rows: the routing first, then its expert's weights
        nb_e = tl.cdiv(I_e, BLOCK_N)
        q = pid - nb_d
        k = q // nb_e
        blk = q % nb_e
        if ROUTED:
            wv, iv = _topk_row(logits_ptr, 0, 0, scale_ptr, E, TOP_K, BLOCK_TOPK, BLOCK_E)
            kk = tl.arange(0, BLOCK_TOPK)
            e = tl.sum(tl.where(kk == k, iv, 0), axis=0).to(tl.int64)
            mine = kk == k + BLOCK_TOPK * (blk != 0).to(tl.int32)  # the slot's first block publishes its routing
            # for the down launch (a lane index past BLOCK_TOPK elsewhere: the interpreter refuses scalar & tensor)
            tl.store(rw_ptr + kk, wv, mask=mine)
            tl.store(ridx_ptr + kk, iv, mask=mine)
        else:
            e = tl.load(ridx_ptr + k).to(tl.int64)
        offs_n = blk * BLOCK_N + lanes
        g_ptrs, u_ptrs = _gate_up_ptrs(we_ptr + e * stride_we, I_e, stride_wen, offs_n, offs_k)
        g, u = _gate_up_first(g_ptrs, u_ptrs, H, offs_k, BLOCK_K, 1)
        a = _gate_up_rest(g, u, xe_ptr + offs_k, g_ptrs, u_ptrs, H, offs_k, BLOCK_N, BLOCK_K, 1)
        tl.store(act_ptr + k * stride_act + offs_n, a.to(act_ptr.dtype.element_ty), mask=offs_n < I_e)


@triton.jit
def _moe_ffn_down_kernel(
    hd_ptr,  # [I_d] dense gelu(gate) * up
    wd_ptr,  # [H, I_d] dense down_proj; contiguous along I_d
    act_ptr,  # [K, I_e] experts' gelu(gate) * up per slot
    we_ptr,  # [E, H, I_e] experts' down_proj
    rw_ptr,  # [K] routing weights fp32
    ridx_ptr,  # [K] expert ids
    m_ptr,  # [H] out: the dense MLP's output
    e_ptr,  # [H] out: the experts' weighted sum
    H,
    I_d,
    I_e,
    stride_wd,
    stride_we,
    stride_wen,
    stride_act,
    TOP_K: tl.constexpr,  # a power of 2 (one [TOP_K, BLOCK_N, BLOCK_K] load per step)
    D_SLOTS: tl.constexpr,  # the dense row's I_d columns as D_SLOTS "slots" of D_SLOT (a power of 2; see below)
    D_SLOT: tl.constexpr,  # I_d // D_SLOTS (a constexpr: the compiler then knows each slot's 16-byte alignment)
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    pid = tl.program_id(0)
    nb = tl.cdiv(H, BLOCK_N)
    dense = pid < nb
    offs_k = tl.arange(0, BLOCK_K)
    offs_n = (pid % nb) * BLOCK_N + tl.arange(0, BLOCK_N)
    rn = tl.minimum(offs_n, H - 1).to(tl.int64)  # rows past H re-read row H - 1 (never stored)
    # the dense product's row split into D_SLOTS column ranges taken as slots of weight 1, so that one step loads
    # D_SLOTS tiles as the experts' does (one [1, BLOCK_N, BLOCK_K] tile per step made this branch latency-bound:
    # 12-11 ffn_probe, 18.9 us for the launch); its first tiles in flight before the wait (the weight is
    # constant); an expert program loads none here (live 0)
    ds = tl.arange(0, D_SLOTS)
    wd_ptrs = wd_ptr + (ds * D_SLOT)[:, None, None] + (rn * stride_wd)[None, :, None] + offs_k[None, None, :]
    live_d = (ds < D_SLOTS * dense.to(tl.int32))[:, None, None]
    wvd = _down_first(wd_ptrs, live_d, D_SLOT, BLOCK_K, 1)
    pdl_enter(PDL)  # h_d, act and the routing come from the gate_up launch just before
    if dense:
        hd_ptrs = hd_ptr + (ds * D_SLOT)[:, None] + offs_k[None, :]  # [D_SLOTS, BLOCK_K]
        ones = tl.full([D_SLOTS], 1.0, tl.float32)
        y = _down_rest(wvd, hd_ptrs, wd_ptrs, ones, live_d, D_SLOT, D_SLOTS, BLOCK_N, BLOCK_K, 1)
        tl.store(m_ptr + offs_n, y.to(m_ptr.dtype.element_ty), mask=offs_n < H)
    else:  # the routed slots
        slots = tl.arange(0, TOP_K)
        es = tl.load(ridx_ptr + slots).to(tl.int64)
        wts = tl.load(rw_ptr + slots).to(tl.float32)
        live = (wts != 0)[:, None, None]
        we_ptrs = we_ptr + es[:, None, None] * stride_we + (rn * stride_wen)[None, :, None] + offs_k[None, None, :]
        act_ptrs = act_ptr + (slots * stride_act)[:, None] + offs_k[None, :]  # [TOP_K, BLOCK_K]
        wve = _down_first(we_ptrs, live, I_e, BLOCK_K, 1)
        y = _down_rest(wve, act_ptrs, we_ptrs, wts, live, I_e, TOP_K, BLOCK_N, BLOCK_K, 1)
        tl.store(e_ptr + offs_n, y.to(e_ptr.dtype.element_ty), mask=offs_n < H)


def moe_ffn_fits(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, experts_gate_up: torch.Tensor,
                 experts_down: torch.Tensor, top_k: int) -> bool:  # fmt: skip
    """The two launches can run this block: one row, every weight in x's dtype with unit stride along its input,
    a power-of-2 top_k (the down launch loads all slots as one tile), matching widths."""
    ws = (w_gate_up, w_down, experts_gate_up, experts_down)
    H = x.shape[-1]
    return (
        x.dim() == 2 and x.shape[0] == 1 and top_k > 0 and top_k & (top_k - 1) == 0
        and all(w.dtype == x.dtype and w.stride(-1) == 1 and w.device == x.device for w in ws)
        and w_gate_up.shape[1] == H and experts_gate_up.shape[2] == H
        and w_down.shape == (H, w_gate_up.shape[0] // 2) and experts_down.shape[1:] == (H, experts_gate_up.shape[1] // 2)
    )  # fmt: skip


def moe_ffn(
    x: torch.Tensor,
    x2: torch.Tensor,
    logits: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    experts_gate_up: torch.Tensor,
    experts_down: torch.Tensor,
    top_k: int,
    per_expert_scale: torch.Tensor,
    pdl: bool = False,
    routing: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token's dense MLP and routed experts in two launches -> (m [1, H], e [1, H]) in x's dtype.

    x / x2: [1, H] the dense / experts' inputs; logits [1, E] the router's; w_gate_up [2 I_d, H] (gate rows, then
    up), w_down [H, I_d]; experts_gate_up [E, 2 I_e, H], experts_down [E, H, I_e]; top_k a power of 2.
    routing: (w fp32 [1, K], ids int32 [1, K]) from a routing launch before, which the gate_up launch then reads
    instead of routing in every expert program (logits unused). pdl: launch both with programmatic dependent
    launch (perfkit/kernels/pdl.py; sm_90+ only)."""
    if not moe_ffn_fits(x, w_gate_up, w_down, experts_gate_up, experts_down, top_k):
        raise ValueError("moe_ffn: needs one row, weights in x's dtype with unit column stride, matching widths "
                         f"and a power-of-2 top_k (x {tuple(x.shape)}, top_k {top_k})")  # fmt: skip
    if x2.shape != x.shape or logits.dim() != 2 or logits.shape[0] != 1:
        raise ValueError(f"moe_ffn: x2 {tuple(x2.shape)} must equal x {tuple(x.shape)}, logits [1, E]")
    h_d, act, rw, ridx = moe_ffn_gate_up(
        x, x2, logits, w_gate_up, experts_gate_up, top_k, per_expert_scale, pdl=pdl, routing=routing
    )  # fmt: skip
    return moe_ffn_down(h_d, act, rw, ridx, w_down, experts_down, pdl=pdl)


def moe_ffn_gate_up(
    x: torch.Tensor,
    x2: torch.Tensor,
    logits: torch.Tensor,
    w_gate_up: torch.Tensor,
    experts_gate_up: torch.Tensor,
    top_k: int,
    per_expert_scale: torch.Tensor,
    pdl: bool = False,
    routing: tuple[torch.Tensor, torch.Tensor] | None = None,
    tiles: dict[str, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`moe_ffn`'s first launch (inputs as moe_ffn checks them) -> (h_d [1, I_d], act [K, I_e], routing w fp32
    [1, K], ids int32 [1, K]). tiles: BLOCK_N / BLOCK_K / num_warps instead of GATE_UP_TILES (a sweep)."""
    I_d, H = w_gate_up.shape[0] // 2, x.shape[1]
    E, I_e = experts_gate_up.shape[0], experts_gate_up.shape[1] // 2
    x, x2, logits = x.contiguous(), x2.contiguous(), logits.contiguous()
    dev, dt = x.device, x.dtype
    h_d = torch.empty((1, I_d), dtype=dt, device=dev)
    act = torch.empty((top_k, I_e), dtype=dt, device=dev)
    if routing is None:
        rw = torch.empty((1, top_k), dtype=torch.float32, device=dev)
        ridx = torch.empty((1, top_k), dtype=torch.int32, device=dev)
    else:
        rw, ridx = routing
    t1 = GATE_UP_TILES if tiles is None else tiles
    grid = triton.cdiv(I_d, t1["BLOCK_N"]) + top_k * triton.cdiv(I_e, t1["BLOCK_N"])
    _moe_ffn_gate_up_kernel[(grid,)](
        x, x2, w_gate_up, experts_gate_up, h_d, act, logits, per_expert_scale, rw, ridx, I_d, I_e, H, E,
        w_gate_up.stride(0), experts_gate_up.stride(0), experts_gate_up.stride(1), act.stride(0),
        TOP_K=top_k, BLOCK_TOPK=top_k, BLOCK_E=triton.next_power_of_2(E), **t1, ROUTED=int(routing is None),
        **pdl_launch(pdl),
    )  # fmt: skip
    return h_d, act, rw, ridx


def moe_ffn_down(
    h_d: torch.Tensor,
    act: torch.Tensor,
    rw: torch.Tensor,
    ridx: torch.Tensor,
    w_down: torch.Tensor,
    experts_down: torch.Tensor,
    pdl: bool = False,
    tiles: dict[str, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`moe_ffn`'s second launch: (h_d, act, w, ids) of :func:`moe_ffn_gate_up` -> (m [1, H], e [1, H]).
    tiles: BLOCK_N / BLOCK_K / num_warps instead of DOWN_TILES (a sweep)."""
    H, I_d, I_e, top_k = w_down.shape[0], w_down.shape[1], experts_down.shape[2], act.shape[0]
    m = torch.empty((1, H), dtype=h_d.dtype, device=h_d.device)
    e = torch.empty((1, H), dtype=h_d.dtype, device=h_d.device)
    t2 = DOWN_TILES if tiles is None else tiles
    d_slots = top_k if I_d % top_k == 0 else 1
    _moe_ffn_down_kernel[(2 * triton.cdiv(H, t2["BLOCK_N"]),)](
        h_d, w_down, act, experts_down, rw, ridx, m, e, H, I_d, I_e,
        w_down.stride(0), experts_down.stride(0), experts_down.stride(1), act.stride(0),
        TOP_K=top_k, D_SLOTS=d_slots, D_SLOT=I_d // d_slots, **t2, **pdl_launch(pdl),
    )  # fmt: skip
    return m, e


def moe_ffn_ref(
    x: torch.Tensor,
    x2: torch.Tensor,
    logits: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    experts_gate_up: torch.Tensor,
    experts_down: torch.Tensor,
    top_k: int,
    per_expert_scale: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Straight from the definition in fp32 (no intermediate rounding) -> (m, e) in x's dtype."""
    I_d = w_down.shape[1]
    gu = x.float() @ w_gate_up.float().T
    h = torch.nn.functional.gelu(gu[:, :I_d], approximate="tanh") * gu[:, I_d:]
    m = (h @ w_down.float().T).to(x.dtype)
    w, idx = moe_routing_ref(logits, top_k, per_expert_scale)
    return m, fused_moe_ref(x2, experts_gate_up, experts_down, w, idx)


def moe_ffn_traffic(hidden: int, dense_inter: int, expert_inter: int, top_k: int, elt_bytes: int = 2) -> dict[str, int]:
    """Minimum DRAM bytes and FLOPs of :func:`moe_ffn` (one token): the dense gate_up [2 I_d, H] and down [H, I_d],
    top_k experts' gate_up [2 I_e, H] and down [H, I_e], each read once; activations x, x2 read, h_d and act
    written and read back, m and e written (the logits and routing, O(E + K), left out). The two launches read
    what the five separate ones read: the saving is launches, not bytes."""
    H, Id, Ie, K = hidden, dense_inter, expert_inter, top_k
    weights = 3 * Id * H + K * 3 * Ie * H
    acts = 2 * H + 2 * Id + 2 * K * Ie + 2 * H
    return {
        "weight_bytes": weights * elt_bytes,
        "activation_bytes": acts * elt_bytes,
        "bytes": (weights + acts) * elt_bytes,
        "flops": 2 * weights,
    }
