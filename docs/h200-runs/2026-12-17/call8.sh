source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
S='scenarios=[{name: c1, workload: {isl: 1024, osl: 128, seed: 1}, arrival: {kind: closed, concurrency: 1}, num_requests: 3, warmup_requests: 1}, {name: c4, workload: {isl: 1024, osl: 128, seed: 3}, arrival: {kind: closed, concurrency: 4}, num_requests: 4, warmup_requests: 1}]'
t0=$SECONDS
timeout -s INT 320 python3 -m perfkit run configs/h200_quant.yaml --out $OUT/e8 --set "$S" > $OUT/8-quant.log 2>&1
echo rc=$? $((SECONDS-t0))s; grep -E "^│ c" $OUT/8-quant.log | cut -c1-150
find $OUT -name telemetry -type d -exec rm -rf {} + ; find $OUT -name requests.jsonl -delete
R=$(find $OUT/e8 -name result.json | head -1); [ -n "$R" ] && cp $R $OUT/8-h200_quant.json; rm -rf $OUT/e8
