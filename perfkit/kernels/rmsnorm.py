"""Gemma4 RMSNorm kernels: plain / residual-add / sandwich (post-norm + residual, then the next pre-norms).

Gemma4's norm is ``y = x * (mean(x^2) + eps)^-0.5 * w`` in fp32 with bf16 (or any float) io (``reference/gemma4.md``
§2.1; ``w is None`` = the weightless ``with_scale=False`` variant, e.g. ``v_norm``).

Two kernels:

- :func:`rmsnorm` (``_rmsnorm_kernel``): ``y = norm(x [+ res]) * w * out_scale`` over the last dim, ROWS rows per
  program (1 row of a 1536..5376 hidden state, or several 256/512-wide heads of a ``[T, heads, hd]`` tensor). With
  ``residual`` it also returns ``s = x + res`` (pre-norm residual add: one read of each input, two writes).
- :func:`sandwich_rmsnorm` (``_sandwich_kernel``): the decoder layer's sandwich block (§2.5)::

      t = x                                       or  norm(x) * wa + norm(x2) * wb      (MoE: two post-FFN norms)
      h = (res + norm(t) * w) [* layer_scalar]                                          (post-norm + residual)
      y_j = norm(h) * w_j * mult_j,  j < len(next_weights) <= 3                         (the following pre-norms)

  Unfused this is 3 + 3·len(next) passes over [T, H] (norm, add, each next norm reads h); fused it reads x (x2),
  res once and writes h and the y_j once. In Gemma4's layer: after attention ``h = r + post_attn(a)`` feeds
  ``pre_ff(h)`` (and on MoE layers ``pre_ff_2(h)`` and the router's ``norm(h) * scale * H^-0.5``); after the
  MLP ``h = r + post_ff(m)`` (MoE: ``m = post_ff_1(m) + post_ff_2(e)``, the ``x2`` form) times ``layer_scalar``.

All math in fp32, one rounding to the output dtype per output (the unfused PyTorch path rounds after every op, so
bf16 results differ by about one bf16 ulp; fp32 agrees to ~1e-6).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from perfkit.kernels.pdl import pdl_enter, pdl_launch

SANDWICH_ROUTER_ROWS = 4  # router experts per extra sandwich program (26B-A4B: 128 experts -> 32 programs)

# --------------------------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------------------------


@triton.jit
def _rmsnorm_kernel(
    x_ptr,  # [R, N] (row stride stride_x, unit column stride)
    res_ptr,  # [R, N] residual (HAS_RES)
    w_ptr,  # [N] weight (HAS_W)
    out_ptr,  # [R, N] normed output
    res_out_ptr,  # [R, N] x + res (HAS_RES)
    R,
    N,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    eps,
    out_scale,
    HAS_RES: tl.constexpr,
    HAS_W: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr = 0,  # launched with launch_pdl (perfkit/kernels/pdl.py)
):
    pdl_enter(PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    rmask = rows < R
    cmask = cols < N
    m = rmask[:, None] & cmask[None, :]
    r64 = rows.to(tl.int64)[:, None]
    x = tl.load(x_ptr + r64 * stride_x + cols[None, :], mask=m, other=0.0).to(tl.float32)
    if HAS_RES:
        x += tl.load(res_ptr + r64 * stride_r + cols[None, :], mask=m, other=0.0).to(tl.float32)
        tl.store(res_out_ptr + r64 * stride_ro + cols[None, :], x.to(res_out_ptr.dtype.element_ty), mask=m)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / N + eps)
    y = x * rstd[:, None]
    if HAS_W:
        y = y * tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    y = y * out_scale
    tl.store(out_ptr + r64 * stride_o + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _norm_row(v, N, eps):
    return v * tl.rsqrt(tl.sum(v * v, axis=0) / N + eps)


@triton.jit
def _store_next(hn, w_ptr, mult, y_row_ptr, cols, cm):
    """One following pre-norm of the sandwich: ``y = norm(h) * w * mult``, stored in y's dtype."""
    y = hn * tl.load(w_ptr + cols, mask=cm, other=0.0).to(tl.float32) * mult
    tl.store(y_row_ptr + cols, y.to(y_row_ptr.dtype.element_ty), mask=cm)


