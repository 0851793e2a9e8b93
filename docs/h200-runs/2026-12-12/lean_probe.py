"""Register-lean forms of the batch-1 weight-streaming kernels (12-12 call 2).

Call 1 (burst_probe) showed the gemvs and the gather kernels at the back-to-back stream ceiling of their size, and
an sm_90 compile shows why neither goes past it: every one keeps an fp32 accumulator the size of its weight tile
([BLOCK_N, BLOCK_K] per product, reduced over K once after the loop), so they take 219-255 registers per thread
(the gather down and the fused FFN down spill): 2 programs of 4 warps, or 4 of 2 warps, per SM. Here each loop
step reduces its products over K at once (acc [BLOCK_N]: a few shuffles per step, the kernels are memory-bound),
which frees the registers for more programs per SM or more tiles in flight per program.

Arms (CUDA graphs of 32 links over 8 weight sets, batch 1, PDL on, us per call; each gemv call after an rmsnorm,
as in the step and in time_gemv_choice):
  gemv/<shape>/<tile>        perfkit's _gemv_kernel                 lean/<shape>/<tile>   the lean form
  gu/<tile>, dn/<tile>       perfkit's gather kernels                lgu/<tile>, ldn/<tile> their lean forms
Each lean arm's output is compared with perfkit's kernel (max abs diff; fp32 summation order differs).
Registers per thread (and spills) of every compiled kernel are printed first.
Run on the device: python3 docs/h200-runs/2026-12-12/lean_probe.py > $OUT/lean.jsonl
"""

import json
import statistics
import sys

import torch
import triton
import triton.language as tl

from perfkit.kernels import moe
from perfkit.kernels.gelu_mul import _gelu_tanh_f32
from perfkit.kernels.gemv import GemvConfig, gemv
from perfkit.kernels.pdl import pdl_enter, pdl_launch
from perfkit.kernels.rmsnorm import rmsnorm

H, I_E, E, TOPK = 2816, 704, 128, 8
SHAPES = {"down": (2816, 2112), "gate_up": (4224, 2816), "o_sliding": (2816, 4096), "o_full": (2816, 8192),
          "qkv_sliding": (8192, 2816)}  # fmt: skip
LAYERS, LINKS, REPLAYS = 8, 32, 20


@triton.jit
def _lean_gemv_kernel(x_ptr, w_ptr, out_ptr, N, K, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      PRELOAD: tl.constexpr, EVICT: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """M = 1: out[n] = x . w[n]; each step's [BLOCK_N, BLOCK_K] products summed over K at once."""
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rn = tl.minimum(offs_n, N - 1).to(tl.int64)
    k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + (rn * stride_wn)[:, None] + k[None, :]
    k_main = K // BLOCK_K * BLOCK_K
    full = (k < k_main)[None, :]
    w = tl.load(w_ptrs, mask=full, other=0.0, eviction_policy=EVICT)
    if PRELOAD >= 2:
        w2 = tl.load(w_ptrs + tl.maximum(tl.minimum(BLOCK_K, k_main - BLOCK_K), 0), mask=full, other=0.0,
                     eviction_policy=EVICT)  # fmt: skip
    if PRELOAD >= 3:
        w3 = tl.load(w_ptrs + tl.maximum(tl.minimum(2 * BLOCK_K, k_main - BLOCK_K), 0), mask=full, other=0.0,
                     eviction_policy=EVICT)  # fmt: skip
    pdl_enter(PDL)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, k_main, BLOCK_K):
        x = tl.load(x_ptr + k0 + k).to(tl.float32)[None, :]
        w_next = tl.load(w_ptrs + tl.minimum(k0 + PRELOAD * BLOCK_K, k_main - BLOCK_K), eviction_policy=EVICT)
        acc += tl.sum(w.to(tl.float32) * x, axis=1)
        if PRELOAD == 1:
            w = w_next
        elif PRELOAD == 2:
            w = w2
            w2 = w_next
        else:
            w = w2
            w2 = w3
            w3 = w_next
    if k_main < K:
        km = k_main + k < K
        x = tl.load(x_ptr + k_main + k, mask=km, other=0.0).to(tl.float32)[None, :]
        wt = tl.load(w_ptrs + k_main, mask=km[None, :], other=0.0, eviction_policy=EVICT)
        acc += tl.sum(wt.to(tl.float32) * x, axis=1)
    tl.store(out_ptr + offs_n, acc.to(out_ptr.dtype.element_ty), mask=offs_n < N)


