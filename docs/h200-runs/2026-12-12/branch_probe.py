"""Can the dense MLP and the routed experts of a 26B-A4B MoE layer stream side by side? (12-12 call 3)

Calls 1-2 put each batch-1 weight-streaming kernel at the back-to-back stream ceiling of its size: ~2.4 us of ramp
and tail per launch plus the bytes at ~4.5 TB/s (1-stream.jsonl), and neither a burst tile nor a register-lean form
goes below it. What is left is fewer launches in a row: the two branches of the FFN block (dense gate_up -> down;
routing -> experts' gate_up -> down) need nothing from each other, so in a CUDA graph they can be two branches
whose kernels overlap (a fork after the attention sandwich, a join before the post-FFN sandwich), each branch
keeping PDL between its own kernels. The fused kernels of 12-11 (decode_moe_ffn) merged the branches into one
launch per stage and lost; here each kernel stays what it is.

Arms (CUDA graphs of LINKS links over LAYERS weight sets, batch 1, bf16, us per link, median of REPLAYS):
  separate   sw3 -> gemv_pair(gate_up + router) -> gemv_routed(GLU down + routing) -> gather gate_up -> gather down
             -> post sandwich                                   (the engine's path today)
  branch     swr (sandwich + router) -> fork: [side] gemv gate_up -> GLU down; [main] moe_routing -> gather
             gate_up -> gather down; join -> post sandwich
  branch_r   as branch, the experts on the side stream and the dense MLP on the main one
  serial_r   swr -> gemv gate_up -> GLU down -> moe_routing -> gather gate_up -> gather down -> post (branch's
             kernels on one stream: what the fork itself buys)
Each arm with PDL on (the kernel after a fork or a join waits by the graph's edge) and off. The branch arm's
outputs (dense and experts) are compared with the separate arm's.
Run on the device: python3 docs/h200-runs/2026-12-12/branch_probe.py > $OUT/branch.jsonl
"""

import json
import statistics

import torch

from perfkit.kernels import moe
from perfkit.kernels.gemv import default_tile, gemv, gemv_pair, gemv_routed
from perfkit.kernels.rmsnorm import sandwich_rmsnorm

H, I_D, E, I_E, K = 2816, 2112, 128, 704, 8
LAYERS, LINKS, REPLAYS = 8, 32, 20


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
    a = torch.randn(1, H, device="cuda", generator=gen).to(torch.bfloat16)
    res = torch.randn(1, H, device="cuda", generator=gen).to(torch.bfloat16)
    scalar = torch.ones(1, device="cuda", dtype=torch.bfloat16)
    t_gu, t_dn, root = default_tile(2 * I_D, H), default_tile(H, I_D), H**-0.5
    side = torch.cuda.Stream()

    def sw3(L, pdl):
        n = L["norms"]
        return sandwich_rmsnorm(a, res, n[0], 1e-6, next_weights=n[1:4], next_mults=[1.0, 1.0, root], pdl=pdl)[1]

    def swr(L, pdl):
        n = L["norms"]
        return sandwich_rmsnorm(a, res, n[0], 1e-6, next_weights=n[1:3], router=(L["w_r"], n[3], root), pdl=pdl)[1]

    def sw_post(L, m, e, pdl):
        n = L["norms"]
        return sandwich_rmsnorm(m, res, n[4], 1e-6, x2=(e, n[5], n[6]), scalar=scalar, next_weights=[n[1]], pdl=pdl)

    def separate(L, pdl):
        ys = sw3(L, pdl)
        gu, logits = gemv_pair(ys[0], L["w_gu"], ys[2], L["w_r"], t_gu, pdl=pdl)
        m, rw, ridx = gemv_routed(gu, L["w_dn"], logits, K, L["scale"], t_dn, pdl=pdl, glu=True)
        e = moe.fused_moe(ys[1], L["e_gu"], L["e_dn"], rw, ridx, path="gather", pdl=pdl)
        return sw_post(L, m, e, pdl), m, e

    def dense(L, y, pdl):
        return gemv(gemv(y, L["w_gu"], t_gu, pdl=pdl), L["w_dn"], t_dn, pdl=pdl, glu=True)

    def experts(L, y, logits, pdl):
        rw, ridx = moe.moe_routing(logits, K, L["scale"], pdl=pdl)
        return moe.fused_moe(y, L["e_gu"], L["e_dn"], rw, ridx, path="gather", pdl=pdl)

    def branch(L, pdl, experts_on_side=False):
        ys = swr(L, pdl)
        main_s = torch.cuda.current_stream()
        side.wait_stream(main_s)
        with torch.cuda.stream(side):
            side_out = experts(L, ys[1], ys[2], pdl) if experts_on_side else dense(L, ys[0], pdl)
        main_out = dense(L, ys[0], pdl) if experts_on_side else experts(L, ys[1], ys[2], pdl)
        main_s.wait_stream(side)
        m, e = (main_out, side_out) if experts_on_side else (side_out, main_out)
        return sw_post(L, m, e, pdl), m, e

    def serial_r(L, pdl):
        ys = swr(L, pdl)
        m = dense(L, ys[0], pdl)
        e = experts(L, ys[1], ys[2], pdl)
        return sw_post(L, m, e, pdl), m, e

    arms = {"separate": separate, "branch": branch, "branch_r": lambda L, p: branch(L, p, True), "serial_r": serial_r}
    _, m0, e0 = separate(layers[0], False)
    for name in ("branch", "branch_r", "serial_r"):
        _, m1, e1 = arms[name](layers[0], False)
        torch.cuda.synchronize()
        print(json.dumps({"check": name, "dense_max_abs": (m1.float() - m0.float()).abs().max().item(),
                          "experts_max_abs": (e1.float() - e0.float()).abs().max().item(),
                          "dense_scale": m0.float().abs().max().item()}), flush=True)  # fmt: skip
    graphs = {}
    for name, fn in arms.items():
        for pdl in (True, False):
            def chain(fn=fn, pdl=pdl):
                for i in range(LINKS):
                    fn(layers[i % LAYERS], pdl)

            try:
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    chain()
                torch.cuda.current_stream().wait_stream(s)
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    chain()
                graphs[(name, pdl)] = g
            except Exception as exc:
                print(json.dumps({"arm": name, "pdl": pdl, "error": f"{type(exc).__name__}: {exc}"[:400]}), flush=True)
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
        print(json.dumps({"arm": name, "pdl": pdl, "us_per_link": round(statistics.median(ts), 3),
                          "min": round(min(ts), 3)}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
