"""`python3 .carry/arm5.py old|new CHOICE.json <perfkit args>`: the perfkit CLI; new caps the norm kernels' warps at
the sweep's best (CHOICE.json's "cap"), old keeps the rule (16)."""
import json
import runpy
import sys

if sys.argv[1] == "new":
    import perfkit.kernels.rmsnorm as R

    cap = json.load(open(sys.argv[2]))["cap"]
    R._warps = lambda block_n: max(1, min(cap, block_n // 256))
    print("new arm: warps capped at", cap, file=sys.stderr)
sys.argv = ["perfkit"] + sys.argv[3:]
runpy.run_module("perfkit", run_name="__main__")
