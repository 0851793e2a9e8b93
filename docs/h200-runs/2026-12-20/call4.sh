source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
PK='import sys; sys.argv=["perfkit"]+sys.argv[1:]; from perfkit.cli import app; app()'
t0=$SECONDS
timeout -s INT 420 python3 -c "$PK" run configs/h200_bf16.yaml --out $OUT/r > $OUT/4-h200_bf16.log 2>&1
echo bf16 rc=$? $((SECONDS-t0))s; grep -E "\] *:" $OUT/4-h200_bf16.log | cut -c1-160 | head -20
find $OUT -name telemetry -type d -exec rm -rf {} + ; find $OUT -name requests.jsonl -delete
R=$(find $OUT/r -name result.json | head -1); [ -n "$R" ] && cp $R $OUT/4-h200_bf16.json; rm -rf $OUT/r
t0=$SECONDS
S='scenarios=[{name: c1, workload: {isl: 1024, osl: 128, seed: 1}, arrival: {kind: closed, concurrency: 1}, num_requests: 3, warmup_requests: 1}]'
timeout -s INT 120 python3 -c "$PK" run configs/h200_26b.yaml --out $OUT/p26 --set "$S" --set capture.profile=torch --set capture.profile_scenario=c1 --set "capture.profile_steps=[40, 44]" > $OUT/4-p26.log 2>&1
echo p26 rc=$? $((SECONDS-t0))s; grep -E "c1 \[" $OUT/4-p26.log | cut -c1-160
find $OUT -name telemetry -type d -exec rm -rf {} + ; find $OUT -name requests.jsonl -delete
R=$(find $OUT/p26 -name result.json | head -1); [ -n "$R" ] && cp $R $OUT/4-p26.json
T=$(find $OUT/p26 -name "*.trace.json" | head -1); [ -n "$T" ] && xz -T4 -c $T > $OUT/4-p26.trace.json.xz
rm -rf $OUT/p26
ls -la $OUT
