"""Does decode_gemv=auto's chain timing (gemv after gemv of one shape) rank the candidates as the step does? (12-08)

Why: two calls of one commit picked different 31B tiles at near-ties (gate_up 43008 x 5376: 4x512w2 108.79 vs
32x256w4 108.89 us; down 5376 x 21504: 8x1024w4e 59.39 vs cuBLAS 60.71) and their c1 TPOT differed by 0.39 ms
(16.46 vs 16.07, `1-` and `2-ab_decode_fusion.json`, equal clocks). In the step each gemv follows a short Triton
kernel launched with PDL (a sandwich, the attention merge), not another gemv. This times every candidate both ways:
  chain:   candidate(x, w_i), 20 distinct weights back to back (what time_gemv_choice times);
  context: [rmsnorm of a row, PDL] -> candidate(normed row, w_i), 20 times.
Run: python3 docs/h200-runs/2026-12-08/context_probe.py (CUDA); one JSON line per (shape, candidate)."""

import json

import torch

from perfkit.kernels import gemv as gv
from perfkit.kernels import rmsnorm as rn
from perfkit.kernels.timing import graph_sequence_us

SHAPES = {k: gv.SWEEP_SHAPES[k] for k in ("31b/gate_up", "31b/down", "31b/qkv_sliding", "31b/o_sliding",
                                           "31b/lm_head", "26b-a4b/gate_up", "26b-a4b/qkv_sliding")}  # fmt: skip
CALLS, REPLAYS = 20, 15

def probe(name: str, N: int, K: int) -> None:
    copies = max(2, min(CALLS, -(-1_000_000_000 // (2 * N * K))))
    ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    a = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    nw = (1 + 0.1 * torch.randn(K, device="cuda")).to(torch.bfloat16)
    x = rn.rmsnorm(a, nw, 1e-6)
    out = torch.empty(1, N, device="cuda", dtype=torch.bfloat16)
    cands = {"cublas": None, **{t.label: t for t in gv.GEMV_TILES}}

    def run(h, w, t):
        return torch.mm(h, w.t(), out=out) if t is None else gv.gemv(h, w, t, out=out, pdl=True)

    for label, t in cands.items():
        row = {"shape": name, "N": N, "K": K, "cand": label}
        row["chain_us"] = round(graph_sequence_us(lambda w, t=t: run(x, w, t), ws, CALLS, REPLAYS), 2)
        row["context_us"] = round(
            graph_sequence_us(lambda w, t=t: run(rn.rmsnorm(a, nw, 1e-6, pdl=True), w, t), ws, CALLS, REPLAYS), 2
        )
        print(json.dumps(row), flush=True)
    row = {"shape": name, "cand": "rmsnorm_only"}
    row["chain_us"] = round(graph_sequence_us(lambda w: rn.rmsnorm(a, nw, 1e-6, pdl=True), ws, CALLS, REPLAYS), 2)
    print(json.dumps(row), flush=True)


for name, (N, K) in SHAPES.items():
    probe(name, N, K)
    torch.cuda.empty_cache()
