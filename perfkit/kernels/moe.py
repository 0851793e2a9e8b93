"""Fused MoE for Gemma4 26B-A4B (``reference/gemma4.md`` §3): routing kernel + expert-grouped GEMMs, no loop over E.

Pipeline (:func:`fused_moe` after :func:`moe_routing`)::

    routing   w, idx = topk(softmax_f32(logits), K); w /= sum(w); w *= per_expert_scale[idx]     (one program/token)
    align     the T*K (token, slot) "pairs" sorted by expert (stable), each expert's run padded to BLOCK_M rows;
              sorted_ids [n_blocks_max * BLOCK_M] (pad = T*K), block_expert [n_blocks_max] (unused block = E).
              Pure tensor ops, no host sync (CUDA-graph safe): n_blocks_max = cdiv(T*K, BLOCK_M) + min(E, T*K)
              bounds sum_e cdiv(n_e, BLOCK_M); programs of unused blocks exit at once.
    gate_up   act[p] = gelu_tanh(x[p // K] @ Wg[e].T) * (x[p // K] @ Wu[e].T)     (one grouped GEMM, two
              accumulators: the gate rows [0, I) and up rows [I, 2I) of gate_up_proj[e]; act [T*K, I] pair order)
    down      y[p] = w[p] * (act[p] @ Wd[e].T)                                   (grouped GEMM, weight fused)
    combine   out[t] = sum_k y[t*K + k]                                          (deterministic, no atomics)

Each program owns a BLOCK_M x BLOCK_N tile of one expert's rows, so each active expert's weights stream from
DRAM once per step (per N tile); at decode every routed expert is read once, which is the roofline. Tiles:
decode (T*K <= 1024) BLOCK_M 16 with narrow N tiles for SM coverage; prefill BLOCK_M 64.
Math: bf16 (or fp32) operands, fp32 accumulation (fp32 inputs use IEEE dots, no TF32), outputs in x's dtype.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

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
):
    t = tl.program_id(0).to(tl.int64)
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
    tl.store(w_ptr + t * TOP_K + kk, wv, mask=km)
    tl.store(idx_ptr + t * TOP_K + kk, iv, mask=km)


@triton.jit
def _gelu_tanh_f32(g):
    z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
    return g / (1.0 + tl.exp(tl.minimum(-2.0 * z, 80.0)))


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
    A_BY_TOKEN: tl.constexpr,
    GELU_MUL: tl.constexpr,
    MUL_W: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,  # interpreter only: its bf16 tl.dot multiplies the raw uint16 bits
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_m)
    if e < E:
        ids = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = ids < num_pairs
        if A_BY_TOKEN:
            arow = ids // top_k
        else:
            arow = ids
        arow = tl.where(valid, arow, 0).to(tl.int64)
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
        if GELU_MUL:
            acc = _gelu_tanh_f32(acc) * acc_u
        if MUL_W:
            acc = acc * tl.load(topw_ptr + ids, mask=valid, other=0.0)[:, None]
        c_ptrs = c_ptr + ids.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & nmask[None, :])


# --------------------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------------------


def moe_routing(logits: torch.Tensor, top_k: int, per_expert_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] logits -> (weights fp32 [T, K], expert ids int32 [T, K]) in HF order (renormalise, then scale)."""
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


def _tiles(num_pairs: int, stage: str) -> dict[str, int]:
    if num_pairs <= 1024:  # decode: few rows per expert, weight-streaming bound -> narrow N tiles, wide K
        return {"BLOCK_M": 16, "BLOCK_N": 32 if stage == "gate_up" else 64, "BLOCK_K": 128, "num_warps": 4}
    return {"BLOCK_M": 64, "BLOCK_N": 64 if stage == "gate_up" else 128, "BLOCK_K": 64, "num_warps": 4}


def _fit(t: dict[str, int], n: int, kd: int) -> dict[str, int]:
    """Shrink N/K tiles for small problems (tests); never below 16 (tl.dot minimum)."""
    t = dict(t)
    t["BLOCK_N"] = max(16, min(t["BLOCK_N"], triton.next_power_of_2(n)))
    t["BLOCK_K"] = max(16, min(t["BLOCK_K"], triton.next_power_of_2(kd)))
    return t


