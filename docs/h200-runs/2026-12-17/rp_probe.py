"""12-17: the repacked NVFP4 word through the real tensor-core gemv (``w4a16_gemm(..., repacked=True)``, branch
``nvfp4-repack``), against the standard word, chained like the engine's decode step (CUDA graph of 20 launches over
distinct weights, PDL on), and the launches ncu profiles (``ncu`` mode) to find why the repacked form loses ~1 us
on the 31B shapes whose grid is more than one wave of programs (12-16 calls 7-9).

Run: python3 rp_probe.py bench [--shapes N,K ...] > out.jsonl; python3 rp_probe.py ncu N K (3 standard launches,
then 3 repacked ones, each on its own weight copy, for ``ncu --launch-skip 2 --launch-count 4``)
"""

import argparse
import json

import torch

import perfkit.kernels.w4a16_gemm as W
from perfkit.kernels.launch import sm_count

SHAPES = ((5376, 8192), (5376, 16384), (5376, 21504), (16384, 5376), (43008, 5376), (18432, 5376))


def _grid(N: int, K: int, dev: torch.device) -> dict:
    cfg = W.GEMV_TC_CONFIG
    split = W.tc_split(N, K, cfg, sm_count(dev))
    blocks = -(-N // cfg.block_n)
    return {"blocks": blocks, "split": split, "programs": blocks * split}


def bench(shapes: list[str]) -> None:
    from perfkit.kernels.stream import CHAIN_CALLS, CHAIN_REPLAYS, stream_chain_us
    from perfkit.kernels.timing import graph_sequence_us

    dev = torch.device("cuda")
    for nk in shapes:
        N, K = (int(v) for v in nk.split(","))
        packed, scale, gs, _, gen = W._bench_weights(N, K, torch.bfloat16, 0, "cuda")
        weights = W._chain_weights(N, K, (packed, scale, gs), torch.bfloat16, "cuda")
        rp = {w[0].data_ptr(): W.repack_words(w[0]) for w in weights}
        counters = {w[0].data_ptr(): W.new_split_counter(N, dev) for w in weights}
        x = torch.randn(1, K, device=dev, dtype=torch.bfloat16, generator=gen)
        nbytes = int(W.w4a16_gemm_traffic(1, N, K, 2)["total_bytes"])
        row = {"N": N, "K": K, **_grid(N, K, dev)}
        row["stream_pdl_us"] = round(stream_chain_us(nbytes, "cuda", pdl=True)["stream_chain_us"], 2)

        def std(w, x=x, counters=counters):
            return W.w4a16_gemm(x, *w, split_counter=counters[w[0].data_ptr()], pdl=True)

        def new(w, x=x, counters=counters, rp=rp):
            return W.w4a16_gemm(x, rp[w[0].data_ptr()], *w[1:], split_counter=counters[w[0].data_ptr()], pdl=True,
                                repacked=True)  # fmt: skip

        row["bit_identical"] = bool(torch.equal(std(weights[0]), new(weights[0])))
        for rep in range(2):
            for tag, fn in (("std", std), ("repack", new)):
                row[f"{tag}_us_{rep}"] = round(graph_sequence_us(fn, weights, CHAIN_CALLS, CHAIN_REPLAYS), 2)
        for tag in ("std", "repack"):
            row[f"{tag}_pct"] = round(100 * row["stream_pdl_us"] / min(row[f"{tag}_us_0"], row[f"{tag}_us_1"]), 1)
        row["counts_zero"] = all(int(c.abs().sum()) == 0 for c in counters.values())
        print(json.dumps(row), flush=True)
        del weights, counters, rp, packed, scale, gs
        torch.cuda.empty_cache()


def rows(shapes: list[str], ms: list[int]) -> None:
    """Call 3: M > 1 (the dot path: the engine's c4 step was 1.5 % slower with the repacked words in call 2), both
    word orders chained, per shape and M."""
    from perfkit.kernels.stream import CHAIN_CALLS, CHAIN_REPLAYS
    from perfkit.kernels.timing import graph_sequence_us

    dev = torch.device("cuda")
    for nk in shapes:
        N, K = (int(v) for v in nk.split(","))
        packed, scale, gs, _, gen = W._bench_weights(N, K, torch.bfloat16, 0, "cuda")
        weights = W._chain_weights(N, K, (packed, scale, gs), torch.bfloat16, "cuda")
        rp = {w[0].data_ptr(): W.repack_words(w[0]) for w in weights}
        for M in ms:
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16, generator=gen)
            row = {"N": N, "K": K, "M": M, "path": W.pick_path(M)}

            def std(w, x=x):
                return W.w4a16_gemm(x, *w)

            def new(w, x=x, rp=rp):
                return W.w4a16_gemm(x, rp[w[0].data_ptr()], *w[1:], repacked=True)

            def dot(w, x=x):  # call 4: the path M 2-16 took before the tensor-core gemv's rows
                return W.w4a16_gemm(x, *w, path="dot")

            row["bit_identical"] = bool(torch.equal(std(weights[0]), new(weights[0])))
            row["tc"] = W.pick_config(M, "gemv", x.dtype, N, sm_count(dev), K, W.tensor_cores_for_gemv(dev)).tc
            for rep in range(2):
                for tag, fn in (("std", std), ("repack", new), ("dot", dot)):
                    row[f"{tag}_us_{rep}"] = round(graph_sequence_us(fn, weights, CHAIN_CALLS, CHAIN_REPLAYS), 2)
            print(json.dumps(row), flush=True)
        del weights, rp, packed, scale, gs
        torch.cuda.empty_cache()


def ncu(N: int, K: int) -> None:
    dev = torch.device("cuda")
    packed, scale, gs, _, gen = W._bench_weights(N, K, torch.bfloat16, 0, "cuda")
    x = torch.randn(1, K, device=dev, dtype=torch.bfloat16, generator=gen)
    counter = W.new_split_counter(N, dev)
    rp = W.repack_words(packed)
    print(json.dumps({"N": N, "K": K, **_grid(N, K, dev)}), flush=True)
    for words, repacked in ((packed, False), (rp, True)):
        for _ in range(3):
            W.w4a16_gemm(x, words, scale, gs, split_counter=counter, repacked=repacked)
    torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=("bench", "ncu", "rows"))
    ap.add_argument("nk", nargs="*")
    ap.add_argument("--shapes", nargs="*", default=[f"{n},{k}" for n, k in SHAPES])
    ap.add_argument("--ms", nargs="*", type=int, default=[2, 4, 8, 16])
    args = ap.parse_args()
    if args.mode == "bench":
        bench(args.shapes)
    elif args.mode == "rows":
        rows(args.shapes, args.ms)
    else:
        ncu(int(args.nk[0]), int(args.nk[1]))


if __name__ == "__main__":
    main()
