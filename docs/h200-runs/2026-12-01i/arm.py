"""`python3 .carry/p7/arm.py old|new <perfkit args>`: the perfkit CLI, with 12-01i's new defaults (old: put back)."""
import runpy
import sys

if sys.argv[1] == "old":
    import perfkit.kernels.fp8_gemv as F
    import perfkit.kernels.w4a16_gemm as W
    import perfkit.runtime.quant as Q

    W.DOT_SMALL_CONFIG = W.W4A16Config(block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=3)
    F.GEMV_CONFIG = F.Fp8GemvConfig(block_m=8, block_n=4, block_k=1024, num_warps=4, num_stages=1)
    Q.Nvfp4Linear.prefill_alpha = False
    Q.QuantizedExperts.dequant_min_pairs = 4096
sys.argv = ["perfkit"] + sys.argv[2:]
runpy.run_module("perfkit", run_name="__main__")
