"""Paged decode attention (one query token per request): split-KV over the live pages, then a merge of the splits.

Why a kernel of our own: at small batches FlashInfer's decode is latency-bound, not bandwidth-bound. On the H200
(``docs/h200-runs/2026-12-01b/1-attention-*.json``, CUDA-graph replays) one batch-1 decode layer took 11-16 µs for
4-17 MB of KV: 31B sliding (hd 256, 16 kv heads) 13.7 µs against a 3.9 µs bound, 26B-A4B sliding 11.4 against
2.0, the hd 512 full pools 13-14 µs against 1-2. Summed over the layers that is ~0.5 ms of a 31B batch-1 step and
~0.45 ms (12 %) of a 26B-A4B one. Decode is a pure read of the pages, so the way to the bound is enough programs in
flight at once: the keys of one (request, kv head) are cut into ``splits`` slices, one program each, and a second
launch merges the slices' partial softmaxes ("flash-decoding").

Layout: the engine's paged cache ``[num_pages, 2, page_size, kv_heads, head_dim]`` (dim 1: 0 = K, 1 = V) in the
activation dtype (bf16 / fp16) or float8_e4m3fn (read as bytes, decoded in registers, dequantised with the
layer's fixed k / v scales, as FlashInfer's fp8 path does). The decode rows' CSR page table, all DEVICE int32 so
a CUDA graph can capture the launch and replay it with new contents: ``indptr [B+1]``, ``indices [nnz]`` (the live
pages of row b in order, the first holding kv position 0 as the kernel sees it), ``kv_lens [B]``. Row b's query
sits at kv position ``kv_lens[b] - 1`` and sees key j iff ``j < kv_len`` and, on sliding layers,
``kv_len - 1 - j < window`` (the engine's mask rule; `perfkit.runtime.attention.torch_paged.request_mask`).
Softmax scale 1.0 (Gemma4's q_norm carries it).

Stage 1, grid (B, kv_heads, splits): program (b, g, s) holds the GQA group's query heads as the rows of one
``[BLOCK_H, head_dim]`` tile (tensor-core dots need 16 rows; rows past the group are masked) and runs an online
softmax over its slice of the visible keys, BLOCK_N token rows at a time (a page is gathered row by row, so
BLOCK_N need not divide the page size). Slices are whole BLOCK_N multiples of the visible span. With one split
it writes the normalised output itself; otherwise its partial output (fp32, normalised by its own sum) and its
log2-sum-exp (an empty slice writes only lse = -inf). Stage 2, grid (B, heads, column blocks):
``out = sum_s 2^(lse_s - m) o_s / sum_s 2^(lse_s - m)``, reading the splits 32 at a time, each chunk's lse and
partials in one round trip. ``splits`` is a launch argument, not a compile-time constant, so any batch compiles the
same two stage-1 variants (direct / split) and two merges (column blocks / whole heads).

Fused merge (``merge_counter``, where ``fused_merge_fits``; toggle decode_merge): stage 2 as a launch of its own is
one more short kernel on the step's dependent chain. Instead each stage-1 program of a split launch counts itself
done on its (row, kv head) counter after storing its partial and lse (a release), and the one that counts last (an
acquire) merges the group's heads from L2 with stage 2's tiles and sums (the same bits) and resets the counter: the
split-K sum of the tensor-core gemv (``w4a16_gemm``) applied to the slices. Only for small merges (the sliding pools
at small batches), since one program does all of it. Measured on the H200 it is slower than the launch (12-19,
``configs/ab_decode_merge.yaml``, TPOT p50 launch -> fused, 2 repeats each: 26B-A4B c1 2.761 -> 2.908 ms, c4 5.28 ->
5.34, 31B c1 16.23 -> 16.52, c4 17.60 -> 17.91): one program per (row, kv head) merging 2 heads x 2 column tiles
after its own slice costs more than a second launch of 32 programs that wait, resident, while the first drains.
The toggle keeps it for A/B runs; the default is the launch.

Prologue (``prologue=DecodePrologue(...)``, toggle decode_prologue): at a decode-only step the separate
``qkv_norm_rope`` launch (q_norm + RoPE, k_norm + RoPE, v_norm, the newest K / V row into the cache) is one more
short kernel on the step's dependent chain, and what a short kernel costs there is its own time, which PDL does not
hide (12-09 call 6: leaving it out of 26B-A4B's batch-1 step saved 90 us, 3.0 us per layer). With the prologue, q
is the raw projection: every program norms and ropes its own GQA group's heads (a few KB from L2; the splits of a
group repeat it) and rounds q to the activation dtype as the separate kernel stores it. With ``k_raw`` the one
program whose slice holds position ``kv_len - 1`` makes row b's newest K / V row for its kv head (rounded to the
activation dtype; an fp8 cache's value quantised with write_kv's rule), runs its last block after the loop with
that row taken from registers instead of the cache (its load is masked off), and writes the row at the prologue's
slots after all its reads (the step's own slot buffers, so graph replays and padded rows write where the separate
launch would; nothing else in the launch reads the row). The arithmetic is the separate kernel's (fp32 norm and
RoPE, one rounding), so outputs and cache bytes are equal under the interpreter; on the GPU the compiler may
contract the RoPE products differently (an fp32 ulp, then a neighbouring bf16 / e4m3 value for an element now and
then). KV-shared layers (``k_raw`` None) take q only and read the newest row from the cache, written by an earlier
layer.

Measured on the H200 (docs/h200-runs/2026-12-10/): not a win, so decode_prologue stays ``separate``. In a chain of
30 launches of the kernel alone (``prologue_probe.py``, call 4, us per layer, separate -> fused) it gains on the
sliding pools at batch 1 (26B-A4B 10.9 -> 9.7, 31B 13.3 -> 10.7) and loses on the full pools (26B-A4B 14.3 -> 16.0,
31B 19.4 -> 23.4; hd 512: the holding program's row and q's norm + RoPE sit on its one block's critical path) and
at batch 4. In the engine it lost in every form tried: 26B-A4B c1 TPOT 2.912 -> 2.934 ms (call 4), c4 +2 to +7 %.
Two forms that were slower still: every program making the new row before its loop with a select inside the
loop (call 1: 26B-A4B c1 +3.6 %), and the slice's first block loaded before q is made (call 3: it slowed the plain
kernel's full pools by ~0.8 us as well).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from perfkit.kernels.fp8 import FP8_DTYPE, fp8_inv_scale
from perfkit.kernels.launch import interpreting
from perfkit.kernels.pdl import pdl_enter, pdl_launch
from perfkit.kernels.qk_norm_rope import KVCacheTarget, _e4m3_of, head_norm_ref, qk_norm_rope_ref, write_kv_ref

LOG2E = 1.4426950408889634

# --------------------------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------------------------


@triton.jit
def _norm_rope(src, rows, rmask, d, w_ptr, cos_row, sin_row, eps, HEAD_DIM: tl.constexpr, ROPE: tl.constexpr):
    """Head rows ``src + rows[r] + d`` ([R, D], d contiguous) -> fp32 [R, D]: ``x / rms(x)`` (v_norm), or with ROPE
    ``rope(x / rms(x) * w)`` (q_norm / k_norm, then rotate-half with the token's tables ``cos_row`` / ``sin_row``
    [D/2]). Why not halves as in qk_norm_rope: the attention dots need the head as one [R, D] tile, so the
    rotate-half partner of lane d (d +- D/2) is loaded a second time (from L1) instead of concatenating halves."""
    half: tl.constexpr = HEAD_DIM // 2
    x = tl.load(src + rows[:, None] + d[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 1) / HEAD_DIM + eps)[:, None]
    if not ROPE:
        return x * rstd
    dp = (d + half) % HEAD_DIM
    xp = tl.load(src + rows[:, None] + dp[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
    y = x * rstd * tl.load(w_ptr + d).to(tl.float32)[None, :]
    yp = xp * rstd * tl.load(w_ptr + dp).to(tl.float32)[None, :]
    c = tl.load(cos_row + d % half).to(tl.float32)[None, :]
    s = tl.load(sin_row + d % half).to(tl.float32)[None, :]
    return y * c + tl.where((d < half)[None, :], -yp, yp) * s  # o1 = y1 c - y2 s, o2 = y2 c + y1 s


@triton.jit
def _as_cached(x, inv_scale, FP8: tl.constexpr):
    """A new K / V row in the activation dtype -> what reading it back from the cache gives before the query's
    dtype, in fp32 (exactly): itself, or (FP8) ``write_kv``'s ``clamp(x * inv_scale)`` rounded to e4m3."""
    y = x.to(tl.float32)
    if FP8:
        y = _e4m3_of(x, inv_scale)
    return y


