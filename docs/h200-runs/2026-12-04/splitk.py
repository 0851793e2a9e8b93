"""12-04 call 4: do the 31B batch-1 GEMMs need cuBLAS's split-K + reduce? F.linear at M = 1 timed in a CUDA graph of
20 calls (each weight > 50 MB, so L2 holds none), with the kernels one call launches; run once per workspace setting
(the env is read when torch creates its handles, so each setting is its own process)."""
import json
import os

import torch
import torch.nn.functional as F

SHAPES = {"o_sliding": (5376, 8192), "down": (5376, 21504), "o_full": (5376, 16384), "qkv_sliding": (16384, 5376),
          "qkv_full": (18432, 5376), "gate_up": (43008, 5376)}
env = {k: os.environ.get(k) for k in ("CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE")}
for name, (n, k) in SHAPES.items():
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    out = F.linear(x, w)
    ref = (x.float() @ w.float().t())
    err = float((out.float() - ref).abs().max())
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        F.linear(x, w)
        torch.cuda.synchronize()
    kernels = [e.name[:60] for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        for _ in range(20):
            F.linear(x, w)
    torch.cuda.current_stream().wait_stream(s)
    for _ in range(3):
        g.replay()
    times = []
    for _ in range(15):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 20 * 1e3)
    times.sort()
    us = times[len(times) // 2]
    print(json.dumps({"env": env, "shape": name, "n": n, "k": k, "us": round(us, 2), "bound_us": round(n * k * 2 / 4.3e12 * 1e6, 2),
                      "kernels": kernels, "max_abs_err": err}), flush=True)
    del w, g
    torch.cuda.empty_cache()
