"""12-18: the tensor-core gemv beyond 16 rows of x (one program per 16-row group, the groups of a row block side by
side in the grid), W4A16 against the dot path and FP8 against W8A8 ``fp8_linear``, at M 32 and 64, chained like the
decode step (20 launches per CUDA graph over distinct weights; the gemvs with PDL and their split counters).

Run: python3 groups_probe.py > out.jsonl
"""

import json

import torch

import perfkit.kernels.fp8_gemv as F
import perfkit.kernels.w4a16_gemm as W
from perfkit.kernels.fp8 import fp8_linear
from perfkit.kernels.stream import CHAIN_CALLS, CHAIN_REPLAYS, chain_args
from perfkit.kernels.timing import graph_sequence_us

SHAPES = ((5376, 21504), (43008, 5376), (5376, 8192))


def us(fn, args):
    return round(graph_sequence_us(fn, args, CHAIN_CALLS, CHAIN_REPLAYS), 2)


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
        for M in (32, 64):
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16, generator=gen)
            row = {"N": N, "K": K, "M": M}
            ref4 = W.w4a16_gemm_ref(x, packed, scale, gs, out_dtype=torch.float32)
            o4 = W.w4a16_gemm(x, packed, scale, gs, out_dtype=torch.float32, split_counter=c4[packed.data_ptr()])
            row["w4_err"] = float(f"{((o4 - ref4).abs().max() / ref4.abs().max()).item():.3g}")
            row["w4_tc_us"] = us(
                lambda w, x=x, c4=c4: W.w4a16_gemm(x, *w, pdl=True, split_counter=c4[w[0].data_ptr()]), w4
            )
            row["w4_dot_us"] = us(lambda w, x=x: W.w4a16_gemm(x, *w, path="dot"), w4)
            ref8 = F.fp8_gemv_ref(x, q, s, out_dtype=torch.float32)
            o8 = F.fp8_gemv(x, q, s, out_dtype=torch.float32, split_counter=c8[q.data_ptr()])
            row["f8_err"] = float(f"{((o8 - ref8).abs().max() / ref8.abs().max()).item():.3g}")
            row["f8_tc_us"] = us(
                lambda w, x=x, c8=c8: F.fp8_gemv(x, *w, pdl=True, split_counter=c8[w[0].data_ptr()]), w8
            )
            row["f8_w8a8_us"] = us(lambda w, x=x: fp8_linear(x, *w), w8)
            row["counts_zero"] = all(int(c.abs().sum()) == 0 for c in (*c4.values(), *c8.values()))
            print(json.dumps(row), flush=True)
        del w4, c4, w8, c8, packed, scale, gs, q, s
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