def lean_gemv(x, w, n, k, warps, preload=1, evict=False, out=None):
    N, K = w.shape
    out = torch.empty(1, N, dtype=x.dtype, device=x.device) if out is None else out
    return _lean_gemv_kernel[(triton.cdiv(N, n),)](x, w, out, N, K, w.stride(0), BLOCK_N=n, BLOCK_K=k,
                                                   PRELOAD=preload, EVICT="evict_first" if evict else "",
                                                   num_warps=warps, **pdl_launch(True))  # fmt: skip


@triton.jit
def _lean_gu_kernel(x_ptr, w_ptr, act_ptr, idx_ptr, inter, H, top_k, stride_we, stride_wn, stride_act,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """The gather gate_up at batch 1 (every pair live), each step reduced over K at once."""
    pdl_enter(PDL)
    p = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    e = tl.load(idx_ptr + p).to(tl.int64)
    t = p // top_k
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rn = tl.minimum(offs_n, inter - 1).to(tl.int64)
    g_ptrs = w_ptr + e * stride_we + rn[:, None] * stride_wn + offs_k[None, :]
    u_ptrs = g_ptrs + inter * stride_wn
    x_ptrs = x_ptr + t * H + offs_k
    h_main = H // BLOCK_K * BLOCK_K
    first = (offs_k < h_main)[None, :]
    g = tl.load(g_ptrs, mask=first, other=0.0, eviction_policy="evict_first")
    u = tl.load(u_ptrs, mask=first, other=0.0, eviction_policy="evict_first")
    acc_g = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, h_main, BLOCK_K):
        xv = tl.load(x_ptrs + k0).to(tl.float32)[None, :]
        k_next = tl.minimum(k0 + BLOCK_K, h_main - BLOCK_K)
        g_next = tl.load(g_ptrs + k_next, eviction_policy="evict_first")
        u_next = tl.load(u_ptrs + k_next, eviction_policy="evict_first")
        acc_g += tl.sum(g.to(tl.float32) * xv, axis=1)
        acc_u += tl.sum(u.to(tl.float32) * xv, axis=1)
        g, u = g_next, u_next
    if h_main < H:
        km = offs_k < H - h_main
        xv = tl.load(x_ptrs + h_main, mask=km, other=0.0).to(tl.float32)[None, :]
        acc_g += tl.sum(tl.load(g_ptrs + h_main, mask=km[None, :], other=0.0).to(tl.float32) * xv, axis=1)
        acc_u += tl.sum(tl.load(u_ptrs + h_main, mask=km[None, :], other=0.0).to(tl.float32) * xv, axis=1)
    a = _gelu_tanh_f32(acc_g) * acc_u
    tl.store(act_ptr + p * stride_act + offs_n, a.to(act_ptr.dtype.element_ty), mask=offs_n < inter)


def lean_gu(x, w, idx, n, k, warps):
    P, inter = idx.numel(), w.shape[1] // 2
    act = torch.empty((P, inter), dtype=x.dtype, device=x.device)
    _lean_gu_kernel[(P, triton.cdiv(inter, n))](x, w, act, idx, inter, x.shape[1], TOPK, w.stride(0), w.stride(1),
                                                act.stride(0), BLOCK_N=n, BLOCK_K=k, num_warps=warps,
                                                **pdl_launch(True))  # fmt: skip
    return act


