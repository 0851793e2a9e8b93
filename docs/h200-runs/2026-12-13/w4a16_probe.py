"""Where does the W4A16 gemv at M = 1 stand against a load-only read of the same bytes, in a back-to-back chain?
(12-13 call 1, issue #10)

The benches so far (``bench_w4a16``) time one launch per CUDA-graph replay with L2 flushed, kernel and load-only
ceiling alike (``stream_read_ms``). 12-12 measured that such a single launch carries ~7 us that a chain of
launches does not (46.1 MB: 20.48 us alone, 13.70 us per launch back to back), so the "% of the measured ceiling"
of the single launch flatters every kernel of a few tens of us. The decode step runs its products back to back,
so this probe times both ways over distinct weights (``graph_sequence_us``, 20 calls per graph, weights cycling
so L2 never serves a re-read), for the five 31B projections at M = 1:

  chain   per shape: the default tile (``pick_config``), a few other wide tiles and the swapped-tile dot path at
          M = 1 (tensor cores, 16 padded rows), each as one launch (graph_ms) and in the chain; the stream probe
          over the same bytes both ways.
  ncu     one shape's default launch, repeated (for ``ncu --kernel-name regex:w4a16``): ``ncu N K``.

A ``--check`` run (CPU, TRITON_INTERPRET=1) compares the probe-local kernels with ``w4a16_gemm_ref`` at a small shape.

Run on the device: python3 docs/h200-runs/2026-12-13/w4a16_probe.py chain [name prefix ...] > $OUT/w4a16.jsonl
"""

import json
import sys

import torch
import triton
import triton.language as tl

from perfkit.kernels import w4a16_gemm as W
from perfkit.kernels.launch import sm_count
from perfkit.kernels.stream import STREAM_CONFIGS, stream_fold, stream_read_ms
from perfkit.kernels.timing import graph_ms, graph_sequence_us

SHAPES = ((5376, 21504), (43008, 5376), (16384, 5376), (5376, 16384), (5376, 8192))
EXTRA = {
    "wide_16x1024x8": W.W4A16Config(1, 16, 1024, num_warps=8, num_stages=1, prefetch=2, wide=True),
    "wide_16x512x4": W.W4A16Config(1, 16, 512, num_warps=4, num_stages=1, prefetch=2, wide=True),
    "wide_8x1024x4": W.W4A16Config(1, 8, 1024, num_warps=4, num_stages=1, prefetch=2, wide=True),
    "wide_4x2048x4": W.W4A16Config(1, 4, 2048, num_warps=4, num_stages=1, prefetch=2, wide=True),
    "narrow": W.GEMV_CONFIG,
    "dot_swap_16x128x64": W.W4A16Config(16, 128, 64, num_warps=4, num_stages=3, swap_ab=True, scales_vec=True),
    "dot_swap_16x64x128": W.W4A16Config(16, 64, 128, num_warps=4, num_stages=4, swap_ab=True, scales_vec=True),
}
CALLS, REPLAYS = 20, 15


def emit(row):
    print(json.dumps(row), flush=True)


def weights(N, K, copies):
    gen = torch.Generator(device="cuda").manual_seed(0)
    out = []
    for _ in range(copies):
        packed, scale, gs = W.quantize_nvfp4(torch.randn(N, K, device="cuda", generator=gen) * 0.02)
        out.append((packed, scale, gs))
    return out


