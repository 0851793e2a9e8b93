"""12-19: the tensor-core gemv with 32 rows of x per program (``tc_cols = 32``: the weight tile decoded once for 32
MMA columns) against 16-row groups of programs (each decodes the tile), the dot path (W4A16) and W8A8
``fp8_linear`` (FP8), at M 17-64 on three 31B shapes, chained like the decode step (20 launches per CUDA graph over
distinct weights; the gemvs with PDL and their split counters).

Run: python3 cols_probe.py > out.jsonl
"""

import dataclasses
import json

import torch

import perfkit.kernels.fp8_gemv as F
import perfkit.kernels.w4a16_gemm as W
from perfkit.kernels.fp8 import fp8_linear
from perfkit.kernels.stream import CHAIN_CALLS, CHAIN_REPLAYS, chain_args
from perfkit.kernels.timing import graph_sequence_us

SHAPES = ((5376, 21504), (43008, 5376), (5376, 8192))
ROWS = (17, 32, 48, 64)
W4 = {
    "g16": W.GEMV_TC_CONFIG,
    "c32k128": dataclasses.replace(W.GEMV_TC_CONFIG, block_k=128, tc_cols=32),
    "c32k256": dataclasses.replace(W.GEMV_TC_CONFIG, tc_cols=32),
}
F8 = {
    "g16": F.GEMV_TC_ROWS_CONFIG,
    "c32k128": dataclasses.replace(F.GEMV_TC_ROWS_CONFIG, tc_cols=32),
    "c32k256": dataclasses.replace(F.GEMV_TC_CONFIG, tc_cols=32),
}


def us(fn, args):
    return round(graph_sequence_us(fn, args, CHAIN_CALLS, CHAIN_REPLAYS), 2)


def err(out, ref):
    return float(f"{((out - ref).abs().max() / ref.abs().max()).item():.3g}")


def main() -> None:
    dev = torch.device("cuda")
    for N, K in SHAPES:
        packed, scale, gs, _, gen = W._bench_weights(N, K, torch.bfloat16, 0, "cuda")
        w4 = W._chain_weights(N, K, (packed, scale, gs), torch.bfloat16, "cuda")
        c4 = {w[0].data_ptr(): W.new_split_counter(N, dev) for w in w4}
        q, s, _ = F._bench_weights(N, K, 0, "cuda")
        nbytes = int(F.fp8_gemv_traffic(1, N, K)["total_bytes"])
        w8 = chain_args((q, s), lambda i, N=N, K=K: F._bench_weights(N, K, 1000 + i, "cuda")[:2], nbytes)
        c8 = {w[0].data_ptr(): W.new_split_counter(N, dev) for w in w8}
        for M in ROWS:
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16, generator=gen)
            row = {"N": N, "K": K, "M": M}
            ref4 = W.w4a16_gemm_ref(x, packed, scale, gs, out_dtype=torch.float32)
            ref8 = F.fp8_gemv_ref(x, q, s, out_dtype=torch.float32)
            for name, cfg in W4.items():
                c = c4[packed.data_ptr()]
                o = W.w4a16_gemm(
                    x, packed, scale, gs, out_dtype=torch.float32, path="gemv", config=cfg, split_counter=c
                )
                row[f"w4_{name}_err"] = err(o, ref4)
                row[f"w4_{name}_us"] = us(
                    lambda w, x=x, c4=c4, cfg=cfg: W.w4a16_gemm(
                        x, *w, path="gemv", config=cfg, pdl=True, split_counter=c4[w[0].data_ptr()]
                    ),
                    w4,
                )
            row["w4_dot_us"] = us(lambda w, x=x: W.w4a16_gemm(x, *w, path="dot"), w4)
            for name, cfg in F8.items():
                o = F.fp8_gemv(x, q, s, config=cfg, out_dtype=torch.float32, split_counter=c8[q.data_ptr()])
                row[f"f8_{name}_err"] = err(o, ref8)
                row[f"f8_{name}_us"] = us(
                    lambda w, x=x, c8=c8, cfg=cfg: F.fp8_gemv(
                        x, *w, config=cfg, pdl=True, split_counter=c8[w[0].data_ptr()]
                    ),
                    w8,
                )
            row["f8_w8a8_us"] = us(lambda w, x=x: fp8_linear(x, *w), w8)
            row["counts_zero"] = all(int(c.abs().sum()) == 0 for c in (*c4.values(), *c8.values()))
            print(json.dumps(row), flush=True)
        del w4, c4, w8, c8, packed, scale, gs, q, s
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
