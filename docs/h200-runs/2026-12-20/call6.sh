source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
PK='import sys; sys.argv=["perfkit"]+sys.argv[1:]; from perfkit.cli import app; app()'
t0=$SECONDS
timeout -s INT 150 python3 -m pytest -v -m gpu tests/test_decode_io.py -p no:cacheprovider --durations=5 > $OUT/6-tests.log 2>&1
echo tests rc=$? $((SECONDS-t0))s; grep -cE "PASSED" $OUT/6-tests.log; grep -E "FAILED|ERROR|Error" $OUT/6-tests.log | head -5; tail -2 $OUT/6-tests.log
t0=$SECONDS
timeout -s INT 200 python3 -c "$PK" run configs/ab_decode_io.yaml --out $OUT/ab > $OUT/6-ab.log 2>&1
echo ab rc=$? $((SECONDS-t0))s; grep -E "\] *:" $OUT/6-ab.log | cut -c1-150 | head -20
find $OUT -name telemetry -type d -exec rm -rf {} + ; find $OUT -name requests.jsonl -delete
R=$(find $OUT/ab -name result.json | head -1); [ -n "$R" ] && cp $R $OUT/6-ab_decode_io.json; rm -rf $OUT/ab
t0=$SECONDS
S='scenarios=[{name: c1, workload: {isl: 1024, osl: 128, seed: 1}, arrival: {kind: closed, concurrency: 1}, num_requests: 3, warmup_requests: 1}]'
timeout -s INT 90 python3 -c "$PK" run configs/h200_26b.yaml --out $OUT/p26 --set "$S" --set capture.profile=torch --set capture.profile_scenario=c1 --set "capture.profile_steps=[40, 44]" > $OUT/6-p26.log 2>&1
echo p26 rc=$? $((SECONDS-t0))s; grep -E "c1 \[" $OUT/6-p26.log | cut -c1-160
T=$(find $OUT/p26 -name "*.trace.json" | head -1); [ -n "$T" ] && xz -T4 -c $T > $OUT/6-p26.trace.json.xz
rm -rf $OUT/p26
ls -la $OUT
