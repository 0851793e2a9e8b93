"""Prepared probe (12-07, CPU-checked under the interpreter, never run on a GPU): does a gemv that normalises its own
input (each CTA computes the RMSNorm of the L2-resident row before its loop) beat [rmsnorm launch -> gemv]?

Why: 12-07's L2 probe (`2-l2_probe.jsonl`) showed a [short PDL kernel -> gemv] link costs the gemv's chain time plus
nearly the whole short kernel (26B-A4B o sliding: 8.56 us against 7.0 + 1.48), so PDL hides the launch, not the
work. The 26B-A4B batch-1 step still runs ~0.37 ms of such short kernels (sandwiches, routing, q/k norm). If a
gemv's CTAs can fold the norm into their prologue (the weight's first tiles already in flight before the wait; the
row is 5-11 KB from L2), the sandwich launches before gemvs could go. This measures the simplest case first.

Arms, CHAIN_LEN links each, one CUDA graph, distinct weights per link, every kernel with PDL:
  norm_then_tile: perfkit's rmsnorm of a [1, K] row, then perfkit's gemv on its output (what the engine runs);
  norm_in_gemv:   this file's kernel: rstd of the raw row, then the gemv loop on (row * rstd * norm weight)
                  rounded to bf16 as rmsnorm stores it;
  tile_only:      perfkit's gemv alone (the floor).
Rows compare norm_in_gemv's output with norm_then_tile's (max abs difference; the rstd's sum order may differ).

Run: `python3 docs/h200-runs/2026-12-07/norm_probe.py` (CUDA, sm_90+), one JSON line per (shape, arm).
CPU check: `TRITON_INTERPRET=1 python3 docs/h200-runs/2026-12-07/norm_probe.py --check` (small shapes, PDL off).
"""

import json
import sys

import torch
import triton
import triton.language as tl

from perfkit.kernels import gemv as gv
from perfkit.kernels import rmsnorm as rn
from perfkit.kernels.pdl import pdl_enter, pdl_launch
from perfkit.kernels.timing import graph_sequence_us

CHAIN_LEN = 20
EPS = 1e-6
SHAPES = {  # name: (N, K, tile): the gemvs that follow a sandwich in a 26B-A4B / 31B layer
    "26b/gate_up": (4224, 2816, gv.GemvConfig(4, 512, 2)),
    "26b/qkv_sliding": (8192, 2816, gv.GemvConfig(32, 256, 4, preload=2)),
    "31b/qkv_sliding": (16384, 5376, gv.GemvConfig(4, 512, 2)),
    "31b/gate_up": (43008, 5376, gv.GemvConfig(4, 512, 2)),
}


@triton.jit
def _gemv_norm_kernel(a_ptr, nw_ptr, w_ptr, out_ptr, N, K, eps, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      K_POW2: tl.constexpr, EVICT: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """out[n] = sum_k w[n, k] * bf16(a[k] * rstd(a) * nw[k]) at M = 1; the first weight tile loads before the wait."""
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rn_ = tl.minimum(offs_n, N - 1).to(tl.int64)
    k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + (rn_ * K)[:, None] + k[None, :]  # [BN, BK]
    k_main = K // BLOCK_K * BLOCK_K
    w = tl.load(w_ptrs, mask=(k < k_main)[None, :], other=0.0, eviction_policy=EVICT)
    pdl_enter(PDL)  # the row a is the predecessor's output
    kk = tl.arange(0, K_POW2)
    row = tl.load(a_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(row * row, axis=0) / K + eps)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, k_main, BLOCK_K):
        x = tl.load(a_ptr + k0 + k).to(tl.float32) * rstd * tl.load(nw_ptr + k0 + k).to(tl.float32)
        x = x.to(a_ptr.dtype.element_ty).to(tl.float32)  # rounded as rmsnorm stores its output
        w_next = tl.load(w_ptrs + tl.minimum(k0 + BLOCK_K, k_main - BLOCK_K), eviction_policy=EVICT)
        acc = tl.fma(w.to(tl.float32), x[None, :], acc)
        w = w_next
    if k_main < K:
        km = k_main + k < K
        x = tl.load(a_ptr + k_main + k, mask=km, other=0.0).to(tl.float32) * rstd
        x = (x * tl.load(nw_ptr + k_main + k, mask=km, other=0.0).to(tl.float32)).to(a_ptr.dtype.element_ty)
        w = tl.load(w_ptrs + k_main, mask=km[None, :], other=0.0, eviction_policy=EVICT)
        acc = tl.fma(w.to(tl.float32), x.to(tl.float32)[None, :], acc)
    tl.store(out_ptr + offs_n, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=offs_n < N)


