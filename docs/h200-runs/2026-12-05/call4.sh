# session 12-05 call 4: the gemv's GPU tests, then the engine A/B (configs/ab_decode_gemv.yaml, c1, both models)
source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
nvidia-smi --query-gpu=clocks.sm,temperature.gpu --format=csv,noheader
t0=$SECONDS
timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gemv.py > $OUT/4-gpu_tests.log 2>&1; echo tests rc=$? $((SECONDS-t0))s; tail -3 $OUT/4-gpu_tests.log
t0=$SECONDS
timeout -s INT 330 python3 -m perfkit run configs/ab_decode_gemv.yaml --out $OUT/ab > $OUT/4-ab.log 2>&1; echo ab rc=$? $((SECONDS-t0))s; grep -iE "error|warn" $OUT/4-ab.log | head -5
find $OUT -name telemetry -type d -exec rm -rf {} + ; find $OUT -name requests.jsonl -delete; find $OUT -name "*.trace.json" -delete
R=$(find $OUT/ab -name result.json | head -1); [ -n "$R" ] && cp $R $OUT/4-ab_c1.json; rm -rf $OUT/ab
python3 -m perfkit compare $OUT/4-ab_c1.json --markdown $OUT/4-compare.md > /dev/null 2>&1; grep -E "TPOT p50|forward_decode device|clock|^#" $OUT/4-compare.md | head -16
python3 - <<'PY'
import json, os
r = json.load(open(os.environ["OUT"] + "/4-ab_c1.json"))
def walk(o):
    if isinstance(o, dict):
        if "decode_gemv" in o and isinstance(o["decode_gemv"], dict) and o["decode_gemv"].get("shapes"):
            yield o["decode_gemv"]
        for v in o.values():
            yield from walk(v)
    elif isinstance(o, list):
        for v in o:
            yield from walk(v)
seen = set()
for g in walk(r):
    for k, row in g["shapes"].items():
        if k in seen or not isinstance(row, dict):
            continue
        seen.add(k)
        print(k, "bound", row["bound_us"], "cublas", row["cublas_us"], "best", row["best"], row["best_us"], row["tiles"])
PY
