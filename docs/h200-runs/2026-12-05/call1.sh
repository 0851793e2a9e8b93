# session 12-05 call 1: the owed GPU tests (upload_parts alignment, 1bf0f6e's merge rule), then the fused merge's
# kernel timing against the committed one
source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
nvidia-smi --query-gpu=clocks.sm,temperature.gpu,power.draw --format=csv,noheader
t0=$SECONDS
timeout 230 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_paged_decode.py tests/test_engine_gpu.py tests/test_engine_page_table.py tests/test_syncs.py > $OUT/1-gpu_tests.log 2>&1; echo tests rc=$? $((SECONDS-t0))s; tail -3 $OUT/1-gpu_tests.log
t0=$SECONDS
timeout 200 python3 .carry/fused_var.py 1,2,4,8 > $OUT/1-fused_var.jsonl 2> $OUT/1-fused_var.err; echo fused_var rc=$? $((SECONDS-t0))s; tail -2 $OUT/1-fused_var.err
python3 - <<'PY'
import collections, json, os
rows = [json.loads(l) for l in open(os.environ["OUT"] + "/1-fused_var.jsonl")]
by = collections.defaultdict(lambda: collections.defaultdict(list))
for r in rows:
    by[(r["preset"], r["pool"], r["batch"], r["kv"], r["splits"])][r["arm"]].append(r["us"])
for k, arms in by.items():
    print(k, " ".join(f"{a} {'/'.join(map(str, v))}" for a, v in arms.items()))
print("max diff", max((r["max_abs_diff"] or 0) for r in rows), "errors", [r["message"] for r in rows if r["status"] != "ok"][:2])
PY
