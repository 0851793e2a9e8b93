"""12-05: candidate bf16 GEMV tiles against F.linear (cuBLAS) at the 31B and 26B-A4B decode shapes, M = 1 / 2 / 4.
Each timing: a CUDA graph of 20 calls cycling over enough distinct weights that L2 (50 MB) holds none between
uses, median of 15 replays / 20. One JSON row per (shape, M, impl) on stdout."""
import importlib.util
import json
import sys

import torch

spec = importlib.util.spec_from_file_location("gemv_cand", ".carry/gemv_cand.py")
G = importlib.util.module_from_spec(spec)
spec.loader.exec_module(G)

SHAPES = {"31b/qkv_s": (16384, 5376), "31b/qkv_f": (18432, 5376), "31b/gate_up": (43008, 5376),
          "31b/down": (5376, 21504), "31b/o_s": (5376, 8192), "31b/o_f": (5376, 16384),
          "26b/qkv_s": (8192, 2816), "26b/qkv_f": (9216, 2816), "26b/o_s": (2816, 4096), "26b/o_f": (2816, 8192),
          "26b/gate_up": (4224, 2816), "26b/down": (2816, 2112), "26b/router": (128, 2816),
          "lm_head_26b": (262144, 2816)}
TILES = [(8, 1024, 4, True, ""), (16, 512, 4, True, ""), (16, 512, 4, True, "evict_first"), (16, 512, 4, False, ""),
         (32, 256, 4, True, ""), (8, 512, 4, True, ""), (8, 512, 2, True, ""), (16, 256, 2, True, ""),
         (16, 1024, 8, True, ""), (32, 512, 8, True, ""), (4, 512, 2, True, ""), (32, 512, 4, True, ""),
         (8, 1024, 4, True, "evict_first"), (64, 256, 8, True, "")]
ms_list = [int(v) for v in sys.argv[1].split(",")] if len(sys.argv) > 1 else [1]


def time_us(fn, calls):
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls:
            fn(*c)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        for c in calls:
            fn(*c)
    torch.cuda.current_stream().wait_stream(s)
    for _ in range(3):
        g.replay()
    ts = []
    for _ in range(15):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / len(calls) * 1e3)
    ts.sort()
    return ts[len(ts) // 2]


for name, (n, k) in SHAPES.items():
    nbytes = n * k * 2
    copies = max(2, min(20, -(-200_000_000 // nbytes)))
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    for m in ms_list:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        outs = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
        calls = [(ws[i % copies], outs[i % 2]) for i in range(20)]
        ref = x.float() @ ws[0].float().t()
        row = {"shape": name, "n": n, "k": k, "m": m, "bound_us": round(nbytes / 4.3e12 * 1e6, 2)}
        row["cublas"] = round(time_us(lambda w, o, x=x: torch.mm(x, w.t(), out=o), calls), 2)
        for bn, bk, nw, pf, ev in TILES:
            key = f"{bn}x{bk}w{nw}{'p' if pf else ''}{'e' if ev else ''}"
            try:
                err = float((G.gemv(x, ws[0], bn, bk, nw, pf, evict=ev).float() - ref).abs().max())
                row[key] = round(time_us(lambda w, o, x=x, c=(bn, bk, nw, pf), ev=ev: G.gemv(x, w, *c, out=o, evict=ev), calls), 2)
                row[key + "_err"] = round(err, 5)
            except Exception as e:
                row[key] = f"{type(e).__name__}: {e}"[:120]
        print(json.dumps(row), flush=True)
    del ws
    torch.cuda.empty_cache()
