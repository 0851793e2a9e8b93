"""#10: a tensor-core W4A16 gemv at M = 1 (12-14 probe).

Why: the CUDA-core gemv spends 5.8 SASS instructions per weight element (decode 2, fp16 -> fp32 1, FFMA 1, x 0.5,
...) and its TMA-fed form (``tma_probe.py``, call 1) tied it: the loop is instruction-bound. On the tensor cores
the multiply-add costs nothing per element; what is left is the decode and the block scale.

Layout trick (no repack): the MMA does not care in which order it sums K, so the dot's logical K is a permutation
of the physical elements chosen so that each thread's A-operand registers come straight from the words it loads.
A thread of an m16n8k16 / wgmma A fragment holds, per 16-wide k block b, logical k {2t, 2t+1, 2t+8, 2t+9} (t = lane
% 4): over 4 k blocks that is 16 elements, made one scale group: physical words 2 g and 2 g + 1 with g = 4 c + t.
Nibbles j and j + 4 of a word decode with one shift pair into a bf16x2 (the MMA's (2t, 2t+1) pair), the block scale
multiplies both halves, and x is gathered in the same permuted order into the dot's B tile [BK, 16].

bf16 exactness: the nibble's bits placed in a bf16 give e2m1 * 2^-126 (bf16 subnormal for the code 0.5); the scale
is e4m3 * 2^118 in bf16 (exact: 4 significant bits, below 2^127), so their product e2m1 * e4m3 * 2^-8 is exact in
bf16 (6 significant bits, >= 2^-18); the MMA multiplies it with bf16 x exactly and accumulates in fp32; the epilogue
applies 2^8 and the global scale. x stays bf16 (no fp16 range risk).
"""

import json
import sys

import torch
import triton
import triton.language as tl

from perfkit.kernels import w4a16_gemm as W


@triton.jit
def _pair(w, SH: tl.constexpr):
    """uint32 words -> bf16x2 bit patterns of nibbles (j, j + 4), j = (12 - SH) / 4: sign to bits 15 / 31, e1 e0 m to
    8..6 / 24..22 (= e2m1 * 2^-126)."""
    if SH >= 0:
        s = w << SH
    else:
        s = w >> (-SH)
    if SH - 6 >= 0:
        m = w << (SH - 6)
    else:
        m = w >> (6 - SH)
    return (s & 0x80008000) | (m & 0x01C001C0)


@triton.jit
def _pair_f32(w, sf, SH: tl.constexpr):
    """Interpreter form of ``_pair_asm``: the same bf16 bit patterns, each half widened to fp32 (bf16 is the top half
    of an fp32: e2m1 * 2^-126, an fp32 subnormal for 0.5) times the fp32 scale e4m3 * 2^118: the same exact values,
    in fp32 (the interpreter's bf16 arithmetic is not IEEE)."""
    pr = _pair(w, SH)
    lo = (pr << 16).to(tl.float32, bitcast=True)
    hi = (pr & 0xFFFF0000).to(tl.float32, bitcast=True)
    return tl.join(lo, hi) * sf[:, :, :, :, None]


@triton.jit
def _asm_pair(w, sf, ASM_TEXT: tl.constexpr):
    return tl.inline_asm_elementwise(ASM_TEXT, "=r,r,r,r", [tl.join(w, w), tl.join(sf, sf)], dtype=tl.bfloat16,
                                     is_pure=True, pack=2)  # fmt: skip


