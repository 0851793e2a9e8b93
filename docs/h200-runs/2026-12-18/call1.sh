source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
timeout -s INT 220 python3 -m pytest -q -m gpu tests/test_quant.py tests/test_pdl.py -k "not engine_tokens or nvfp4" > $OUT/1-tests.log 2>&1
tail -3 $OUT/1-tests.log
S='scenarios=[{name: c2, workload: {isl: 1024, osl: 128, seed: 2}, arrival: {kind: closed, concurrency: 2}, num_requests: 4, warmup_requests: 1}, {name: c4, workload: {isl: 1024, osl: 128, seed: 3}, arrival: {kind: closed, concurrency: 4}, num_requests: 4, warmup_requests: 1}, {name: c8, workload: {isl: 1024, osl: 128, seed: 4}, arrival: {kind: closed, concurrency: 8}, num_requests: 8, warmup_requests: 1}, {name: c16, workload: {isl: 1024, osl: 128, seed: 5}, arrival: {kind: closed, concurrency: 16}, num_requests: 16, warmup_requests: 1}]'
MD='models=[{preset: 26b-a4b, weights: random, dtype: bfloat16, quant: nvfp4, device: cuda}]'
A='arms=[{name: auto, toggles: {w4a16_words: auto}}]'
for arm in dot rows; do
t0=$SECONDS
timeout -s INT 170 python3 -c "import sys, perfkit.kernels.w4a16_gemm as W; W.GEMV_TC_ROWS_ANY_SHAPE = sys.argv[1] == 'rows'; sys.argv = ['perfkit'] + sys.argv[2:]; from perfkit.cli import app; app()" $arm run configs/ab_w4a16_words.yaml --out $OUT/e_$arm --set "$MD" --set "$S" --set "$A" --set runtime.max_batch_size=16 --set repeats=1 > $OUT/1-$arm.log 2>&1
echo $arm rc=$? $((SECONDS-t0))s; grep -E "^│ c" $OUT/1-$arm.log | cut -c1-140
done
find $OUT -name telemetry -type d -exec rm -rf {} + ; find $OUT -name requests.jsonl -delete
for d in e_dot e_rows; do R=$(find $OUT/$d -name result.json | head -1); [ -n "$R" ] && cp $R $OUT/1-$d.json; rm -rf $OUT/$d; done
