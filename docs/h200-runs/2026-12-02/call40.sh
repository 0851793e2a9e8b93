# session 12-02 call 5: W4A16 dot scales_vec sweep (M 32-128); 31B NVFP4 c64 + c128 A/B of the chosen tiles (new vs vec)
nvidia-smi --query-gpu=clocks.sm,temperature.gpu --format=csv,noheader
t0=$SECONDS
timeout 150 python3 .carry/p8/dotvec_sweep.py > $OUT/5-dotvec.txt 2> $OUT/5-dotvec.err; echo sweep rc=$? $((SECONDS-t0))s; cat $OUT/5-dotvec.txt; tail -2 $OUT/5-dotvec.err
S='scenarios=[{name: c64, workload: {isl: 1024, osl: 128, seed: 2}, arrival: {kind: closed, concurrency: 64}, num_requests: 128, warmup_requests: 8}, {name: c128, workload: {isl: 1024, osl: 128, seed: 3}, arrival: {kind: closed, concurrency: 128}, num_requests: 128, warmup_requests: 8}]'
M='models=[{preset: 31b, weights: random, dtype: bfloat16, quant: nvfp4, device: cuda}]'
for arm in new vec; do
t0=$SECONDS
timeout -s INT 140 python3 .carry/p8/arm.py $arm run configs/b200_nvfp4.yaml --out $OUT/v_$arm --set "$M" --set "$S" --set runtime.max_batch_size=128 > $OUT/5-31b_$arm.log 2>&1; echo 31b $arm rc=$? $((SECONDS-t0))s; grep -iE "error|vec arm" $OUT/5-31b_$arm.log | head -3
done
find $OUT -name telemetry -type d -exec rm -rf {} + ; find $OUT -name requests.jsonl -delete
for d in v_new v_vec; do R=$(find $OUT/$d -name result.json | head -1); [ -n "$R" ] && cp $R $OUT/5-$d.json; rm -rf $OUT/$d; done
rm -f $OUT/5-31b_new.log
python3 -m perfkit compare $OUT/5-v_new.json $OUT/5-v_vec.json > $OUT/5-compare_31b.md 2>&1; grep -E "^c|TPOT p50|output thr|forward_(decode|prefill) device|clock" $OUT/5-compare_31b.md | head -16
