"""decode_gemv=auto's GLU timing (12-08) on random bf16 weights at the two dense down shapes, PDL on: one JSON line
per shape (time_gemv_choice(glu=True): the plain row plus "glu": [gelu_mul -> winner] vs each tile's GLU form).
Run: python3 docs/h200-runs/2026-12-08/glu_timing.py (CUDA)."""

import json

import torch

from perfkit.kernels import gemv as gv

for name, (N, K) in {"31b/down": (5376, 21504), "26b-a4b/down": (2816, 2112)}.items():
    ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(gv.TIMING_CALLS)]
    print(json.dumps({"shape": name, **gv.time_gemv_choice(ws, pdl=True, glu=True)}), flush=True)
