"""Per-head RMSNorm (with weight) + rotate-half RoPE in one pass; optionally v_norm of the same raw input; and the
whole attention prologue of a decoder layer (q, k, v from one merged qkv GEMM output, K/V into the paged cache).

Gemma4 attention (``reference/gemma4.md`` §2.4)::

    q = rope(q_norm(q_raw));   k = rope(k_norm(k_raw));   v = v_norm(v_raw)   (v_norm: no weight, no rope)
    K=V full layers: v_raw = k_raw  -> one kernel reads k_raw once and writes both k and v.

RoPE is GPT-NeoX rotate-half: dim d pairs with d + hd/2, ``o1 = y1 cos - y2 sin``, ``o2 = y2 cos + y1 sin`` with
``cos/sin [T, hd/2]`` (one entry per frequency, already gathered at the token positions). Sliding layers (hd 256)
rotate every pair. Full layers (hd 512, "proportional") have 64 live frequencies ``1e6^(-2i/512)`` and 192 zero
ones, so the tables hold cos = 1, sin = 0 there: the generic rotate-half with a table lookup rotates exactly the
pairs (0..63, 256..319) and passes dims 64..255 and 320..511 through (tested against an explicit construction).

Two kernels:

- ``_qk_norm_rope_kernel`` (:func:`qk_norm_rope`, :func:`k_norm_rope_v_norm`, :func:`head_norm`): one tensor of
  heads. One program per (token, BLOCK_H heads); each head row is loaded as two halves [BLOCK_H, HALF].
- ``_qkv_norm_rope_kernel`` (:func:`qkv_norm_rope` on the merged ``[T, (nh + kvh [+ kvh]) * hd]`` output of the
  fused q|k|v GEMM, :func:`qkv_norm_rope_split` on three separate projection outputs): the fused decoder layer's
  whole prologue in one launch. Grid (T, q blocks + k blocks + v blocks); a program's block index picks which
  heads it normalises (q: q_norm weight + RoPE; k: k_norm weight + RoPE, and on K=V layers also v = v_norm of
  the same raw k, before the weight and RoPE; v: weightless norm). K and V go either to ``[T, kvh, hd]`` outputs
  or straight into the paged KV cache ``[num_pages, 2, page_size, kvh, hd]`` (dim 1: 0 = K, 1 = V) at
  ``(slot_page[t], slot_offset[t])``: the slots are read on the device (pointers, never host values), so a CUDA
  graph that captured the launch writes wherever the static slot buffers point at replay. The cache is of the
  activation dtype (bf16 / fp32) or float8_e4m3fn with per-layer K / V scales: then k and v are first rounded to
  the activation dtype and stored as ``clamp(x * fp8_inv_scale(scale), -448, 448)`` in e4m3 (round to nearest
  even): the backend's ``write_kv`` sequence, bit for bit under the interpreter and, with bf16 activations, on
  the H200 (since 12-01g's signed-zero fix in ``_round_e4m3``; test_gpu_qkv_norm_rope_31b at 1 to 4096 tokens).
  With fp32 activations a byte may be one code off there (test_qkv_norm_rope_fp8_cache_write_is_write_kv_bit_for_bit
  says why). Why fused: the backend's fp8 write is ~10 small torch kernels per layer (cast, divide, clamp, cast,
  index_put for each of K and V); on the H200 they cost 26B-A4B NVFP4 decode 0.75 ms per batch-1 step (12-01f:
  TPOT 4.23 ms with an fp8 cache vs 3.48 ms with bf16; 3.60 ms with this kernel's fp8 write).

fp32 math, one rounding to the output dtype. Unfused: norm (read + write), rope (read x + tables, write), v_norm
(read + write) per tensor, then the KV write (read k and v, write them into the cache).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from perfkit.kernels.fp8 import FP8_MAX, fp8_inv_scale, quantize_fp8_per_tensor
from perfkit.kernels.pdl import pdl_enter, pdl_launch

_E4M3_MAX = tl.constexpr(FP8_MAX)  # float8_e4m3fn's largest finite value, for the kernels


class KVCacheTarget(NamedTuple):
    """A direct K/V write target: the layer's cache and the step's slots (a plain 3-tuple is accepted too)."""

    cache: torch.Tensor  # [num_pages, 2, page_size, kvh, hd]: the activation dtype or float8_e4m3fn
    slot_page: torch.Tensor  # [T] int64
    slot_offset: torch.Tensor  # [T] int64
    k_scale: float = 1.0  # fp8 caches: stored = clamp(k * fp8_inv_scale(k_scale)); ignored otherwise
    v_scale: float = 1.0


# --------------------------------------------------------------------------------------------------------------
# Triton kernels
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
    PDL: tl.constexpr = 0,  # launched with launch_pdl (perfkit/kernels/pdl.py)
):
    pdl_enter(PDL)
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


@triton.jit
def _normed_halves(src, heads, stride_h, n_heads, d, dm, half, eps):
    """Rows `heads` of one token's [n_heads, HD] block at `src` -> (y1, y2) [BLOCK_H, HALF] fp32: the two halves
    of x / rms(x) (masked heads and lanes are 0), plus the load mask."""
    m = (heads < n_heads)[:, None] & dm[None, :]
    p = src + heads[:, None].to(tl.int64) * stride_h + d[None, :]
    x1 = tl.load(p, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(p + half, mask=m, other=0.0).to(tl.float32)
    rstd = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * half) + eps)[:, None]
    return x1 * rstd, x2 * rstd, m


@triton.jit
def _weight_rope(y1, y2, w_ptr, c, s, d, dm, half):
    """(y * w) rotated: o1 = y1 cos - y2 sin, o2 = y2 cos + y1 sin; c, s [1, HALF] fp32."""
    y1 = y1 * tl.load(w_ptr + d, mask=dm, other=0.0).to(tl.float32)[None, :]
    y2 = y2 * tl.load(w_ptr + half + d, mask=dm, other=0.0).to(tl.float32)[None, :]
    return y1 * c - y2 * s, y2 * c + y1 * s


@triton.jit
def _store_halves(dst, heads, stride_h, d, half, y1, y2, m):
    p = dst + heads[:, None].to(tl.int64) * stride_h + d[None, :]
    tl.store(p, y1.to(dst.dtype.element_ty), mask=m)
    tl.store(p + half, y2.to(dst.dtype.element_ty), mask=m)


@triton.jit
def _round_e4m3(x):
    """fp32 x, |x| <= 448 -> the nearest float8_e4m3fn value (ties to even), still fp32, so the store's cast is
    exact. Why by hand: Triton's interpreter (how CI runs the kernels) casts fp32 -> e4m3 with three defects
    (triton issue 8322: ties away from zero; a carry out of the mantissa dropped, 126.2 -> 64; subnormals rounded
    twice); the GPU's cvt.rn.satfinite has none, and with this rounding both give PyTorch's bytes. The spacing at
    x is 2^(e - 3) for x's exponent e (2^-9 below 2^-6, the subnormals); x / spacing < 16 is rounded to an integer
    by the fp32 add of 1.5 x 2^23 (round to nearest even); the sign is put back as x's sign bit, OR-ed into the
    bits (-0 stays -0). ``where(x < 0, -r, r)`` lost it on the GPU: compiled to ``FSEL R, -R, R``, it stored 0x00
    for -0.0 and for every negative that rounds to zero, where PyTorch's cast stores 0x80 (H200, 12-01g)."""
    bits = x.to(tl.int32, bitcast=True)
    e = tl.maximum((bits >> 23) & 0xFF, 127 - 6)  # biased exponent, subnormals at 2^-6's
    step = ((e - 3) << 23).to(tl.float32, bitcast=True)  # 2^(e - 127 - 3)
    inv_step = ((257 - e) << 23).to(tl.float32, bitcast=True)  # 1 / step, exact
    r = ((tl.abs(x) * inv_step + 12582912.0) - 12582912.0) * step  # >= 0
    return (r.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_of(x, inv_scale):
    """``write_kv``'s e4m3 value of x (already rounded to the activation dtype), in fp32: clamp(x * inv_scale),
    rounded to e4m3 (``inv_scale`` is ``fp8_inv_scale``)."""
    return _round_e4m3(tl.clamp(x.to(tl.float32) * inv_scale, -_E4M3_MAX, _E4M3_MAX))


@triton.jit
def _store_kv_halves(dst, heads, stride_h, d, half, y1, y2, m, inv_scale, act_ptr, FP8: tl.constexpr):
    """K or V rows into their destination; FP8: rounded to the activation dtype first, then clamp(x * inv_scale),
    rounded to e4m3: ``write_kv``'s ``quantize_fp8_per_tensor(k.to(act))`` (``inv_scale`` is ``fp8_inv_scale``; how
    exactly it matches on which device: the module docstring).
    ``act_ptr``: any pointer of the activation dtype (a dtype itself cannot be passed to a jit function)."""
    if FP8:
        act_ty = act_ptr.dtype.element_ty
        y1 = _e4m3_of(y1.to(act_ty), inv_scale)
        y2 = _e4m3_of(y2.to(act_ty), inv_scale)
    _store_halves(dst, heads, stride_h, d, half, y1, y2, m)


@triton.jit
def _qkv_norm_rope_kernel(
    q_ptr,  # [T, NH, HD] raw q (strides stride_qt, stride_qh, 1): a column slice of the merged qkv output
    k_ptr,  # [T, KVH, HD] raw k (stride_kt, stride_kh, 1)
    v_ptr,  # [T, KVH, HD] raw v (stride_vt, stride_vh, 1); unused on K=V layers
    qw_ptr,  # [HD] q_norm weight
    kw_ptr,  # [HD] k_norm weight
    cos_ptr,  # [T, HD/2] (row stride stride_c)
    sin_ptr,  # [T, HD/2] (row stride stride_s)
    q_out_ptr,  # [T, NH, HD] contiguous
    k_dst_ptr,  # TO_CACHE: the cache's K plane (cache[:, 0]); else [T, KVH, HD] k output
    v_dst_ptr,  # TO_CACHE: the cache's V plane (cache[:, 1]); else [T, KVH, HD] v output
    slot_page_ptr,  # [T] int64 page of each token (TO_CACHE)
    slot_offset_ptr,  # [T] int64 offset inside that page (TO_CACHE)
    NH,
    KVH,
    half,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_c,
    stride_s,
    stride_dst_t,  # row stride of the k/v outputs (not TO_CACHE)
    stride_page,  # cache strides of dims 0 (page) and 2 (slot); K and V planes share them (TO_CACHE)
    stride_slot,
    stride_dst_h,  # head stride of the K/V destination (outputs and cache alike)
    eps,
    k_inv_scale,  # FP8: 1 / the cache layer's K / V scales (fp8.fp8_inv_scale)
    v_inv_scale,
    K_EQ_V: tl.constexpr,
    TO_CACHE: tl.constexpr,
    FP8: tl.constexpr,  # the destination is an fp8 cache
    BLOCK_H: tl.constexpr,
    HALF: tl.constexpr,
    PDL: tl.constexpr = 0,  # launched with launch_pdl (perfkit/kernels/pdl.py)
):
    pdl_enter(PDL)  # before the slot reads and the cache writes too
    t = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    n_qb = tl.cdiv(NH, BLOCK_H)
    n_kb = tl.cdiv(KVH, BLOCK_H)
    d = tl.arange(0, HALF)
    dm = d < half
    if blk < n_qb:  # query heads: q_norm weight + rope
        heads = blk * BLOCK_H + tl.arange(0, BLOCK_H)
        y1, y2, m = _normed_halves(q_ptr + t * stride_qt, heads, stride_qh, NH, d, dm, half, eps)
        c = tl.load(cos_ptr + t * stride_c + d, mask=dm, other=1.0).to(tl.float32)[None, :]
        s = tl.load(sin_ptr + t * stride_s + d, mask=dm, other=0.0).to(tl.float32)[None, :]
        o1, o2 = _weight_rope(y1, y2, qw_ptr, c, s, d, dm, half)
        _store_halves(q_out_ptr + t * NH * 2 * half, heads, 2 * half, d, half, o1, o2, m)
    else:
        if TO_CACHE:  # the token's cache slot, read on the device (CUDA graphs replay with new slots)
            row = tl.load(slot_page_ptr + t) * stride_page + tl.load(slot_offset_ptr + t) * stride_slot
        else:
            row = t * stride_dst_t
        if blk < n_qb + n_kb:  # key heads: k_norm weight + rope (K=V: v = the weightless norm of the same k_raw)
            heads = (blk - n_qb) * BLOCK_H + tl.arange(0, BLOCK_H)
            y1, y2, m = _normed_halves(k_ptr + t * stride_kt, heads, stride_kh, KVH, d, dm, half, eps)
            if K_EQ_V:
                _store_kv_halves(v_dst_ptr + row, heads, stride_dst_h, d, half, y1, y2, m, v_inv_scale, q_out_ptr, FP8)
            c = tl.load(cos_ptr + t * stride_c + d, mask=dm, other=1.0).to(tl.float32)[None, :]
            s = tl.load(sin_ptr + t * stride_s + d, mask=dm, other=0.0).to(tl.float32)[None, :]
            o1, o2 = _weight_rope(y1, y2, kw_ptr, c, s, d, dm, half)
            _store_kv_halves(k_dst_ptr + row, heads, stride_dst_h, d, half, o1, o2, m, k_inv_scale, q_out_ptr, FP8)
        else:  # value heads (layers with a v_proj): weightless norm, no rope
            heads = (blk - n_qb - n_kb) * BLOCK_H + tl.arange(0, BLOCK_H)
            y1, y2, m = _normed_halves(v_ptr + t * stride_vt, heads, stride_vh, KVH, d, dm, half, eps)
            _store_kv_halves(v_dst_ptr + row, heads, stride_dst_h, d, half, y1, y2, m, v_inv_scale, q_out_ptr, FP8)


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
    pdl: bool = False,
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
        num_warps=max(1, min(8, block_h * HALF // 256)), **pdl_launch(pdl),
    )  # fmt: skip
    return out, v


def qk_norm_rope(
    x: torch.Tensor, weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, eps: float,
    pdl: bool = False,
) -> torch.Tensor:  # fmt: skip
    """[T, heads, hd] raw q or k -> rope(norm(x) * weight) with cos/sin [T, hd/2]. pdl: launch with programmatic
    dependent launch (perfkit/kernels/pdl.py; sm_90+ only)."""
    return _launch(x, weight, cos, sin, eps, write_v=False, pdl=pdl)[0]


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


def split_qkv(
    qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, k_eq_v: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Merged q|k|v GEMM output [T, (nh + kvh [+ kvh]) * hd] -> views q_raw [T, nh, hd], k_raw [T, kvh, hd],
    v_raw [T, kvh, hd] (None on K=V layers, whose merged weight has no v rows). No copies."""
    T = qkv.shape[0]
    nq, nk = num_heads * head_dim, num_kv_heads * head_dim
    width = nq + nk * (1 if k_eq_v else 2)
    if qkv.dim() != 2 or qkv.shape[1] != width:
        raise ValueError(f"qkv must be [T, {width}] (nh {num_heads}, kvh {num_kv_heads}, hd {head_dim}, "
                         f"k_eq_v {k_eq_v}), got {tuple(qkv.shape)}")  # fmt: skip
    q = qkv[:, :nq].view(T, num_heads, head_dim)
    k = qkv[:, nq : nq + nk].view(T, num_kv_heads, head_dim)
    v = None if k_eq_v else qkv[:, nq + nk :].view(T, num_kv_heads, head_dim)
    return q, k, v


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _qkv_block_h(T: int, nh: int, kvh: int, HALF: int, k_eq_v: bool) -> int:
    """Heads per program: all query heads up to a 2048-element tile (hd 256: 16, hd 512: 8). At small T (decode)
    the tile is halved, down to 512 elements, while the grid is under ~128 programs, so more SMs share the step's
    few bytes (31B decode at T = 1: 4 heads of 256 / 2 heads of 512 per program, 16 / 18 programs)."""
    block_h = max(1, min(triton.next_power_of_2(max(nh, kvh)), 2048 // HALF))

    def programs(b: int) -> int:
        return T * (triton.cdiv(nh, b) + triton.cdiv(kvh, b) * (1 if k_eq_v else 2))

    while block_h > 1 and block_h * HALF > 512 and programs(block_h) < 128:
        block_h //= 2
    return block_h


def qkv_norm_rope_split(
    q_raw: torch.Tensor,
    k_raw: torch.Tensor,
    v_raw: torch.Tensor | None,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    kv_cache: KVCacheTarget | None = None,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """One launch for a decoder layer's q, k and v (see the module docstring); pdl: launch with programmatic
    dependent launch (perfkit/kernels/pdl.py; sm_90+ only).

    q_raw [T, nh, hd], k_raw / v_raw [T, kvh, hd] raw projections (row-strided views allowed; v_raw None: K=V
    layer, v = v_norm(k_raw)); weights [hd]; cos/sin [T, hd/2]. Returns (q [T, nh, hd], k, v): k and v are
    [T, kvh, hd], or None when `kv_cache = (cache, slot_page, slot_offset[, k_scale, v_scale])` was given and they
    were written into cache[slot_page[t], 0 / 1, slot_offset[t]] (cache [num_pages, 2, page_size, kvh, hd] of q's
    dtype, or float8_e4m3fn quantised with the scales; slots int64 device tensors [T])."""
    if q_raw.dim() != 3 or k_raw.dim() != 3 or q_raw.shape[-1] % 2:
        raise ValueError(f"q_raw / k_raw must be [T, heads, hd] with an even hd, got {tuple(q_raw.shape)} / "
                         f"{tuple(k_raw.shape)}")  # fmt: skip
    T, NH, HD = q_raw.shape
    KVH = k_raw.shape[1]
    if k_raw.shape != (T, KVH, HD) or (v_raw is not None and v_raw.shape != k_raw.shape):
        raise ValueError(f"k_raw {tuple(k_raw.shape)} / v_raw {None if v_raw is None else tuple(v_raw.shape)} "
                         f"must be [T, kvh, hd] with T, hd of q_raw {tuple(q_raw.shape)}")  # fmt: skip
    half = HD // 2
    if cos.shape != (T, half) or sin.shape != (T, half):
        raise ValueError(f"cos/sin must be [T, hd/2] = {(T, half)}, got {tuple(cos.shape)} / {tuple(sin.shape)}")
    q_raw, k_raw, cos, sin = _unit_last(q_raw), _unit_last(k_raw), _unit_last(cos), _unit_last(sin)
    v_src = k_raw if v_raw is None else _unit_last(v_raw)
    dev, dtype = q_raw.device, q_raw.dtype
    q = torch.empty((T, NH, HD), dtype=dtype, device=dev)
    if kv_cache is None:
        k = torch.empty((T, KVH, HD), dtype=dtype, device=dev)
        v = torch.empty_like(k)
        k_dst, v_dst, slot_page, slot_offset = k, v, k, k
        stride_dst_t, stride_page, stride_slot, stride_dst_h = KVH * HD, 0, 0, HD
        k_scale = v_scale = 1.0
    else:
        cache, slot_page, slot_offset, k_scale, v_scale = KVCacheTarget(*kv_cache)
        if cache.dim() != 5 or cache.shape[1] != 2 or cache.shape[3:] != (KVH, HD) or cache.stride(-1) != 1:
            raise ValueError(f"cache must be [num_pages, 2, page_size, {KVH}, {HD}] with unit dim stride, got "
                             f"{tuple(cache.shape)} strides {cache.stride()}")  # fmt: skip
        if cache.dtype not in (dtype, torch.float8_e4m3fn):
            raise ValueError(f"direct KV writes need the cache dtype ({cache.dtype}) to equal the activations' "
                             f"({dtype}) or be float8_e4m3fn")  # fmt: skip
        if slot_page.shape != (T,) or slot_offset.shape != (T,):
            raise ValueError(f"slot_page / slot_offset must be [T] = [{T}], got {tuple(slot_page.shape)} / "
                             f"{tuple(slot_offset.shape)}")  # fmt: skip
        k = v = None
        k_dst, v_dst = cache[:, 0], cache[:, 1]  # the K / V planes (same strides)
        stride_dst_t, stride_page, stride_slot, stride_dst_h = 0, cache.stride(0), cache.stride(2), cache.stride(3)
    if T == 0:
        return q, k, v
    HALF = triton.next_power_of_2(half)
    fp8 = k_dst.dtype == torch.float8_e4m3fn
    k_inv, v_inv = (fp8_inv_scale(k_scale), fp8_inv_scale(v_scale)) if fp8 else (1.0, 1.0)
    block_h = _qkv_block_h(T, NH, KVH, HALF, v_raw is None)
    n_blocks = triton.cdiv(NH, block_h) + triton.cdiv(KVH, block_h) * (1 if v_raw is None else 2)
    _qkv_norm_rope_kernel[(T, n_blocks)](
        q_raw, k_raw, v_src, q_weight, k_weight, cos, sin, q, k_dst, v_dst, slot_page, slot_offset,
        NH, KVH, half, q_raw.stride(0), q_raw.stride(1), k_raw.stride(0), k_raw.stride(1),
        v_src.stride(0), v_src.stride(1), cos.stride(0), sin.stride(0),
        stride_dst_t, stride_page, stride_slot, stride_dst_h, float(eps), k_inv, v_inv,
        K_EQ_V=v_raw is None, TO_CACHE=kv_cache is not None, FP8=fp8,
        BLOCK_H=block_h, HALF=HALF,
        num_warps=max(1, min(8, block_h * HALF // 256)), **pdl_launch(pdl),
    )  # fmt: skip
    return q, k, v


def qkv_norm_rope(
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    *,
    k_eq_v: bool,
    kv_cache: KVCacheTarget | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The merged q|k|v GEMM output [T, (nh + kvh [+ kvh]) * hd] (K=V layers: no v columns) -> (q, k, v) as
    :func:`qkv_norm_rope_split`: one read of qkv, q [T, nh, hd] written, K/V written to outputs or the cache."""
    q_raw, k_raw, v_raw = split_qkv(qkv, num_heads, num_kv_heads, head_dim, k_eq_v)
    return qkv_norm_rope_split(q_raw, k_raw, v_raw, q_weight, k_weight, cos, sin, eps, kv_cache)


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


def qkv_norm_rope_ref(
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    *,
    k_eq_v: bool,
    kv_cache: KVCacheTarget | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The unfused model's sequence on the split views; with `kv_cache` the rows are index_put into the cache
    (the torch backend's `write_kv`: an fp8 cache gets ``quantize_fp8_per_tensor`` of the rounded rows) and
    (q, None, None) is returned."""
    q_raw, k_raw, v_raw = split_qkv(qkv, num_heads, num_kv_heads, head_dim, k_eq_v)
    q = qk_norm_rope_ref(q_raw, q_weight, cos, sin, eps)
    k = qk_norm_rope_ref(k_raw, k_weight, cos, sin, eps)
    v = _norm_ref(k_raw if v_raw is None else v_raw, None, eps)
    if kv_cache is None:
        return q, k, v
    write_kv_ref(KVCacheTarget(*kv_cache), k, v)
    return q, None, None


def write_kv_ref(target: KVCacheTarget, k: torch.Tensor, v: torch.Tensor) -> None:
    """K / V rows [T, kvh, hd] index_put into ``target.cache`` at its slots, as the torch backend's `write_kv`
    does (an fp8 cache gets ``quantize_fp8_per_tensor`` of the rows with the target's scales)."""
    cache, slot_page, slot_offset, k_scale, v_scale = target
    if cache.dtype == torch.float8_e4m3fn:
        raw = cache.view(torch.uint8)  # index_put on bytes (as write_kv)
        raw[:, 0][slot_page, slot_offset] = quantize_fp8_per_tensor(k, k_scale).view(torch.uint8)
        raw[:, 1][slot_page, slot_offset] = quantize_fp8_per_tensor(v, v_scale).view(torch.uint8)
        return
    cache[:, 0][slot_page, slot_offset] = k.to(cache.dtype)
    cache[:, 1][slot_page, slot_offset] = v.to(cache.dtype)


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


def qkv_norm_rope_traffic(
    tokens: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    elt_bytes: int = 2,
    k_eq_v: bool = False,
    kv_cache: bool = True,
    kv_elt_bytes: int | None = None,
) -> dict[str, int]:
    """Minimum DRAM bytes of :func:`qkv_norm_rope`: read the merged qkv row once ([T, (nh + kvh [+ kvh]) * hd]),
    both weights, cos + sin [T, hd/2] once, the int64 slots (kv_cache); write q, k and v (into the cache:
    ``kv_elt_bytes`` per element, 1 for fp8; default ``elt_bytes``).

    ``unfused_bytes``: the unfused model's sequence: q and k each norm (read + write) and rope (read + tables,
    write), v_norm (read + write), and with ``kv_cache`` the backend's KV write (read k and v, write them, slots;
    fp8 intermediates of its quantising ops left out).
    FLOPs per element: q and k norm 3 + weight 1 + rope 3; v norm 3.
    """
    aq = tokens * num_heads * head_dim * elt_bytes
    ak = tokens * num_kv_heads * head_dim * elt_bytes
    kv_out = tokens * num_kv_heads * head_dim * (kv_elt_bytes or elt_bytes) if kv_cache else ak
    tables = 2 * tokens * (head_dim // 2) * elt_bytes
    w = 2 * head_dim * elt_bytes
    slots = 2 * 8 * tokens if kv_cache else 0
    read = aq + ak * (1 if k_eq_v else 2) + tables + w + slots
    written = aq + 2 * kv_out
    unfused = 4 * (aq + ak) + 2 * tables + w + 2 * ak + (2 * ak + 2 * kv_out + slots if kv_cache else 0)
    flops = tokens * head_dim * (7 * (num_heads + num_kv_heads) + 3 * num_kv_heads)
    return {
        "bytes_read": read,
        "bytes_written": written,
        "total_bytes": read + written,
        "unfused_bytes": unfused,
        "flops": flops,
    }
