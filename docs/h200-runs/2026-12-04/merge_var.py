"""12-04 call 2: merge variants of the Triton decode, interleaved twice through the attention sweep's CUDA-graph
timing (31B and 26B-A4B pools, kv 1024). Arms: cur = the committed merge (two passes, partial loads masked by lse,
128 columns per program); v0_d512 = the same with whole heads per program; v1 = one online pass (lse and partials
load together, empty slices cleared with a where); v1_d512, v1_s16 = v1 with whole heads / 16 splits per load;
old = 12-03's scalar loop. One JSON row per case on stdout."""
import importlib.util
import json
import sys

import perfkit.runners.attention_sweep as S


def load(name):
    spec = importlib.util.spec_from_file_location(name, f".carry/{name}.py")
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m.paged_decode_attention


arms = {"cur": S.paged_decode_attention, **{n: load(n) for n in ("pd_v0_d512", "pd_v1", "pd_v1_d512", "pd_v1_s16")},
        "old": load("paged_decode_old")}
batches = [int(x) for x in sys.argv[1].split(",")] if len(sys.argv) > 1 else [1, 2, 4, 8, 16]
for preset in ("31b", "26b-a4b"):
    for rep in range(2):
        for arm in (list(arms) if rep == 0 else list(arms)[::-1]):
            S.paged_decode_attention = arms[arm]
            rows = S.attention_cases(preset, ["sliding", "full"], batches, [1024], [], ["triton"], [])
            S.run_attention_sweep(rows, repeats=30)
            for r in rows:
                s = r["shape"]
                print(json.dumps({"preset": preset, "pool": s["pool"], "batch": s["batch"], "arm": arm, "rep": rep,
                                  "splits": r.get("num_splits"), "us": r["median_ms"] and round(r["median_ms"] * 1e3, 2),
                                  "bound_us": round(r["bound_ms"] * 1e3, 2), "max_abs_diff": r.get("max_abs_diff"),
                                  "status": r["status"], "message": r["message"]}), flush=True)