def gemv_norm(a, nw, w, out, cfg, pdl: bool):
    N, K = w.shape
    _gemv_norm_kernel[(triton.cdiv(N, cfg.block_n),)](
        a, nw, w, out, N, K, EPS, BLOCK_N=cfg.block_n, BLOCK_K=min(cfg.block_k, triton.next_power_of_2(K)),
        K_POW2=triton.next_power_of_2(K), EVICT="evict_first" if cfg.evict_first else "", num_warps=cfg.num_warps,
        **pdl_launch(pdl),
    )  # fmt: skip
    return out


def probe_shape(name: str, N: int, K: int, cfg) -> None:
    copies = max(2, min(CHAIN_LEN, -(-200_000_000 // (2 * N * K))))
    ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    a = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    nw = (1 + 0.1 * torch.randn(K, device="cuda")).to(torch.bfloat16)
    out = torch.empty(1, N, device="cuda", dtype=torch.bfloat16)
    x = rn.rmsnorm(a, nw, EPS)
    arms = {
        "norm_then_tile": lambda i: gv.gemv(rn.rmsnorm(a, nw, EPS, pdl=True), ws[i % copies], cfg, out=out, pdl=True),
        "norm_in_gemv": lambda i: gemv_norm(a, nw, ws[i % copies], out, cfg, True),
        "tile_only": lambda i: gv.gemv(x, ws[i % copies], cfg, out=out, pdl=True),
    }
    ref = gv.gemv(x, ws[0], cfg).float()
    for arm, fn in arms.items():
        row = {"shape": name, "N": N, "K": K, "tile": cfg.label, "arm": arm}
        try:
            row["us_per_link"] = round(graph_sequence_us(fn, range(CHAIN_LEN), CHAIN_LEN, 15), 2)
            fn(0)
            torch.cuda.synchronize()
            row["max_abs_diff"] = float((out.float() - ref).abs().max())
        except Exception as exc:  # a variant that does not compile or launch here
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        print(json.dumps(row), flush=True)
    print(json.dumps({"shape": name, "bound_us": round(gv.gemv_traffic(1, N, K)["bound_us"], 2)}), flush=True)


def check() -> None:
    """CPU (TRITON_INTERPRET=1): the kernel against rmsnorm + gemv on small shapes, PDL off."""
    torch.manual_seed(0)
    for N, K in ((40, 208), (33, 96)):
        a = torch.randn(1, K, dtype=torch.bfloat16)
        nw = (1 + 0.1 * torch.randn(K)).to(torch.bfloat16)
        w = (torch.randn(N, K) * 0.1).to(torch.bfloat16)
        cfg = gv.GemvConfig(16, 64, 4)
        got = gemv_norm(a, nw, w, torch.empty(1, N, dtype=torch.bfloat16), cfg, False).float()
        want = gv.gemv(rn.rmsnorm(a, nw, EPS), w, cfg).float()
        print(json.dumps({"N": N, "K": K, "max_abs_diff": float((got - want).abs().max()),
                          "max_abs": float(want.abs().max())}))  # fmt: skip


def main() -> None:
    torch.manual_seed(0)
    for name, (N, K, cfg) in SHAPES.items():
        probe_shape(name, N, K, cfg)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    check() if "--check" in sys.argv else main()
