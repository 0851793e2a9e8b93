"""12-04 call 1: the Triton decode's old merge (one scalar load per split, every slice writes its partial) against
the new one (32 splits per load, empty slices write only lse), interleaved twice through the attention sweep's
CUDA-graph timing, 31B and 26B-A4B pools at kv 1024; FlashInfer's two decodes beside them; then the new kernel's
tiles. One JSON row per case on stdout."""
import importlib.util
import json
import sys

import perfkit.runners.attention_sweep as S

spec = importlib.util.spec_from_file_location("pd_old", ".carry/paged_decode_old.py")
old = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old)
arms = {"old": old.paged_decode_attention, "new": S.paged_decode_attention}
batches = [int(x) for x in sys.argv[1].split(",")] if len(sys.argv) > 1 else [1, 2, 4, 8, 16]


def emit(rows, **extra):
    for r in rows:
        s = r["shape"]
        print(json.dumps({"preset": s["preset"], "pool": s["pool"], "batch": s["batch"], "impl": S.impl_label(r), **extra,
                          "splits": r.get("num_splits"), "us": r["median_ms"] and round(r["median_ms"] * 1e3, 2),
                          "p10_us": r["p10_ms"] and round(r["p10_ms"] * 1e3, 2), "p90_us": r["p90_ms"] and round(r["p90_ms"] * 1e3, 2),
                          "bound_us": round(r["bound_ms"] * 1e3, 2), "max_abs_diff": r.get("max_abs_diff"),
                          "status": r["status"], "message": r["message"]}), flush=True)


for preset in ("31b", "26b-a4b"):
    fi = S.attention_cases(preset, ["sliding", "full"], batches, [1024], [], ["cuda_cores", "tc_fa2"], [])
    S.run_attention_sweep(fi, repeats=30)
    emit(fi, arm="flashinfer")
    for rep in range(2):
        for arm in (("old", "new") if rep == 0 else ("new", "old")):
            S.paged_decode_attention = arms[arm]
            rows = S.attention_cases(preset, ["sliding", "full"], batches, [1024], [], ["triton"], [])
            S.run_attention_sweep(rows, repeats=30)
            emit(rows, arm=arm, rep=rep)
    S.paged_decode_attention = arms["new"]
    tiles = S.parse_triton_tiles("32x4x4,64x4x2,32x8x1,32x8x2,16x4x4")
    rows = S.attention_cases(preset, ["sliding", "full"], batches, [1024], [], ["triton"], [], triton_tiles=tiles)
    S.run_attention_sweep(rows, repeats=30)
    emit(rows, arm="new_tiles")
