"""12-16: a repacked NVFP4 word for the tensor-core W4A16 gemv, measured before it is built into every path.

The committed decode turns each pair of codes (j, j + 4) of a word (code i at bits 4i..4i+3: m, e0, e1, s) into a
bf16x2 with two shifts and two LOP3 (one shift and two LOP3 for j = 3), then the bf16x2 scale multiply: 19
instructions per word. A bit permutation inside the word lets one rotation place a whole pair: for pair j < 3 the
codes' magnitudes sit at bits 3j..3j+2 (+16 for code j + 4) and the signs 9 bits above (bit (3j + 9) mod 16), so
``rot(w, 6 - 3j) & 0x81C081C0`` is the pair (no rotation for j = 2). The four bits left in each half (10, 11, 13,
14) take pair 3 as e1, s, m, e0: isolate, rotate by 25, multiply by 1 + 2^5 + 2^11 (three shifted copies that do
not overlap, so the sum is their OR) and mask. 9 + 4 instructions per word. Same codes, same products, same order:
the result must equal the committed kernel's bit for bit.

Arms per shape, chained (us per launch, CUDA graph of 20 launches over distinct weights, PDL as in the engine):
the committed kernel on the standard words, this kernel on the repacked words; the PDL load-only chain beside.

Run: python3 repack_probe.py [--shapes N,K ...] > out.jsonl; python3 repack_probe.py --check (CPU: the repack and
the decode's bit logic against the standard decode, in torch)
"""

import argparse
import json

import torch
import triton
import triton.language as tl

import perfkit.kernels.w4a16_gemm as W
from perfkit.kernels.launch import sm_count
from perfkit.kernels.pdl import pdl_enter, pdl_launch

SHAPES = ((5376, 8192), (5376, 16384), (5376, 21504), (43008, 5376), (16384, 5376), (18432, 5376))
# new bit of each field of code i (pair j = i % 4, half h = i // 4; + 16 h): m, e0, e1, s
_FIELDS = {0: (0, 1, 2, 9), 1: (3, 4, 5, 12), 2: (6, 7, 8, 15), 3: (13, 14, 10, 11)}


def repack(words: torch.Tensor) -> torch.Tensor:
    """int32 words [..., W] in the standard layout -> the same codes in the repacked layout."""
    u = words.to(torch.int64) & 0xFFFFFFFF
    out = torch.zeros_like(u)
    for i in range(8):
        j, h = i % 4, i // 4
        for f, new in enumerate(_FIELDS[j]):
            out |= ((u >> (4 * i + f)) & 1) << (new + 16 * h)
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


def _rot(u: torch.Tensor, n: int) -> torch.Tensor:
    return ((u << n) | (u >> (32 - n))) & 0xFFFFFFFF if n else u


def decode_pairs_torch(words: torch.Tensor) -> list[torch.Tensor]:
    """Repacked words -> the 4 pairs' bf16x2 bit patterns (int64 holding uint32), as the kernel computes them."""
    u = words.to(torch.int64) & 0xFFFFFFFF
    m = 0x81C081C0
    d3 = (_rot(u & 0x6C006C00, 25) * 2081) & 0xFFFFFFFF
    return [_rot(u, 6) & m, _rot(u, 3) & m, u & m, d3 & m]


def standard_pairs_torch(words: torch.Tensor) -> list[torch.Tensor]:
    """Standard words -> the committed decode's bit patterns (``_tc_pair_bits``)."""
    u = words.to(torch.int64) & 0xFFFFFFFF
    out = []
    for sh in (12, 8, 4, 0):
        s = (u << sh) & 0xFFFFFFFF
        mm = ((u << (sh - 6)) if sh >= 6 else (u >> (6 - sh))) & 0xFFFFFFFF
        out.append((s & 0x80008000) | (mm & 0x01C001C0))
    return out


def check() -> None:
    gen = torch.Generator().manual_seed(0)
    words = torch.randint(-(2**31), 2**31, (4096,), generator=gen, dtype=torch.int64).to(torch.int32)
    words = torch.cat([words, torch.tensor([0, -1, 0x12345678, -0x789ABCDF], dtype=torch.int32)])
    got = decode_pairs_torch(repack(words))
    want = standard_pairs_torch(words)
    ok = all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    print(json.dumps({"check": "repack decode == standard decode", "words": words.numel(), "equal": ok}))
    assert ok


@triton.jit
def _rp_asm(ws, ss, TEXT: tl.constexpr):
    return tl.inline_asm_elementwise(TEXT, "=r,r,r,r", [ws, ss], dtype=tl.bfloat16, is_pure=True, pack=2)


