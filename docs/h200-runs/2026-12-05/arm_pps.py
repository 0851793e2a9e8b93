"""A prepared engine A/B for the next session: `python3 .carry/arm_pps.py old|new <perfkit args>` is the perfkit CLI;
new gives the Triton decode 4 programs per SM on sliding pools (a window) from batch 2 on, and keeps 2 elsewhere.
Call 3's sweep (`3-attn_*.json`): sliding 31B b2 17.52 vs 19.45 us, b4 27.65 vs 29.42; 26B-A4B b4 17.28 vs 19.48;
full pools lose with 4 (31B b4 24.88 vs 20.93)."""
import runpy
import sys

if sys.argv[1] == "new":
    import perfkit.runtime.attention.flashinfer as F

    base = F.pick_splits

    def pick_splits(batch, num_kv_heads, sms, max_span, **kw):
        if max_span is not None and batch >= 2:
            kw["programs_per_sm"] = 4
        return base(batch, num_kv_heads, sms, max_span, **kw)

    F.pick_splits = pick_splits
sys.argv = ["perfkit"] + sys.argv[2:]
runpy.run_module("perfkit", run_name="__main__")
