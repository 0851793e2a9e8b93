"""A tensor-core W4A16 at M = 1 in Triton: does the dequantised weight reach the wgmma from registers, and at what
instruction cost? (12-13: an sm_90 compile here; timed on the H200 in call 7, ``python3 mma_compile_probe.py time``: 5-16x slower
than the gemv, 42-84 programs on the 5376-row shapes and ~10 instructions per weight element)

Finding (Triton 3.9 here, ``python3 mma_compile_probe.py sass``): when each nibble plane of the packed bytes feeds
its own ``tl.dot`` (no join of the planes), Triton stages the packed uint8 tile through shared memory, loads it
into the wgmma A operand's register layout and runs the decode and the block scale in registers (an RS wgmma, no
convert_layout of the fp16 tile). But the loop costs 9.8-11.4 SASS instructions per weight element (the gemv: 5.8):
per-element scale addressing (IMAD, one LDG.U8 per pair) and byte-to-half shuffles (PRMT). A form that loads the
scales once per group and decodes whole 32-bit words into f16x2 pairs (as Marlin does with lop3) would be needed.
``python3 mma_compile_probe.py check`` (TRITON_INTERPRET=1) compares it with ``w4a16_gemm_ref`` (rel 4.6e-3, the
bf16 output's rounding): fp16 e2m1 * 2^-14 times an e4m3 scale is exact, x in fp16.
"""

import collections
import os
import re
import subprocess
import sys

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from perfkit.kernels import w4a16_gemm as W