@triton.jit
def _cache_bytes(x, cache_ptr, FP8: tl.constexpr):
    """`_as_cached`'s value as the cache stores it (an fp8 cache is passed as its uint8 view; the cast is exact)."""
    if FP8:
        y = x.to(tl.float32).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        y = x.to(cache_ptr.dtype.element_ty)
    return y


@triton.jit
def _load_block(t0, end, last, pages_ptr, cache_ptr, head_off, stride_page, stride_tok, stride_kv, d,
                PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SKIP_LAST: tl.constexpr):  # fmt: skip
    """Key / value rows t0 .. t0 + BLOCK_N - 1 of one kv head (those below ``end``), as stored ([BLOCK_N, D] each;
    fp8 caches as bytes); the conversions and the dots are `_softmax_step`'s. SKIP_LAST: row ``last`` is not read
    (the prologue's newest row, taken from registers)."""
    t = t0 + tl.arange(0, BLOCK_N)
    tmask = t < end
    page = tl.load(pages_ptr + t // PAGE_SIZE, mask=tmask, other=0).to(tl.int64)
    row = page * stride_page + (t % PAGE_SIZE) * stride_tok + head_off  # [BLOCK_N]
    kv_mask = tmask
    if SKIP_LAST:
        kv_mask = tmask & (t != last)
    k = tl.load(cache_ptr + row[:, None] + d[None, :], mask=kv_mask[:, None], other=0)
    v = tl.load(cache_ptr + stride_kv + row[:, None] + d[None, :], mask=kv_mask[:, None], other=0)
    return k, v, t, tmask


@triton.jit
def _softmax_step(q, m_i, l_i, acc, k, v, t, tmask, last, k_new, v_new, qk_scale, FP8: tl.constexpr,
                  UPCAST: tl.constexpr, NEW: tl.constexpr):  # fmt: skip
    """One online-softmax step over a `_load_block` tile with at least one visible key: (m_i, l_i, acc) updated.
    NEW: row ``last`` (if in the tile) is ``k_new`` / ``v_new`` ([1, D] in q's dtype) instead of what was loaded."""
    if FP8:  # e4m3 -> the query's dtype is exact (bf16 / fp16 hold every e4m3 value)
        k = k.to(tl.float8e4nv, bitcast=True)
        v = v.to(tl.float8e4nv, bitcast=True)
    k = k.to(q.dtype)
    v = v.to(q.dtype)
    if NEW:
        is_new = (t == last)[:, None]
        k = tl.where(is_new, k_new, k)
        v = tl.where(is_new, v_new, v)
    if UPCAST:
        sc = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        sc = tl.dot(q, tl.trans(k))
    sc = sc * qk_scale  # [BLOCK_H, BLOCK_N] fp32
    sc = tl.where(tmask[None, :], sc, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(sc, 1))
    alpha = tl.exp2(m_i - m_new)  # first block: exp2(-inf) = 0
    p = tl.exp2(sc - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if UPCAST:  # p rounded to q's dtype as on the GPU, then multiplied exactly
        pv = tl.dot(p.to(q.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(q.dtype), v)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit(do_not_specialize=["num_splits", "window"])  # one compile per pool shape, whatever the batch
def _paged_decode_kernel(
    q_ptr,  # [B, H, D] (row stride stride_qb, head stride stride_qh, d contiguous)
    cache_ptr,  # [P, 2, PS, KVH, D]; an fp8 cache as its uint8 view
    indices_ptr,  # int32 [nnz]
    indptr_ptr,  # int32 [B + 1]
    kv_lens_ptr,  # int32 [B]
    out_ptr,  # [B, H, D] (DIRECT)
    part_ptr,  # fp32 [B, H, splits, D] (not DIRECT)
    lse_ptr,  # fp32 [B, H, splits] (not DIRECT)
    stride_qb,
    stride_qh,
    stride_ob,
    stride_oh,
    stride_page,
    stride_kv,
    stride_tok,
    stride_head,
    num_splits,
    window,  # 0: no window
    qk_scale,  # k_scale * log2(e): scores in the log2 domain
    v_scale,
    k_raw_ptr,  # NEW_KV: [B, KVH, D] raw k projection (strides stride_kb, stride_kh, 1)
    v_raw_ptr,  # NEW_KV: [B, KVH, D] raw v projection (K=V layers: the raw k)
    qw_ptr,  # PROLOGUE: [D] q_norm weight
    kw_ptr,  # NEW_KV: [D] k_norm weight
    cos_ptr,  # PROLOGUE: [B, D/2] (row stride stride_cb)
    sin_ptr,  # PROLOGUE: [B, D/2] (row stride stride_sb)
    slot_page_ptr,  # NEW_KV: int64 [B], the page of row b's newest K / V row (the step's slots)
    slot_offset_ptr,  # NEW_KV: int64 [B], its offset inside that page
    stride_kb,
    stride_kh,
    stride_vb,
    stride_vh,
    stride_cb,
    stride_sb,
    eps,
    k_inv_scale,  # NEW_KV + FP8: 1 / the layer's K / V scales (fp8.fp8_inv_scale)
    v_inv_scale,
    count_ptr,  # FUSE_MERGE: int32 [B * kv_heads], 0 between launches (``new_merge_counter``)
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP8: tl.constexpr,
    DIRECT: tl.constexpr,
    UPCAST: tl.constexpr,  # interpreter only: its bf16 tl.dot multiplies the raw uint16 bits, so dot in fp32
    PDL: tl.constexpr = 0,  # launched with launch_pdl (perfkit/kernels/pdl.py)
    PROLOGUE: tl.constexpr = 0,  # q_ptr holds the raw q projection: q_norm + RoPE here (module docstring)
    NEW_KV: tl.constexpr = 0,  # with PROLOGUE: the newest K / V row from the raw projections, written here
    FUSE_MERGE: tl.constexpr = 0,  # not DIRECT: the slice of (b, g) that counts last merges the group's heads
    MERGE_S: tl.constexpr = 32,  # FUSE_MERGE: slices per load (MERGE_BLOCK_S)
    MERGE_CHUNKS: tl.constexpr = 1,  # FUSE_MERGE: cdiv(num_splits, MERGE_S)
    MERGE_D: tl.constexpr = 128,  # FUSE_MERGE: columns per merge tile (the merge launch's BLOCK_D)
):
    pdl_enter(PDL)  # every program, before the lengths, the page ids, q and the cache (all written this step)
    b = tl.program_id(0)
    g = tl.program_id(1)
    s = tl.program_id(2)
    kv_len = tl.load(kv_lens_ptr + b)
    first = tl.load(indptr_ptr + b)
    lo = 0
    if window > 0:
        lo = tl.maximum(kv_len - window, 0)  # keys before lo are outside the window
    chunk = tl.cdiv(tl.cdiv(kv_len - lo, num_splits), BLOCK_N) * BLOCK_N
    start = lo + s * chunk
    end = tl.minimum(start + chunk, kv_len)

    rows = tl.arange(0, BLOCK_H)
    heads = g * GROUP + rows
    hmask = rows < GROUP
    d = tl.arange(0, HEAD_DIM)
    last = kv_len - 1  # the row's newest key
    pages = indices_ptr + first
    head_off = g * stride_head
    q_rows = b.to(tl.int64) * stride_qb + heads * stride_qh  # [BLOCK_H]
    if PROLOGUE:  # rope(q_norm(q_raw)) rounded to the activation dtype, as the separate kernel stores it
        cos_row = cos_ptr + b.to(tl.int64) * stride_cb
        sin_row = sin_ptr + b.to(tl.int64) * stride_sb
        q = _norm_rope(q_ptr, q_rows, hmask, d, qw_ptr, cos_row, sin_row, eps, HEAD_DIM, True)
        q = q.to(q_ptr.dtype.element_ty)
    else:
        q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=hmask[:, None], other=0.0)  # [BLOCK_H, D]
    k_new = tl.zeros([1, HEAD_DIM], q.dtype)  # without NEW_KV: unused (the steps below never select them)
    v_new = tl.zeros([1, HEAD_DIM], q.dtype)
    loop_end = end
    if NEW_KV:
        holds = ((start <= last) & (last < end)).to(tl.int32)  # this slice holds the newest row (one per row, head)
        t_last = start + (end - 1 - start) // BLOCK_N * BLOCK_N  # the slice's last block: after the loop if it holds
        loop_end = end - holds * (end - t_last)
        if holds != 0:  # only that program makes the row: [1, D], the value a read of the cache would give
            one = tl.arange(0, 1)
            kr = _norm_rope(k_raw_ptr, b.to(tl.int64) * stride_kb + g * stride_kh + one, one < 1, d, kw_ptr,
                            cos_row, sin_row, eps, HEAD_DIM, True)  # fmt: skip
            vr = _norm_rope(v_raw_ptr, b.to(tl.int64) * stride_vb + g * stride_vh + one, one < 1, d, kw_ptr,
                            cos_row, sin_row, eps, HEAD_DIM, False)  # fmt: skip
            k_new = _as_cached(kr.to(q.dtype), k_inv_scale, FP8).to(q.dtype)
            v_new = _as_cached(vr.to(q.dtype), v_inv_scale, FP8).to(q.dtype)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    for t0 in range(start, loop_end, BLOCK_N):
        k, v, t, tm = _load_block(t0, end, last, pages, cache_ptr, head_off, stride_page, stride_tok, stride_kv, d,
                                  PAGE_SIZE, BLOCK_N, False)  # fmt: skip
        m_i, l_i, acc = _softmax_step(q, m_i, l_i, acc, k, v, t, tm, last, k_new, v_new, qk_scale, FP8, UPCAST,
                                      False)  # fmt: skip
    if NEW_KV:
        if holds != 0:  # the holding slice's last block, with the new row selected in
            k, v, t, tm = _load_block(t_last, end, last, pages, cache_ptr, head_off, stride_page, stride_tok,
                                      stride_kv, d, PAGE_SIZE, BLOCK_N, True)  # fmt: skip
            m_i, l_i, acc = _softmax_step(q, m_i, l_i, acc, k, v, t, tm, last, k_new, v_new, qk_scale, FP8, UPCAST,
                                          True)  # fmt: skip
        # the new row into the cache at the step's slot, after every read of this program (its own row is never
        # read: SKIP_LAST); the [1, D] mask carries the scalar (AND-ing a scalar into it fails in the interpreter)
        slot = tl.load(slot_page_ptr + b) * stride_page + tl.load(slot_offset_ptr + b) * stride_tok + head_off
        dst = cache_ptr + slot + d[None, :]
        mine = d[None, :] < HEAD_DIM * holds
        tl.store(dst, _cache_bytes(k_new, cache_ptr, FP8), mask=mine)
        tl.store(dst + stride_kv, _cache_bytes(v_new, cache_ptr, FP8), mask=mine)

    if DIRECT:  # one split: it always holds key kv_len - 1, so l_i > 0
        o = acc / l_i[:, None] * v_scale
        out = out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + d[None, :]
        tl.store(out, o.to(out_ptr.dtype.element_ty), mask=hmask[:, None])
    else:  # an empty slice (short rows, many splits) writes weight 0: lse -inf, output 0
        nonempty = l_i > 0
        l_safe = tl.where(nonempty, l_i, 1.0)
        o = acc / l_safe[:, None]
        lse = tl.where(nonempty, m_i + tl.log2(l_safe), float("-inf"))
        num_heads = tl.num_programs(1) * GROUP
        slot = (b.to(tl.int64) * num_heads + heads) * num_splits + s  # [BLOCK_H]
        # an empty slice writes only its lse: the merge drops its partial (never written)
        tl.store(part_ptr + slot[:, None] * HEAD_DIM + d[None, :], o, mask=hmask[:, None] & nonempty[:, None])
        tl.store(lse_ptr + slot, lse, mask=hmask)
        if FUSE_MERGE:  # module docstring, "Fused merge"
            tl.debug_barrier()  # every thread's partial stored before the release half of the count
            count = count_ptr + b * tl.num_programs(1) + g
            if tl.atomic_add(count, 1, sem="acq_rel", scope="gpu") == num_splits - 1:
                for hh in tl.static_range(GROUP):  # the merge launch's tiles (MERGE_D columns), so its sums
                    head = g * GROUP + hh
                    base = (b.to(tl.int64) * num_heads + head) * num_splits
                    for c in tl.static_range(HEAD_DIM // MERGE_D):
                        dc = c * MERGE_D + tl.arange(0, MERGE_D)
                        acc_m, den = _merge_head(part_ptr, lse_ptr, base, num_splits, dc, HEAD_DIM, MERGE_S,
                                                 MERGE_CHUNKS)  # fmt: skip
                        o_dst = out_ptr + b.to(tl.int64) * stride_ob + head * stride_oh + dc
                        tl.store(o_dst, (acc_m / den * v_scale).to(out_ptr.dtype.element_ty))
                tl.atomic_xchg(count, 0, sem="relaxed", scope="gpu")


@triton.jit
def _merge_chunk(part_ptr, lse_ptr, base, num_splits, s0, d, m, acc, den, HEAD_DIM: tl.constexpr,
                 BLOCK_S: tl.constexpr):  # fmt: skip
    """Slices s0 .. s0 + BLOCK_S - 1 of one head into the running (max lse m, sum_s w_s o_s, sum_s w_s): their lse and
    partials loaded together (one memory round trip), what came before rescaled (online softmax; first chunk: m is
    -inf and exp2(-inf) = 0). An empty slice's partial was never written (whatever the buffer holds): ``where``
    drops it, so its weight 0 never multiplies it. ``.cg``: the fused merge reads partials that other programs of
    its launch wrote (from L2, not this SM's L1)."""
    s = s0 + tl.arange(0, BLOCK_S)
    lse = tl.load(lse_ptr + base + s, mask=s < num_splits, other=float("-inf"), cache_modifier=".cg")
    part = tl.load(part_ptr + (base + s)[:, None] * HEAD_DIM + d[None, :], mask=(s < num_splits)[:, None], other=0.0,
                   cache_modifier=".cg")  # fmt: skip
    m_new = tl.maximum(m, tl.max(lse, 0))  # split 0 always holds keys: finite from the first chunk on
    alpha = tl.exp2(m - m_new)
    w = tl.exp2(lse - m_new)  # empty and padding slices: 0
    acc = acc * alpha + tl.sum(tl.where((lse > float("-inf"))[:, None], w[:, None] * part, 0.0), 0)
    return m_new, acc, den * alpha + tl.sum(w, 0)


@triton.jit
def _merge_head(part_ptr, lse_ptr, base, num_splits, d, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr,
                CHUNKS: tl.constexpr):  # fmt: skip
    """One head's slices ``base .. base + num_splits - 1`` at columns ``d`` -> (sum_s w_s o_s, sum_s w_s) with
    w_s = 2^(lse_s - max lse), in one pass of BLOCK_S-slice chunks (12-04's merge loaded the lse first, then the live
    partials: two round trips per chunk). CHUNKS: cdiv(num_splits, BLOCK_S) known at compile time (the fused merge:
    unrolled, so the loads of every chunk and head can be in flight together), or 0 (a loop: one compile for any
    number of splits)."""
    m = tl.max(tl.full([BLOCK_S], float("-inf"), tl.float32), 0)
    acc = tl.zeros(d.shape, tl.float32)
    den = tl.sum(tl.zeros([BLOCK_S], tl.float32), 0)
    if CHUNKS > 0:
        for c in tl.static_range(CHUNKS):
            m, acc, den = _merge_chunk(part_ptr, lse_ptr, base, num_splits, c * BLOCK_S, d, m, acc, den, HEAD_DIM,
                                       BLOCK_S)  # fmt: skip
    else:
        for s0 in range(0, num_splits, BLOCK_S):
            m, acc, den = _merge_chunk(part_ptr, lse_ptr, base, num_splits, s0, d, m, acc, den, HEAD_DIM, BLOCK_S)
    return acc, den


@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(
    part_ptr,  # fp32 [B, H, splits, D]; an empty split's rows are never written (and dropped here)
    lse_ptr,  # fp32 [B, H, splits]
    out_ptr,  # [B, H, D]
    stride_ob,
    stride_oh,
    num_splits,
    v_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # output columns per program (grid dim 2)
    BLOCK_S: tl.constexpr,  # splits per load
    PDL: tl.constexpr = 0,  # launched with launch_pdl (perfkit/kernels/pdl.py)
):
    """Program (b, h, column block). The splits are read BLOCK_S at a time as one vector / tile load, so a merge of
    64 splits is two memory round trips, not 64 dependent scalar loads (12-03's sweep: every extra split cost
    ~0.13 us at batch 1 with the scalar loop)."""
    pdl_enter(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    base = (b.to(tl.int64) * tl.num_programs(1) + h) * num_splits
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    acc, den = _merge_head(part_ptr, lse_ptr, base, num_splits, d, HEAD_DIM, BLOCK_S, 0)
    tl.store(
        out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + d, (acc / den * v_scale).to(out_ptr.dtype.element_ty)
    )


# --------------------------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------------------------

# Tile and split defaults: within 5 % of the per-case best of the H200 sweep (docs/h200-runs/2026-12-03/
# 2-decode_sweep.jsonl; `perfkit kernels attention --triton-tiles` repeats it) except the hd 512 pools at batch 1-2,
# where 8 warps and 1 program per SM were faster (14.94 vs 18.97 us at 31B batch 1).
DECODE_BLOCK_N = 32  # key rows per step
DECODE_NUM_WARPS = 4
DECODE_NUM_STAGES = 2
DECODE_MAX_SPLITS = 64
DECODE_PROGRAMS_PER_SM = 2  # splits fill about this many programs per SM (stage 1)
# Sliding pools (a window) from batch 2 fill twice as many: 31B sliding batch 2 17.52 vs 19.45 us, 26B-A4B batch 4
# 17.28 vs 19.48 (docs/h200-runs/2026-12-04/3-attn_*.json), while the full pools lose with it (31B batch 4: 24.88
# vs 20.93). In the engine (docs/h200-runs/2026-12-05/7-pps_*.json, 31B bf16, old new new old as separate runs):
# forward_decode c2 17.49 / 17.50 -> 17.39 / 17.40 ms, c4 18.11 / 18.11 -> 17.97 / 17.98.
SLIDING_PROGRAMS_PER_SM = 4
# The merge (docs/h200-runs/2026-12-04/1-merge_ab.jsonl, 2-merge_var.jsonl): 32 splits per load, against one scalar
# load per split before, took the hd 512 pools at batch 1 from 18.7 to 11.6 us (31B); a head's columns spread over
# D / 128 programs while there are few (row, head) pairs (batch 1-2: 11.6 vs 12.0 us at 31B full), whole heads above
# (31B full batch 16: 53.1 vs 57.6 us).
MERGE_BLOCK_S = 32  # splits per load
MERGE_BLOCK_D = 128  # output columns per merge program while B x heads <= MERGE_COLUMN_SPLIT_MAX_ROWS
MERGE_COLUMN_SPLIT_MAX_ROWS = 64
# Fused merge (``merge_counter``): the stage-1 program of (row, kv head) that finishes last merges the group's heads
# itself, where that is at most FUSED_MERGE_MAX_ELEMENTS partial elements (group x splits x head_dim: the sliding
# pools of 31B and 26B-A4B at batch 1-2, 2 x 17-32 x 256). Larger merges (the hd 512 full pools: 8 heads x 64 splits
# x 512) stay on the merge launch, which spreads them over B x heads x D / 128 programs.
FUSED_MERGE_MAX_ELEMENTS = 2 * 32 * 256


def pick_splits(batch: int, num_kv_heads: int, sms: int, max_span: int | None, block_n: int = DECODE_BLOCK_N,
                programs_per_sm: int | None = None, max_splits: int = DECODE_MAX_SPLITS) -> int:  # fmt: skip
    """Slices per (request, kv head): enough programs for ``programs_per_sm`` per SM (None: SLIDING_PROGRAMS_PER_SM
    on a sliding pool from batch 2, else DECODE_PROGRAMS_PER_SM), no more slices than the longest visible span has
    BLOCK_N blocks (``max_span``: the window on sliding pools; None = unbounded), at most ``max_splits``. Depends on
    the batch and the pool only, never on this step's kv lengths, so a CUDA graph captured for a batch size replays
    with the same grid whatever the lengths are."""
    if programs_per_sm is None:
        sliding = max_span is not None and batch >= 2
        programs_per_sm = SLIDING_PROGRAMS_PER_SM if sliding else DECODE_PROGRAMS_PER_SM
    want = math.ceil(programs_per_sm * sms / max(1, batch * num_kv_heads))
    if max_span is not None:
        want = min(want, math.ceil(max_span / block_n))
    return max(1, min(want, max_splits))


def fused_merge_fits(group: int, splits: int, head_dim: int) -> bool:
    """Whether a launch of ``splits`` slices merges them in its own last program (given a counter): more than one
    slice, and at most FUSED_MERGE_MAX_ELEMENTS partial elements for that program to read."""
    return splits > 1 and group * splits * head_dim <= FUSED_MERGE_MAX_ELEMENTS


def new_merge_counter(batch: int, kv_heads: int, device: torch.device | str) -> torch.Tensor:
    """The fused merge's counters for launches of up to ``batch`` rows and ``kv_heads`` kv heads: int32 zeros, one per
    (row, kv head); the launch leaves them at zero, so one buffer serves every layer of a stream in turn (never two
    launches at once)."""
    return torch.zeros(batch * kv_heads, dtype=torch.int32, device=device)


def _split_buffers(batch: int, heads: int, splits: int, head_dim: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 1's outputs, uninitialised: partials fp32 [B, H, splits, D] (empty slices never write theirs) and lse
    fp32 [B, H, splits] (every split writes its own)."""
    part = torch.empty(batch, heads, splits, head_dim, dtype=torch.float32, device=device)
    return part, torch.empty(batch, heads, splits, dtype=torch.float32, device=device)


class DecodePrologue(NamedTuple):
    """What the decode kernel needs to make q, and the newest K / V row, from the raw projections itself
    (:func:`paged_decode_attention`'s ``prologue``): the work of ``qkv_norm_rope_split`` at a decode-only step."""

    q_weight: torch.Tensor  # [D] q_norm weight
    cos: torch.Tensor  # [B, D/2] at each row's position (one token per row)
    sin: torch.Tensor  # [B, D/2]
    eps: float
    k_raw: torch.Tensor | None = None  # [B, KVH, D]; None: a KV-shared layer (its newest row is in the cache)
    v_raw: torch.Tensor | None = None  # [B, KVH, D]; None with k_raw given: a K=V layer, v = v_norm(k_raw)
    k_weight: torch.Tensor | None = None  # [D] k_norm weight (with k_raw)
    slot_page: torch.Tensor | None = None  # int64 [B]: where row b's newest K / V row goes (with k_raw)
    slot_offset: torch.Tensor | None = None  # int64 [B]


def _prologue_args(pro: DecodePrologue | None, q: torch.Tensor, kvh: int, fp8: bool, k_scale: float,
                   v_scale: float) -> tuple[list, bool]:  # fmt: skip
    """The kernel's prologue arguments (dummies without one) and whether it writes a new K / V row."""
    if pro is None:
        return [q] * 8 + [0] * 6 + [0.0, 1.0, 1.0], False
    B, _, D = q.shape
    cos, sin = (t if t.stride(-1) == 1 else t.contiguous() for t in (pro.cos, pro.sin))
    if cos.shape != (B, D // 2) or sin.shape != (B, D // 2):
        raise ValueError(f"cos / sin must be [B, D/2] = {(B, D // 2)}, got {tuple(cos.shape)} / {tuple(sin.shape)}")
    if pro.k_raw is None:
        return [q, q, pro.q_weight, q, cos, sin, q, q, 0, 0, 0, 0, cos.stride(0), sin.stride(0), float(pro.eps),
                1.0, 1.0], False  # fmt: skip
    k_raw = pro.k_raw
    v_raw = k_raw if pro.v_raw is None else pro.v_raw
    for name, t in (("k_raw", k_raw), ("v_raw", v_raw)):
        if t.shape != (B, kvh, D) or t.stride(-1) != 1 or t.dtype != q.dtype:
            raise ValueError(f"{name} must be [B, kvh, D] = {(B, kvh, D)} of q's dtype with contiguous rows, got "
                             f"{tuple(t.shape)} {t.dtype} strides {t.stride()}")  # fmt: skip
    if pro.k_weight is None or pro.slot_page is None or pro.slot_offset is None:
        raise ValueError("a prologue with k_raw needs k_weight, slot_page and slot_offset")
    if pro.slot_page.shape != (B,) or pro.slot_offset.shape != (B,):
        raise ValueError(f"slot_page / slot_offset must be [B] = [{B}], got {tuple(pro.slot_page.shape)} / "
                         f"{tuple(pro.slot_offset.shape)}")  # fmt: skip
    inv = (fp8_inv_scale(k_scale), fp8_inv_scale(v_scale)) if fp8 else (1.0, 1.0)
    return [k_raw, v_raw, pro.q_weight, pro.k_weight, cos, sin, pro.slot_page, pro.slot_offset,
            k_raw.stride(0), k_raw.stride(1), v_raw.stride(0), v_raw.stride(1), cos.stride(0), sin.stride(0),
            float(pro.eps), *inv], True  # fmt: skip


def paged_decode_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    indices: torch.Tensor,
    indptr: torch.Tensor,
    kv_lens: torch.Tensor,
    *,
    window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    num_splits: int = 1,
    out: torch.Tensor | None = None,
    block_n: int = DECODE_BLOCK_N,
    num_warps: int = DECODE_NUM_WARPS,
    num_stages: int = DECODE_NUM_STAGES,
    pdl: bool = False,
    prologue: DecodePrologue | None = None,
    merge_counter: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query token per row over its paged keys; q [B, H, D] (bf16 / fp16), cache
    [P, 2, page_size, KVH, D] (q's dtype or float8_e4m3fn), indices / indptr / kv_lens device int32 (see the
    module docstring). Returns ``out`` [B, H, D] (q's dtype; written in place when given). pdl: both kernels
    launch with programmatic dependent launch (perfkit/kernels/pdl.py; sm_90+ only).

    prologue: q is the raw q projection (row-strided views allowed), normed and roped here; with
    ``prologue.k_raw`` the kernel also makes the newest K / V row of every row and writes it into the cache at the
    prologue's slots (an fp8 cache quantised with k_scale / v_scale as ``write_kv`` does), using it from registers
    (module docstring, "Prologue").

    merge_counter (``new_merge_counter``, owned by the caller, at least B x kv_heads): where ``fused_merge_fits``,
    the last slice of each (row, kv head) merges the slices in the same launch instead of a merge launch (module
    docstring, "Fused merge")."""
    B, H, D = q.shape
    P, two, page_size, kvh, Dc = cache.shape
    if two != 2 or Dc != D or H % kvh:
        raise ValueError(f"q {tuple(q.shape)} does not fit cache {tuple(cache.shape)} (need [P, 2, ps, kvh, D], H % kvh == 0)")
    if q.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"q dtype {q.dtype}: the decode kernel takes bf16 or fp16 queries")
    fp8 = cache.dtype == FP8_DTYPE
    if not fp8 and cache.dtype != q.dtype:
        raise ValueError(f"cache dtype {cache.dtype} is neither q's ({q.dtype}) nor float8_e4m3fn")
    if D & (D - 1) or cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("head_dim must be a power of two with contiguous q / cache rows")
    out = torch.empty_like(q) if out is None else out
    if B == 0:
        return out
    group = H // kvh
    block_h = max(16, triton.next_power_of_2(group))
    num_splits = max(1, int(num_splits))
    direct = num_splits == 1
    if direct:
        part = lse = out  # unused
    else:
        part, lse = _split_buffers(B, H, num_splits, D, q.device)
    c = cache.view(torch.uint8) if fp8 else cache
    pro_args, new_kv = _prologue_args(prologue, q, kvh, fp8, k_scale, v_scale)
    fuse = merge_counter is not None and fused_merge_fits(group, num_splits, D)
    block_d = min(D, MERGE_BLOCK_D) if B * H <= MERGE_COLUMN_SPLIT_MAX_ROWS else D  # merge columns per tile
    if fuse and (merge_counter.dtype != torch.int32 or merge_counter.numel() < B * kvh):
        raise ValueError(f"merge_counter must be int32 with >= B x kv_heads = {B * kvh} elements (new_merge_counter), "
                         f"got {merge_counter.dtype} [{merge_counter.numel()}]")  # fmt: skip
    _paged_decode_kernel[(B, kvh, num_splits)](
        q, c, indices, indptr, kv_lens, out, part, lse,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        c.stride(0), c.stride(1), c.stride(2), c.stride(3),
        num_splits, window or 0, float(k_scale) * LOG2E, float(v_scale), *pro_args,
        GROUP=group, BLOCK_H=block_h, HEAD_DIM=D, PAGE_SIZE=page_size, BLOCK_N=block_n, FP8=fp8, DIRECT=direct,
        UPCAST=interpreting(), PROLOGUE=int(prologue is not None), NEW_KV=int(new_kv),
        count_ptr=merge_counter if fuse else lse, FUSE_MERGE=int(fuse), MERGE_S=MERGE_BLOCK_S,
        MERGE_CHUNKS=triton.cdiv(num_splits, MERGE_BLOCK_S) if fuse else 1, MERGE_D=block_d if fuse else 128,
        num_warps=num_warps, num_stages=num_stages, **pdl_launch(pdl),
    )  # fmt: skip
    if not direct and not fuse:
        _merge_splits_kernel[(B, H, D // block_d)](
            part, lse, out, out.stride(0), out.stride(1), num_splits, float(v_scale),
            HEAD_DIM=D, BLOCK_D=block_d, BLOCK_S=MERGE_BLOCK_S, num_warps=4, **pdl_launch(pdl),
        )  # fmt: skip
    return out


# --------------------------------------------------------------------------------------------------------------
# Reference and traffic
# --------------------------------------------------------------------------------------------------------------


def paged_decode_attention_ref(
    q: torch.Tensor,
    cache: torch.Tensor,
    indices: torch.Tensor,
    indptr: torch.Tensor,
    kv_lens: torch.Tensor,
    *,
    window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Per row in fp32: gather the live pages back, keep the visible keys, softmax(q k^T) v; fp8 caches read as
    float(stored) * scale. The output in q's dtype."""
    B, H, D = q.shape
    kvh = cache.shape[3]
    ind, ptr, lens = indices.long().cpu(), indptr.long().cpu().tolist(), kv_lens.long().cpu().tolist()
    out = torch.empty_like(q)
    for b in range(B):
        pages = ind[ptr[b] : ptr[b + 1]].to(cache.device)
        kv_len = lens[b]
        k = cache[pages, 0].reshape(-1, kvh, D)[:kv_len].float() * k_scale
        v = cache[pages, 1].reshape(-1, kvh, D)[:kv_len].float() * v_scale
        lo = max(kv_len - window, 0) if window else 0
        k, v = k[lo:], v[lo:]
        k = k.repeat_interleave(H // kvh, dim=1)  # [n, H, D]
        v = v.repeat_interleave(H // kvh, dim=1)
        s = torch.einsum("hd,nhd->hn", q[b].float(), k)
        out[b] = torch.einsum("hn,nhd->hd", s.softmax(-1), v).to(q.dtype)
    return out


def paged_decode_prologue_ref(
    q_raw: torch.Tensor,
    cache: torch.Tensor,
    indices: torch.Tensor,
    indptr: torch.Tensor,
    kv_lens: torch.Tensor,
    prologue: DecodePrologue,
    *,
    window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """The separate path the prologue replaces: q, k, v by qk_norm_rope's references (rounded to q_raw's dtype), the
    new K / V rows written into ``cache`` at the slots (``write_kv``'s rule), then
    :func:`paged_decode_attention_ref`."""
    pro = prologue
    q = qk_norm_rope_ref(q_raw, pro.q_weight, pro.cos, pro.sin, pro.eps)
    if pro.k_raw is not None:
        k = qk_norm_rope_ref(pro.k_raw, pro.k_weight, pro.cos, pro.sin, pro.eps)
        v = head_norm_ref(pro.k_raw if pro.v_raw is None else pro.v_raw, None, pro.eps)
        write_kv_ref(KVCacheTarget(cache, pro.slot_page, pro.slot_offset, k_scale, v_scale), k, v)
    return paged_decode_attention_ref(q, cache, indices, indptr, kv_lens, window=window, k_scale=k_scale,
                                      v_scale=v_scale)  # fmt: skip


def paged_decode_traffic(
    kv_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int, *, window: int | None = None,
    kv_bytes: int = 2, q_bytes: int = 2, num_splits: int = 1, block_n: int = DECODE_BLOCK_N,
    prologue: str | None = None,
) -> dict[str, int]:  # fmt: skip
    """Bytes and FLOPs of one launch: the visible K and V rows read once (``min(kv_len, window)`` per row and kv
    head), q read and the output written once; with splits > 1 also what stage 1 writes and the merge reads
    (``split_bytes``): every split's fp32 lse written and read, the fp32 partial output written by each slice that
    holds keys (slices are whole ``block_n`` multiples, so a short row leaves its last slices empty) and read for
    every slice (an empty one's is dropped after its load: ``_merge_head``).
    FLOPs: q k^T and p v, 2 x 2 x visible x heads x head_dim.

    ``prologue`` (None | "q" | "kv" | "k=v"): the launch also reads the q_norm weight and the cos / sin rows; with
    "kv" / "k=v" it makes the newest K / V row: reads the raw k (and v) rows, the k_norm weight and the int64 slots,
    writes the new rows into the cache and reads them from no cache (``prologue_bytes`` is that difference, so
    ``total_bytes`` stays what the launch moves). The separate path moves in addition the q it writes and this
    launch reads back, and the new rows read from the cache (``saved_bytes``)."""
    spans = [min(n, window) if window else n for n in kv_lens]
    visible = sum(spans)
    b = len(kv_lens)
    kv = 2 * visible * num_kv_heads * head_dim * kv_bytes
    qo = 2 * b * num_heads * head_dim * q_bytes
    pro = saved = 0
    if prologue is not None:
        if prologue not in ("q", "kv", "k=v"):
            raise ValueError(f"prologue {prologue!r}: None, 'q', 'kv' or 'k=v'")
        pro = head_dim * q_bytes + b * head_dim * q_bytes  # q_norm weight, cos + sin rows [B, D/2] each
        saved = 2 * b * num_heads * head_dim * q_bytes  # q written by the separate kernel, read back here
        if prologue != "q":
            rows = b * num_kv_heads * head_dim
            raw = rows * q_bytes * (1 if prologue == "k=v" else 2)
            pro += raw + head_dim * q_bytes + 16 * b  # the new rows: written instead of read (net zero)
            saved += 2 * rows * kv_bytes
    split = 0
    if num_splits > 1:
        for span in spans:
            chunk = math.ceil(math.ceil(span / num_splits) / block_n) * block_n  # the kernel's slice length
            live = min(num_splits, math.ceil(span / chunk)) if span else 0
            split += num_heads * (2 * num_splits + (live + num_splits) * head_dim) * 4
    return {
        "kv_bytes": kv,
        "split_bytes": split,
        "prologue_bytes": pro,
        "saved_bytes": saved,
        "total_bytes": kv + qo + split + pro,
        "min_bytes": kv + qo + pro,
        "flops": 4 * visible * num_heads * head_dim,
    }

