"""A prepared probe for the next session (never run on a GPU): does programmatic dependent launch (PDL) take the
latency floor off a chain of batch-1 GEMVs inside a CUDA graph?

Why: after 12-05's gemv the 26B-A4B batch-1 step is 463 kernels, 3.26 ms busy against a 1.83 ms bound; its 125
small gemv calls run 3-8 us each for ~0.5 ms of weights (`6-ab_c1_profile.json`), and the router's 0.7 MB takes
2.8 us. Each kernel waits for its predecessor to finish, then starts its DRAM round trips from cold. With PDL
(`launch_pdl=True` at launch; `griddepcontrol.wait` = `gdc_wait()` in the kernel) the next kernel's CTAs start
while the previous one drains, and a gemv can issue its first weight loads (which depend on nothing) before it
waits for x. `gdc_launch_dependents()` after the prologue lets the kernel after it start early in turn.

Arms, each a CUDA graph of a chain of CHAIN_LEN dependent products (x -> W1 -> W2 -> W1' -> ..., distinct weights, so
y_i is x_{i+1}), timed as the median of 15 replays:
  cublas: torch.mm;  gemv: this file's kernel as perfkit/kernels/gemv.py launches it (PDL 0);
  pdl_wait: launched with launch_pdl=True, weight prologue, then gdc_wait (PDL 1);
  pdl_trigger: the same plus gdc_launch_dependents right after the wait (PDL 2).
Every arm's final output is compared with the gemv arm's (the same kernel and order: bit for bit) and with an fp32
reference chain. One JSON line per (chain, arm).

Run on the H200: `python3 docs/h200-runs/2026-12-05/pdl_probe.py` (needs triton >= 3.4 for launch_pdl; the script
reports an error row if the launch option or the capture is refused). CPU: `TRITON_INTERPRET=1 python3 ...
--check` runs the PDL 0 kernel against the reference on small shapes only (the interpreter has no gdc_wait).

Correctness rule if it is adopted: every kernel launched with launch_pdl must execute gdc_wait on every path before
it reads anything a predecessor wrote or writes anything a predecessor reads, and before it exits; otherwise
the kernel after it may run before the one before it has finished.
"""

import json
import sys

import torch
import triton
import triton.language as tl

from perfkit.kernels.timing import graph_sequence_us

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # older Triton: only PDL 0 can run
    gdc_launch_dependents = gdc_wait = None

CHAINS = {  # name: the two alternating [N, K] shapes (the second's K is the first's N)
    "26b_gate_up_down": ((4224, 2816), (2816, 4224)),
    "26b_qkv_full_o_full": ((8192, 2816), (2816, 8192)),
    "31b_o_sliding": ((8192, 5376), (5376, 8192)),
}
CHAIN_LEN = 20
TILE = (8, 1024, 4, True)  # block_n, block_k, num_warps, evict_first: 12-05's best on the 26B-A4B o_proj shapes


@triton.jit
def _gemv_pdl_kernel(x_ptr, w_ptr, out_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     EVICT: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """perfkit/kernels/gemv.py's kernel at M = 1, with PDL 1 / 2: the first weight tile loads before gdc_wait."""
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rn = tl.minimum(offs_n, N - 1).to(tl.int64)
    k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + (rn * K)[:, None] + k[None, :]  # [BN, BK]
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    k_main = K // BLOCK_K * BLOCK_K
    w = tl.load(w_ptrs, mask=(k < k_main)[None, :], other=0.0, eviction_policy=EVICT)  # independent of x
    if PDL >= 1:
        gdc_wait()  # the predecessor (which wrote x) has finished and its writes are visible
    if PDL == 2:
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


def gemv_pdl(x, w, out, pdl: int, tile=TILE):
    N, K = w.shape
    bn, bk, warps, evict = tile
    bk = min(bk, triton.next_power_of_2(K))
    kw = {"launch_pdl": True} if pdl else {}
    _gemv_pdl_kernel[(triton.cdiv(N, bn),)](x, w, out, N, K, BLOCK_N=bn, BLOCK_K=bk,
                                            EVICT="evict_first" if evict else "", PDL=pdl, num_warps=warps, **kw)  # fmt: skip
    return out


def run_chain(arm: str, xs, ws):
    """xs[i] feeds ws[i] into xs[i + 1] (preallocated [1, N_i] buffers)."""
    for i, w in enumerate(ws):
        if arm == "cublas":
            torch.mm(xs[i], w.t(), out=xs[i + 1])
        else:
            gemv_pdl(xs[i][0], w, xs[i + 1][0], {"gemv": 0, "pdl_wait": 1, "pdl_trigger": 2}[arm])


def time_graph(fn, replays: int = 15) -> float:
    """Median us of one replay of a CUDA graph of fn() (perfkit.kernels.timing, one call)."""
    return graph_sequence_us(lambda _: fn(), [None], calls=1, replays=replays)


def main() -> None:
    dev = "cuda"
    for name, (s1, s2) in CHAINS.items():
        gen = torch.Generator(device=dev).manual_seed(0)
        ws = [torch.randn(*(s1 if i % 2 == 0 else s2), device=dev, generator=gen).to(torch.bfloat16) * 0.02
              for i in range(CHAIN_LEN)]  # fmt: skip
        dims = [s1[1]] + [w.shape[0] for w in ws]
        ref = torch.randn(1, dims[0], device=dev, generator=gen)
        x0 = ref.to(torch.bfloat16)
        for w in ws:
            ref = (ref @ w.float().t()).to(torch.bfloat16).float()
        outs = {}
        for arm in ("cublas", "gemv", "pdl_wait", "pdl_trigger"):
            xs = [x0.clone()] + [torch.empty(1, d, device=dev, dtype=torch.bfloat16) for d in dims[1:]]
            row = {"chain": name, "arm": arm, "len": CHAIN_LEN,
                   "weight_mb": round(sum(w.numel() * 2 for w in ws) / 1e6, 1)}  # fmt: skip
            try:
                row["us"] = round(time_graph(lambda xs=xs, arm=arm, ws=ws: run_chain(arm, xs, ws)), 2)
                run_chain(arm, xs, ws)
                torch.cuda.synchronize()
                outs[arm] = xs[-1].float()
                row["rel_err_vs_ref"] = float((outs[arm] - ref).abs().max() / ref.abs().max())
                if "gemv" in outs and arm.startswith("pdl"):
                    row["equal_to_gemv"] = bool(torch.equal(outs[arm], outs["gemv"]))
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            row["bound_us"] = round(row["weight_mb"] * 1e6 / 4.3e12 * 1e6, 2)
            print(json.dumps(row), flush=True)


def check_cpu() -> None:
    for N, K in ((40, 208), (7, 30), (16, 1024)):
        x = torch.randn(K).to(torch.bfloat16)
        w = (torch.randn(N, K) * 0.1).to(torch.bfloat16)
        out = gemv_pdl(x, w, torch.empty(N, dtype=torch.bfloat16), 0, (16, 64, 4, False))
        ref = w.float() @ x.float()
        assert (out.float() - ref).abs().max() <= 0.02 * ref.abs().max() + 1e-3, (N, K)
    print("PDL 0 kernel matches the reference on 3 shapes")


if __name__ == "__main__":
    check_cpu() if "--check" in sys.argv else main()
