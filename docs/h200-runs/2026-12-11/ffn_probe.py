"""Where decode_moe_ffn's two launches lose (12-11 call 2: 26B-A4B c1 TPOT 2.898 -> 3.059 ms with them).

CUDA graphs of LINKS links, each link one 26B-A4B MoE layer's feed-forward chain at batch 1 (bf16, real shapes,
LAYERS distinct weight sets cycled so that no weight is re-read from L2), PDL on unless the arm says off. Arms:

  separate      sandwich(3 pre-norms) -> gemv_pair(gate_up + router) -> gemv_routed(GLU down + routing)
                -> gather gate_up -> gather down -> post-FFN sandwich          (the engine's path today)
  fused         sandwich + router -> moe_ffn gate_up -> moe_ffn down -> post-FFN sandwich
  fused_pre     as fused, the gate_up launch reading a routing made once outside the graph (no top-k per program)
  sw3 / swr     the two sandwiches alone: 3 pre-norms / 2 pre-norms + the router's programs
  pair_routed   gemv_pair -> gemv_routed            gather       the gather path's two kernels
  ffn_gu        the fused gate_up alone             ffn_gu_pre   the same reading a given routing
  ffn_dn        the fused down alone                gather_gu / gather_dn   the gather path's kernels alone
  ffn_gu_NxKwW / ffn_dn_NxKwW   the fused launches with other tiles (BLOCK_N x BLOCK_K on W warps)

One JSON line per arm: the median us per link over REPLAYS replays (arms interleaved).
Run on the device: python3 docs/h200-runs/2026-12-11/ffn_probe.py > $OUT/ffn_probe.jsonl
"""

import json
import statistics

import torch

from perfkit.kernels import moe
from perfkit.kernels.gemv import default_tile, gemv_pair, gemv_routed
from perfkit.kernels.moe_ffn import moe_ffn_down, moe_ffn_gate_up
from perfkit.kernels.rmsnorm import sandwich_rmsnorm

H, I_D, E, I_E, K = 2816, 2112, 128, 704, 8
LAYERS, LINKS, REPLAYS = 8, 32, 20
GU_TILES = ((8, 512, 4), (16, 256, 4), (4, 512, 2), (8, 256, 4))  # (BLOCK_N, BLOCK_K, num_warps) besides 8 x 256 w2
DN_TILES = ((16, 128, 4), (4, 128, 2), (8, 64, 2), (8, 128, 8))  # besides 8 x 128 w4


def layer_weights(gen):
    def rnd(*shape, s=0.02):
        return (torch.randn(*shape, device="cuda", generator=gen) * s).to(torch.bfloat16)

    return {
        "w_gu": rnd(2 * I_D, H), "w_dn": rnd(H, I_D), "w_r": rnd(E, H, s=0.05), "e_gu": rnd(E, 2 * I_E, H),
        "e_dn": rnd(E, H, I_E), "scale": torch.rand(E, device="cuda", generator=gen) + 0.5,
        "norms": [rnd(H, s=1.0) for _ in range(7)],
    }  # fmt: skip


