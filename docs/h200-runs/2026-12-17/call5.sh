source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
D=docs/h200-runs/2026-12-17
timeout -s INT 120 python3 -m pytest -q -m gpu tests/test_quant.py -k "tc_rows or repacked_words" > $OUT/5-tests.log 2>&1
tail -3 $OUT/5-tests.log
timeout -s INT 80 python3 $D/rp_probe.py rows --shapes 5376,21504 43008,5376 5376,8192 --ms 2 4 8 16 > $OUT/5-rows.jsonl 2> $OUT/5-rows.err
tail -2 $OUT/5-rows.err; cat $OUT/5-rows.jsonl | python3 -c "
import json,sys
for l in sys.stdin:
    r=json.loads(l); print(r['N'],r['K'],r['M'],'std',min(r['std_us_0'],r['std_us_1']),'rp',min(r['repack_us_0'],r['repack_us_1']),'dot',min(r['dot_us_0'],r['dot_us_1']))"
S='scenarios=[{name: c1, workload: {isl: 1024, osl: 128, seed: 1}, arrival: {kind: closed, concurrency: 1}, num_requests: 3, warmup_requests: 1}, {name: c2, workload: {isl: 1024, osl: 128, seed: 2}, arrival: {kind: closed, concurrency: 2}, num_requests: 4, warmup_requests: 1}, {name: c4, workload: {isl: 1024, osl: 128, seed: 3}, arrival: {kind: closed, concurrency: 4}, num_requests: 4, warmup_requests: 1}, {name: c8, workload: {isl: 1024, osl: 128, seed: 4}, arrival: {kind: closed, concurrency: 8}, num_requests: 8, warmup_requests: 1}, {name: c16, workload: {isl: 1024, osl: 128, seed: 5}, arrival: {kind: closed, concurrency: 16}, num_requests: 16, warmup_requests: 1}]'
A='arms=[{name: standard, toggles: {w4a16_words: standard}}, {name: auto, toggles: {w4a16_words: auto}}]'
t0=$SECONDS
timeout -s INT 200 python3 -m perfkit run configs/ab_w4a16_words.yaml --out $OUT/e_rows2 --set "$S" --set "$A" --set runtime.max_batch_size=16 --set repeats=1 > $OUT/5-rows2.log 2>&1
echo rc=$? $((SECONDS-t0))s; grep -E "^│ c" $OUT/5-rows2.log | cut -c1-120
find $OUT -name telemetry -type d -exec rm -rf {} + ; find $OUT -name requests.jsonl -delete
R=$(find $OUT/e_rows2 -name result.json | head -1); [ -n "$R" ] && cp $R $OUT/5-e_rows2.json; rm -rf $OUT/e_rows2
