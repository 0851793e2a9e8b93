# session 12-05 call 7: decode_gemv's GPU lockstep with the cuBLAS fused baseline; then 12-04's prepared per-pool
# split A/B (arm_pps.py: programs_per_sm 4 on sliding pools from batch 2), 31B bf16, c2 / c4, old new new old
source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
t0=$SECONDS
timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_engine_gpu.py -k "decode_gemv" > $OUT/7-gpu_tests.log 2>&1; echo tests rc=$? $((SECONDS-t0))s; tail -3 $OUT/7-gpu_tests.log
M='models=[{preset: 31b, weights: random, dtype: bfloat16, device: cuda}]'
S='scenarios=[{name: c2, workload: {isl: 1024, osl: 128, seed: 6}, arrival: {kind: closed, concurrency: 2}, num_requests: 4, warmup_requests: 1}, {name: c4, workload: {isl: 1024, osl: 128, seed: 2}, arrival: {kind: closed, concurrency: 4}, num_requests: 8, warmup_requests: 1}]'
i=0
for arm in old new new old; do
i=$((i+1)); t0=$SECONDS
timeout -s INT 100 python3 .carry/arm_pps.py $arm run configs/ab_decode_attention.yaml --set "$M" --set "$S" --set "arms=[]" --set repeats=1 --out $OUT/p$i > /tmp/pps_$i.log 2>&1; echo pps $arm rc=$? $((SECONDS-t0))s; grep -iE "error" /tmp/pps_$i.log | tail -2
find $OUT/p$i -name telemetry -type d -exec rm -rf {} + ; find $OUT/p$i -name requests.jsonl -delete
R=$(find $OUT/p$i -name result.json | head -1); [ -n "$R" ] && python3 -c "
import json
for s in json.load(open('$R'))['scenarios']:
    print('$arm', s['name'], 'tpot p50', round(s['metrics']['tpot_ms']['p50'], 3), 'forward_decode dev', round(s['nvtx']['forward_decode']['device_mean_ms'], 3))
"; [ -n "$R" ] && cp $R $OUT/7-pps_${i}_$arm.json; rm -rf $OUT/p$i
done
