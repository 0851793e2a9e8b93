"""W4A16 GEMM for NVFP4 weights: ``y = x @ dequant(W)^T`` with the dequantisation inside the kernel.

Weight format (NVIDIA ModelOpt NVFP4 checkpoint layout, per linear layer of shape [N, K]):

- ``weight``         uint8 [N, K/2]: e2m1 codes, two per byte, low nibble = element 2i, high nibble = 2i+1.
  A code is ``s e1 e0 m``: sign bit, then an index into the magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6}.
- ``weight_scale``   float8_e4m3fn [N, K/16]: one block scale per 16 consecutive elements along K.
- ``weight_scale_2`` fp32 scalar (here also accepted as a per-output-row vector [N]): the global scale.

``dequant(W)[n, k] = e2m1(code[n, k]) * float(weight_scale[n, k // 16]) * weight_scale_2[n]``.

Kernel design (one kernel, two fixed tile families chosen by M, no autotune):

- Unpacking without interleaving: the packed tile is split into its low nibbles (even k) and high nibbles (odd
  k), and the activation tile is loaded as its even and odd columns, so ``acc += x_even @ w_lo + x_odd @ w_hi``
  (two ``tl.dot`` with K/2 each) and no nibble interleave / join is needed.
- e2m1 -> float by bit placement: ``(code & 8) << 12 | (code & 7) << 9`` is an fp16 whose value is
  ``e2m1 * 2^-14`` (subnormal fp16 for the codes 0/1, which the fp16 -> fp32 conversion keeps exact). The e4m3
  block scale, read as raw bytes, becomes an fp16 the same way: ``(b & 0x7f) << 7`` = ``e4m3 * 2^-8``. The
  product times 2^22 is exact in fp32 and has at most 6 significant bits, so the tile cast to bf16 for the
  tensor-core dot is exact: the only rounding is fp32 accumulation, then the global scale (per column, in the
  epilogue, as vLLM/ModelOpt's ``alpha``) and the output cast.
- Block scale broadcast: one scale per 8 packed bytes of a row; the [BK/16, BN] scale tile is broadcast over
  a [BK/16, 8, BN] view of the dequantised half-tile (``tl.reshape``); ``scale_mode="gather"`` is a fallback that
  reads one scale per packed byte instead (redundant, L1-served loads).
- Decode (M <= 16): BLOCK_M = 16 (the minimum dot M), wide BLOCK_N and long BLOCK_K, split-K so that the grid
  covers ~2 waves of SMs; fp32 partials [S, M, N] are summed in torch (deterministic; S*M*N*4 bytes, small
  next to the weight). Memory-bound: the target is the traffic below over the DRAM bandwidth.
- Prefill (M > 16): 64/128-row tiles, no split-K, tensor-core dots on the dequantised tiles.

``w4a16_gemm_ref`` dequantises in torch and multiplies in fp32. ``w4a16_gemm_traffic`` gives the minimum DRAM
bytes and the FLOPs. On CPU the kernel runs under ``TRITON_INTERPRET=1`` (set before importing triton).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitudes of codes 0..7; code | 8 is the negative
FP4_MAX = 6.0
FP8_E4M3_MAX = 448.0
BLOCK_SIZE = 16  # NVFP4 elements per block scale
HBM_BYTES_PER_S = 4.3e12  # achievable H200 DRAM bandwidth used for "% of bound"

# --------------------------------------------------------------------------------------------------------------
# Triton kernel
# --------------------------------------------------------------------------------------------------------------


@triton.jit
def _e2m1_times_2m14(code):
    """uint8 nibble (0..15) -> fp32 e2m1 value * 2^-14, via fp16 bit placement (exact)."""
    c = code.to(tl.int16)
    bits = ((c & 8) << 12) | ((c & 7) << 9)
    return bits.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _e4m3_times_2m8(b):
    """uint8 raw e4m3fn byte (non-negative scale) -> fp32 value * 2^-8, via fp16 bit placement (exact)."""
    bits = (b.to(tl.int16) & 0x7F) << 7
    return bits.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _w4a16_gemm_kernel(
    x_ptr,  # [M, K] bf16/fp16/fp32 activations
    w_ptr,  # [N, K/2] uint8 packed e2m1
    s_ptr,  # [N, K/16] uint8 (raw e4m3fn bytes)
    gs_ptr,  # fp32 global scale: [1] (gs_stride 0) or [N] (gs_stride 1)
    out_ptr,  # [M, N] output dtype, or [SPLIT_K, M, N] fp32 partials
    eid_ptr,  # PER_ROW_EXPERT: [M] expert id of each row (weights are stacked [E, ...]); else unused
    M,
    N,
    K,
    stride_xm,
    stride_xk,
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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GATHER_SCALES: tl.constexpr,
    IEEE: tl.constexpr,
    PER_ROW_EXPERT: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    HALF: tl.constexpr = BLOCK_K // 2
    GROUPS: tl.constexpr = BLOCK_K // 16

    if PER_ROW_EXPERT:  # one row per program, against its own expert's weight (MoE decode, no host sync)
        e = tl.load(eid_ptr + pid_m).to(tl.int64)
        w_ptr += e * stride_we
        s_ptr += e * stride_se
        gs_ptr += e * stride_ge
        offs_m = pid_m + tl.arange(0, BLOCK_M)
        m_ok = tl.arange(0, BLOCK_M) == 0
    else:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = offs_m < M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_j = tl.arange(0, HALF)  # packed byte within the tile = element pair (2j, 2j+1)
    offs_g = tl.arange(0, GROUPS)
    n_ok = offs_n < N
    num_groups = K // 16

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + 2 * offs_j  # even element index of each packed byte
        k_ok = kk < K  # K is even, so kk + 1 < K too
        # packed weight tile, transposed view [HALF, BLOCK_N]
        w = tl.load(
            w_ptr + offs_n[None, :] * stride_wn + (k0 // 2 + offs_j)[:, None],
            mask=k_ok[:, None] & n_ok[None, :],
            other=0,
        )
        lo = _e2m1_times_2m14(w & 0xF)
        hi = _e2m1_times_2m14(w >> 4)
        if GATHER_SCALES:
            s = tl.load(
                s_ptr + offs_n[None, :] * stride_sn + (k0 // 16 + offs_j // 8)[:, None],
                mask=k_ok[:, None] & n_ok[None, :],
                other=0,
            )
            sf = _e4m3_times_2m8(s) * 4194304.0  # 2^22 undoes 2^-14 * 2^-8
            lo = lo * sf
            hi = hi * sf
        else:
            g = k0 // 16 + offs_g
            s = tl.load(
                s_ptr + offs_n[None, :] * stride_sn + g[:, None],
                mask=(g < num_groups)[:, None] & n_ok[None, :],
                other=0,
            )
            sf = (_e4m3_times_2m8(s) * 4194304.0)[:, None, :]  # [GROUPS, 1, BLOCK_N]
            lo = tl.reshape(tl.reshape(lo, (GROUPS, 8, BLOCK_N)) * sf, (HALF, BLOCK_N))
            hi = tl.reshape(tl.reshape(hi, (GROUPS, 8, BLOCK_N)) * sf, (HALF, BLOCK_N))
        x_rows = x_ptr + offs_m[:, None] * stride_xm
        x_mask = m_ok[:, None] & k_ok[None, :]
        x_even = tl.load(x_rows + kk[None, :] * stride_xk, mask=x_mask, other=0.0)
        x_odd = tl.load(x_rows + (kk + 1)[None, :] * stride_xk, mask=x_mask, other=0.0)
        if IEEE:  # fp32 activations, or the CPU interpreter (whose bf16 tl.dot is wrong): fp32 dot
            acc = tl.dot(x_even.to(tl.float32), lo, acc, input_precision="ieee")
            acc = tl.dot(x_odd.to(tl.float32), hi, acc, input_precision="ieee")
        else:  # the tile is exact in bf16/fp16 (<= 6 significant bits): tensor-core dot, fp32 accumulate
            acc = tl.dot(x_even, lo.to(x_even.dtype), acc)
            acc = tl.dot(x_odd, hi.to(x_odd.dtype), acc)

    gs = tl.load(gs_ptr + offs_n * gs_stride, mask=n_ok, other=0.0)
    acc = acc * gs[None, :]
    out = out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# --------------------------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class W4A16Config:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int | None = None  # None: chosen from the SM count (decode) / 1 (prefill)


DECODE_CONFIG = W4A16Config(block_m=16, block_n=64, block_k=256, num_warps=4, num_stages=4)
MID_CONFIG = W4A16Config(block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=3)
PREFILL_CONFIG = W4A16Config(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=3, split_k=1)


def pick_config(M: int) -> W4A16Config:
    """Fixed configs by M (no autotune): decode M <= 16, small batches M <= 64, prefill beyond."""
    if M <= 16:
        return DECODE_CONFIG
    if M <= 64:
        return MID_CONFIG
    return PREFILL_CONFIG


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _split_k(device: torch.device, tiles: int, K: int, block_k: int) -> int:
    sms = (
        _num_sms(device.index if device.index is not None else torch.cuda.current_device())
        if device.type == "cuda"
        else 4
    )
    want = triton.cdiv(2 * sms, max(tiles, 1))
    return max(1, min(want, triton.cdiv(K, block_k), 16))


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


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor,
    gs: torch.Tensor,
    gs_stride: int,
    expert_ids: torch.Tensor | None,
    out_dtype: torch.dtype,
    config: W4A16Config | None,
    scale_mode: str,
) -> torch.Tensor:
    M, K = x.shape
    N = weight.shape[-2]
    out = torch.empty((M, N), dtype=out_dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    if scale_mode not in ("reshape", "gather"):
        raise ValueError(f"scale_mode {scale_mode!r}: allowed values are reshape, gather")
    cfg = config or pick_config(1 if expert_ids is not None else M)
    per_row = expert_ids is not None
    grid_mn = (triton.cdiv(N, cfg.block_n), M if per_row else triton.cdiv(M, cfg.block_m))
    split = cfg.split_k or _split_k(x.device, grid_mn[0] * grid_mn[1], K, cfg.block_k)
    k_per_split = triton.cdiv(triton.cdiv(K, split), cfg.block_k) * cfg.block_k
    split = triton.cdiv(K, k_per_split)
    target = out if split == 1 else torch.empty((split, M, N), dtype=torch.float32, device=x.device)
    stride_os, stride_om, stride_on = (0, *out.stride()) if split == 1 else target.stride()
    stride_we, stride_se, stride_ge = (weight.stride(0), scales.stride(0), gs.stride(0)) if per_row else (0, 0, 0)
    _w4a16_gemm_kernel[(grid_mn[0], grid_mn[1], split)](
        x, weight, scales, gs, target, expert_ids if per_row else gs,
        M, N, K,
        x.stride(0), x.stride(1), weight.stride(-2), scales.stride(-2),
        stride_os, stride_om, stride_on, gs_stride, stride_we, stride_se, stride_ge, k_per_split,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        GATHER_SCALES=scale_mode == "gather", IEEE=x.dtype == torch.float32 or _interpreting(),
        PER_ROW_EXPERT=per_row, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if split > 1:
        torch.sum(target, dim=0, out=out) if out_dtype == torch.float32 else out.copy_(target.sum(dim=0))
    return out


def w4a16_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    global_scale: torch.Tensor | float,
    out_dtype: torch.dtype | None = None,
    config: W4A16Config | None = None,
    scale_mode: str = "reshape",
) -> torch.Tensor:
    """``x [M, K] @ dequant(weight [N, K/2])^T -> [M, N]`` (format: module docstring). ``global_scale``: scalar
    or per output row [N]. No host sync (the global scale is read on the device): CUDA-graph safe.
    ``scale_mode``: reshape | gather (how block scales are broadcast; same result)."""
    M, N, K = _check(x, weight, weight_scale)
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [N, K/2], got {tuple(weight.shape)}")
    gs = torch.as_tensor(global_scale, dtype=torch.float32, device=x.device).reshape(-1)
    if gs.numel() not in (1, N):
        raise ValueError(f"global scale must have 1 or N={N} elements, got {gs.numel()}")
    return _launch(
        x, weight.contiguous(), weight_scale.contiguous().view(torch.uint8), gs.contiguous(),
        0 if gs.numel() == 1 else 1, None, out_dtype or x.dtype, config, scale_mode,
    )  # fmt: skip


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
    ``weight_scale [E, N, K/16]``, ``global_scale [E]`` or ``[E, N]`` -> ``[R, N]``. One program per (row, N
    tile): each row streams its expert's weight (the MoE decode path: few rows, no host sync)."""
    M, N, K = _check(x, weight, weight_scale)
    E = weight.shape[0]
    if weight.dim() != 3 or expert_ids.shape != (M,):
        raise ValueError(
            f"weight must be [E, N, K/2] and expert_ids [R]; got {tuple(weight.shape)}, {tuple(expert_ids.shape)}"
        )
    gs = global_scale.to(device=x.device, dtype=torch.float32)
    if gs.shape == (E,):
        gs_stride = 0
        gs = gs.contiguous()
    elif gs.shape == (E, N):
        gs_stride = 1
        gs = gs.contiguous()
    else:
        raise ValueError(f"global_scale must be [E] or [E, N] = [{E}, {N}], got {tuple(gs.shape)}")
    return _launch(
        x, weight.contiguous(), weight_scale.contiguous().view(torch.uint8), gs, gs_stride,
        expert_ids.contiguous(), out_dtype or x.dtype, config, "reshape",
    )  # fmt: skip