@triton.jit
def _pair_asm(w, sf, SH: tl.constexpr):
    """The pair of ``_pair`` times the scale in one inline-PTX block: the int32 word and the bf16 scale are each
    joined with themselves so that pack=2 hands one instance the word ($1) and the scale's bf16x2 ($3), and its
    one 32-bit output register is the (lo, hi) bf16 pair in place (no half extraction, no repacking)."""
    if SH == 12:
        return _asm_pair(w, sf, "{ .reg .b32 s, m, d; shl.b32 s, $1, 12; shl.b32 m, $1, 6; and.b32 s, s, 0x80008000; "
                                "and.b32 m, m, 0x01C001C0; or.b32 d, s, m; mul.rn.bf16x2 $0, d, $3; }")  # fmt: skip
    elif SH == 8:
        return _asm_pair(w, sf, "{ .reg .b32 s, m, d; shl.b32 s, $1, 8; shl.b32 m, $1, 2; and.b32 s, s, 0x80008000; "
                                "and.b32 m, m, 0x01C001C0; or.b32 d, s, m; mul.rn.bf16x2 $0, d, $3; }")  # fmt: skip
    elif SH == 4:
        return _asm_pair(w, sf, "{ .reg .b32 s, m, d; shl.b32 s, $1, 4; shr.b32 m, $1, 2; and.b32 s, s, 0x80008000; "
                                "and.b32 m, m, 0x01C001C0; or.b32 d, s, m; mul.rn.bf16x2 $0, d, $3; }")  # fmt: skip
    else:
        return _asm_pair(w, sf, "{ .reg .b32 m, d; shr.b32 m, $1, 6; and.b32 d, $1, 0x80008000; "
                                "and.b32 m, m, 0x01C001C0; or.b32 d, d, m; mul.rn.bf16x2 $0, d, $3; }")  # fmt: skip