@triton.jit
def _rp_pair(w, sf, J: tl.constexpr):
    ws = tl.join(w, w)
    ss = tl.join(sf, sf)
    if J == 0:
        y = _rp_asm(ws, ss, "{ .reg .b32 r; shf.l.wrap.b32 r, $1, $1, 6; and.b32 r, r, 0x81C081C0; "
                            "mul.rn.bf16x2 $0, r, $3; }")  # fmt: skip
    elif J == 1:
        y = _rp_asm(ws, ss, "{ .reg .b32 r; shf.l.wrap.b32 r, $1, $1, 3; and.b32 r, r, 0x81C081C0; "
                            "mul.rn.bf16x2 $0, r, $3; }")  # fmt: skip
    elif J == 2:
        y = _rp_asm(ws, ss, "{ .reg .b32 r; and.b32 r, $1, 0x81C081C0; mul.rn.bf16x2 $0, r, $3; }")
    else:
        y = _rp_asm(ws, ss, "{ .reg .b32 r; and.b32 r, $1, 0x6C006C00; shf.l.wrap.b32 r, r, r, 25; "
                            "mul.lo.u32 r, r, 2081; and.b32 r, r, 0x81C081C0; mul.rn.bf16x2 $0, r, $3; }")  # fmt: skip
    return y


@triton.jit
def _rp_tile(w_ptr, s_ptr, rr, stride_wn, stride_sn, k0, BN: tl.constexpr, BK: tl.constexpr):
    """``W._tc_tile`` (whole steps, GPU form) on repacked words: same pairs, same K order."""
    C: tl.constexpr = BK // 64
    wofs = k0 // 8 + tl.arange(0, BK // 8)
    sofs = k0 // 16 + tl.arange(0, BK // 16)
    words = tl.load(w_ptr + rr[:, None] * stride_wn + wofs[None, :])
    sc = tl.load(s_ptr + rr[:, None] * stride_sn + sofs[None, :])
    sf = sc.to(tl.float8e4nv, bitcast=True).to(tl.float32) * 3.3230699894622794e35  # e4m3 * 2^118
    w = tl.reshape(words.to(tl.uint32, bitcast=True), (BN, C, 4, 2))
    sfb = tl.broadcast_to(tl.reshape(sf.to(tl.bfloat16), (BN, C, 4, 1)), (BN, C, 4, 2))
    v0 = _rp_pair(w, sfb, 0)
    v1 = _rp_pair(w, sfb, 1)
    v2 = _rp_pair(w, sfb, 2)
    v3 = _rp_pair(w, sfb, 3)
    v = tl.join(tl.join(v0, v1), tl.join(v2, v3))
    return tl.reshape(tl.permute(v, (0, 1, 3, 6, 5, 2, 4)), (BN, BK))