def fused_moe(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_w: torch.Tensor,
    topk_idx: torch.Tensor,
    *,
    block_m: int | None = None,
) -> torch.Tensor:
    """Routed GeGLU experts: x [T, H], w_gate_up [E, 2I, H] (gate rows first), w_down [E, H, I],
    topk_w [T, K] (applied to each expert's output), topk_idx [T, K] -> [T, H] in x's dtype."""
    T, H = x.shape
    E, two_i, H2 = w_gate_up.shape
    inter = two_i // 2
    if H2 != H or w_down.shape != (E, H, inter) or topk_idx.shape != topk_w.shape or topk_idx.shape[0] != T:
        raise ValueError(
            f"shapes: x {tuple(x.shape)}, gate_up {tuple(w_gate_up.shape)}, down {tuple(w_down.shape)}, "
            f"w {tuple(topk_w.shape)}, idx {tuple(topk_idx.shape)}"
        )
    K = topk_idx.shape[1]
    P = T * K
    if P == 0:
        return torch.zeros_like(x)
    x = x if x.stride(-1) == 1 else x.contiguous()
    w_gate_up = w_gate_up.contiguous()
    w_down = w_down.contiguous()
    t1, t2 = _fit(_tiles(P, "gate_up"), inter, H), _fit(_tiles(P, "down"), H, inter)
    bm = block_m or t1["BLOCK_M"]
    t1["BLOCK_M"] = t2["BLOCK_M"] = bm
    sorted_ids, block_expert = moe_align(topk_idx, E, bm)
    n_blocks = block_expert.numel()
    upcast = os.environ.get("TRITON_INTERPRET") == "1" and x.dtype != torch.float32
    prec = "ieee" if x.dtype == torch.float32 or upcast else "tf32"
    act = torch.empty((P, inter), dtype=x.dtype, device=x.device)
    w_flat = topk_w.reshape(-1).to(torch.float32).contiguous()
    _moe_gemm_kernel[(n_blocks, triton.cdiv(inter, t1["BLOCK_N"]))](
        x, w_gate_up, act, sorted_ids, block_expert, w_flat,
        inter, H, E, P, K, x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1), w_gate_up.stride(2), act.stride(0),
        A_BY_TOKEN=True, GELU_MUL=True, MUL_W=False, DOT_PRECISION=prec, UPCAST=upcast, **t1,
    )  # fmt: skip
    y = torch.empty((P, H), dtype=x.dtype, device=x.device)
    _moe_gemm_kernel[(n_blocks, triton.cdiv(H, t2["BLOCK_N"]))](
        act, w_down, y, sorted_ids, block_expert, w_flat,
        H, inter, E, P, K, act.stride(0), w_down.stride(0), w_down.stride(1), w_down.stride(2), y.stride(0),
        A_BY_TOKEN=False, GELU_MUL=False, MUL_W=True, DOT_PRECISION=prec, UPCAST=upcast, **t2,
    )  # fmt: skip
    return y.view(T, K, H).sum(dim=1)


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
) -> dict[str, int]:
    """Minimum DRAM bytes and FLOPs of :func:`fused_moe` (routing metadata, O(T K) int32, left out).

    Weights: every active expert's gate_up [2I, H] and down [H, I] once (``active_experts`` default: the
    uniform-routing expectation, rounded). Activations: x [T, H] read, act [T K, I] written + read, y [T K, H]
    written + read, out [T, H] written. FLOPs: 2 T K H (2I) + 2 T K I H (+ ~10 per act element for the gelu-mul).
    """
    a = round(expected_active_experts(tokens, num_experts, top_k)) if active_experts is None else active_experts
    P = tokens * top_k
    weights = a * 3 * inter * hidden * elt_bytes
    read = weights + tokens * hidden * elt_bytes + P * inter * elt_bytes + P * hidden * elt_bytes
    written = P * inter * elt_bytes + P * hidden * elt_bytes + tokens * hidden * elt_bytes
    flops = 6 * P * hidden * inter + 10 * P * inter + 2 * P * hidden
    return {
        "weight_bytes": weights,
        "bytes_read": read,
        "bytes_written": written,
        "total_bytes": read + written,
        "flops": flops,
        "active_experts": a,
    }
