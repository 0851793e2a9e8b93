"""`python3 .carry/p8/arm.py old|oldmoe|vec|new <perfkit args>`: the perfkit CLI; old puts back 12-01i's W4A16 M > 64
defaults, oldmoe 12-01i's quantised sorted MoE GEMMs (byte scales, the 32 x 64 gate_up tile)."""
import runpy
import sys

if sys.argv[1] == "old":
    import perfkit.kernels.w4a16_gemm as W

    W.DOT_LARGE_CONFIG = W.W4A16Config(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)
    W.DEQUANT_MM_MIN_M = 128
if sys.argv[1] == "oldmoe":
    import perfkit.kernels.moe as M

    M.QUANT_SCALES_VEC = False
    M.QUANT_DECODE_TILES["gate_up"] = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "num_warps": 4, "num_stages": 4}
if sys.argv[1] == "vec":  # the tiles the 12-02 call-5 sweep chose (5-choice.json under $OUT)
    import json
    import os

    import perfkit.kernels.w4a16_gemm as W

    choice = json.load(open(os.environ["OUT"] + "/5-choice.json"))
    W.DOT_SMALL_CONFIG = W.W4A16Config(**choice["small"])
    W.DOT_LARGE_CONFIG = W.W4A16Config(**choice["large"])
    print("vec arm:", W.DOT_SMALL_CONFIG, W.DOT_LARGE_CONFIG, file=sys.stderr)
sys.argv = ["perfkit"] + sys.argv[2:]
runpy.run_module("perfkit", run_name="__main__")