@triton.jit
def _sandwich_kernel(
    x_ptr,  # [R, N] block output (attention / MLP / PLE projection)
    x2_ptr,  # [R, N] second block output (HAS_X2: MoE experts)
    wa_ptr,  # [N] norm weight of x when HAS_X2 (post_feedforward_layernorm_1)
    wb_ptr,  # [N] norm weight of x2 (post_feedforward_layernorm_2)
    res_ptr,  # [R, N] residual stream
    w_ptr,  # [N] post-norm weight
    scalar_ptr,  # [1] layer_scalar (HAS_SCALAR)
    h_ptr,  # [R, N] out: new residual stream
    w1_ptr,
    w2_ptr,
    w3_ptr,  # [N] next pre-norm weights
    y1_ptr,
    y2_ptr,
    y3_ptr,  # [R, N] next pre-norm outputs (contiguous rows)
    rw_ptr,  # [E, N] router weight (HAS_ROUTER), contiguous
    rn_ptr,  # [N] the router's norm weight
    logits_ptr,  # [R, E] out: router logits
    N,
    stride_x,
    stride_x2,
    stride_r,
    eps,
    mult1,
    mult2,
    mult3,
    rmult,  # the router norm's multiplier (H^-0.5)
    E,  # router experts
    HAS_X2: tl.constexpr,
    HAS_SCALAR: tl.constexpr,
    NUM_NEXT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_ROUTER: tl.constexpr = 0,  # programs (row, j >= 1) compute router logits (sandwich_rmsnorm(router=))
    ROUTER_ROWS: tl.constexpr = 1,  # experts per router program
    PDL: tl.constexpr = 0,  # launched with launch_pdl (perfkit/kernels/pdl.py)
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    cm = cols < N
    if HAS_ROUTER:  # program (row, j >= 1): router rows [(j-1) R, j R), their weight in flight before the wait
        j = tl.program_id(1)
        r = (j - 1) * ROUTER_ROWS + tl.arange(0, ROUTER_ROWS)  # negative (nothing loaded) for program (row, 0)
        wt = tl.load(rw_ptr + r[:, None] * N + cols[None, :], mask=((r >= 0) & (r < E))[:, None] & cm[None, :],
                     other=0.0)  # fmt: skip
    pdl_enter(PDL)
    h = _sandwich_h(x_ptr, x2_ptr, wa_ptr, wb_ptr, res_ptr, w_ptr, scalar_ptr, row, N, stride_x, stride_x2, stride_r,
                    eps, cols, cm, HAS_X2, HAS_SCALAR)  # fmt: skip
    if HAS_ROUTER:
        if j > 0:  # the router's input exactly as a stored pre-norm output (rounded to x's dtype), its product
            y = _norm_row(h, N, eps) * tl.load(rn_ptr + cols, mask=cm, other=0.0).to(tl.float32) * rmult
            y = y.to(logits_ptr.dtype.element_ty).to(tl.float32)
            z = tl.sum(wt.to(tl.float32) * y[None, :], axis=1)  # [ROUTER_ROWS]
            tl.store(logits_ptr + row * E + r, z.to(logits_ptr.dtype.element_ty), mask=(r >= 0) & (r < E))
        else:
            _sandwich_outputs(h, h_ptr, w1_ptr, w2_ptr, w3_ptr, y1_ptr, y2_ptr, y3_ptr, row, N, eps, mult1, mult2,
                              mult3, cols, cm, NUM_NEXT)  # fmt: skip
    else:
        _sandwich_outputs(h, h_ptr, w1_ptr, w2_ptr, w3_ptr, y1_ptr, y2_ptr, y3_ptr, row, N, eps, mult1, mult2, mult3,
                          cols, cm, NUM_NEXT)  # fmt: skip


@triton.jit
def _sandwich_h(x_ptr, x2_ptr, wa_ptr, wb_ptr, res_ptr, w_ptr, scalar_ptr, row, N, stride_x, stride_x2, stride_r, eps,
                cols, cm, HAS_X2: tl.constexpr, HAS_SCALAR: tl.constexpr):  # fmt: skip
    """The new residual stream of one row, fp32 (before its rounding to h's dtype)."""
    x = tl.load(x_ptr + row * stride_x + cols, mask=cm, other=0.0).to(tl.float32)
    if HAS_X2:
        x2 = tl.load(x2_ptr + row * stride_x2 + cols, mask=cm, other=0.0).to(tl.float32)
        wa = tl.load(wa_ptr + cols, mask=cm, other=0.0).to(tl.float32)
        wb = tl.load(wb_ptr + cols, mask=cm, other=0.0).to(tl.float32)
        x = _norm_row(x, N, eps) * wa + _norm_row(x2, N, eps) * wb
    w = tl.load(w_ptr + cols, mask=cm, other=0.0).to(tl.float32)
    h = tl.load(res_ptr + row * stride_r + cols, mask=cm, other=0.0).to(tl.float32) + _norm_row(x, N, eps) * w
    if HAS_SCALAR:
        h = h * tl.load(scalar_ptr).to(tl.float32)
    return h


@triton.jit
def _sandwich_outputs(h, h_ptr, w1_ptr, w2_ptr, w3_ptr, y1_ptr, y2_ptr, y3_ptr, row, N, eps, mult1, mult2, mult3, cols,
                      cm, NUM_NEXT: tl.constexpr):  # fmt: skip
    """Program (row, 0): h stored, then the following pre-norms."""
    tl.store(h_ptr + row * N + cols, h.to(h_ptr.dtype.element_ty), mask=cm)
    if NUM_NEXT > 0:
        hn = _norm_row(h, N, eps)
        _store_next(hn, w1_ptr, mult1, y1_ptr + row * N, cols, cm)
        if NUM_NEXT > 1:
            _store_next(hn, w2_ptr, mult2, y2_ptr + row * N, cols, cm)
        if NUM_NEXT > 2:
            _store_next(hn, w3_ptr, mult3, y3_ptr + row * N, cols, cm)


# --------------------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------------------


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as a 2-D [R, N] view with unit column stride (copies only when the last dim is strided)."""
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    return x2 if x2.stride(-1) == 1 or x2.shape[-1] == 1 else x2.contiguous()


def _warps(block_n: int) -> int:
    return max(1, min(16, block_n // 256))


def rmsnorm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    residual: torch.Tensor | None = None,
    out_scale: float = 1.0,
    pdl: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``norm(x) * weight * out_scale`` over the last dim, x of any leading shape ([T, H] or [T, heads, hd]).

    With ``residual``: returns ``(norm(x + residual) * weight, x + residual)``. Output dtype = x's dtype.
    pdl: launch with programmatic dependent launch (perfkit/kernels/pdl.py; sm_90+ only).
    """
    shape, N = x.shape, x.shape[-1]
    x2 = _rows(x)
    R = x2.shape[0]
    out = torch.empty(shape, dtype=x.dtype, device=x.device)
    o2 = out.view(-1, N)
    if residual is not None:
        if residual.shape != shape:
            raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(shape)}")
        r2 = _rows(residual)
        res_out = torch.empty(shape, dtype=x.dtype, device=x.device)
        ro2 = res_out.view(-1, N)
    else:
        r2, res_out, ro2 = x2, None, o2
    if R == 0:
        return out if residual is None else (out, res_out)
    block_n = triton.next_power_of_2(N)
    rows = max(1, min(16, 2048 // block_n))  # several short rows (per-head norms) per program
    _rmsnorm_kernel[(triton.cdiv(R, rows),)](
        x2, r2, x2 if weight is None else weight, o2, ro2, R, N,
        x2.stride(0), r2.stride(0), o2.stride(0), ro2.stride(0), float(eps), float(out_scale),
        HAS_RES=residual is not None, HAS_W=weight is not None, ROWS=rows, BLOCK_N=block_n,
        num_warps=_warps(block_n * rows), **pdl_launch(pdl),
    )  # fmt: skip
    return out if residual is None else (out, res_out)


def sandwich_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    x2: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    scalar: torch.Tensor | None = None,
    next_weights: Sequence[torch.Tensor] = (),
    next_mults: Sequence[float] | None = None,
    router: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    pdl: bool = False,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``h = (residual + norm(t) * weight) * scalar``, ``t = x`` or, with ``x2 = (e, wa, wb)``,
    ``t = norm(x) * wa + norm(e) * wb``; returns ``(h, [norm(h) * w_j * mult_j for w_j in next_weights])``.

    x, residual, e: [T, H] (row-strided views allowed); weights [H]; scalar: a 1-element tensor (layer_scalar).
    router: (proj [E, H], norm weight [H], mult): a MoE router's product rides in this launch, and the logits
    ``proj @ (norm(h) * norm_weight * mult)`` [T, E] (the input rounded to x's dtype, as a pre-norm output would
    be; fp32 accumulation, logits in x's dtype) are appended to the returned list. Extra programs
    (``SANDWICH_ROUTER_ROWS`` experts each) recompute the row's h and load their router rows before the PDL wait;
    the batch-1 MoE FFN (perfkit/kernels/moe_ffn.py) reads the logits in its next launch.
    pdl: launch with programmatic dependent launch (perfkit/kernels/pdl.py; sm_90+ only).
    """
    if x.dim() != 2 or residual.shape != x.shape:
        raise ValueError(f"x {tuple(x.shape)} and residual {tuple(residual.shape)} must be equal 2-D shapes")
    if len(next_weights) > 3:
        raise ValueError("at most 3 next_weights")
    mults = [1.0] * len(next_weights) if next_mults is None else [float(m) for m in next_mults]
    if len(mults) != len(next_weights):
        raise ValueError("next_mults must match next_weights")
    R, N = x.shape
    xr, rr = _rows(x), _rows(residual)
    h = torch.empty((R, N), dtype=residual.dtype, device=x.device)
    ys = [torch.empty((R, N), dtype=x.dtype, device=x.device) for _ in next_weights]
    if R == 0:
        return h, ys if router is None else [*ys, torch.empty((0, router[0].shape[0]), dtype=x.dtype, device=x.device)]
    if x2 is not None:
        e, wa, wb = x2
        if e.shape != x.shape:
            raise ValueError(f"x2 shape {tuple(e.shape)} != x shape {tuple(x.shape)}")
        er = _rows(e)
    else:
        er, wa, wb = xr, weight, weight
    ws = list(next_weights) + [weight] * (3 - len(next_weights))
    yp = ys + [h] * (3 - len(ys))
    mp = mults + [1.0] * (3 - len(mults))
    block_n = triton.next_power_of_2(N)
    rw, rn, rmult, E, logits, programs = weight, weight, 1.0, 0, h, 1
    if router is not None:
        rw, rn, rmult = router
        E = rw.shape[0]
        if rw.shape != (E, N) or rn.shape != (N,) or not rw.is_contiguous():
            raise ValueError(f"router weight {tuple(rw.shape)} must be a contiguous [E, {N}], its norm weight [{N}]")
        logits = torch.empty((R, E), dtype=x.dtype, device=x.device)
        programs = 1 + triton.cdiv(E, SANDWICH_ROUTER_ROWS)
    _sandwich_kernel[(R, programs)](
        xr, er, wa, wb, rr, weight, weight if scalar is None else scalar, h, *ws, *yp, rw, rn, logits,
        N, xr.stride(0), er.stride(0), rr.stride(0), float(eps), *mp, float(rmult), E,
        HAS_X2=x2 is not None, HAS_SCALAR=scalar is not None, NUM_NEXT=len(next_weights), BLOCK_N=block_n,
        HAS_ROUTER=router is not None, ROUTER_ROWS=SANDWICH_ROUTER_ROWS, num_warps=_warps(block_n), **pdl_launch(pdl),
    )  # fmt: skip
    return h, ys if router is None else [*ys, logits]


# --------------------------------------------------------------------------------------------------------------
# PyTorch references (the unfused model's op sequence, rounding after every op)
# --------------------------------------------------------------------------------------------------------------


def rmsnorm_ref(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    residual: torch.Tensor | None = None,
    out_scale: float = 1.0,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    s = x if residual is None else x + residual
    xf = s.float()
    y = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if weight is not None:
        y = y * weight.float()
    y = (y * out_scale).to(x.dtype)
    return y if residual is None else (y, s)


def sandwich_rmsnorm_ref(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    x2: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    scalar: torch.Tensor | None = None,
    next_weights: Sequence[torch.Tensor] = (),
    next_mults: Sequence[float] | None = None,
    router: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    t = x
    if x2 is not None:
        e, wa, wb = x2
        t = rmsnorm_ref(x, wa, eps) + rmsnorm_ref(e, wb, eps)
    h = residual + rmsnorm_ref(t, weight, eps)
    if scalar is not None:
        h = h * scalar
    mults = [1.0] * len(next_weights) if next_mults is None else list(next_mults)
    ys = [rmsnorm_ref(h, w, eps, out_scale=m) for w, m in zip(next_weights, mults, strict=True)]
    if router is not None:  # the router's product of its (rounded) input, fp32 accumulation
        proj, rn, rmult = router
        ys.append((rmsnorm_ref(h, rn, eps, out_scale=rmult).float() @ proj.float().T).to(x.dtype))
    return h, ys


# --------------------------------------------------------------------------------------------------------------
# Traffic
# --------------------------------------------------------------------------------------------------------------


def rmsnorm_traffic(
    rows: int, n: int, elt_bytes: int = 2, residual: bool = False, weight: bool = True, w_bytes: int | None = None
) -> dict[str, int]:
    """Minimum DRAM bytes of :func:`rmsnorm`: read x (+ residual), write y (+ x + residual), read w once.

    FLOPs per element: square + sum (2), scale by rstd (1), weight (1), residual add (1).
    """
    w_bytes = elt_bytes if w_bytes is None else w_bytes
    read = rows * n * elt_bytes * (2 if residual else 1) + (n * w_bytes if weight else 0)
    written = rows * n * elt_bytes * (2 if residual else 1)
    flops = rows * n * (3 + int(weight) + int(residual))
    return {"bytes_read": read, "bytes_written": written, "total_bytes": read + written, "flops": flops}


def sandwich_rmsnorm_traffic(
    rows: int, n: int, elt_bytes: int = 2, num_next: int = 0, x2: bool = False, w_bytes: int | None = None,
    router_experts: int = 0,
) -> dict[str, int]:
    """Minimum DRAM bytes of :func:`sandwich_rmsnorm`: read x (+ x2), res, the weights; write h and num_next outputs.
    ``router_experts`` E > 0: the router's product rides along: its [E, n] weight and norm weight read, [rows, E]
    logits written, 2 E n FLOPs per row (its programs' re-reads of x and res hit L2 and are not counted).

    ``unfused_bytes``: the PyTorch sequence (each norm reads and writes [R, N], the add reads 2 and writes 1, each
    next norm reads h; the x2 form adds two norms and one add), for the saving.
    """
    w_bytes = elt_bytes if w_bytes is None else w_bytes
    a = rows * n * elt_bytes
    n_w = 1 + num_next + (2 if x2 else 0)
    router = (router_experts + 1) * n * w_bytes if router_experts else 0
    read = a * (2 + int(x2)) + n_w * n * w_bytes + router
    written = a * (1 + num_next) + rows * router_experts * elt_bytes
    unfused = (2 * a + 3 * a) + num_next * 2 * a + (7 * a if x2 else 0) + n_w * n * w_bytes
    flops = rows * n * (4 + 1 + 4 * num_next + (9 if x2 else 0) + 2 * router_experts)
    return {
        "bytes_read": read,
        "bytes_written": written,
        "total_bytes": read + written,
        "unfused_bytes": unfused,
        "flops": flops,
    }