@triton.jit
def _lean_dn_kernel(act_ptr, w_ptr, out_ptr, idx_ptr, topw_ptr, H, inter, stride_act, stride_we, stride_wn,
                    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """The gather down at batch 1 (one token, every slot live), each step reduced over K (and the slots) at once."""
    pdl_enter(PDL)
    pid_n = tl.program_id(0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    slots = tl.arange(0, TOP_K)
    es = tl.load(idx_ptr + slots).to(tl.int64)
    wts = tl.load(topw_ptr + slots).to(tl.float32)
    rn = tl.minimum(offs_n, H - 1).to(tl.int64)
    w_ptrs = w_ptr + es[:, None, None] * stride_we + (rn * stride_wn)[None, :, None] + offs_k[None, None, :]
    a_ptrs = act_ptr + (slots * stride_act)[:, None] + offs_k[None, :]
    i_main = inter // BLOCK_K * BLOCK_K
    wv = tl.load(w_ptrs, mask=(offs_k < i_main)[None, None, :], other=0.0, eviction_policy="evict_first")
    acc = tl.zeros((TOP_K, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, i_main, BLOCK_K):
        a = tl.load(a_ptrs + k0).to(tl.float32)  # [S, BK]
        k_next = tl.minimum(k0 + BLOCK_K, i_main - BLOCK_K)
        wv_next = tl.load(w_ptrs + k_next, eviction_policy="evict_first")
        acc += tl.sum(wv.to(tl.float32) * a[:, None, :], axis=2)
        wv = wv_next
    if i_main < inter:
        km = offs_k < inter - i_main
        a = tl.load(a_ptrs + i_main, mask=km[None, :], other=0.0).to(tl.float32)
        wt = tl.load(w_ptrs + i_main, mask=km[None, None, :], other=0.0).to(tl.float32)
        acc += tl.sum(wt * a[:, None, :], axis=2)
    y = tl.sum(acc * wts[:, None], axis=0)
    tl.store(out_ptr + offs_n, y.to(out_ptr.dtype.element_ty), mask=offs_n < H)


def lean_dn(act, w, idx, topw, n, k, warps):
    H_, inter = w.shape[1], w.shape[2]
    out = torch.empty((1, H_), dtype=act.dtype, device=act.device)
    _lean_dn_kernel[(triton.cdiv(H_, n),)](act, w, out, idx, topw, H_, inter, act.stride(0), w.stride(0),
                                           w.stride(1), TOP_K=TOPK, BLOCK_N=n, BLOCK_K=k, num_warps=warps,
                                           **pdl_launch(True))  # fmt: skip
    return out


def emit(row):
    print(json.dumps(row), flush=True)


def regs_of(jit_fn):
    """(registers, spills) of every compiled variant of a jit function (device cache)."""
    rows = []
    for dev_cache in jit_fn.device_caches.values():
        for key, k in dev_cache[0].items():
            k._init_handles()
            rows.append({"kernel": jit_fn.fn.__name__, "consts": str(k.src.constants)[-160:] if hasattr(k, "src") else
                         str(key)[-160:], "regs": k.n_regs, "spills": k.n_spills, "warps": k.metadata.num_warps})  # fmt: skip
    return rows


def timed(arms):
    graphs = {}
    for name, fn in arms.items():
        try:
            fn(0)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for i in range(LINKS):
                    fn(i % LAYERS)
            graphs[name] = g
        except Exception as exc:
            emit({"arm": name, "error": f"{type(exc).__name__}: {exc}"[:300]})
    times = {k: [] for k in graphs}
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(REPLAYS):
        for k, g in graphs.items():
            start.record()
            g.replay()
            stop.record()
            stop.synchronize()
            times[k].append(start.elapsed_time(stop) * 1e3 / LINKS)
    return {k: round(statistics.median(v), 3) for k, v in times.items()}


def gemv_arms(sel):
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, (N, K) in SHAPES.items():
        if not sel or name in sel:
            gemv_shape(name, N, K, gen)
            torch.cuda.empty_cache()


def gemv_shape(name, N, K, gen):
    ws = [(torch.randn(N, K, device="cuda", generator=gen) * 0.02).to(torch.bfloat16) for _ in range(LAYERS)]
    x = torch.randn(1, K, device="cuda", generator=gen).to(torch.bfloat16)
    nw = torch.ones(K, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(1, N, device="cuda", dtype=torch.bfloat16)
    ref = gemv(x, ws[0], GemvConfig(4, 512, 2))
    arms = {}
    for t in (GemvConfig(4, 512, 2), GemvConfig(8, 1024, 4, True), GemvConfig(32, 256, 4)):
        arms[f"gemv/{name}/{t.label}"] = lambda i, t=t: gemv(rmsnorm(x, nw, 1e-6, pdl=True), ws[i], t, out=out,
                                                              pdl=True)  # fmt: skip
    for n, k, w, p, e in ((4, 512, 2, 1, 0), (4, 512, 2, 2, 0), (8, 512, 2, 1, 0), (8, 512, 4, 2, 0),
                          (8, 1024, 4, 1, 1), (8, 1024, 4, 2, 1), (16, 512, 4, 2, 1), (4, 1024, 2, 2, 1),
                          (16, 256, 2, 2, 0), (8, 256, 2, 3, 0)):  # fmt: skip
        lbl = f"lean/{name}/{n}x{k}w{w}p{p}{'e' if e else ''}"
        y = lean_gemv(x, ws[0], n, k, w, p, bool(e))
        emit({"check": lbl, "max_abs_diff": (y.float() - ref.float()).abs().max().item()})
        arms[lbl] = lambda i, n=n, k=k, w=w, p=p, e=e: lean_gemv(rmsnorm(x, nw, 1e-6, pdl=True), ws[i], n, k, w, p,
                                                                 bool(e), out=out)  # fmt: skip
    for k, us in timed(arms).items():
        emit({"arm": k, "us_per_call": us, "mb": round(2 * N * K / 1e6, 1)})


def gather_arms():
    gen = torch.Generator(device="cuda").manual_seed(0)
    rnd = lambda *s: (torch.randn(*s, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)  # noqa: E731
    e_gu = [rnd(E, 2 * I_E, H) for _ in range(LAYERS)]
    e_dn = [rnd(E, H, I_E) for _ in range(LAYERS)]
    x = rnd(1, H) * 50
    rw, ridx = moe.moe_routing(torch.randn(1, E, device="cuda", generator=gen), TOPK, torch.ones(E, device="cuda"))
    idx, topw = ridx.reshape(-1).contiguous(), rw.reshape(-1).contiguous()
    act = rnd(TOPK, I_E) * 50
    t_gu = moe._gather_tiles(moe.gather_gate_up_defaults(TOPK), None, I_E, H)
    t_dn = moe._gather_tiles(moe.GATHER_DOWN_TILES, None, H, I_E)
    ref_gu = moe._gather_gate_up(x, e_gu[0], idx, topw, TOPK, t_gu)
    ref_dn = moe._gather_down(act, e_dn[0], idx, topw, TOPK, t_dn, torch.bfloat16)
    arms = {"gu/default": lambda i: moe._gather_gate_up(x, e_gu[i], idx, topw, TOPK, t_gu, True),
            "dn/default": lambda i: moe._gather_down(act, e_dn[i], idx, topw, TOPK, t_dn, torch.bfloat16, True)}
    for n, k, w in ((8, 256, 2), (4, 256, 2), (8, 512, 4), (16, 256, 4), (4, 512, 2), (8, 256, 4), (2, 512, 2)):
        lbl = f"lgu/{n}x{k}w{w}"
        emit({"check": lbl, "max_abs_diff": (lean_gu(x, e_gu[0], idx, n, k, w).float() - ref_gu.float()).abs().max().item()})
        arms[lbl] = lambda i, n=n, k=k, w=w: lean_gu(x, e_gu[i], idx, n, k, w)
    for n, k, w in ((8, 128, 4), (4, 128, 2), (8, 64, 2), (4, 256, 4), (2, 256, 2), (8, 128, 2), (16, 64, 4)):
        lbl = f"ldn/{n}x{k}w{w}"
        emit({"check": lbl, "max_abs_diff": (lean_dn(act, e_dn[0], idx, topw, n, k, w).float() - ref_dn.float()).abs().max().item()})
        arms[lbl] = lambda i, n=n, k=k, w=w: lean_dn(act, e_dn[i], idx, topw, n, k, w)
    for k, us in timed(arms).items():
        mb = (2 * 2 * I_E * H if "gu/" in k else 2 * H * I_E) * TOPK / 1e6
        emit({"arm": k, "us_per_call": us, "mb": round(mb, 1), "tb_s": round(mb / us, 3)})


if __name__ == "__main__":
    what = sys.argv[1:] or ["gather", "gemv"]
    if "gather" in what:
        gather_arms()
    if "gemv" in what:
        gemv_arms([w for w in what if w in SHAPES])
    from perfkit.kernels.gemv import _gemv_kernel
    for fn in (_lean_gemv_kernel, _lean_gu_kernel, _lean_dn_kernel, _gemv_kernel, moe._moe_gather_gate_up_kernel,
               moe._moe_gather_down_kernel):
        try:
            for r in regs_of(fn):
                emit(r)
        except Exception as exc:
            emit({"regs_error": f"{fn.fn.__name__}: {type(exc).__name__}: {exc}"[:300]})
