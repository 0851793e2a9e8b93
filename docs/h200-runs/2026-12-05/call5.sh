# session 12-05 call 6: the engine GPU test of decode_gemv (graphs, batch 1) with the fused / overlap tests, then the
# 31B c1 A/B with 3 repeats (a CI) and 26B-A4B c1 with 6 requests per arm
source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
t0=$SECONDS
timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_engine_gpu.py -k "decode_gemv or fused_kernels or overlap" > $OUT/6-gpu_tests.log 2>&1; echo tests rc=$? $((SECONDS-t0))s; tail -3 $OUT/6-gpu_tests.log
S='scenarios=[{name: c1, workload: {isl: 1024, osl: 128, seed: 1}, arrival: {kind: closed, concurrency: 1}, num_requests: 5, warmup_requests: 1}]'
t0=$SECONDS
timeout -s INT 300 python3 -m perfkit run configs/ab_decode_gemv.yaml --set "$S" --set repeats=3 --out $OUT/ab > $OUT/5-ab.log 2>&1; echo ab rc=$? $((SECONDS-t0))s; grep -iE "error|warn" $OUT/5-ab.log | head -5
find $OUT -name telemetry -type d -exec rm -rf {} + ; find $OUT -name requests.jsonl -delete; find $OUT -name "*.trace.json" -delete
R=$(find $OUT/ab -name result.json | head -1); [ -n "$R" ] && cp $R $OUT/5-ab_c1.json; rm -rf $OUT/ab
python3 -m perfkit compare $OUT/5-ab_c1.json --markdown $OUT/5-compare.md > /dev/null 2>&1; grep -E "TPOT (p50|mean)|forward_(decode|prefill) device|clock|^#" $OUT/5-compare.md | head -16
python3 -c "
import json,os
r=json.load(open(os.environ['OUT']+'/5-ab_c1.json'))
print(json.dumps(r)[:0])
" 
