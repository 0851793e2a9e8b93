"""`python3 .carry/arm_fused.py cur|fused <perfkit args>`: the perfkit CLI; fused swaps the FlashInfer backend's
Triton decode for .carry/pd_fused.py (the merge by the last slice to finish). Its counters come from one zeroed
int32 buffer made before the engine starts (every slice group resets its own counters), so no allocation happens
inside a graph capture."""
import importlib.util
import runpy
import sys

if sys.argv[1] == "fused":
    import torch

    import perfkit.runtime.attention.flashinfer as F

    spec = importlib.util.spec_from_file_location("pd_fused", ".carry/pd_fused.py")
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    counters = torch.zeros(1 << 16, dtype=torch.int32, device="cuda")
    m._counters = lambda n, device: counters[:n]
    F.paged_decode_attention = m.paged_decode_attention
sys.argv = ["perfkit"] + sys.argv[2:]
runpy.run_module("perfkit", run_name="__main__")
