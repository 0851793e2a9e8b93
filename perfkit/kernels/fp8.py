"""FP8 (e4m3fn) W8A8 linear: per-output-channel weight scales, per-token dynamic activation scales.

Format of one quantised [N, K] linear: ``weight`` float8_e4m3fn [N, K], ``weight_scale`` fp32 [N]
(``amax(|W[n, :]|) / 448``), so ``dequant(W)[n, k] = float(weight[n, k]) * weight_scale[n]``.

- :func:`fp8_linear`: quantise x per token (row-wise ``amax / 448``), then ``torch._scaled_mm`` with row-wise
  scales (cuBLASLt / CUTLASS, needs sm_89+, bf16 output, K and N multiples of 16). No host sync. For small M
  (decode) see :func:`perfkit.kernels.fp8_gemv.fp8_gemv`: a weight-only Triton GEMV, x not quantised.
- :func:`fp8_linear_ref`: the same numerics in torch on any device: fake-quantise x per token (unless
  ``quantize_input=False``), dequantise W, multiply in fp32.
- :func:`fp8_per_tensor_scale`: ``amax / 448`` helper (e.g. for an FP8 KV cache's per-tensor scales).
- :func:`quantize_fp8_per_tensor` / :func:`dequantize_fp8_per_tensor`: one fixed Python-float scale for a whole
  tensor (the FP8 KV cache: ``stored = clamp(x * fp8_inv_scale(scale), +-448)``, ``x ~ float(stored) * scale``);
  graph-capturable.
"""

from __future__ import annotations

import numpy as np
import torch

from perfkit.kernels.launch import capability

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
_MIN_SCALE = 1e-12


def fp8_supported(device: torch.device | str) -> bool:
    """torch._scaled_mm with row-wise scales: CUDA sm_89+ (Ada, Hopper, Blackwell)."""
    device = torch.device(device)
    return capability(device) >= (8, 9)  # (0, 0) off CUDA


def fp8_per_tensor_scale(t: torch.Tensor) -> torch.Tensor:
    """fp32 scalar ``amax(|t|) / 448`` (>= 1e-12): ``t / scale`` fits e4m3."""
    return (t.detach().abs().amax().float() / FP8_MAX).clamp(min=_MIN_SCALE)


def fp8_inv_scale(scale: float) -> float:
    """1 / scale as an fp32 value (the IEEE fp32 reciprocal of fp32(scale)). Why one spelled-out multiplier: PyTorch
    divides by a Python scalar exactly on the CPU but as ``x * (1 / scale)`` on CUDA (its div_true kernel), so
    ``x / scale`` can differ by an fp32 ulp between the two; a multiplication by this fp32 value is IEEE-rounded
    the same everywhere, and the fused qkv kernel's fp8 KV write multiplies by the same value."""
    return float(np.float32(1.0) / np.float32(scale))  # numpy: IEEE fp32, no tensor (called per layer per step)


def quantize_fp8_per_tensor(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``(x * fp8_inv_scale(scale)).clamp(-448, 448)`` rounded to float8_e4m3fn, in fp32 (one rounding,
    saturating), the same bytes on every device."""
    return (x.float() * fp8_inv_scale(scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_fp8_per_tensor(q: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``float(q) * scale`` in fp32, cast to `dtype` (one rounding)."""
    return (q.float() * scale).to(dtype)


def quantize_fp8_rowwise(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., N, K] -> (float8_e4m3fn [..., N, K], fp32 [..., N]) with one scale per row (output channel)."""
    wf = w.float()
    scale = (wf.abs().amax(dim=-1) / FP8_MAX).clamp(min=_MIN_SCALE)
    q = (wf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize_fp8_rowwise(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale[..., None]


def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> (float8_e4m3fn [M, K], fp32 [M, 1]): dynamic per-token (row) scales."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=_MIN_SCALE)
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """``x [M, K] @ dequant(W)^T -> [M, N]`` in x's dtype through ``torch._scaled_mm`` (sm_89+)."""
    M = x.shape[0]
    N = weight.shape[0]
    if M == 0:
        return x.new_empty((0, N))
    xq, xs = quantize_fp8_per_token(x)
    y = torch._scaled_mm(xq, weight.t(), scale_a=xs, scale_b=weight_scale.view(1, N).float(), out_dtype=torch.bfloat16)
    return y if x.dtype == torch.bfloat16 else y.to(x.dtype)


def fp8_linear_ref(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, quantize_input: bool = True
) -> torch.Tensor:
    """Torch reference of :func:`fp8_linear` (any device): fake-quantised x, dequantised W, fp32 matmul."""
    if quantize_input:
        xq, xs = quantize_fp8_per_token(x)
        xf = xq.float() * xs
    else:
        xf = x.float()
    return (xf @ dequantize_fp8_rowwise(weight, weight_scale).T).to(x.dtype)


def fp8_linear_traffic(M: int, N: int, K: int, act_bytes: int = 2, out_bytes: int = 2) -> dict[str, int]:
    """Minimum DRAM bytes (weight N*K + scales 4N + x M*K + out M*N; the fp8 copy of x stays in L2) and FLOPs."""
    read = N * K + 4 * N + M * K * act_bytes
    written = M * N * out_bytes
    return {"bytes_read": read, "bytes_written": written, "total_bytes": read + written, "flops": 2 * M * N * K}
