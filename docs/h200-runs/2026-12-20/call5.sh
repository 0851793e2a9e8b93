source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
PK='import sys; sys.argv=["perfkit"]+sys.argv[1:]; from perfkit.cli import app; app()'
t0=$SECONDS
timeout -s INT 400 python3 -c "$PK" run configs/h200_quant.yaml --out $OUT/q > $OUT/5-h200_quant.log 2>&1
echo quant rc=$? $((SECONDS-t0))s; grep -E "\] *:|W4A16|w4a16" $OUT/5-h200_quant.log | cut -c1-160 | head -20
find $OUT -name telemetry -type d -exec rm -rf {} + ; find $OUT -name requests.jsonl -delete
R=$(find $OUT/q -name result.json | head -1); [ -n "$R" ] && cp $R $OUT/5-h200_quant.json; rm -rf $OUT/q
ls -la $OUT
