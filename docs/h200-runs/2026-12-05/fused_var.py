"""12-05 call 1: the Triton decode with the committed two-launch merge (cur) against the merge by the last slice
(pd_fused, from 12-04/make_fused_merge.py), interleaved twice through the attention sweep's CUDA-graph timing
(31B and 26B-A4B pools, kv 1024 and 4096). One JSON row per case on stdout."""
import importlib.util
import json
import sys

import perfkit.runners.attention_sweep as S

spec = importlib.util.spec_from_file_location("pd_fused", ".carry/pd_fused.py")
m = importlib.util.module_from_spec(spec)
spec.loader.exec_module(m)
arms = {"cur": S.paged_decode_attention, "fused": m.paged_decode_attention}
batches = [int(x) for x in sys.argv[1].split(",")] if len(sys.argv) > 1 else [1, 2, 4, 8]
for preset in ("31b", "26b-a4b"):
    for rep in range(2):
        for arm in (list(arms) if rep == 0 else list(arms)[::-1]):
            S.paged_decode_attention = arms[arm]
            rows = S.attention_cases(preset, ["sliding", "full"], batches, [1024, 4096], [], ["triton"], [])
            S.run_attention_sweep(rows, repeats=30)
            for r in rows:
                s = r["shape"]
                print(json.dumps({"preset": preset, "pool": s["pool"], "batch": s["batch"], "kv": s.get("kv_len"),
                                  "arm": arm, "rep": rep, "splits": r.get("num_splits"),
                                  "us": r["median_ms"] and round(r["median_ms"] * 1e3, 2),
                                  "bound_us": round(r["bound_ms"] * 1e3, 2), "max_abs_diff": r.get("max_abs_diff"),
                                  "status": r["status"], "message": r["message"]}), flush=True)