# --------------------------------------------------------------------------------------------------------------
# Reference, dequantisation, quantisation (torch)
# --------------------------------------------------------------------------------------------------------------


def _e2m1_table(device: torch.device) -> torch.Tensor:
    mags = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
    return torch.cat([mags, -mags])  # index = 4-bit code


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


def bench_w4a16(
    M: int,
    N: int,
    K: int,
    config: W4A16Config | None = None,
    scale_mode: str = "reshape",
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
) -> dict[str, float]:
    """GPU timing of one decode/prefill-shaped W4A16 GEMM: median ms (triton.testing.do_bench, L2 flushed
    between reps), the bandwidth bound and the % of it reached; also the bf16 cuBLAS GEMM of the same shape."""
    if not torch.cuda.is_available():
        raise RuntimeError("bench_w4a16 needs CUDA")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(N, K, device="cuda", generator=gen) * 0.02
    packed, scale, gs = quantize_nvfp4(w)
    x = torch.randn(M, K, device="cuda", dtype=dtype, generator=gen)
    w_bf16 = w.to(dtype)
    del w
    out = w4a16_gemm(x, packed, scale, gs, config=config, scale_mode=scale_mode)
    ref = w4a16_gemm_ref(x, packed, scale, gs)
    rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    ms = triton.testing.do_bench(
        lambda: w4a16_gemm(x, packed, scale, gs, config=config, scale_mode=scale_mode), return_mode="median"
    )
    bf16_ms = triton.testing.do_bench(lambda: x @ w_bf16.T, return_mode="median")
    t = w4a16_gemm_traffic(M, N, K, x.element_size(), x.element_size())
    return {
        "M": M,
        "N": N,
        "K": K,
        "median_ms": ms,
        "bound_ms": t["bound_ms"],
        "pct_of_bound": 100.0 * t["bound_ms"] / ms,
        "achieved_tb_s": t["total_bytes"] / ms / 1e9,
        "bf16_cublas_ms": bf16_ms,
        "speedup_vs_bf16": bf16_ms / ms,
        "rel_err_vs_ref": rel,
    }
