"""#10 (12-14): the tensor-core gemv's split count per shape, the package kernel (``GEMV_TC_CONFIG`` with
``split_k``; splits summed in the same launch), chained over distinct weights as ``bench_w4a16``'s ``chain_us``.

Why: call 4 (``4-tc.jsonl``) found no programs-per-SM target best everywhere (p6 for 5376 x 21504, p4 for
5376 x 16384 / 8192): with 4 resident programs per SM (127 registers), the grid's waves and their tail may be
what matters. Candidates per shape: one full wave (floor(4 * SMs / row blocks)), its neighbours, two waves."""

import json

import torch
import triton

from perfkit.kernels import w4a16_gemm as W
from perfkit.kernels.stream import CHAIN_CALLS, CHAIN_REPLAYS, chain_copies, stream_chain_us
from perfkit.kernels.timing import graph_sequence_us

SHAPES = ((5376, 21504), (43008, 5376), (16384, 5376), (5376, 16384), (5376, 8192), (8192, 5376), (5376, 4096),
          (4224, 2816), (18432, 5376))  # fmt: skip

if __name__ == "__main__":
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for N, K in SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(0)
        nbytes = W.w4a16_gemm_traffic(1, N, K)["weight_bytes"]
        ws = [W.quantize_nvfp4(torch.randn(N, K, device="cuda", generator=gen) * 0.02)
              for _ in range(chain_copies(nbytes, 12))]  # fmt: skip
        x = (torch.randn(1, K, device="cuda", generator=gen) * 0.5).to(torch.bfloat16)
        counts = [torch.zeros(W.split_counter_size(N), dtype=torch.int32, device="cuda") for _ in ws]
        args = list(zip(ws, counts, strict=True))
        blocks = triton.cdiv(N, 64)
        steps = triton.cdiv(K, 256)
        w1 = max(1, 4 * sms // blocks)
        row = {"N": N, "K": K, "blocks": blocks, "steps": steps, "one_wave": w1,
               "stream_chain_us": round(stream_chain_us(nbytes)["stream_chain_us"], 2),
               "wide_us": round(graph_sequence_us(lambda a, x=x, c=W.pick_config(1, "gemv", torch.bfloat16, N, sms):
                                                  W.w4a16_gemm(x, *a[0], config=c), args, CHAIN_CALLS, CHAIN_REPLAYS),
                                2)}  # fmt: skip
        for split in sorted({max(1, w1 - 1), w1, w1 + 1, 2 * w1 - 1, 2 * w1, 3 * w1}):
            cfg = W.W4A16Config(1, 64, 256, num_warps=4, num_stages=3, split_k=split, tc=True)
            real = W.tc_split(N, K, cfg, sms)[0]

            def f(a, cfg=cfg, x=x):
                return W.w4a16_gemm(x, *a[0], config=cfg, path="gemv", split_counter=a[1])

            row[f"split{real}"] = round(graph_sequence_us(f, args, CHAIN_CALLS, CHAIN_REPLAYS), 2)
        print(json.dumps(row), flush=True)
        del ws, args
        torch.cuda.empty_cache()
