"""`python3 .carry/arm.py old|new <perfkit args>`: the perfkit CLI; old turns the W4A16 dot path's row mask off
(12-03's DOT_ROW_MASK: padding rows re-read row M - 1 instead of being masked)."""
import runpy
import sys

if sys.argv[1] == "old":
    import perfkit.kernels.w4a16_gemm as W

    W.DOT_ROW_MASK = False
sys.argv = ["perfkit"] + sys.argv[2:]
runpy.run_module("perfkit", run_name="__main__")