@triton.jit
def _rp_kernel(x_ptr, w_ptr, s_ptr, gs_ptr, out_ptr, part_ptr, count_ptr, N, K, steps, stride_wn, stride_sn,
               gs_stride, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """``W._w4a16_gemv_tc_kernel`` (whole K steps, splits summed in the launch) on repacked words."""
    pdl_enter(PDL)
    pid = tl.program_id(0)
    k_lo = tl.multiple_of((tl.program_id(1) * steps // SPLIT) * BK, BK)
    k_hi = tl.minimum(((tl.program_id(1) + 1) * steps // SPLIT) * BK, K)
    rows = pid * BN + tl.arange(0, BN)
    rr = tl.minimum(rows, N - 1).to(tl.int64)
    col = tl.arange(0, 16)
    acc = tl.zeros((BN, 16), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        a = _rp_tile(w_ptr, s_ptr, rr, stride_wn, stride_sn, k0, BN, BK)
        xb = W._tc_x_tile(x_ptr, k0, K, BK)
        acc = tl.dot(a, xb, acc)
    y = tl.sum(tl.where(col[None, :] == 0, acc, 0.0), axis=1) * 256.0 * tl.load(gs_ptr + rr * gs_stride)
    if SPLIT == 1:
        tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=rows < N)
    else:
        tl.store(part_ptr + tl.program_id(1) * N + rows, y, mask=rows < N)
        tl.debug_barrier()
        if tl.atomic_add(count_ptr + pid, 1, sem="acq_rel", scope="gpu") == SPLIT - 1:
            tot = tl.zeros((BN,), dtype=tl.float32)
            for i in tl.static_range(SPLIT):
                tot += tl.load(part_ptr + i * N + rows, mask=rows < N, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + rows, tot.to(out_ptr.dtype.element_ty), mask=rows < N)
            tl.atomic_xchg(count_ptr + pid, 0, sem="relaxed", scope="gpu")


def rp_gemv(x, words_rp, scales, gs, counter, pdl=True, out_dtype=torch.float32):
    cfg = W.GEMV_TC_CONFIG
    N, K = words_rp.shape[0], x.shape[1]
    assert K % cfg.block_k == 0
    split = W.tc_split(N, K, cfg, sm_count(x.device))
    out = torch.empty((1, N), dtype=out_dtype, device=x.device)
    part = torch.empty((split, 1, N), dtype=torch.float32, device=x.device)
    gs_stride = 1 if gs.numel() > 1 else 0
    _rp_kernel[(triton.cdiv(N, cfg.block_n), split)](
        x, words_rp, scales.view(torch.uint8), gs, out, part, counter, N, K, K // cfg.block_k, words_rp.stride(0),
        scales.stride(0), gs_stride, BN=cfg.block_n, BK=cfg.block_k, SPLIT=split,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch(pdl))  # fmt: skip
    return out


def _kernel_regs(fn) -> list:
    """(constexprs, registers, spills) of each compiled variant of a jit function (call 8: whether the device's
    Triton 3.6 gives a variant more than the 128 registers that 4 programs per SM need)."""
    rows = []
    for caches in getattr(fn, "device_caches", {}).values():
        cache = caches[0] if isinstance(caches, tuple) else caches
        for key, k in cache.items():
            k._init_handles()
            rows.append((str(key)[-160:], k.n_regs, k.n_spills))
    return rows


def main() -> None:
    from perfkit.kernels.stream import CHAIN_CALLS, CHAIN_REPLAYS, stream_chain_us
    from perfkit.kernels.timing import graph_sequence_us

    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=[f"{n},{k}" for n, k in SHAPES])
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--regs", action="store_true", help="after the shapes, the compiled variants' registers")
    ap.add_argument("--plain", action="store_true", help="both arms launched without PDL (call 9)")
    args = ap.parse_args()
    if args.check:
        check()
        return
    dev = torch.device("cuda")
    for nk in args.shapes:
        N, K = (int(v) for v in nk.split(","))
        packed, scale, gs, _, gen = W._bench_weights(N, K, torch.bfloat16, 0, "cuda")
        weights = W._chain_weights(N, K, (packed, scale, gs), torch.bfloat16, "cuda")
        rp = {w[0].data_ptr(): repack(W._words(w[0])) for w in weights}
        counters = {w[0].data_ptr(): W.new_split_counter(N, dev) for w in weights}
        x = torch.randn(1, K, device=dev, dtype=torch.bfloat16, generator=gen)
        nbytes = int(W.w4a16_gemm_traffic(1, N, K, 2)["total_bytes"])
        row = {"N": N, "K": K, "stream_pdl_us": round(stream_chain_us(nbytes, "cuda", pdl=True)["stream_chain_us"], 2)}

        pdl = not args.plain
        if args.plain:
            row["stream_us"] = round(stream_chain_us(nbytes, "cuda")["stream_chain_us"], 2)

        def std(w, x=x, counters=counters, pdl=pdl):
            return W.w4a16_gemm(x, *w, split_counter=counters[w[0].data_ptr()], pdl=pdl, out_dtype=torch.float32)

        def new(w, x=x, counters=counters, rp=rp, pdl=pdl):
            return rp_gemv(x, rp[w[0].data_ptr()], w[1], w[2], counters[w[0].data_ptr()], pdl=pdl)

        ref = std(weights[0])
        got = new(weights[0])
        row["bit_identical"] = bool(torch.equal(ref, got))
        row["max_abs_diff"] = float((ref - got).abs().max())
        for rep in range(2):
            for tag, fn in (("std", std), ("repack", new)):
                us = graph_sequence_us(fn, weights, CHAIN_CALLS, CHAIN_REPLAYS)
                row[f"{tag}_us_{rep}"] = round(us, 2)
        for tag in ("std", "repack"):
            best = min(row[f"{tag}_us_0"], row[f"{tag}_us_1"])
            row[f"{tag}_pct"] = round(100 * row["stream_pdl_us"] / best, 1)
        row["counts_zero"] = all(int(c.abs().sum()) == 0 for c in counters.values())
        print(json.dumps(row), flush=True)
        del weights, counters, rp, packed, scale, gs
        torch.cuda.empty_cache()
    if args.regs:
        for name, fn in (("committed", W._w4a16_gemv_tc_kernel), ("repacked", _rp_kernel)):
            try:
                for key, regs, spills in _kernel_regs(fn):
                    print(json.dumps({"kernel": name, "regs": regs, "spills": spills, "key": key}), flush=True)
            except Exception as exc:  # the cache's layout is Triton's own: report, do not lose the timings
                print(json.dumps({"kernel": name, "error": f"{type(exc).__name__}: {exc}"[:300]}), flush=True)


if __name__ == "__main__":
    main()
