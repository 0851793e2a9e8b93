"""12-18: the FP8 weight-only tensor-core gemv (``fp8_gemv`` with ``GEMV_TC_CONFIG``: the W4A16 tc kernel on e4m3
words) against what FP8 linears ran before at M 1-16: the CUDA-core gemv at M = 1, W8A8 ``fp8_linear`` (per-token
x quantisation + ``torch._scaled_mm``) above; bf16 cuBLAS beside. Chained like the engine's decode step (a CUDA
graph of 20 launches over distinct weights; the gemvs with PDL) against the load-only chain of the FP8 bytes (PDL).

Checks per (shape, M): the tc result within 1e-5 relative of ``fp8_gemv_ref`` (fp32 out), each of its rows equal to
that row's M = 1 launch bit for bit, the split counters back at zero.

Run: python3 fp8_probe.py [--shapes N,K ...] [--ms 1 2 4 ...] [--bk 128 256] > out.jsonl
"""

import argparse
import dataclasses
import json

import torch

import perfkit.kernels.fp8_gemv as F
from perfkit.kernels.fp8 import fp8_linear
from perfkit.kernels.stream import CHAIN_CALLS, CHAIN_REPLAYS, chain_args, stream_chain_us
from perfkit.kernels.timing import graph_sequence_us
from perfkit.kernels.w4a16_gemm import new_split_counter

SHAPES = ("5376,21504", "43008,5376", "21504,5376", "16384,5376", "5376,16384", "5376,8192")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--ms", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    ap.add_argument("--bk", nargs="+", type=int, default=[128])
    ap.add_argument("--no-base", action="store_true", help="skip the bf16 / W8A8 / CUDA-core baselines")
    a = ap.parse_args()
    dev = torch.device("cuda")
    for nk in a.shapes:
        N, K = (int(v) for v in nk.split(","))
        q, s, wb = F._bench_weights(N, K, 0, "cuda")
        nbytes = int(F.fp8_gemv_traffic(1, N, K)["total_bytes"])
        weights = chain_args((q, s), lambda i, N=N, K=K: F._bench_weights(N, K, 1000 + i, "cuda")[:2], nbytes)
        counters = {w[0].data_ptr(): new_split_counter(N, dev) for w in weights}
        bfs = [wb] + [torch.randn(N, K, device=dev, dtype=torch.bfloat16) for _ in range(min(len(weights), 3) - 1)]
        stream = stream_chain_us(nbytes, "cuda", pdl=True)["stream_chain_us"]
        for M in a.ms:
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            row = {"N": N, "K": K, "M": M, "stream_pdl_us": round(stream, 2)}
            ref = F.fp8_gemv_ref(x, q, s, out_dtype=torch.float32)
            for bk in a.bk:
                cfg = dataclasses.replace(F.GEMV_TC_CONFIG, block_k=bk)
                c0 = counters[q.data_ptr()]
                out = F.fp8_gemv(x, q, s, config=cfg, split_counter=c0, out_dtype=torch.float32)
                err = ((out - ref).abs().max() / ref.abs().max()).item()
                rows = torch.cat(
                    [F.fp8_gemv(x[i : i + 1], q, s, config=cfg, out_dtype=torch.float32) for i in range(M)]
                )
                row[f"tc{bk}_rel_err"] = float(f"{err:.3g}")
                row[f"tc{bk}_rows_equal"] = bool(torch.equal(out, rows))

                def tc(w, x=x, cfg=cfg, counters=counters):
                    return F.fp8_gemv(x, *w, config=cfg, pdl=True, split_counter=counters[w[0].data_ptr()])

                us = min(graph_sequence_us(tc, weights, CHAIN_CALLS, CHAIN_REPLAYS) for _ in range(2))
                row[f"tc{bk}_us"] = round(us, 2)
                row[f"tc{bk}_pct"] = round(100 * stream / us, 1)
            row["counts_zero"] = all(int(c.abs().sum()) == 0 for c in counters.values())
            if not a.no_base:
                if M == 1:
                    row["gemv_us"] = round(graph_sequence_us(
                        lambda w, x=x: F.fp8_gemv(x, *w, config=F.GEMV_CONFIG, pdl=True), weights, CHAIN_CALLS,
                        CHAIN_REPLAYS), 2)  # fmt: skip
                else:
                    row["w8a8_us"] = round(graph_sequence_us(
                        lambda w, x=x: fp8_linear(x, *w), weights, CHAIN_CALLS, CHAIN_REPLAYS), 2)  # fmt: skip
                row["bf16_us"] = round(graph_sequence_us(
                    lambda w, x=x: x @ w.T, bfs, CHAIN_CALLS, CHAIN_REPLAYS), 2)  # fmt: skip
            print(json.dumps(row), flush=True)
        del weights, counters, bfs, q, s, wb
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
