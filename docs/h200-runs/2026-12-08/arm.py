"""`python3 docs/h200-runs/2026-12-08/arm.py context|chain <perfkit args>`: the perfkit CLI, with decode_gemv=auto
timing its candidates after an rmsnorm (context, the default since 12-08) or as a plain chain (chain, to 12-08)."""

import runpy
import sys

import perfkit.kernels.gemv as G

G.TIMING_AFTER_NORM = {"context": True, "chain": False}[sys.argv[1]]
sys.argv = ["perfkit"] + sys.argv[2:]
runpy.run_module("perfkit", run_name="__main__")
