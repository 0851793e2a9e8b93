"""#10: the W4A16 gemv at M = 1 fed by TMA (12-14 probe).

Why: ncu of the wide gemv (12-13 `1-ncu_5376x16384.txt`) shows 48 % of its warp cycles on long-scoreboard stalls
(waiting on its own global loads) at 0.65 issued warps per scheduler and 80 registers (20 of 24 warps): the
register double buffer holds too few bytes in flight. Here the same arithmetic (``_wide_rows``) reads its words
and scales from shared memory that TMA fills STAGES steps ahead (Triton's loop pipeliner), so the bytes in
flight cost shared memory, not registers.

``python3 tma_probe.py check`` (CPU interpreter or GPU): against ``w4a16_gemm_ref``. ``python3 tma_probe.py sass``:
an sm_90 compile here, instructions per weight element in the loop. ``python3 tma_probe.py time`` (H200): us per
launch in a back-to-back chain, default gemv vs the TMA tiles, with the load-only chain of the same bytes.
"""

import json
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from perfkit.kernels import w4a16_gemm as W


@triton.jit
def _tma_gemv_kernel(
    x_ptr, w_desc, s_desc, gs_ptr, out_ptr, N, K, gs_stride,
    H: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, ASM: tl.constexpr, ONE: tl.constexpr,
):  # fmt: skip
    """Rows [row0, row0 + 2 H) as two sets of H (x converted once for both, as in the wide kernel); per step each
    set's words [H, BLOCK_K/8] and scales [H, BLOCK_K/16] arrive by TMA (zero past N and K)."""
    C: tl.constexpr = BLOCK_K // 32
    row0 = tl.program_id(0) * 2 * H
    c = tl.arange(0, C)
    xp = W._wide_x(x_ptr, c)
    acc_a = tl.zeros((H, C, 2), dtype=tl.float32)
    acc_b = tl.zeros((H, C, 2), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        if ONE:  # one TMA per operand and step: both sets' rows, split in registers
            wa, wb = tl.split(tl.permute(tl.reshape(w_desc.load([row0, k0 // 8]), (2, H, C, 4)), (1, 2, 3, 0)))
            sa, sb = tl.split(tl.permute(tl.reshape(s_desc.load([row0, k0 // 16]), (2, H, C, 2)), (1, 2, 3, 0)))
        else:
            wa = tl.reshape(w_desc.load([row0, k0 // 8]), (H, C, 4))
            wb = tl.reshape(w_desc.load([row0 + H, k0 // 8]), (H, C, 4))
            sa = tl.reshape(s_desc.load([row0, k0 // 16]), (H, C, 2))
            sb = tl.reshape(s_desc.load([row0 + H, k0 // 16]), (H, C, 2))
        x0, x1, x2, x3, x4, x5, x6, x7 = W._wide_x_step(xp, k0, K, c, False)
        acc_a = W._wide_rows(acc_a, wa, sa, x0, x1, x2, x3, x4, x5, x6, x7, ASM)
        acc_b = W._wide_rows(acc_b, wb, sb, x0, x1, x2, x3, x4, x5, x6, x7, ASM)
    offs_a = row0 + tl.arange(0, H)
    offs_b = offs_a + H
    ya = W._wide_sum(acc_a) * tl.load(gs_ptr + tl.minimum(offs_a, N - 1) * gs_stride)
    yb = W._wide_sum(acc_b) * tl.load(gs_ptr + tl.minimum(offs_b, N - 1) * gs_stride)
    tl.store(out_ptr + offs_a, ya.to(out_ptr.dtype.element_ty), mask=offs_a < N)
    tl.store(out_ptr + offs_b, yb.to(out_ptr.dtype.element_ty), mask=offs_b < N)


def descs(packed, scale, H, BK, one=False):
    words = W._words(packed)
    s8 = scale.view(torch.uint8)
    R = 2 * H if one else H
    wd = TensorDescriptor(words, list(words.shape), list(words.stride()), [R, BK // 8])
    sd = TensorDescriptor(s8, list(s8.shape), list(s8.stride()), [R, BK // 16])
    return wd, sd


def tma_gemv(x, packed, scale, gs, H=8, BK=1024, stages=4, num_warps=8, d=None, one=False):
    N, K = packed.shape[0], x.shape[1]
    wd, sd = d if d is not None else descs(packed, scale, H, BK, one)
    out = torch.empty((1, N), dtype=torch.bfloat16, device=x.device)
    gsv = gs.reshape(-1).float()
    _tma_gemv_kernel[(triton.cdiv(N, 2 * H),)](
        x, wd, sd, gsv, out, N, K, 1 if gsv.numel() > 1 else 0,
        H=H, BLOCK_K=BK, STAGES=stages, ASM=W._asm(), ONE=one, num_warps=num_warps,
    )  # fmt: skip
    return out


TILES = (
    (8, 1024, 4, 8, 0),
    (8, 1024, 4, 8, 1),
    (8, 1024, 6, 8, 1),
    (8, 512, 6, 4, 1),
    (4, 1024, 4, 4, 1),
    (4, 512, 8, 4, 1),
    (16, 512, 4, 8, 1),
)
SHAPES = ((5376, 21504), (43008, 5376), (16384, 5376), (5376, 16384), (5376, 8192))


def time_chain():
    from perfkit.kernels.stream import chain_copies, stream_chain_us
    from perfkit.kernels.timing import graph_sequence_us

    for N, K in SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(0)
        nbytes = W.w4a16_gemm_traffic(1, N, K)["weight_bytes"]
        ws = [
            W.quantize_nvfp4(torch.randn(N, K, device="cuda", generator=gen) * 0.02)
            for _ in range(chain_copies(nbytes, 12))
        ]
        x = (torch.randn(1, K, device="cuda", generator=gen) * 0.5).to(torch.bfloat16)
        ref = W.w4a16_gemm_ref(x, *ws[0])
        row = {"N": N, "K": K, "stream_chain_us": round(stream_chain_us(nbytes)["stream_chain_us"], 2),
               "default": round(graph_sequence_us(lambda w, x=x: W.w4a16_gemm(x, *w), ws, 20, 15), 2)}  # fmt: skip
        for H, BK, st, nw, one in TILES:
            name = f"tma_{2 * H}x{BK}_s{st}_w{nw}" + ("_one" if one else "")
            try:
                ds = [descs(p, s, H, BK, bool(one)) for p, s, _ in ws]
                args = list(zip(ws, ds, strict=True))

                def f(a, H=H, BK=BK, st=st, nw=nw, x=x, one=bool(one)):
                    return tma_gemv(x, *a[0], H=H, BK=BK, stages=st, num_warps=nw, d=a[1], one=one)

                rel = ((f(args[0]).float() - ref).norm() / ref.norm()).item()
                row[name] = {"chain_us": round(graph_sequence_us(f, args, 20, 15), 2), "rel": round(rel, 6)}
            except Exception as e:  # a tile the device's triton rejects
                row[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        print(json.dumps(row), flush=True)
        del ws
        torch.cuda.empty_cache()


if __name__ == "__main__":
    if sys.argv[1] == "time":
        time_chain()
    else:
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        torch.manual_seed(0)
        for N, K in ((40, 2048), (16, 1024 + 512)):
            packed, scale, gs = W.quantize_nvfp4(torch.randn(N, K, device=dev) * 0.02)
            x = (torch.randn(1, K, device=dev) * 0.5).to(torch.bfloat16)
            ref = W.w4a16_gemm_ref(x, packed, scale, gs)
            for one in (False, True):
                out = tma_gemv(x, packed, scale, gs, H=8, BK=1024, stages=2, num_warps=4, one=one)
                print(N, K, one, "rel", ((out.float() - ref).norm() / ref.norm()).item())
