"""Probe (12-09): can a short, latency-bound decode kernel pull the NEXT gemv's weight into L2 with extra programs?

Why: a batch-1 26B-A4B step is ~11 launches per layer, of which the short ones (q/k norm + RoPE, the decode merge,
the two sandwiches) each hold the critical path ~2.5 us while the DRAM idles (12-09 call 3: folding the routing
launch into the down gemv's launch took 2.6 us per layer). 12-07's `l2_probe.py` had the gemv's own CTAs prefetch
their rows (`prefetch.global.L2`, one per line) before the PDL wait: it lost 1.5-3 us per link. Here the prefetch
rides in the short kernel's launch instead, as extra programs that issue `cp.async.bulk.prefetch.L2` (the TMA
unit's bulk L2 prefetch, one instruction per CHUNK contiguous bytes) before their PDL wait: they start while the
kernel before the short one still runs, and the gemv after it should find its weight in L2.

Chain per arm, one CUDA graph of CHAIN_LEN links [short kernel -> gemv (perfkit's, PDL)], distinct weights per link
(L2-cold). The short kernel is this file's rmsnorm of a [1, K] row, preceded by SPIN dependent L2 reads (SPIN = 0:
a plain norm; larger: a longer latency-bound window, like the decode attention + merge before o_proj). Arms:
`plain` (no prefetch programs), `pf<frac>` (prefetch programs for the first frac of the gemv's weight bytes).
us per link = median replay / CHAIN_LEN. Outputs compared with the plain arm's (the gemv is the same: bit for bit).

Run: `python3 docs/h200-runs/2026-12-09/l2_ride_probe.py` (CUDA, sm_90+); one JSON line per (shape, spin, arm).
"""

import json

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from perfkit.kernels import gemv as gv
from perfkit.kernels.timing import graph_sequence_us

CHAIN_LEN = 20
SHAPES = {  # name: (N, K, tile)
    "26b/o_sliding": (2816, 4096, gv.GemvConfig(8, 1024, 4, evict_first=True)),
    "26b/gate_up": (4224, 2816, gv.GemvConfig(4, 512, 2)),
    "26b/qkv_sliding": (8192, 2816, gv.GemvConfig(32, 256, 4, preload=2)),
}


@triton.jit
def _bulk_prefetch_l2(ptrs, nbytes):
    return tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
                                     [ptrs, nbytes], dtype=tl.int32, is_pure=False, pack=1)  # fmt: skip


@triton.jit
def _norm_pf_kernel(x_ptr, w_ptr, out_ptr, K, eps, spin, pf_ptr, pf_bytes, CHUNK: tl.constexpr,
                    LANES: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """Program 0: out = rmsnorm(x) * w after ``spin`` dependent L2 reads. Programs 1..: bulk L2 prefetches of
    LANES chunks of CHUNK bytes each from pf_ptr (clamped into [0, pf_bytes)), issued before the PDL wait."""
    pid = tl.program_id(0)
    if pid > 0:
        lane = tl.arange(0, LANES)
        off = tl.minimum(((pid - 1) * LANES + lane).to(tl.int64) * CHUNK, pf_bytes - CHUNK)
        _bulk_prefetch_l2(pf_ptr + off, tl.full([LANES], CHUNK, tl.int32))
    gdc_wait()
    gdc_launch_dependents()
    if pid == 0:
        k = tl.arange(0, BLOCK_K)
        m = k < K
        acc = tl.zeros([BLOCK_K], tl.float32)
        for _ in range(spin):  # each read's address depends on the last one's value
            acc += tl.load(x_ptr + k + (acc != acc).to(tl.int32), mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
        x = tl.load(x_ptr + k, mask=m, other=0.0).to(tl.float32) + acc * 0
        r = tl.rsqrt(tl.sum(x * x, axis=0) / K + eps)
        y = x * r * tl.load(w_ptr + k, mask=m, other=0.0).to(tl.float32)
        tl.store(out_ptr + k, y.to(out_ptr.dtype.element_ty), mask=m)


def norm_pf(x, w, out, spin, pf: torch.Tensor | None, frac: float, chunk: int, lanes: int) -> None:
    K = x.shape[-1]
    nbytes = 0 if pf is None else int(pf.numel() * pf.element_size() * frac) // chunk * chunk
    progs = 1 + (triton.cdiv(nbytes, chunk * lanes) if nbytes else 0)
    pf_u8 = (x if pf is None else pf).view(torch.uint8)  # byte addresses
    _norm_pf_kernel[(progs,)](x, w, out, K, 1e-6, spin, pf_u8, max(nbytes, chunk), CHUNK=chunk,
                              LANES=lanes, BLOCK_K=triton.next_power_of_2(K), num_warps=1, launch_pdl=True)  # fmt: skip


def probe_shape(name: str, N: int, K: int, cfg) -> None:
    ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(CHAIN_LEN)]
    h = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    nw = torch.ones(K, device="cuda", dtype=torch.bfloat16)
    xs = [torch.empty(1, K, device="cuda", dtype=torch.bfloat16) for _ in range(CHAIN_LEN)]
    outs = [torch.empty(1, N, device="cuda", dtype=torch.bfloat16) for _ in range(CHAIN_LEN)]
    arms = {"plain": (0.0, 65536, 8), "pf1.0": (1.0, 65536, 8), "pf0.5": (0.5, 65536, 8),
            "pf1.0c16k": (1.0, 16384, 32), "pf1.0c256k": (1.0, 262144, 4)}  # fmt: skip
    for spin in (0, 8):
        ref = None
        for arm, (frac, chunk, lanes) in arms.items():
            row = {"shape": name, "N": N, "K": K, "tile": cfg.label, "spin": spin, "arm": arm}
            try:

                def link(i, frac=frac, chunk=chunk, lanes=lanes, spin=spin):
                    norm_pf(h, nw, xs[i], spin, ws[i] if frac else None, frac, chunk, lanes)
                    gv.gemv(xs[i], ws[i], cfg, out=outs[i], pdl=True)

                row["us_per_link"] = round(graph_sequence_us(link, list(range(CHAIN_LEN)), CHAIN_LEN, 15), 2)
                torch.cuda.synchronize()
                got = torch.cat(outs)
                if ref is None:
                    ref = got.clone()
                row["equal_to_plain"] = bool(torch.equal(got, ref))
                if arm == "plain":  # the short kernel alone, for the window it holds
                    row["short_alone_us"] = round(graph_sequence_us(
                        lambda i, spin=spin: norm_pf(h, nw, xs[i], spin, None, 0.0, 65536, 8), list(range(CHAIN_LEN)),
                        CHAIN_LEN, 15), 2)  # fmt: skip
            except Exception as exc:  # a variant that does not compile or launch here
                row["error"] = f"{type(exc).__name__}: {exc}"[:400]
            print(json.dumps(row), flush=True)
    print(json.dumps({"shape": name, "bound_us": round(gv.gemv_traffic(1, N, K)["bound_us"], 2)}), flush=True)


def main() -> None:
    torch.manual_seed(0)
    for name, (N, K, cfg) in SHAPES.items():
        probe_shape(name, N, K, cfg)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
