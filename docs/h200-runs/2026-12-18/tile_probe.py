"""12-18: tiles of the W4A16 tensor-core gemv where the default falls short. (a) 5376 x 8192 at M = 1 (the 31B's
sliding-layer o_proj, #10's one shape under 60 % of the PDL load-only chain: 54.3 % on 12-17): K step, stages,
splits, and 128-row tiles on 8 warps. (b) 2816 x 2112 at M 2-16 (the 26B-A4B's dense down, on the dot path because
2112 is not a multiple of the 256-wide step): 64-wide steps, which divide it, against the dot path.
Chained with PDL over distinct weights (20 launches per CUDA graph), the repacked words where ``w4a16_words=auto``
repacks (the one-wave shapes), the splits summed in the launch.

Run: python3 tile_probe.py > out.jsonl
"""

import json

import torch

import perfkit.kernels.w4a16_gemm as W
from perfkit.kernels.launch import sm_count
from perfkit.kernels.stream import CHAIN_CALLS, CHAIN_REPLAYS, stream_chain_us
from perfkit.kernels.timing import graph_sequence_us


def tile(bk, st, split=None, bn=64, nw=4):
    return W.W4A16Config(block_m=1, block_n=bn, block_k=bk, num_warps=nw, num_stages=st, split_k=split, tc=True)


CASES = (
    (
        (5376, 8192),
        (1,),
        [None]
        + [tile(256, 3, s) for s in (4, 5, 8)]
        + [tile(256, 4, s) for s in (None, 4)]
        + [tile(256, 2)]
        + [tile(128, 3, s) for s in (None, 8, 12)]
        + [tile(128, 4, s) for s in (8, 12)]
        + [tile(128, 6, 12), tile(256, 3, 6, 128, 8), tile(256, 3, 12, 128, 8)],
    ),
    ((5376, 16384), (1,), [None, tile(128, 4, 12), tile(256, 4)]),
    ((2816, 2112), (1, 2, 4, 16), ["dot", None, tile(64, 3), tile(64, 4), tile(64, 6), tile(128, 3)]),
)


def main() -> None:
    dev = torch.device("cuda")
    for (N, K), ms, cfgs in CASES:
        packed, scale, gs, _, gen = W._bench_weights(N, K, torch.bfloat16, 0, "cuda")
        weights = W._chain_weights(N, K, (packed, scale, gs), torch.bfloat16, "cuda")
        rp_on = W.repack_pays(N, K, dev)
        words = {w[0].data_ptr(): (W.repack_words(w[0]) if rp_on else w[0]) for w in weights}
        counters = {w[0].data_ptr(): W.new_split_counter(N, dev) for w in weights}
        stream = stream_chain_us(int(W.w4a16_gemm_traffic(1, N, K, 2)["total_bytes"]), "cuda", pdl=True)
        for M in ms:
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16, generator=gen)
            ref = W.w4a16_gemm_ref(x, packed, scale, gs, out_dtype=torch.float32)
            for cfg in cfgs:
                row = {"N": N, "K": K, "M": M, "repacked": rp_on, "stream_pdl_us": round(stream["stream_chain_us"], 2)}
                if cfg == "dot":
                    row["config"] = "dot"

                    def fn(w, x=x):
                        return W.w4a16_gemm(x, *w, path="dot")
                else:
                    c = cfg or W.pick_config(M, "gemv", x.dtype, N, sm_count(dev), K, True)
                    row["config"] = {"bk": c.block_k, "st": c.num_stages, "split": c.split_k, "bn": c.block_n,
                                     "nw": c.num_warps, "tc": c.tc, "default": cfg is None}  # fmt: skip
                    if c.tc:
                        row["splits_run"] = W.tc_split(N, K, W._fit(c, "gemv", M, N, K), sm_count(dev))

                    def fn(w, x=x, c=c, words=words, counters=counters, rp_on=rp_on):
                        return W.w4a16_gemm(x, words[w[0].data_ptr()], *w[1:], config=c, path="gemv", pdl=True,
                                            split_counter=counters[w[0].data_ptr()], repacked=rp_on)  # fmt: skip

                try:
                    out = fn(weights[0]).float()
                    row["rel_err"] = float(f"{((out - ref).abs().max() / ref.abs().max()).item():.3g}")
                    row["us"] = round(
                        min(graph_sequence_us(fn, weights, CHAIN_CALLS, CHAIN_REPLAYS) for _ in range(2)), 2
                    )
                    row["pct"] = round(100 * row["stream_pdl_us"] / row["us"], 1)
                except Exception as exc:  # a tile that does not compile: recorded
                    row["error"] = f"{type(exc).__name__}: {exc}"[:300]
                print(json.dumps(row), flush=True)
        row = {"N": N, "K": K, "counts_zero": all(int(c.abs().sum()) == 0 for c in counters.values())}
        print(json.dumps(row), flush=True)
        del weights, words, counters, packed, scale, gs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
