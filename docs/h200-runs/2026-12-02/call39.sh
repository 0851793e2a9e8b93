# session 12-02 call 3: 26B-A4B NVFP4 A/B of the MoE scale vectors + gate_up tile (oldmoe vs new); GPU tests l-z
nvidia-smi --query-gpu=clocks.sm,temperature.gpu --format=csv,noheader
S='scenarios=[{name: c64, workload: {isl: 1024, osl: 128, seed: 2}, arrival: {kind: closed, concurrency: 64}, num_requests: 192, warmup_requests: 8}, {name: c128, workload: {isl: 1024, osl: 128, seed: 3}, arrival: {kind: closed, concurrency: 128}, num_requests: 256, warmup_requests: 8}]'
M='models=[{preset: 26b-a4b, weights: random, dtype: bfloat16, quant: nvfp4, device: cuda}]'
for arm in oldmoe new; do
t0=$SECONDS
timeout -s INT 130 python3 .carry/p8/arm.py $arm run configs/b200_nvfp4.yaml --out $OUT/m_$arm --set "$M" --set "$S" --set runtime.max_batch_size=128 > $OUT/3-26b_$arm.log 2>&1; echo 26b $arm rc=$? $((SECONDS-t0))s; grep -iE "error" $OUT/3-26b_$arm.log | head -3
done
find $OUT -name telemetry -type d -exec rm -rf {} + ; find $OUT -name requests.jsonl -delete
for d in m_oldmoe m_new; do R=$(find $OUT/$d -name result.json | head -1); [ -n "$R" ] && cp $R $OUT/3-$d.json; rm -rf $OUT/$d; done
python3 -m perfkit compare $OUT/3-m_oldmoe.json $OUT/3-m_new.json > $OUT/3-compare_26b.md 2>&1; grep -E "^c|TPOT p50|TTFT p50|output thr|forward_(decode|prefill) device|clock|·" $OUT/3-compare_26b.md | head -24
t0=$SECONDS
timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_[l-z]*.py > $OUT/3-gpu_tests_lz.log 2>&1; echo tests rc=$? $((SECONDS-t0))s; tail -1 $OUT/3-gpu_tests_lz.log; grep -E "^FAILED|^E  " $OUT/3-gpu_tests_lz.log | head -8