@triton.jit
def _tc_gemv_kernel(
    x_ptr, w_ptr, s_ptr, gs_ptr, out_ptr, part_ptr, count_ptr, N, K, k_split, stride_wn, stride_sn, gs_stride,
    BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr, FUSED: tl.constexpr,
    INTERP: tl.constexpr,
):  # fmt: skip
    """One program: rows [pid * BN, + BN) over K in [pid_k * k_split, + k_split) (k_split a multiple of BK). Per
    step BK physical elements: words [BN, C, 4 (t), 2 (w)] (C = BK / 64), scales [BN, C, 4 (t)]. SPLIT > 1: fp32
    partials [SPLIT, N] for ``_finish_split``."""
    C: tl.constexpr = BK // 64
    pid = tl.program_id(0)
    k_lo = tl.multiple_of(tl.program_id(1) * k_split, BK)
    k_hi = tl.minimum(k_lo + k_split, K)
    rows = pid * BN + tl.arange(0, BN)
    rr = tl.minimum(rows, N - 1).to(tl.int64)
    wofs = tl.arange(0, BK // 8)
    sofs = tl.arange(0, BK // 16)
    # logical k -> physical element: k = 64 c + 16 b + 8 h + 2 t + p, b = 2 w + jh, j = 2 jh + h
    k = tl.arange(0, BK)
    p = k % 2
    t = (k // 2) % 4
    h = (k // 8) % 2
    b = (k // 16) % 4
    c = k // 64
    phys = 64 * c + 16 * t + 8 * (b // 2) + 2 * (b % 2) + h + 4 * p
    col = tl.arange(0, 16)
    acc = tl.zeros((BN, 16), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        wp = w_ptr + rr[:, None] * stride_wn + (k0 // 8 + wofs)[None, :]
        sp = s_ptr + rr[:, None] * stride_sn + (k0 // 16 + sofs)[None, :]
        if EVEN_K:
            words = tl.load(wp)  # int32 [BN, BK/8]
            sc = tl.load(sp)  # u8 [BN, BK/16]
        else:
            words = tl.load(wp, mask=(k0 // 8 + wofs)[None, :] < K // 8, other=0)
            sc = tl.load(sp, mask=(k0 // 16 + sofs)[None, :] < K // 16, other=0)
        sf = sc.to(tl.float8e4nv, bitcast=True).to(tl.float32) * 3.3230699894622794e35  # e4m3 * 2^118
        w = tl.reshape(words.to(tl.uint32, bitcast=True), (BN, C, 4, 2))  # [BN, C, t, w]
        if INTERP:
            sf = tl.reshape(sf, (BN, C, 4, 1))
            v0 = _pair_f32(w, sf, 12)  # j = 0: [BN, C, t, w, p]
            v1 = _pair_f32(w, sf, 8)
            v2 = _pair_f32(w, sf, 4)
            v3 = _pair_f32(w, sf, 0)
        else:
            sfb = tl.broadcast_to(tl.reshape(sf.to(tl.bfloat16), (BN, C, 4, 1)), (BN, C, 4, 2))
            v0 = _pair_asm(w, sfb, 12)  # j = 0: [BN, C, t, w, p]
            v1 = _pair_asm(w, sfb, 8)
            v2 = _pair_asm(w, sfb, 4)
            v3 = _pair_asm(w, sfb, 0)
        # j = 2 jh + h: join h then jh -> [BN, C, t, w, p, h, jh]
        v = tl.join(tl.join(v0, v1), tl.join(v2, v3))
        v = tl.permute(v, (0, 1, 3, 6, 5, 2, 4))  # [BN, C, w, jh, h, t, p] = logical k order
        a = tl.reshape(v, (BN, BK))
        xv = tl.load(x_ptr + k0 + phys, mask=(k0 + phys) < K, other=0.0)
        xb = tl.broadcast_to(xv[:, None], (BK, 16))
        if INTERP:
            acc = tl.dot(a, xb.to(tl.float32), acc)
        else:
            acc = tl.dot(a, xb, acc)
    y = tl.sum(tl.where(col[None, :] == 0, acc, 0.0), axis=1) * 256.0 * tl.load(gs_ptr + rr * gs_stride)
    if SPLIT == 1:
        tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=rows < N)
    else:
        tl.store(part_ptr + tl.program_id(1) * N + rows, y, mask=rows < N)
        if FUSED:  # the split that counts last sums all SPLIT partials in a fixed order and puts the count back
            tl.debug_barrier()  # every thread's partial stored before the release half of the count
            if tl.atomic_add(count_ptr + pid, 1, sem="acq_rel", scope="gpu") == SPLIT - 1:
                tot = tl.zeros((BN,), dtype=tl.float32)
                for s in tl.static_range(SPLIT):  # unrolled: the loads in flight together
                    tot += tl.load(part_ptr + s * N + rows, mask=rows < N, other=0.0, cache_modifier=".cg")
                tl.store(out_ptr + rows, tot.to(out_ptr.dtype.element_ty), mask=rows < N)
                tl.atomic_xchg(count_ptr + pid, 0, sem="relaxed", scope="gpu")


def pick_split(N, K, BN, BK, per_sm, sms=132):
    blocks = triton.cdiv(N, BN)
    steps = triton.cdiv(K, BK)
    split = max(1, min(steps, triton.cdiv(per_sm * sms, blocks)))
    k_split = triton.cdiv(steps, split) * BK
    return triton.cdiv(K, k_split), k_split


def tc_gemv(x, packed, scale, gs, BN=64, BK=256, num_warps=4, num_stages=3, per_sm=4, reduce=True, count=None):
    """count: int32 [cdiv(N, BN)] zeros: the split-K sum in the same launch; None: ``_finish_split`` after it
    (reduce=False: neither, the partials only, for timing)."""
    N, K = packed.shape[0], x.shape[1]
    words = W._words(packed)
    out = torch.empty((1, N), dtype=torch.bfloat16, device=x.device)
    gsv = gs.reshape(-1).float()
    split, k_split = pick_split(N, K, BN, BK, per_sm)
    part = torch.empty((split, 1, N), dtype=torch.float32, device=x.device) if split > 1 else out
    fused = split > 1 and count is not None
    _tc_gemv_kernel[(triton.cdiv(N, BN), split)](
        x, words, scale.view(torch.uint8), gsv, out, part, count if fused else words, N, K, k_split,
        words.stride(0), scale.stride(0), 1 if gsv.numel() > 1 else 0, BN=BN, BK=BK, SPLIT=split,
        EVEN_K=K % BK == 0, FUSED=fused, INTERP=W.interpreting(), num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if split > 1 and reduce and not fused:
        W._finish_split(part, out)
    return out


TILES = (
    (64, 256, 4, 3, 6),
    (64, 256, 4, 3, 4),
    (64, 256, 4, 2, 6),
    (64, 256, 4, 4, 6),
    (64, 128, 4, 3, 6),
    (64, 128, 4, 4, 6),
    (64, 256, 4, 3, 5),
)
SHAPES = (
    (5376, 21504),
    (43008, 5376),
    (16384, 5376),
    (5376, 16384),
    (5376, 8192),
    (4224, 2816),
    (5376, 4096),
    (8192, 5376),
)


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
        dflt = W.w4a16_gemm(x, *ws[0])
        row = {"N": N, "K": K, "stream_chain_us": round(stream_chain_us(nbytes)["stream_chain_us"], 2),
               "default": round(graph_sequence_us(lambda w, x=x: W.w4a16_gemm(x, *w), ws, 20, 15), 2),
               "default_rel": round(((dflt.float() - ref).norm() / ref.norm()).item(), 6)}  # fmt: skip
        for bn, bk, nw, ns, per_sm in TILES:
            name = f"tc_{bn}x{bk}_w{nw}_s{ns}_p{per_sm}"
            try:
                counts = [torch.zeros(triton.cdiv(N, bn), dtype=torch.int32, device="cuda") for _ in ws]
                args = list(zip(ws, counts, strict=True))

                def f(a, bn=bn, bk=bk, nw=nw, ns=ns, per_sm=per_sm, x=x, reduce=True, fused=True):
                    return tc_gemv(x, *a[0], BN=bn, BK=bk, num_warps=nw, num_stages=ns, per_sm=per_sm,
                                   reduce=reduce, count=a[1] if fused else None)  # fmt: skip

                out = f(args[0])
                rel = ((out.float() - ref).norm() / ref.norm()).item()
                again = f(args[0])  # the count was put back: the same bytes
                row[name] = {
                    "chain_us": round(graph_sequence_us(f, args, 20, 15), 2),
                    "separate_reduce_us": round(graph_sequence_us(lambda a, f=f: f(a, fused=False), args, 20, 15), 2),
                    "no_reduce_us": round(
                        graph_sequence_us(lambda a, f=f: f(a, reduce=False, fused=False), args, 20, 15), 2
                    ),
                    "split": pick_split(N, K, bn, bk, per_sm)[0],
                    "rel": round(rel, 6),
                    "eq_default": round((out == dflt).float().mean().item(), 4),
                    "repeat_equal": bool(torch.equal(out, again)),
                    "counts_zero": bool(all(int(c.abs().sum()) == 0 for c in counts)),
                }
            except Exception as e:  # a tile the device's triton rejects
                row[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                if "illegal" in str(e):
                    raise
        print(json.dumps(row), flush=True)
        del ws
        torch.cuda.empty_cache()


if __name__ == "__main__":
    if sys.argv[1:] == ["time"]:
        time_chain()
        sys.exit()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    for N, K in ((64, 512), (80, 1024 + 64)):
        packed, scale, gs = W.quantize_nvfp4(torch.randn(N, K, device=dev) * 0.02)
        x = (torch.randn(1, K, device=dev) * 0.5).to(torch.bfloat16)
        ref = W.w4a16_gemm_ref(x, packed, scale, gs)
        for per_sm in (1, 64):
            for fused in (False, True):
                count = torch.zeros(triton.cdiv(N, 64), dtype=torch.int32, device=dev) if fused else None
                out = tc_gemv(x, packed, scale, gs, BK=128, per_sm=per_sm, count=count)
                rel = ((out.float() - ref).norm() / ref.norm()).item()
                print(N, K, per_sm, fused, "rel", rel, "count", None if count is None else count.tolist())
