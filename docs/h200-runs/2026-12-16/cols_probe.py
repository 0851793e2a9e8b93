"""12-16: the W4A16 tensor-core gemv with the block scales applied after the MMA (``TC_GROUP_COLS``: x in one MMA
column per block-scale group, the decoded codes as the A operand unscaled) against the 12-15 form (each decoded pair
times its scale before the MMA), chained (us per launch, CUDA graph of 20 launches over distinct weights) next to
the load-only chain, plain and with PDL. Each arm's error against the fp64 product of the dequantised weight, and
whether a repeat is bit-identical.

Run: python3 cols_probe.py [--shapes N,K ...] > out.jsonl
"""

import argparse
import json

import torch

import perfkit.kernels.w4a16_gemm as W
from perfkit.kernels.stream import CHAIN_CALLS, CHAIN_REPLAYS, stream_chain_us
from perfkit.kernels.timing import graph_sequence_us

SHAPES = ((5376, 21504), (43008, 5376), (16384, 5376), (5376, 16384), (5376, 8192), (18432, 5376))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=[f"{n},{k}" for n, k in SHAPES])
    args = ap.parse_args()
    dev = torch.device("cuda")
    for nk in args.shapes:
        N, K = (int(v) for v in nk.split(","))
        packed, scale, gs, _, gen = W._bench_weights(N, K, torch.bfloat16, 0, "cuda")
        weights = W._chain_weights(N, K, (packed, scale, gs), torch.bfloat16, "cuda")
        counters = {w[0].data_ptr(): W.new_split_counter(N, dev) for w in weights}
        x = torch.randn(1, K, device=dev, dtype=torch.bfloat16, generator=gen)
        ref = (x.double() @ W.dequantize_nvfp4(packed, scale, 1.0).double().T) * gs.double()
        nbytes = int(W.w4a16_gemm_traffic(1, N, K, 2)["total_bytes"])
        row = {"N": N, "K": K}
        row["stream_us"] = round(stream_chain_us(nbytes, "cuda")["stream_chain_us"], 2)
        row["stream_pdl_us"] = round(stream_chain_us(nbytes, "cuda", pdl=True)["stream_chain_us"], 2)

        def gemv(w, pdl, x=x, counters=counters):
            return W.w4a16_gemm(x, *w, split_counter=counters[w[0].data_ptr()], pdl=pdl, out_dtype=torch.float32)

        for cols in (False, True):
            W.TC_GROUP_COLS = cols
            tag = "cols" if cols else "pre"
            out = gemv(weights[0], True)
            row[f"{tag}_rel_err"] = float(((out.double() - ref).norm() / ref.norm()).item())
            row[f"{tag}_repeat_equal"] = bool(torch.equal(out, gemv(weights[0], True)))
            for pdl in (False, True):
                us = graph_sequence_us(lambda w, pdl=pdl: gemv(w, pdl), weights, CHAIN_CALLS, CHAIN_REPLAYS)
                row[f"{tag}_{'pdl' if pdl else 'plain'}_us"] = round(us, 2)
        W.TC_GROUP_COLS = True
        row["counts_zero"] = all(int(c.abs().sum()) == 0 for c in counters.values())
        for tag in ("pre", "cols"):
            row[f"{tag}_pct_plain"] = round(100 * row["stream_us"] / row[f"{tag}_plain_us"], 1)
            row[f"{tag}_pct_pdl"] = round(100 * row["stream_pdl_us"] / row[f"{tag}_pdl_us"], 1)
        print(json.dumps(row), flush=True)
        del weights, counters, packed, scale, gs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
