"""12-16 (this machine, no GPU): what the repacked word of ``repack_probe.py`` would cost the dot path (M 2-143),
which decodes pairs to fp16 halves (``w4a16_gemm._e2m1_decode``) rather than to the tc gemv's bf16x2 pairs.

Compiles ``_w4a16_dot_kernel`` for sm_90 at DOT_SMALL_CONFIG / DOT_LARGE_CONFIG with the committed decode, and
with ``_e2m1_decode`` replaced by the repacked word's (pairs from rotations by 6 / 3 / 0 and the isolate-rotate-
multiply of pair 3, then the same fp16 placement), and prints the SASS of the K loop. Result (Triton 3.9): the same
loop length either way (487 / 319 instructions per thread per step), so the dot path would decode the repacked word
at no extra cost.

Run: python3 dot_repack_sass.py small|large [rp]
"""

import collections
import os
import re
import subprocess
import sys
import tempfile

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from perfkit.kernels import w4a16_gemm as W


@triton.jit
def _rotl(w, N: tl.constexpr):
    return (w << N) | (w >> (32 - N))


@triton.jit
def _e2m1_decode_rp(w, ASM: tl.constexpr):
    d3 = _rotl(w & 0x6C006C00, 25) * 2081
    a = tl.join(tl.join(_rotl(w, 6), _rotl(w, 3)), tl.join(w, d3))  # pair j at [..., j % 2, j // 2]
    bits = (a & 0x80008000) | ((a << 3) & 0x0E000E00)
    lo, hi = tl.inline_asm_elementwise(
        "{ .reg .b16 l, h; mov.b32 {l, h}, $2; cvt.f32.f16 $0, l; cvt.f32.f16 $1, h; }",
        "=r,=r,r",
        [bits],
        dtype=(tl.float32, tl.float32),
        is_pure=True,
        pack=1,
    )
    lo01, lo23 = tl.split(lo)
    hi01, hi23 = tl.split(hi)
    lo0, lo1 = tl.split(lo01)
    lo2, lo3 = tl.split(lo23)
    hi0, hi1 = tl.split(hi01)
    hi2, hi3 = tl.split(hi23)
    return lo0, hi0, lo1, hi1, lo2, hi2, lo3, hi3


def loop_sass(fn, sig: dict, consts: dict, num_warps: int, num_stages: int, div: tuple) -> tuple[str, list[str]]:
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in div}
    k = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": num_warps, "num_stages": num_stages})  # fmt: skip
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        usage = subprocess.run([tools + "/cuobjdump", "--dump-resource-usage", f.name], capture_output=True, text=True)
        lines = subprocess.run([tools + "/nvdisasm", "-c", f.name], capture_output=True, text=True).stdout.splitlines()
    loop: list[str] = []  # the longest backward branch's body: the K loop
    for i, line in enumerate(lines):
        m = re.search(r"BRA `\((\.L_x_\d+)\)", line)
        if m:
            lab = [j for j, x in enumerate(lines) if x.strip() == m.group(1) + ":"]
            if lab and lab[0] < i and i - lab[0] > len(loop):
                loop = [x for x in lines[lab[0] : i + 1] if re.match(r"\s+/\*[0-9a-f]{4}\*/", x)]
    return " ".join(re.findall(r"REG:\d+", usage.stdout)), loop


def main() -> None:
    cfg = W.DOT_SMALL_CONFIG if sys.argv[1] == "small" else W.DOT_LARGE_CONFIG
    if len(sys.argv) > 2:
        W._e2m1_decode = _e2m1_decode_rp  # resolved by name when the kernel compiles
    ints = ("M", "N", "K", "stride_xm", "stride_wn", "stride_sn", "stride_os", "stride_om", "stride_on", "gs_stride")
    sig = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*u8", "gs_ptr": "*fp32", "out_ptr": "*bf16"}
    sig |= dict.fromkeys(ints + ("k_per_split",), "i32")
    consts = {"BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k, "GROUP_M": 8, "EVEN_K": True,
              "GATHER_SCALES": False, "IEEE": False, "ASM": True, "SWAP_AB": cfg.swap_ab,
              "SCALES_AHEAD": cfg.scales_ahead, "SCALES_VEC": cfg.scales_vec, "ROW_MASK": True}  # fmt: skip
    sig |= dict.fromkeys(consts, "constexpr")
    div = ("x_ptr", "w_ptr", "s_ptr", "gs_ptr", "out_ptr", "M", "N", "K", "stride_xm", "stride_wn", "stride_sn")
    regs, loop = loop_sass(W._w4a16_dot_kernel, sig, consts, cfg.num_warps, cfg.num_stages, div + ("k_per_split",))
    ops = collections.Counter(re.sub(r"^\s*/\*[0-9a-f]+\*/\s*(@!?U?P\d\s+)?", "", x).split()[0].split(".")[0]
                              for x in loop)  # fmt: skip
    print(regs, "loop", len(loop), sorted(ops.items(), key=lambda t: -t[1])[:10])


if __name__ == "__main__":
    main()
