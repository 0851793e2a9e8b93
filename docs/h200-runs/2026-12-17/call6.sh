source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
S='scenarios=[{name: c1, workload: {isl: 1024, osl: 128, seed: 1}, arrival: {kind: closed, concurrency: 1}, num_requests: 3, warmup_requests: 1}, {name: c32, workload: {isl: 1024, osl: 128, seed: 6}, arrival: {kind: closed, concurrency: 32}, num_requests: 32, warmup_requests: 2}, {name: c64, workload: {isl: 1024, osl: 128, seed: 7}, arrival: {kind: closed, concurrency: 64}, num_requests: 64, warmup_requests: 4}]'
A='arms=[{name: standard, toggles: {w4a16_words: standard}}, {name: auto, toggles: {w4a16_words: auto}}]'
t0=$SECONDS
timeout -s INT 300 python3 -m perfkit run configs/ab_w4a16_words.yaml --out $OUT/e6 --set "$S" --set "$A" --set runtime.max_batch_size=64 --set repeats=1 > $OUT/6-c64.log 2>&1
echo rc=$? $((SECONDS-t0))s; grep -E "^│ c" $OUT/6-c64.log | cut -c1-150
find $OUT -name telemetry -type d -exec rm -rf {} + ; find $OUT -name requests.jsonl -delete
R=$(find $OUT/e6 -name result.json | head -1); [ -n "$R" ] && cp $R $OUT/6-e_c64.json; rm -rf $OUT/e6
