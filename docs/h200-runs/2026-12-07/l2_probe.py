"""Probe (12-07): can a PDL-launched gemv pull its weights into L2 while the short kernel before it runs?

Why: with PDL a batch-1 gemv's CTAs are resident while their predecessor runs (a norm, the decode merge, a
sandwich: 2-10 us each, latency-bound, the DRAM mostly idle), but today they load only their first weight tile before
`griddepcontrol.wait`. Issuing `prefetch.global.L2` for every 128-byte line of the CTA's weight rows before the
wait would overlap the weight read with the predecessor. 26B-A4B's per-gemv overhead over the weight read is ~2 us
x 151 calls per step (12-07 call 1), the largest pool left.

Chain per arm, one CUDA graph, CHAIN_LEN links of [predecessor -> gemv], distinct weights per link (L2-cold), both
kernels launched with PDL; the predecessor is perfkit's rmsnorm of a [1, K] row (the gemv's x) or its sandwich.
Arms: `tile` (perfkit's gemv as the engine launches it) and `l2pf` (this file's kernel: the same loop after an L2
prefetch of the CTA's rows), and `pred_only` (the predecessors alone). us per link = median replay / CHAIN_LEN.
Outputs of `l2pf` are compared with `tile` (same loop and order: bit for bit).

Run: `python3 docs/h200-runs/2026-12-07/l2_probe.py` (CUDA, sm_90+); one JSON line per (shape, predecessor, arm).
"""

import json
import statistics

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from perfkit.kernels import gemv as gv
from perfkit.kernels import rmsnorm as rn

CHAIN_LEN = 20
SHAPES = {  # name: (N, K, tile)
    "26b/o_sliding": (2816, 4096, gv.GemvConfig(8, 1024, 4, evict_first=True)),
    "26b/gate_up": (4224, 2816, gv.GemvConfig(4, 512, 2)),
    "26b/down": (2816, 2112, gv.GemvConfig(8, 1024, 4, evict_first=True)),
    "26b/qkv_sliding": (8192, 2816, gv.GemvConfig(32, 256, 4, preload=2)),
    "31b/o_sliding": (5376, 8192, gv.GemvConfig(16, 512, 4, evict_first=True)),
}


@triton.jit
def _prefetch_l2(ptrs):
    return tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                                     dtype=tl.int32, is_pure=False, pack=1)  # fmt: skip


@triton.jit
def _gemv_l2pf_kernel(x_ptr, w_ptr, out_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      EVICT: tl.constexpr, K_LINES: tl.constexpr, L2PF: tl.constexpr):  # fmt: skip
    """perfkit's gemv loop at M = 1 (preload 1), PDL on; L2PF: every 128-byte line of this CTA's rows is
    prefetched into L2 before the wait."""
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rn_ = tl.minimum(offs_n, N - 1).to(tl.int64)
    k = tl.arange(0, BLOCK_K)
    if L2PF:
        lines = tl.minimum(tl.arange(0, K_LINES) * 64, K - 1)  # bf16: 64 elements per line (repeats: harmless)
        _prefetch_l2(w_ptr + (rn_ * K)[:, None] + lines[None, :])
    w_ptrs = w_ptr + (rn_ * K)[:, None] + k[None, :]  # [BN, BK]
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    k_main = K // BLOCK_K * BLOCK_K
    w = tl.load(w_ptrs, mask=(k < k_main)[None, :], other=0.0, eviction_policy=EVICT)
    gdc_wait()
    gdc_launch_dependents()
    for k0 in range(0, k_main, BLOCK_K):
        x = tl.load(x_ptr + k0 + k)
        w_next = tl.load(w_ptrs + tl.minimum(k0 + BLOCK_K, k_main - BLOCK_K), eviction_policy=EVICT)
        acc = tl.fma(w.to(tl.float32), x.to(tl.float32)[None, :], acc)
        w = w_next
    if k_main < K:
        km = k_main + k < K
        x = tl.load(x_ptr + k_main + k, mask=km, other=0.0)
        w = tl.load(w_ptrs + k_main, mask=km[None, :], other=0.0, eviction_policy=EVICT)
        acc = tl.fma(w.to(tl.float32), x.to(tl.float32)[None, :], acc)
    tl.store(out_ptr + offs_n, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=offs_n < N)


def gemv_l2pf(x, w, out, cfg, l2pf: bool):
    N, K = w.shape
    _gemv_l2pf_kernel[(triton.cdiv(N, cfg.block_n),)](
        x, w, out, N, K, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVICT="evict_first" if cfg.evict_first else "",
        K_LINES=triton.next_power_of_2(triton.cdiv(K, 64)), L2PF=int(l2pf), num_warps=cfg.num_warps, launch_pdl=True,
    )  # fmt: skip


def chain_us(links) -> float:
    """Median us per link of the links (callables) captured back to back in one CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in links:
            f()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in links:
            f()
    for _ in range(3):
        g.replay()
    ts = []
    for _ in range(15):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / len(links))
    return statistics.median(ts)


def probe_shape(name: str, N: int, K: int, cfg) -> None:
    """Every (predecessor, arm) chain at one shape; one JSON line each, then the shape's bound."""
    copies = max(2, min(CHAIN_LEN, -(-200_000_000 // (2 * N * K))))
    ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    h = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    a = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    nw = torch.ones(K, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(1, N, device="cuda", dtype=torch.bfloat16)
    preds = {  # each returns the gemv's x [1, K], a fresh tensor (no copy kernel in the chain)
        "rmsnorm": lambda: rn.rmsnorm(h, nw, 1e-6, pdl=True),
        "sandwich": lambda: rn.sandwich_rmsnorm(a, h, nw, 1e-6, next_weights=[nw], pdl=True)[1][0],
    }
    arms = {
        "pred_only": lambda i, x: None,
        "tile": lambda i, x: gv.gemv(x, ws[i % copies], cfg, out=out, pdl=True),
        "l2pf_off": lambda i, x: gemv_l2pf(x, ws[i % copies], out, cfg, False),
        "l2pf": lambda i, x: gemv_l2pf(x, ws[i % copies], out, cfg, True),
    }
    for pname, pred in preds.items():
        ref = None
        for arm, fn in arms.items():
            row = {"shape": name, "N": N, "K": K, "tile": cfg.label, "pred": pname, "arm": arm}
            try:
                links = [lambda i=i, fn=fn, pred=pred: fn(i, pred()) for i in range(CHAIN_LEN)]
                row["us_per_link"] = round(chain_us(links), 2)
                if arm != "pred_only":
                    fn(0, pred())
                    torch.cuda.synchronize()
                    if ref is None:
                        ref = out.clone()
                    row["equal_to_tile"] = bool(torch.equal(out, ref))
            except Exception as exc:  # a variant that does not compile or launch here
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            print(json.dumps(row), flush=True)
    print(json.dumps({"shape": name, "bound_us": round(gv.gemv_traffic(1, N, K)["bound_us"], 2)}), flush=True)


def main() -> None:
    torch.manual_seed(0)
    for name, (N, K, cfg) in SHAPES.items():
        probe_shape(name, N, K, cfg)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