def main():
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = [layer_weights(gen) for _ in range(LAYERS)]
    a = (torch.randn(1, H, device="cuda", generator=gen)).to(torch.bfloat16)
    res = (torch.randn(1, H, device="cuda", generator=gen)).to(torch.bfloat16)
    scalar = torch.ones(1, device="cuda", dtype=torch.bfloat16)
    t_gu, t_dn, root = default_tile(2 * I_D, H), default_tile(H, I_D), H**-0.5
    routing = moe.moe_routing(torch.randn(1, E, device="cuda", generator=gen), K, layers[0]["scale"])
    fixed = {"logits": torch.randn(1, E, device="cuda", generator=gen).to(torch.bfloat16)}

    def sw3(L, pdl):
        n = L["norms"]
        return sandwich_rmsnorm(a, res, n[0], 1e-6, next_weights=n[1:4], next_mults=[1.0, 1.0, root], pdl=pdl)[1]

    def swr(L, pdl):
        n = L["norms"]
        return sandwich_rmsnorm(a, res, n[0], 1e-6, next_weights=n[1:3], router=(L["w_r"], n[3], root), pdl=pdl)[1]

    def sw_post(L, m, e, pdl):
        n = L["norms"]
        sandwich_rmsnorm(m, res, n[4], 1e-6, x2=(e, n[5], n[6]), scalar=scalar, next_weights=[n[1]], pdl=pdl)

    def separate_ffn(L, ys, pdl):
        gu, logits = gemv_pair(ys[0], L["w_gu"], ys[2], L["w_r"], t_gu, pdl=pdl)
        m, rw, ridx = gemv_routed(gu, L["w_dn"], logits, K, L["scale"], t_dn, pdl=pdl, glu=True)
        return m, moe.fused_moe(ys[1], L["e_gu"], L["e_dn"], rw, ridx, path="gather", pdl=pdl)

    def fused_ffn(L, ys, pdl, given=None):
        h_d, act, rw, ridx = moe_ffn_gate_up(ys[0], ys[1], ys[2], L["w_gu"], L["e_gu"], K, L["scale"], pdl=pdl,
                                             routing=given)  # fmt: skip
        return moe_ffn_down(h_d, act, rw, ridx, L["w_dn"], L["e_dn"], pdl=pdl)

    x0 = sw3(layers[0], False)
    xs = [x0[0], x0[1], fixed["logits"]]
    h_d, act, rw, ridx = moe_ffn_gate_up(*xs, layers[0]["w_gu"], layers[0]["e_gu"], K, layers[0]["scale"])
    idx, topw = routing[1].reshape(-1).contiguous(), routing[0].reshape(-1).contiguous()
    t_ggu = moe._gather_tiles(moe.gather_gate_up_defaults(K), None, I_E, H)
    t_gdn = moe._gather_tiles(moe.GATHER_DOWN_TILES, None, H, I_E)

    def pair_routed(L, pdl):
        gu, logits = gemv_pair(x0[0], L["w_gu"], x0[2], L["w_r"], t_gu, pdl=pdl)
        return gemv_routed(gu, L["w_dn"], logits, K, L["scale"], t_dn, pdl=pdl, glu=True)

    arms = {
        "separate": lambda L, p: sw_post(L, *separate_ffn(L, sw3(L, p), p), p),
        "fused": lambda L, p: sw_post(L, *fused_ffn(L, swr(L, p), p), p),
        "fused_pre": lambda L, p: sw_post(L, *fused_ffn(L, swr(L, p), p, routing), p),
        "sw3": lambda L, p: sw3(L, p),
        "swr": lambda L, p: swr(L, p),
        "pair_routed": lambda L, p: pair_routed(L, p),
        "gather": lambda L, p: moe.fused_moe(xs[1], L["e_gu"], L["e_dn"], *routing, path="gather", pdl=p),
        "ffn_gu": lambda L, p: moe_ffn_gate_up(*xs, L["w_gu"], L["e_gu"], K, L["scale"], pdl=p),
        "ffn_gu_pre": lambda L, p: moe_ffn_gate_up(*xs, L["w_gu"], L["e_gu"], K, L["scale"], pdl=p, routing=routing),
        "ffn_dn": lambda L, p: moe_ffn_down(h_d, act, rw, ridx, L["w_dn"], L["e_dn"], pdl=p),
        **{f"ffn_gu_{n}x{k}w{w}": (lambda L, p, t=dict(BLOCK_N=n, BLOCK_K=k, num_warps=w): moe_ffn_gate_up(
            *xs, L["w_gu"], L["e_gu"], K, L["scale"], pdl=p, tiles=t)) for n, k, w in GU_TILES},
        **{f"ffn_dn_{n}x{k}w{w}": (lambda L, p, t=dict(BLOCK_N=n, BLOCK_K=k, num_warps=w): moe_ffn_down(
            h_d, act, rw, ridx, L["w_dn"], L["e_dn"], pdl=p, tiles=t)) for n, k, w in DN_TILES},
        "gather_gu": lambda L, p: moe._gather_gate_up(xs[1], L["e_gu"], idx, topw, K, t_ggu, p),
        "gather_dn": lambda L, p: moe._gather_down(act, L["e_dn"], idx, topw, K, t_gdn, torch.bfloat16, p),
    }  # fmt: skip
    graphs = {}
    for name, fn in arms.items():
        for pdl in (True, False) if name in ("separate", "fused") else (True,):

            def chain(fn=fn, pdl=pdl):
                for i in range(LINKS):
                    fn(layers[i % LAYERS], pdl)

            chain()
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                chain()
            graphs[(name, pdl)] = g
    times = {k: [] for k in graphs}
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(REPLAYS):
        for k, g in graphs.items():
            start.record()
            g.replay()
            stop.record()
            stop.synchronize()
            times[k].append(start.elapsed_time(stop) * 1e3 / LINKS)
    for (name, pdl), ts in times.items():
        print(json.dumps({"arm": name, "pdl": pdl, "us_per_link": round(statistics.median(ts), 3)}), flush=True)


if __name__ == "__main__":
    main()
