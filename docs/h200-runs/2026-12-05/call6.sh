# session 12-05 call 6: call 5's GPU tests again after the deepcopy fix, plus the gemv's own GPU tests
source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
t0=$SECONDS
timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_engine_gpu.py tests/test_gemv.py -k "decode_gemv or fused_kernels or overlap or gemv" > $OUT/6-gpu_tests.log 2>&1; echo tests rc=$? $((SECONDS-t0))s; tail -3 $OUT/6-gpu_tests.log
S='scenarios=[{name: c1, workload: {isl: 1024, osl: 128, seed: 1}, arrival: {kind: closed, concurrency: 1}, num_requests: 2, warmup_requests: 1}]'
t0=$SECONDS
timeout -s INT 220 python3 -m perfkit run configs/ab_decode_gemv.yaml --set "$S" --set repeats=1 --profile torch --out $OUT/ab > $OUT/6-ab.log 2>&1; echo ab rc=$? $((SECONDS-t0))s; grep -iE "error|warn" $OUT/6-ab.log | head -5
find $OUT -name telemetry -type d -exec rm -rf {} + ; find $OUT -name requests.jsonl -delete; find $OUT -name "*.trace.json*" -delete
R=$(find $OUT/ab -name result.json | head -1); [ -n "$R" ] && cp $R $OUT/6-ab_c1_profile.json; rm -rf $OUT/ab
python3 -m perfkit compare $OUT/6-ab_c1_profile.json --markdown $OUT/6-compare.md > /dev/null 2>&1; grep -E "TPOT p50|forward_decode device|^#|profile" $OUT/6-compare.md | head -30