def chain_section(only=()):
    sms = sm_count(torch.device("cuda"))
    for N, K in SHAPES:
        nbytes = W.w4a16_gemm_traffic(1, N, K)["weight_bytes"]
        copies = max(2, min(12, -(-400_000_000 // nbytes)))
        ws = weights(N, K, copies)
        x = (torch.randn(1, K, device="cuda") * 0.5).to(torch.bfloat16)
        ref = W.w4a16_gemm_ref(x, *ws[0])
        default = W.pick_config(1, "gemv", x.dtype, N, sms)
        cases = {"default": ("gemv", default)} | {k: ("dot" if c.swap_ab else "gemv", c) for k, c in EXTRA.items()}
        fns = {
            name: (lambda w, x=x, path=path, cfg=cfg: W.w4a16_gemm(x, *w, config=cfg, path=path))
            for name, (path, cfg) in cases.items()
        }
        for name, (kernel, sets, h, bk, nw) in VARIANTS.items():
            if K % bk == 0:
                run = variant_launcher(kernel, sets, h, bk, nw)
                fns[name] = lambda w, x=x, run=run: run(x, *w)
        for name, spec in Q_VARIANTS.items():
            if K % (spec[1] * spec[2] * 32) == 0:
                run = q_launcher(*spec)
                fns[name] = lambda w, x=x, run=run: run(x, *w)
        for name, spec in SPLIT_VARIANTS.items():
            if K % (spec[1] * spec[3]) == 0:
                run = split_launcher(*spec)
                fns[name] = lambda w, x=x, run=run: run(x, *w)
        if only:  # the default tile and the cases whose names start with one of ``only``
            fns = {k: f for k, f in fns.items() if k == "default" or k.startswith(tuple(only))}
        row = {"section": "chain", "N": N, "K": K, "mb": round(nbytes / 1e6, 2), "default_tile": str(default)}
        w0 = ws[0]
        for name, fn in fns.items():
            try:
                rel = ((fn(w0).float() - ref).norm() / ref.norm()).item()
                one = graph_ms(lambda fn=fn, w0=w0: fn(w0)) * 1e3
                chain = graph_sequence_us(fn, ws, CALLS, REPLAYS)
                row[name] = {"one_us": round(one, 2), "chain_us": round(chain, 2), "rel": round(rel, 6)}
            except Exception as e:  # a tile the device's triton rejects: record it, go on
                row[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        del ws
        torch.cuda.empty_cache()
        n = nbytes // 4
        bufs = [torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32, device="cuda") for _ in range(copies)]
        row["stream_one_us"] = round(stream_read_ms(nbytes)["stream_ms"] * 1e3, 2)
        row["stream_chain_us"] = round(
            min(graph_sequence_us(lambda b, c=c: stream_fold(b, c), bufs, CALLS, REPLAYS) for c in STREAM_CONFIGS), 2
        )
        dflt = row["default"]
        if "one_us" in dflt:
            row["pct_of_stream_one"] = round(100 * row["stream_one_us"] / dflt["one_us"], 1)
            row["pct_of_stream_chain"] = round(100 * row["stream_chain_us"] / dflt["chain_us"], 1)
        emit(row)
        del bufs
        torch.cuda.empty_cache()


def ncu_section(N, K):
    ws = weights(N, K, 4)
    x = (torch.randn(1, K, device="cuda") * 0.5).to(torch.bfloat16)
    for i in range(12):
        W.w4a16_gemm(x, *ws[i % 4])
    torch.cuda.synchronize()


def check():
    torch.manual_seed(0)
    N, K = 64, 8192
    packed, scale, gs = W.quantize_nvfp4(torch.randn(N, K) * 0.02)
    x = (torch.randn(1, K) * 0.5).to(torch.bfloat16)
    ref = W.w4a16_gemm_ref(x, packed, scale, gs)
    for name, (kernel, sets, h, bk, nw) in VARIANTS.items():
        out = variant_launcher(kernel, sets, h, bk, nw)(x, packed, scale, gs)
        err = ((out.float() - ref).norm() / ref.norm()).item()
        print(name, err)
        assert err < 1e-2, name
    for name, spec in SPLIT_VARIANTS.items():
        run = split_launcher(*spec)
        for _ in range(2):  # twice: the counters must have been reset
            out = run(x, packed, scale, gs)
            err = ((out.float() - ref).norm() / ref.norm()).item()
            print(name, err)
            assert err < 1e-2, name
    for name, spec in Q_VARIANTS.items():
        if K % (spec[1] * spec[2] * 32) == 0:
            out = q_launcher(*spec)(x, packed, scale, gs)
            err = ((out.float() - ref).norm() / ref.norm()).item()
            print(name, err)
            assert err < 1e-2 or name.endswith("xbcast"), name


# --- candidate forms of the wide kernel (probe-local): more row sets per x, a deeper prefetch -----------------


@triton.jit
def _wide4_kernel(x_ptr, w_ptr, s_ptr, gs_ptr, out_ptr, N, K, stride_wn, stride_sn, gs_stride,
                  H: tl.constexpr, BLOCK_K: tl.constexpr, ASM: tl.constexpr):  # fmt: skip
    """Four row sets of H share each thread's x (the module's kernel: two); two steps in flight; EVEN_K only."""
    c = tl.arange(0, BLOCK_K // 32)
    row0 = tl.program_id(0) * 4 * H
    o0 = row0 + tl.arange(0, H)
    o1 = o0 + H
    o2 = o0 + 2 * H
    o3 = o0 + 3 * H
    r0 = tl.minimum(o0, N - 1).to(tl.int64)
    r1 = tl.minimum(o1, N - 1).to(tl.int64)
    r2 = tl.minimum(o2, N - 1).to(tl.int64)
    r3 = tl.minimum(o3, N - 1).to(tl.int64)
    w0p, s0p = W._wide_ptrs(w_ptr, s_ptr, r0, stride_wn, stride_sn, c)
    w1p, s1p = W._wide_ptrs(w_ptr, s_ptr, r1, stride_wn, stride_sn, c)
    w2p, s2p = W._wide_ptrs(w_ptr, s_ptr, r2, stride_wn, stride_sn, c)
    w3p, s3p = W._wide_ptrs(w_ptr, s_ptr, r3, stride_wn, stride_sn, c)
    xp = W._wide_x(x_ptr, c)
    a0 = tl.zeros((H, BLOCK_K // 32, 2), dtype=tl.float32)
    a1 = tl.zeros((H, BLOCK_K // 32, 2), dtype=tl.float32)
    a2 = tl.zeros((H, BLOCK_K // 32, 2), dtype=tl.float32)
    a3 = tl.zeros((H, BLOCK_K // 32, 2), dtype=tl.float32)
    w0, s0 = W._wide_step(w0p, s0p, 0, K, c, True, BLOCK_K)
    w1, s1 = W._wide_step(w1p, s1p, 0, K, c, True, BLOCK_K)
    w2, s2 = W._wide_step(w2p, s2p, 0, K, c, True, BLOCK_K)
    w3, s3 = W._wide_step(w3p, s3p, 0, K, c, True, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        n0, t0 = W._wide_step(w0p, s0p, k0 + BLOCK_K, K, c, True, BLOCK_K)
        n1, t1 = W._wide_step(w1p, s1p, k0 + BLOCK_K, K, c, True, BLOCK_K)
        n2, t2 = W._wide_step(w2p, s2p, k0 + BLOCK_K, K, c, True, BLOCK_K)
        n3, t3 = W._wide_step(w3p, s3p, k0 + BLOCK_K, K, c, True, BLOCK_K)
        x0, x1, x2, x3, x4, x5, x6, x7 = W._wide_x_step(xp, k0, K, c, True)
        a0 = W._wide_rows(a0, w0, s0, x0, x1, x2, x3, x4, x5, x6, x7, ASM)
        a1 = W._wide_rows(a1, w1, s1, x0, x1, x2, x3, x4, x5, x6, x7, ASM)
        a2 = W._wide_rows(a2, w2, s2, x0, x1, x2, x3, x4, x5, x6, x7, ASM)
        a3 = W._wide_rows(a3, w3, s3, x0, x1, x2, x3, x4, x5, x6, x7, ASM)
        w0, s0, w1, s1, w2, s2, w3, s3 = n0, t0, n1, t1, n2, t2, n3, t3
    tl.store(out_ptr + o0, (W._wide_sum(a0) * tl.load(gs_ptr + r0 * gs_stride)).to(tl.bfloat16), mask=o0 < N)
    tl.store(out_ptr + o1, (W._wide_sum(a1) * tl.load(gs_ptr + r1 * gs_stride)).to(tl.bfloat16), mask=o1 < N)
    tl.store(out_ptr + o2, (W._wide_sum(a2) * tl.load(gs_ptr + r2 * gs_stride)).to(tl.bfloat16), mask=o2 < N)
    tl.store(out_ptr + o3, (W._wide_sum(a3) * tl.load(gs_ptr + r3 * gs_stride)).to(tl.bfloat16), mask=o3 < N)


@triton.jit
def _wide_d3_kernel(x_ptr, w_ptr, s_ptr, gs_ptr, out_ptr, N, K, stride_wn, stride_sn, gs_stride,
                    H: tl.constexpr, BLOCK_K: tl.constexpr, ASM: tl.constexpr):  # fmt: skip
    """The module's two row sets, three steps in flight instead of two; EVEN_K only."""
    c = tl.arange(0, BLOCK_K // 32)
    row0 = tl.program_id(0) * 2 * H
    oa = row0 + tl.arange(0, H)
    ob = oa + H
    ra = tl.minimum(oa, N - 1).to(tl.int64)
    rb = tl.minimum(ob, N - 1).to(tl.int64)
    wa, sa = W._wide_ptrs(w_ptr, s_ptr, ra, stride_wn, stride_sn, c)
    wb, sb = W._wide_ptrs(w_ptr, s_ptr, rb, stride_wn, stride_sn, c)
    xp = W._wide_x(x_ptr, c)
    acc_a = tl.zeros((H, BLOCK_K // 32, 2), dtype=tl.float32)
    acc_b = tl.zeros((H, BLOCK_K // 32, 2), dtype=tl.float32)
    w_a, s_a = W._wide_step(wa, sa, 0, K, c, True, BLOCK_K)
    w_b, s_b = W._wide_step(wb, sb, 0, K, c, True, BLOCK_K)
    w_a1, s_a1 = W._wide_step(wa, sa, BLOCK_K, K, c, True, BLOCK_K)
    w_b1, s_b1 = W._wide_step(wb, sb, BLOCK_K, K, c, True, BLOCK_K)
    w_a2, s_a2 = W._wide_step(wa, sa, 2 * BLOCK_K, K, c, True, BLOCK_K)
    w_b2, s_b2 = W._wide_step(wb, sb, 2 * BLOCK_K, K, c, True, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        w_a3, s_a3 = W._wide_step(wa, sa, k0 + 3 * BLOCK_K, K, c, True, BLOCK_K)
        w_b3, s_b3 = W._wide_step(wb, sb, k0 + 3 * BLOCK_K, K, c, True, BLOCK_K)
        x0, x1, x2, x3, x4, x5, x6, x7 = W._wide_x_step(xp, k0, K, c, True)
        acc_a = W._wide_rows(acc_a, w_a, s_a, x0, x1, x2, x3, x4, x5, x6, x7, ASM)
        acc_b = W._wide_rows(acc_b, w_b, s_b, x0, x1, x2, x3, x4, x5, x6, x7, ASM)
        w_a, s_a, w_a1, s_a1, w_a2, s_a2 = w_a1, s_a1, w_a2, s_a2, w_a3, s_a3
        w_b, s_b, w_b1, s_b1, w_b2, s_b2 = w_b1, s_b1, w_b2, s_b2, w_b3, s_b3
    ya = W._wide_sum(acc_a) * tl.load(gs_ptr + ra * gs_stride)
    yb = W._wide_sum(acc_b) * tl.load(gs_ptr + rb * gs_stride)
    tl.store(out_ptr + oa, ya.to(tl.bfloat16), mask=oa < N)
    tl.store(out_ptr + ob, yb.to(tl.bfloat16), mask=ob < N)


@triton.jit
def _q_rows(acc, w, s, x0, x1, x2, x3, x4, x5, x6, x7, ASM: tl.constexpr):
    """acc [CO, H, CI, 2] + one row set's words [CO, H, CI, 4] against x's elements [CO, 1, CI, 4] each."""
    CO: tl.constexpr = w.shape[0]
    H: tl.constexpr = w.shape[1]
    CI: tl.constexpr = w.shape[2]
    sf = W._e4m3_times_2m8(s) * 4194304.0
    l0, h0, l1, h1, l2, h2, l3, h3 = W._e2m1_decode(w.to(tl.uint32, bitcast=True), ASM)
    part = W._word_sums(l0, h0, l1, h1, l2, h2, l3, h3, x0, x1, x2, x3, x4, x5, x6, x7)
    even, odd = tl.split(tl.reshape(part, (CO, H, CI, 2, 2)))
    return acc + (even + odd) * sf


@triton.jit
def _wide_q_kernel(x_ptr, w_ptr, s_ptr, gs_ptr, out_ptr, N, K, stride_wn, stride_sn, gs_stride,
                   H: tl.constexpr, CO: tl.constexpr, CI: tl.constexpr, ASM: tl.constexpr,
                   XBCAST: tl.constexpr, X128: tl.constexpr = False):  # fmt: skip
    """The wide kernel with a 4-D tile [CO, H, CI, 4] per row set: a warp's 32 threads cover 4 rows x 8 chunks
    (CI = 8) instead of 1 row x 32 chunks, so its x loads touch 8 chunks (4 threads share each) instead of 32.
    BLOCK_K = CO * CI * 32; two row sets of H, two steps in flight, EVEN_K only. XBCAST (diagnostic, wrong
    results): every thread reads chunk 0 of x."""
    BLOCK_K: tl.constexpr = CO * CI * 32
    co = tl.arange(0, CO)[:, None, None, None]
    ci = tl.arange(0, CI)[None, None, :, None]
    chunk = co * CI + ci  # [CO, 1, CI, 1]
    j4 = tl.arange(0, 4)[None, None, None, :]
    j2 = tl.arange(0, 2)[None, None, None, :]
    row0 = tl.program_id(0) * 2 * H
    oa = row0 + tl.arange(0, H)
    ob = oa + H
    ra = tl.minimum(oa, N - 1).to(tl.int64)
    rb = tl.minimum(ob, N - 1).to(tl.int64)
    wa = w_ptr + tl.multiple_of(ra * stride_wn, 4)[None, :, None, None] + 4 * chunk + j4
    wb = w_ptr + tl.multiple_of(rb * stride_wn, 4)[None, :, None, None] + 4 * chunk + j4
    sa = s_ptr + tl.multiple_of(ra * stride_sn, 2)[None, :, None, None] + 2 * chunk + j2
    sb = s_ptr + tl.multiple_of(rb * stride_sn, 2)[None, :, None, None] + 2 * chunk + j2
    xb = x_ptr.to(tl.pointer_type(tl.int64), bitcast=True)
    if XBCAST:
        xp = xb + 0 * chunk + 2 * j4
    else:
        xp = xb + 8 * chunk + 2 * j4  # [CO, 1, CI, 4]: element 0 of each word's span, as int64 words
    acc_a = tl.zeros((CO, H, CI, 2), dtype=tl.float32)
    acc_b = tl.zeros((CO, H, CI, 2), dtype=tl.float32)
    w_a = tl.load(wa)
    s_a = tl.load(sa)
    w_b = tl.load(wb)
    s_b = tl.load(sb)
    w_a1 = tl.load(wa + tl.minimum(BLOCK_K, K - BLOCK_K) // 8)
    s_a1 = tl.load(sa + tl.minimum(BLOCK_K, K - BLOCK_K) // 16)
    w_b1 = tl.load(wb + tl.minimum(BLOCK_K, K - BLOCK_K) // 8)
    s_b1 = tl.load(sb + tl.minimum(BLOCK_K, K - BLOCK_K) // 16)
    for k0 in range(0, K, BLOCK_K):
        kk = tl.minimum(k0 + 2 * BLOCK_K, K - BLOCK_K)
        w_a2 = tl.load(wa + tl.multiple_of(kk // 8, 4))
        s_a2 = tl.load(sa + tl.multiple_of(kk // 16, 2))
        w_b2 = tl.load(wb + tl.multiple_of(kk // 8, 4))
        s_b2 = tl.load(sb + tl.multiple_of(kk // 16, 2))
        if XBCAST:
            a = tl.load(xp)
            b = tl.load(xp + 1)
        elif X128:  # the thread's 8 int64 of x as one [.., 4, 2] tensor: 16-byte loads
            ab = tl.load(tl.join(xp, xp + 1) + k0 // 4)
            a, b = tl.split(ab)
        else:
            a = tl.load(xp + k0 // 4)
            b = tl.load(xp + k0 // 4 + 1)
        x0, x1, x2, x3, x4, x5, x6, x7 = W._x_elems(a, b)
        acc_a = _q_rows(acc_a, w_a, s_a, x0, x1, x2, x3, x4, x5, x6, x7, ASM)
        acc_b = _q_rows(acc_b, w_b, s_b, x0, x1, x2, x3, x4, x5, x6, x7, ASM)
        w_a, s_a, w_a1, s_a1 = w_a1, s_a1, w_a2, s_a2
        w_b, s_b, w_b1, s_b1 = w_b1, s_b1, w_b2, s_b2
    ya = tl.sum(tl.sum(tl.sum(acc_a, axis=3), axis=2), axis=0)
    yb = tl.sum(tl.sum(tl.sum(acc_b, axis=3), axis=2), axis=0)
    ya = ya * tl.load(gs_ptr + tl.minimum(oa, N - 1) * gs_stride)
    yb = yb * tl.load(gs_ptr + tl.minimum(ob, N - 1) * gs_stride)
    tl.store(out_ptr + oa, ya.to(tl.bfloat16), mask=oa < N)
    tl.store(out_ptr + ob, yb.to(tl.bfloat16), mask=ob < N)


def q_launcher(H, CO, CI, num_warps, xbcast=False, x128=False):
    def run(x, packed, scale, gs):
        N, K = packed.shape[0], x.shape[1]
        words = packed.view(torch.int32)
        out = torch.empty((1, N), dtype=torch.bfloat16, device=x.device)
        gsv = gs.reshape(-1).float()
        _wide_q_kernel[(triton.cdiv(N, 2 * H),)](
            x, words, scale.view(torch.uint8), gsv, out, N, K, words.stride(0), K // 16, 1 if gsv.numel() > 1 else 0,
            H=H, CO=CO, CI=CI, ASM=not W.interpreting(), XBCAST=xbcast, X128=x128, num_warps=num_warps,
        )  # fmt: skip
        return out

    return run


def variant_launcher(kernel, sets, H, block_k, num_warps):
    """A w4a16_gemm-like callable (x, packed, scale, gs) for a probe-local kernel (M = 1, bf16, K % block_k == 0)."""

    def run(x, packed, scale, gs):
        N, K = packed.shape[0], x.shape[1]
        words = packed.view(torch.int32)
        out = torch.empty((1, N), dtype=torch.bfloat16, device=x.device)
        gsv = gs.reshape(-1).float()
        kernel[(triton.cdiv(N, sets * H),)](
            x, words, scale.view(torch.uint8), gsv, out, N, K, words.stride(0), K // 16, 1 if gsv.numel() > 1 else 0,
            H=H, BLOCK_K=block_k, ASM=not W.interpreting(), num_warps=num_warps,
        )  # fmt: skip
        return out

    return run


@triton.jit
def _wide_split_kernel(x_ptr, w_ptr, s_ptr, gs_ptr, out_ptr, part_ptr, cnt_ptr, N, K, stride_wn, stride_sn,
                       gs_stride, k_per_split, H: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                       ASM: tl.constexpr):  # fmt: skip
    """The module's wide kernel over K in [pid_k * k_per_split, +k_per_split) (split-K in one launch): each program
    writes its fp32 partials [SPLIT, N], then counts itself in at its row block (atomic, acq_rel); the last of the
    SPLIT programs of a block sums the partials in split order (deterministic), applies the global scale, stores
    and resets the counter for the next launch. EVEN_K only (k_per_split a multiple of BLOCK_K)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    k0 = pid_k * k_per_split
    row0 = pid_n * 2 * H
    xk = x_ptr + k0
    wk = w_ptr + k0 // 8
    sk = s_ptr + k0 // 16
    oa, ra, ya, ob, rb, yb = W._wide_gemv(xk, wk, sk, row0, N, k_per_split, k_per_split, stride_wn, stride_sn, H,
                                          BLOCK_K, True, ASM)  # fmt: skip
    tl.store(part_ptr + pid_k * N + oa, ya, mask=oa < N)
    tl.store(part_ptr + pid_k * N + ob, yb, mask=ob < N)
    done = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
    if done == SPLIT - 1:
        sa = tl.zeros((H,), dtype=tl.float32)
        sb = tl.zeros((H,), dtype=tl.float32)
        for j in range(SPLIT):
            sa += tl.load(part_ptr + j * N + oa, mask=oa < N, other=0.0, cache_modifier=".cg")
            sb += tl.load(part_ptr + j * N + ob, mask=ob < N, other=0.0, cache_modifier=".cg")
        tl.store(out_ptr + oa, (sa * tl.load(gs_ptr + ra * gs_stride)).to(tl.bfloat16), mask=oa < N)
        tl.store(out_ptr + ob, (sb * tl.load(gs_ptr + rb * gs_stride)).to(tl.bfloat16), mask=ob < N)
        tl.store(cnt_ptr + pid_n, 0)


def split_launcher(H, block_k, num_warps, split):
    cache = {}

    def run(x, packed, scale, gs):
        N, K = packed.shape[0], x.shape[1]
        words = packed.view(torch.int32)
        out = torch.empty((1, N), dtype=torch.bfloat16, device=x.device)
        gsv = gs.reshape(-1).float()
        blocks = triton.cdiv(N, 2 * H)
        if (N, x.device) not in cache:  # persistent: the last program of each block resets its counter
            cache[(N, x.device)] = (torch.empty((split, N), dtype=torch.float32, device=x.device),
                                    torch.zeros(blocks, dtype=torch.int32, device=x.device))  # fmt: skip
        part, cnt = cache[(N, x.device)]
        _wide_split_kernel[(blocks, split)](
            x, words, scale.view(torch.uint8), gsv, out, part, cnt, N, K, words.stride(0), K // 16,
            1 if gsv.numel() > 1 else 0, K // split, H=H, BLOCK_K=block_k, SPLIT=split, ASM=not W.interpreting(),
            num_warps=num_warps,
        )  # fmt: skip
        return out

    return run


SPLIT_VARIANTS = {  # (H, BLOCK_K, warps, split): K % (split * BLOCK_K) == 0
    "split2_8x1024x8": (8, 1024, 8, 2),
    "split4_8x1024x8": (8, 1024, 8, 4),
    "split2_8x512x4": (8, 512, 4, 2),
    "split4_8x512x4": (8, 512, 4, 4),
    "split8_8x512x4": (8, 512, 4, 8),
}
Q_VARIANTS = {
    "q_8x4x8_w8": (8, 4, 8, 8),  # 16 rows, BLOCK_K 1024, 8 warps: threads 4 rows x 8 chunks, warps 2 (H) x 4 (CO)
    "q_8x2x8_w4": (8, 2, 8, 4),  # 16 rows, 512, 4 warps
    "q_8x1x8_w2": (8, 1, 8, 2),  # 16 rows, 256, 2 warps
    "q_16x2x8_w8": (16, 2, 8, 8),  # 32 rows, 512, 8 warps
    "q_8x4x8_w8_xbcast": (8, 4, 8, 8, True),  # diagnostic: x from one chunk (wrong results)
}
VARIANTS = {
    "wide4_8x1024x8": (_wide4_kernel, 4, 8, 1024, 8),
    "wide4_4x1024x4": (_wide4_kernel, 4, 4, 1024, 4),
    "wide4_8x512x4": (_wide4_kernel, 4, 8, 512, 4),
    "d3_8x1024x8": (_wide_d3_kernel, 2, 8, 1024, 8),
    "d3_8x512x4": (_wide_d3_kernel, 2, 8, 512, 4),
}


if __name__ == "__main__":
    if sys.argv[1] == "--check":
        check()
    elif sys.argv[1] == "ncu":
        ncu_section(int(sys.argv[2]), int(sys.argv[3]))
    else:
        chain_section(tuple(sys.argv[2:]))
