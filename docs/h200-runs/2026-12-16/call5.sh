source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
M='models=[{preset: 26b-a4b, weights: random, dtype: bfloat16, quant: nvfp4, device: cuda}]'
t0=$SECONDS
timeout -s INT 540 python3 -m perfkit run configs/b200_nvfp4.yaml --out $OUT/b26 --set "$M" > $OUT/5-b26.log 2>&1
echo rc=$? $((SECONDS-t0))s
tail -25 $OUT/5-b26.log
find $OUT -name telemetry -type d -exec rm -rf {} + ; find $OUT -name requests.jsonl -delete
R=$(find $OUT/b26 -name result.json | head -1); [ -n "$R" ] && cp $R $OUT/5-b200_26b.json; rm -rf $OUT/b26