@triton.jit
def _w4a16_mma_kernel(
    xx_ptr, w_ptr, s_ptr, gs_ptr, out_ptr, N, K, stride_wn, stride_sn, gs_stride, BN: tl.constexpr, BK: tl.constexpr
):
    """M = 1 on the tensor cores, weights on the MMA's M side: per K step, the packed bytes [BN, BK/2] split into
    their low and high nibble planes (elements k0 + 2j and k0 + 2j + 1), each decoded in registers to fp16
    e2m1 * 2^-14 times its block scale (exact), each multiplied with x's even / odd elements ([BK/2, 16] fp16, x in
    column 0 of ``xx``, zeros elsewhere) by its own dot."""
    pid = tl.program_id(0)
    n = pid * BN + tl.arange(0, BN)
    rn = tl.minimum(n, N - 1).to(tl.int64)
    kh = tl.arange(0, BK // 2)
    m = tl.arange(0, 16)
    acc = tl.zeros((BN, 16), dtype=tl.float32)
    for k0 in range(0, K, BK):
        w = tl.load(w_ptr + rn[:, None] * stride_wn + (k0 // 2 + kh)[None, :])  # u8 [BN, BK/2]
        sc = tl.load(s_ptr + rn[:, None] * stride_sn + ((k0 + 2 * kh) // 16)[None, :])  # u8 [BN, BK/2]
        sf = sc.to(tl.float8e4nv, bitcast=True).to(tl.float16)
        lo = (w & 0xF).to(tl.int16)
        hi = (w >> 4).to(tl.int16)
        alo = (((lo & 8) << 12) | ((lo & 7) << 9)).to(tl.float16, bitcast=True) * sf
        ahi = (((hi & 8) << 12) | ((hi & 7) << 9)).to(tl.float16, bitcast=True) * sf
        be = tl.load(xx_ptr + (k0 + 2 * kh)[:, None] * 16 + m[None, :])  # fp16 [BK/2, 16]
        bo = tl.load(xx_ptr + (k0 + 2 * kh + 1)[:, None] * 16 + m[None, :])
        acc = tl.dot(alo, be, acc)
        acc = tl.dot(ahi, bo, acc)
    y = tl.sum(tl.where(m[None, :] == 0, acc, 0.0), axis=1) * 16384.0 * tl.load(gs_ptr + rn * gs_stride)
    tl.store(out_ptr + n, y.to(tl.bfloat16), mask=n < N)


def mma_gemv(x, packed, scale, gs, BN=64, BK=64, num_warps=4, num_stages=3, xx=None):
    N, K = packed.shape[0], x.shape[1]
    if xx is None:
        xx = torch.zeros((K, 16), dtype=torch.float16, device=x.device)
        xx[:, 0] = x[0].to(torch.float16)
    out = torch.empty((1, N), dtype=torch.bfloat16, device=x.device)
    gsv = gs.reshape(-1).float()
    _w4a16_mma_kernel[(triton.cdiv(N, BN),)](
        xx,
        packed,
        scale.view(torch.uint8),
        gsv,
        out,
        N,
        K,
        packed.stride(0),
        scale.stride(0),
        1 if gsv.numel() > 1 else 0,
        BN=BN,
        BK=BK,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


def time_chain():
    """On the H200: us per launch in a back-to-back chain (distinct weights) of the default W4A16 gemv and of this
    kernel's tiles at the five 31B M = 1 shapes; x's [K, 16] fp16 staging is built once per x, outside the timing
    (an engine form would fold it into the previous launch)."""
    import json

    from perfkit.kernels.stream import chain_copies
    from perfkit.kernels.timing import graph_sequence_us

    tiles = ((64, 64, 4, 3), (64, 128, 4, 3), (128, 64, 4, 3), (128, 128, 8, 3), (64, 128, 4, 4))
    for N, K in ((5376, 21504), (43008, 5376), (16384, 5376), (5376, 16384), (5376, 8192)):
        gen = torch.Generator(device="cuda").manual_seed(0)
        copies = chain_copies(W.w4a16_gemm_traffic(1, N, K)["weight_bytes"], 12)
        ws = [W.quantize_nvfp4(torch.randn(N, K, device="cuda", generator=gen) * 0.02) for _ in range(copies)]
        x = (torch.randn(1, K, device="cuda", generator=gen) * 0.5).to(torch.bfloat16)
        xx = torch.zeros((K, 16), dtype=torch.float16, device="cuda")
        xx[:, 0] = x[0].to(torch.float16)
        ref = W.w4a16_gemm_ref(x, *ws[0])
        row = {"N": N, "K": K, "default": round(graph_sequence_us(lambda w, x=x: W.w4a16_gemm(x, *w), ws, 20, 15), 2)}
        for bn, bk, nw, ns in tiles:
            name = f"mma_{bn}x{bk}_w{nw}_s{ns}"
            try:

                def f(w, bn=bn, bk=bk, nw=nw, ns=ns, x=x, xx=xx):
                    return mma_gemv(x, *w, BN=bn, BK=bk, num_warps=nw, num_stages=ns, xx=xx)

                rel = ((f(ws[0]).float() - ref).norm() / ref.norm()).item()
                row[name] = {"chain_us": round(graph_sequence_us(f, ws, 20, 15), 2), "rel": round(rel, 5)}
            except Exception as e:  # a tile the device's triton rejects
                row[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        print(json.dumps(row), flush=True)
        del ws
        torch.cuda.empty_cache()


if __name__ == "__main__":
    if sys.argv[1] == "time":
        time_chain()
    elif sys.argv[1] == "sass":
        bin = os.path.dirname(triton.__file__) + "/backends/nvidia/bin"
        for BN, BK, nw, ns in ((64, 64, 4, 3), (64, 128, 4, 3), (128, 64, 4, 3), (128, 128, 8, 3)):
            sig = {
                "xx_ptr": "*fp16",
                "w_ptr": "*u8",
                "s_ptr": "*u8",
                "gs_ptr": "*fp32",
                "out_ptr": "*bf16",
                "N": "i32",
                "K": "i32",
                "stride_wn": "i32",
                "stride_sn": "i32",
                "gs_stride": "i32",
                "BN": "constexpr",
                "BK": "constexpr",
            }
            names = list(sig)
            attrs = {
                (names.index(nm),): [["tt.divisibility", 16]]
                for nm in ("xx_ptr", "w_ptr", "s_ptr", "gs_ptr", "out_ptr", "N", "K", "stride_wn", "stride_sn")
            }
            k = triton.compile(
                ASTSource(_w4a16_mma_kernel, sig, constexprs={"BN": BN, "BK": BK}, attrs=attrs),
                target=GPUTarget("cuda", 90, 32),
                options={"num_warps": nw, "num_stages": ns},
            )
            open("/tmp/rs/m.cubin", "wb").write(k.asm["cubin"])
            res = subprocess.run(
                [bin + "/cuobjdump", "--dump-resource-usage", "/tmp/rs/m.cubin"], capture_output=True, text=True
            ).stdout
            sl = subprocess.run(
                [bin + "/nvdisasm", "-c", "/tmp/rs/m.cubin"], capture_output=True, text=True
            ).stdout.splitlines()
            loop = []
            for i, line in enumerate(sl):
                mm = re.search(r"BRA `\((\.L_x_\d+)\)", line)
                if mm:
                    lab = [j for j, x in enumerate(sl) if x.strip() == mm.group(1) + ":"][0]
                    if lab < i and i - lab > len(loop):
                        loop = [x for x in sl[lab : i + 1] if re.match(r"\s+/\*[0-9a-f]{4}\*/", x)]
            c = collections.Counter(
                re.sub(r"^\s*/\*[0-9a-f]+\*/\s*(@!?U?P\d\s+)?", "", x).split()[0].split(".")[0] for x in loop
            )
            per_thread_elems = BN * BK / (32 * nw)
            cvt = [t for t in k.asm["ttgir"].splitlines() if "convert_layout" in t or "local_load" in t]
            print(
                BN,
                BK,
                nw,
                re.findall(r"REG:\d+|SHARED:\d+", res),
                "loop",
                len(loop),
                "per elem",
                round(len(loop) / per_thread_elems, 2),
                c.most_common(12),
                "cvt/local_load",
                len(cvt),
            )
    else:
        torch.manual_seed(0)
        N, K = 128, 1024
        packed, scale, gs = W.quantize_nvfp4(torch.randn(N, K) * 0.02)
        x = (torch.randn(1, K) * 0.5).to(torch.bfloat16)
        ref = W.w4a16_gemm_ref(x, packed, scale, gs)
        out = mma_gemv(x, packed, scale, gs)
        print("rel", ((out.float() - ref).norm() / ref.norm()).item())
