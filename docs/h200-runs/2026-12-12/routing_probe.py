"""How long the batch-1 routing launch takes on the experts' branch, by its warps and its top-k form (12-12 call 6).

With decode_moe_ffn=branches the experts' branch is [routing] -> [gather gate_up] -> [gather down] and the routing
kernel (one program, 128 logits, 8 rounds of argmax) is on the step's critical path. moe_routing launches it on
2 warps for 128 experts: each argmax round is a max and a min reduction across the warps (shared memory and a
barrier each). Arms, CUDA graphs of LINKS links, PDL on, us per link:
  route_wW          [sandwich + router] -> routing on W warps            (the routing's share of the chain)
  route_packed_wW   the same, each round one max over (p bits << 32 | 127 - e) keys (value, lowest index first)
  branch_wW / branch_packed_wW   the full FFN link of branch_probe's "branch" arm with that routing
The packed form's ids and weights are compared with moe_routing's.
Run on the device: python3 docs/h200-runs/2026-12-12/routing_probe.py > $OUT/routing.jsonl
"""

import json
import os
import statistics
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(__file__))
from branch_probe import I_D, LAYERS, LINKS, REPLAYS, E, H, K, layer_weights  # noqa: E402

from perfkit.kernels import moe  # noqa: E402
from perfkit.kernels.gemv import default_tile, gemv  # noqa: E402
from perfkit.kernels.pdl import pdl_enter, pdl_launch  # noqa: E402
from perfkit.kernels.rmsnorm import sandwich_rmsnorm  # noqa: E402


@triton.jit
def _packed_routing_kernel(logits_ptr, scale_ptr, w_ptr, idx_ptr, E, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr,
                           BLOCK_E: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    pdl_enter(PDL)
    e = tl.arange(0, BLOCK_E)
    z = tl.load(logits_ptr + e, mask=e < E, other=-float("inf")).to(tl.float32)
    p = tl.exp(z - tl.max(z, axis=0))
    p = p / tl.sum(p, axis=0)
    key = (p.to(tl.uint32, bitcast=True).to(tl.uint64) << 32) | (BLOCK_E - 1 - e).to(tl.uint64)
    key = tl.where(e < E, key, 0)
    kk = tl.arange(0, BLOCK_K)
    wv = tl.zeros([BLOCK_K], dtype=tl.float32)
    iv = tl.zeros([BLOCK_K], dtype=tl.int32)
    for k in tl.static_range(TOP_K):
        best = tl.max(key, axis=0)
        i = BLOCK_E - 1 - (best & 0xFFFFFFFF).to(tl.int32)
        mx = (best >> 32).to(tl.uint32).to(tl.float32, bitcast=True)
        wv = tl.where(kk == k, mx, wv)
        iv = tl.where(kk == k, i, iv)
        key = tl.where(e == i, 0, key)
    km = kk < TOP_K
    wv = wv / tl.sum(tl.where(km, wv, 0.0), axis=0)
    wv = wv * tl.load(scale_ptr + iv, mask=km, other=0.0).to(tl.float32)
    tl.store(w_ptr + kk, wv, mask=km)
    tl.store(idx_ptr + kk, iv, mask=km)


def routing(logits, scale, warps, packed):
    w = torch.empty((1, K), dtype=torch.float32, device="cuda")
    idx = torch.empty((1, K), dtype=torch.int32, device="cuda")
    if packed:
        _packed_routing_kernel[(1,)](logits, scale, w, idx, E, TOP_K=K, BLOCK_K=K, BLOCK_E=128, num_warps=warps,
                                     **pdl_launch(True))  # fmt: skip
    else:
        moe._moe_routing_kernel[(1,)](logits, scale, w, idx, E, logits.stride(0), TOP_K=K, BLOCK_K=K, BLOCK_E=128,
                                      num_warps=warps, **pdl_launch(True))  # fmt: skip
    return w, idx


def main():
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = [layer_weights(gen) for _ in range(LAYERS)]
    a = torch.randn(1, H, device="cuda", generator=gen).to(torch.bfloat16)
    res = torch.randn(1, H, device="cuda", generator=gen).to(torch.bfloat16)
    scalar = torch.ones(1, device="cuda", dtype=torch.bfloat16)
    t_gu, t_dn, root = default_tile(2 * I_D, H), default_tile(H, I_D), H**-0.5
    side = torch.cuda.Stream()

    def swr(L):
        n = L["norms"]
        return sandwich_rmsnorm(a, res, n[0], 1e-6, next_weights=n[1:3], router=(L["w_r"], n[3], root), pdl=True)[1]

    def branch(L, warps, packed):
        ys = swr(L)
        main_s = torch.cuda.current_stream()
        side.wait_stream(main_s)
        with torch.cuda.stream(side):
            m = gemv(gemv(ys[0], L["w_gu"], t_gu, pdl=True), L["w_dn"], t_dn, pdl=True, glu=True)
        w, idx = routing(ys[2], L["scale"], warps, packed)
        e = moe.fused_moe(ys[1], L["e_gu"], L["e_dn"], w, idx, path="gather", pdl=True)
        main_s.wait_stream(side)
        n = L["norms"]
        sandwich_rmsnorm(m, res, n[4], 1e-6, x2=(e, n[5], n[6]), scalar=scalar, next_weights=[n[1]], pdl=True)

    for L in layers[:4]:  # the packed form against moe_routing
        logits = swr(L)[2]
        w0, i0 = moe.moe_routing(logits, K, L["scale"])
        for warps in (1, 2, 4):
            w1, i1 = routing(logits, L["scale"], warps, True)
            w2, i2 = routing(logits, L["scale"], warps, False)
            print(json.dumps({"check": warps, "packed_ids_equal": torch.equal(i1, i0), "plain_ids_equal":
                              torch.equal(i2, i0), "packed_w_max_abs": (w1 - w0).abs().max().item(),
                              "plain_w_max_abs": (w2 - w0).abs().max().item()}), flush=True)  # fmt: skip
    arms = {}
    for warps in (1, 2, 4):
        for packed in (False, True):
            tag = f"{'packed_' if packed else ''}w{warps}"
            arms[f"route_{tag}"] = lambda L, w=warps, p=packed: routing(swr(L)[2], L["scale"], w, p)
            arms[f"branch_{tag}"] = lambda L, w=warps, p=packed: branch(L, w, p)
    graphs = {}
    for name, fn in arms.items():
        def chain(fn=fn):
            for i in range(LINKS):
                fn(layers[i % LAYERS])

        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            chain()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            chain()
        graphs[name] = g
    times = {k: [] for k in graphs}
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(REPLAYS):
        for k, g in graphs.items():
            start.record()
            g.replay()
            stop.record()
            stop.synchronize()
            times[k].append(start.elapsed_time(stop) * 1e3 / LINKS)
    for k, ts in times.items():
        print(json.dumps({"arm": k, "us_per_link": round(statistics.median(ts), 3)}), flush=True)


if __name__ == "__main__":
    main()
