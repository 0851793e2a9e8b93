"""Per-head RMSNorm (with weight) + rotate-half RoPE in one pass; optionally v_norm of the same raw input.

Gemma4 attention (``reference/gemma4.md`` §2.4)::

    q = rope(q_norm(q_raw));   k = rope(k_norm(k_raw));   v = v_norm(v_raw)   (v_norm: no weight, no rope)
    K=V full layers: v_raw = k_raw  -> one kernel reads k_raw once and writes both k and v.

RoPE is GPT-NeoX rotate-half: dim d pairs with d + hd/2, ``o1 = y1 cos - y2 sin``, ``o2 = y2 cos + y1 sin`` with
``cos/sin [T, hd/2]`` (one entry per frequency, already gathered at the token positions). Sliding layers (hd 256)
rotate every pair. Full layers (hd 512, "proportional") have 64 live frequencies ``1e6^(-2i/512)`` and 192 zero
ones, so the tables hold cos = 1, sin = 0 there: the generic rotate-half with a table lookup rotates exactly the
pairs (0..63, 256..319) and passes dims 64..255 and 320..511 through (tested against an explicit construction).

One program per (token, BLOCK_H heads); each head row is loaded as two halves [BLOCK_H, HALF]; fp32 math, one
rounding to the output dtype. Unfused: norm (read + write), rope (read x + tables, write), v_norm (read + write).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# --------------------------------------------------------------------------------------------------------------
# Triton kernel
# --------------------------------------------------------------------------------------------------------------


@triton.jit
def _qk_norm_rope_kernel(
    x_ptr,  # [T, NH, HD] raw projection (strides stride_t, stride_h, 1)
    w_ptr,  # [HD] norm weight (HAS_W)
    cos_ptr,  # [T, HD/2] (row stride stride_c)
    sin_ptr,  # [T, HD/2] (row stride stride_s)
    out_ptr,  # [T, NH, HD] contiguous: norm (+ weight) (+ rope)
    v_ptr,  # [T, NH, HD] contiguous: weightless norm, no rope (WRITE_V)
    NH,
    half,
    stride_t,
    stride_h,
    stride_c,
    stride_s,
    eps,
    HAS_W: tl.constexpr,
    HAS_ROPE: tl.constexpr,
    WRITE_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, HALF)
    dm = d < half
    m = (heads < NH)[:, None] & dm[None, :]
    src = x_ptr + t * stride_t + heads[:, None].to(tl.int64) * stride_h + d[None, :]
    x1 = tl.load(src, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(src + half, mask=m, other=0.0).to(tl.float32)
    rstd = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * half) + eps)[:, None]
    y1 = x1 * rstd
    y2 = x2 * rstd
    dst = t * NH * 2 * half + heads[:, None].to(tl.int64) * (2 * half) + d[None, :]
    if WRITE_V:
        tl.store(v_ptr + dst, y1.to(v_ptr.dtype.element_ty), mask=m)
        tl.store(v_ptr + dst + half, y2.to(v_ptr.dtype.element_ty), mask=m)
    if HAS_W:
        y1 = y1 * tl.load(w_ptr + d, mask=dm, other=0.0).to(tl.float32)[None, :]
        y2 = y2 * tl.load(w_ptr + half + d, mask=dm, other=0.0).to(tl.float32)[None, :]
    if HAS_ROPE:
        c = tl.load(cos_ptr + t * stride_c + d, mask=dm, other=1.0).to(tl.float32)[None, :]
        s = tl.load(sin_ptr + t * stride_s + d, mask=dm, other=0.0).to(tl.float32)[None, :]
        o1 = y1 * c - y2 * s
        o2 = y2 * c + y1 * s
        y1 = o1
        y2 = o2
    tl.store(out_ptr + dst, y1.to(out_ptr.dtype.element_ty), mask=m)
    tl.store(out_ptr + dst + half, y2.to(out_ptr.dtype.element_ty), mask=m)


# --------------------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------------------


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    eps: float,
    write_v: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if x.dim() != 3 or x.shape[-1] % 2:
        raise ValueError(f"x must be [T, heads, hd] with an even hd, got {tuple(x.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    T, NH, HD = x.shape
    half = HD // 2
    out = torch.empty((T, NH, HD), dtype=x.dtype, device=x.device)
    v = torch.empty_like(out) if write_v else None
    if cos is not None:
        assert sin is not None
        if cos.shape != (T, half) or sin.shape != (T, half):
            raise ValueError(f"cos/sin must be [T, hd/2] = {(T, half)}, got {tuple(cos.shape)} / {tuple(sin.shape)}")
        if cos.stride(-1) != 1:
            cos = cos.contiguous()
        if sin.stride(-1) != 1:
            sin = sin.contiguous()
    if T == 0 or NH == 0:
        return out, v
    HALF = triton.next_power_of_2(half)
    block_h = max(1, min(triton.next_power_of_2(NH), 2048 // HALF))
    c = x if cos is None else cos
    s = x if sin is None else sin
    _qk_norm_rope_kernel[(T, triton.cdiv(NH, block_h))](
        x, x if weight is None else weight, c, s, out, out if v is None else v,
        NH, half, x.stride(0), x.stride(1), c.stride(0), s.stride(0), float(eps),
        HAS_W=weight is not None, HAS_ROPE=cos is not None, WRITE_V=write_v, BLOCK_H=block_h, HALF=HALF,
        num_warps=max(1, min(8, block_h * HALF // 256)),
    )  # fmt: skip
    return out, v


def qk_norm_rope(
    x: torch.Tensor, weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, eps: float
) -> torch.Tensor:
    """[T, heads, hd] raw q or k -> rope(norm(x) * weight) with cos/sin [T, hd/2]."""
    return _launch(x, weight, cos, sin, eps, write_v=False)[0]


def k_norm_rope_v_norm(
    k_raw: torch.Tensor, weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """K=V layers: one read of the raw k projection -> (rope(k_norm(k_raw)), v_norm(k_raw))."""
    k, v = _launch(k_raw, weight, cos, sin, eps, write_v=True)
    assert v is not None
    return k, v


def head_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Per-head norm without rope ([T, heads, hd]); weight None = v_norm."""
    return _launch(x, weight, None, None, eps, write_v=False)[0]


