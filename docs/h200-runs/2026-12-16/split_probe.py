"""12-16: the W4A16 tensor-core gemv with balanced splits (``TC_BALANCED_SPLITS``: split i of s takes steps
[i * steps // s, (i + 1) * steps // s), so no split is left short) against the 12-15 uniform splits (each
ceil(steps / s) steps, the last split short: 5376 x 8192 at 6 splits ran 6, 6, 6, 6, 6, 2 steps), chained (us per
launch, CUDA graph of 20 launches over distinct weights, PDL as in the engine) next to the load-only chain with PDL.
The default split count of each shape, and for the 84-row-block shapes other counts forced (``split_k``). Every arm's
output against the default arm's (equal within the fp32 sum-order bound) and repeat-identical.

Run: python3 split_probe.py [--shapes N,K ...] > out.jsonl
"""

import argparse
import dataclasses
import json

import torch

import perfkit.kernels.w4a16_gemm as W
from perfkit.kernels.stream import CHAIN_CALLS, CHAIN_REPLAYS, stream_chain_us
from perfkit.kernels.timing import graph_sequence_us

SHAPES = ((5376, 8192), (5376, 16384), (5376, 21504), (43008, 5376), (16384, 5376), (18432, 5376))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=[f"{n},{k}" for n, k in SHAPES])
    args = ap.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for nk in args.shapes:
        N, K = (int(v) for v in nk.split(","))
        packed, scale, gs, _, gen = W._bench_weights(N, K, torch.bfloat16, 0, "cuda")
        weights = W._chain_weights(N, K, (packed, scale, gs), torch.bfloat16, "cuda")
        counters = {w[0].data_ptr(): W.new_split_counter(N, dev) for w in weights}
        x = torch.randn(1, K, device=dev, dtype=torch.bfloat16, generator=gen)
        nbytes = int(W.w4a16_gemm_traffic(1, N, K, 2)["total_bytes"])
        row = {"N": N, "K": K, "stream_pdl_us": round(stream_chain_us(nbytes, "cuda", pdl=True)["stream_chain_us"], 2)}
        row["default_split"] = W.tc_split(N, K, W.GEMV_TC_CONFIG, sms)[0]
        row["default_split_bal"] = W.tc_split(N, K, W.GEMV_TC_CONFIG, sms, True)[0]
        forced = (None, 5, 6, 7, 8) if N == 5376 else (None,)
        ref = None
        for bal in (False, True):
            W.TC_BALANCED_SPLITS = bal
            for sk in forced:
                if sk is not None and not bal and sk != 7:
                    continue
                cfg = dataclasses.replace(W.GEMV_TC_CONFIG, split_k=sk)
                tag = f"{'bal' if bal else 'uni'}_{sk or 'default'}"

                def gemv(w, cfg=cfg, x=x, counters=counters):
                    return W.w4a16_gemm(x, *w, config=cfg, split_counter=counters[w[0].data_ptr()], pdl=True,
                                        out_dtype=torch.float32)

                out = gemv(weights[0])
                ref = out if ref is None else ref
                row[f"{tag}_ok"] = bool(torch.equal(out, gemv(weights[0]))) and bool(
                    torch.allclose(out, ref, rtol=1e-4, atol=1e-3 * float(ref.abs().max())))
                us = graph_sequence_us(gemv, weights, CHAIN_CALLS, CHAIN_REPLAYS)
                row[f"{tag}_us"] = round(us, 2)
                row[f"{tag}_pct"] = round(100 * row["stream_pdl_us"] / us, 1)
        W.TC_BALANCED_SPLITS = True
        row["counts_zero"] = all(int(c.abs().sum()) == 0 for c in counters.values())
        print(json.dumps(row), flush=True)
        del weights, counters, packed, scale, gs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
