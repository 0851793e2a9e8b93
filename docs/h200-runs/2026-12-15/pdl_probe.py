"""12-15: the W4A16 tensor-core gemv launched with PDL, chained (us per launch, CUDA graph of 20 launches over
distinct weights), against the load-only chain launched the same way.

Arms per shape: plain launches (the 12-14 default); PDL with 0 / 2 / 4 / 8 steps of each program's weight asked
into L2 before its wait (``GEMV_TC_PDL_PREFETCH`` of commit 6652313, run in call 1; the prefetch was then removed,
and at later commits only the PDL arm without it runs); the load-only chain plain and with PDL (its reads after the
wait). Then the engine's pattern, an rmsnorm before each gemv ([rmsnorm, gemv] links, both PDL or both plain).
Every arm's output is checked equal to the plain launch's (bit for bit: same kernel, same split order).

Run: python3 pdl_probe.py [--shapes N,K ...] > out.jsonl
"""

import argparse
import json

import torch

import perfkit.kernels.w4a16_gemm as W
from perfkit.kernels.rmsnorm import rmsnorm
from perfkit.kernels.stream import CHAIN_CALLS, CHAIN_REPLAYS, stream_chain_us
from perfkit.kernels.timing import graph_sequence_us

SHAPES = ((5376, 21504), (43008, 5376), (16384, 5376), (5376, 16384), (5376, 8192), (18432, 5376))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=[f"{n},{k}" for n, k in SHAPES])
    ap.add_argument("--prefetch", type=int, nargs="*", default=[0, 2, 4, 8])
    args = ap.parse_args()
    dev = torch.device("cuda")
    for nk in args.shapes:
        N, K = (int(v) for v in nk.split(","))
        packed, scale, gs, _, gen = W._bench_weights(N, K, torch.bfloat16, 0, "cuda")
        weights = W._chain_weights(N, K, (packed, scale, gs), torch.bfloat16, "cuda")
        counters = {w[0].data_ptr(): W.new_split_counter(N, dev) for w in weights}
        x = torch.randn(1, K, device=dev, dtype=torch.bfloat16, generator=gen)
        nw = torch.randn(K, device=dev, dtype=torch.bfloat16, generator=gen)
        nbytes = int(W.w4a16_gemm_traffic(1, N, K, 2)["total_bytes"])
        row = {"N": N, "K": K, "split": W.tc_split(N, K, W.GEMV_TC_CONFIG, torch.cuda.get_device_properties(0).multi_processor_count)[0]}
        row["stream_us"] = round(stream_chain_us(nbytes, "cuda")["stream_chain_us"], 2)
        row["stream_pdl_us"] = round(stream_chain_us(nbytes, "cuda", pdl=True)["stream_chain_us"], 2)

        def gemv(w, pdl, xin=x, counters=counters):
            return W.w4a16_gemm(xin, *w, split_counter=counters[w[0].data_ptr()], pdl=pdl)

        ref = gemv(weights[0], False)
        row["plain_us"] = round(graph_sequence_us(lambda w: gemv(w, False), weights, CHAIN_CALLS, CHAIN_REPLAYS), 2)
        keep = getattr(W, "GEMV_TC_PDL_PREFETCH", 0)
        for pf in args.prefetch if hasattr(W, "GEMV_TC_PDL_PREFETCH") else [0]:
            W.GEMV_TC_PDL_PREFETCH = pf
            row[f"pdl_pf{pf}_us"] = round(graph_sequence_us(lambda w: gemv(w, True), weights, CHAIN_CALLS, CHAIN_REPLAYS), 2)
            row[f"pdl_pf{pf}_equal"] = bool(torch.equal(gemv(weights[0], True), ref))
        if hasattr(W, "GEMV_TC_PDL_PREFETCH"):
            W.GEMV_TC_PDL_PREFETCH = keep
        for pdl in (False, True):
            row[f"norm_link_{'pdl' if pdl else 'plain'}_us"] = round(graph_sequence_us(
                lambda w, pdl=pdl, x=x, nw=nw: gemv(w, pdl, rmsnorm(x, nw, 1e-6, pdl=pdl)), weights, CHAIN_CALLS,
                CHAIN_REPLAYS), 2)
        row["counts_zero"] = all(int(c.abs().sum()) == 0 for c in counters.values())
        row["pct_plain"] = round(100 * row["stream_us"] / row["plain_us"], 1)
        row[f"pct_pdl_pf{keep}"] = round(100 * row["stream_us"] / row[f"pdl_pf{keep}_us"], 1)
        row[f"pct_pdl_pf{keep}_vs_stream_pdl"] = round(100 * row["stream_pdl_us"] / row[f"pdl_pf{keep}_us"], 1)
        print(json.dumps(row), flush=True)
        del weights, counters, packed, scale, gs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