# --------------------------------------------------------------------------------------------------------------
# References and traffic
# --------------------------------------------------------------------------------------------------------------


def _norm_ref(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if weight is not None:
        y = y * weight.float()
    return y.type_as(x)


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE, x [T, heads, hd], cos/sin [T, hd/2] (the model's ``apply_rope``)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def qk_norm_rope_ref(
    x: torch.Tensor, weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, eps: float
) -> torch.Tensor:
    return rope_ref(_norm_ref(x, weight, eps), cos, sin)


def k_norm_rope_v_norm_ref(
    k_raw: torch.Tensor, weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return qk_norm_rope_ref(k_raw, weight, cos, sin, eps), _norm_ref(k_raw, None, eps)


def head_norm_ref(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    return _norm_ref(x, weight, eps)


def qk_norm_rope_traffic(
    tokens: int, heads: int, head_dim: int, elt_bytes: int = 2, rope: bool = True, write_v: bool = False
) -> dict[str, int]:
    """Read x [T, heads, hd], the weight and (rope) cos + sin [T, hd/2] each; write out (+ v).

    ``unfused_bytes``: norm (read + write x), rope (read x + tables, write), v_norm (read + write x).
    FLOPs per element: norm 3 + weight 1 (+ v: none extra) + rope 3.
    """
    a = tokens * heads * head_dim * elt_bytes
    tables = 2 * tokens * (head_dim // 2) * elt_bytes if rope else 0
    w = head_dim * elt_bytes
    read = a + tables + w
    written = a * (2 if write_v else 1)
    unfused = 2 * a + w + (2 * a + tables if rope else 0) + (2 * a if write_v else 0)
    flops = tokens * heads * head_dim * (4 + (3 if rope else 0))
    return {
        "bytes_read": read,
        "bytes_written": written,
        "total_bytes": read + written,
        "unfused_bytes": unfused,
        "flops": flops,
    }
