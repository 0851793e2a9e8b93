"""GeGLU activation ``gelu_tanh(gate) * up`` in one pass (Gemma4 MLP, MoE experts, PLE gate; gemma4.md §2.5).

``gate`` and ``up`` are two [R, N] tensors or row-strided views: the two halves of one concatenated
``[R, 2N]`` gate_up GEMM output (``gelu_mul_cat``) or the outputs of separate gate/up projections (the model's
layout: HF ``gate_proj``/``up_proj`` stay separate nn.Linear modules so quantisation and tensor parallelism can
swap them by name). Math in fp32 with ``gelu_tanh(g) = g * sigmoid(2 z)``, ``z = sqrt(2/pi) (g + 0.044715 g^3)``
(= ``0.5 g (1 + tanh z)``), one rounding to the output dtype. Unfused PyTorch reads gate, writes gelu, reads
gelu and up, writes the product (5 passes); fused: 3.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from perfkit.kernels.pdl import pdl_enter, pdl_launch

# --------------------------------------------------------------------------------------------------------------
# Triton kernel
# --------------------------------------------------------------------------------------------------------------


@triton.jit
def _gelu_tanh_f32(g):
    z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
    return g / (1.0 + tl.exp(tl.minimum(-2.0 * z, 80.0)))  # clamp: no inf on the way to 0


@triton.jit
def _gelu_mul_kernel(
    g_ptr,  # [R, N] gate (row stride stride_g)
    u_ptr,  # [R, N] up (row stride stride_u)
    out_ptr,  # [R, N] contiguous
    N,
    stride_g,
    stride_u,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr = 0,  # launched with launch_pdl (perfkit/kernels/pdl.py)
):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = cols < N
    g = tl.load(g_ptr + row * stride_g + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * N + cols, (_gelu_tanh_f32(g) * u).to(out_ptr.dtype.element_ty), mask=m)


# --------------------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------------------


def _rows2d(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def gelu_mul(gate: torch.Tensor, up: torch.Tensor, block_n: int = 1024, pdl: bool = False) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` elementwise; same shapes (leading dims flattened), output dtype = gate's. pdl:
    launch with programmatic dependent launch (perfkit/kernels/pdl.py; sm_90+ only)."""
    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} must have the same shape")
    g2, u2 = _rows2d(gate), _rows2d(up)
    R, N = g2.shape
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if R == 0 or N == 0:
        return out
    block_n = min(block_n, triton.next_power_of_2(N))
    _gelu_mul_kernel[(R, triton.cdiv(N, block_n))](
        g2, u2, out.view(R, N), N, g2.stride(0), u2.stride(0), BLOCK_N=block_n, num_warps=max(1, min(8, block_n // 256)),
        **pdl_launch(pdl),
    )  # fmt: skip
    return out


def gelu_mul_cat(gate_up: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """[..., 2N] concatenated (gate | up) -> [..., N]: the fused gate_up GEMM layout (rows 0..N-1 gate)."""
    n = gate_up.shape[-1] // 2
    if gate_up.shape[-1] != 2 * n:
        raise ValueError(f"last dim {gate_up.shape[-1]} is not even")
    return gelu_mul(gate_up[..., :n], gate_up[..., n:], pdl=pdl)


# --------------------------------------------------------------------------------------------------------------
# Reference and traffic
# --------------------------------------------------------------------------------------------------------------


def gelu_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The model's unfused op sequence (rounds after the gelu and after the product)."""
    return F.gelu(gate, approximate="tanh") * up


def gelu_mul_traffic(rows: int, n: int, elt_bytes: int = 2) -> dict[str, int]:
    """Read gate and up, write the product, each [rows, n]; ``unfused_bytes`` = the 5-pass PyTorch sequence.

    FLOPs per element: the tanh-gelu polynomial and sigmoid (~9) and the product (1).
    """
    a = rows * n * elt_bytes
    return {
        "bytes_read": 2 * a,
        "bytes_written": a,
        "total_bytes": 3 * a,
        "unfused_bytes": 5 * a,
        "flops": 10 * rows * n,
    }
