source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
PK='import sys; sys.argv=["perfkit"]+sys.argv[1:]; from perfkit.cli import app; app()'
t0=$SECONDS
timeout -s INT 390 python3 -c "$PK" run configs/h200_bf16.yaml --out $OUT/r31 > $OUT/3-h200_bf16.log 2>&1
echo bf16 rc=$? $((SECONDS-t0))s; grep -E "\] *:|TPOT|: TTFT" $OUT/3-h200_bf16.log | cut -c1-160 | head -20
t0=$SECONDS
timeout -s INT 170 python3 -c "$PK" run configs/h200_26b.yaml --out $OUT/r26 > $OUT/3-h200_26b.log 2>&1
echo 26b rc=$? $((SECONDS-t0))s; grep -E "\] *:|TPOT|: TTFT" $OUT/3-h200_26b.log | cut -c1-160 | head -20
find $OUT -name telemetry -type d -exec rm -rf {} + ; find $OUT -name requests.jsonl -delete
R=$(find $OUT/r31 -name result.json | head -1); [ -n "$R" ] && cp $R $OUT/3-h200_bf16.json; rm -rf $OUT/r31
R=$(find $OUT/r26 -name result.json | head -1); [ -n "$R" ] && cp $R $OUT/3-h200_26b.json; rm -rf $OUT/r26
ls $OUT
