source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
timeout -s INT 60 python3 -m pytest -q -m gpu tests/test_fp8_gemv.py -k "fp8_linear_gemv" > $OUT/6-tests.log 2>&1
tail -2 $OUT/6-tests.log
S='scenarios=[{name: c16, workload: {isl: 1024, osl: 128, seed: 5}, arrival: {kind: closed, concurrency: 16}, num_requests: 16, warmup_requests: 1}, {name: c32, workload: {isl: 1024, osl: 128, seed: 6}, arrival: {kind: closed, concurrency: 32}, num_requests: 32, warmup_requests: 2}, {name: c64, workload: {isl: 1024, osl: 128, seed: 7}, arrival: {kind: closed, concurrency: 64}, num_requests: 64, warmup_requests: 2}]'
MD='models=[{preset: 31b, weights: random, dtype: bfloat16, quant: bf16, device: cuda}, {preset: 31b, weights: random, dtype: bfloat16, quant: fp8, device: cuda}]'
t0=$SECONDS
timeout -s INT 330 python3 -c "import sys; sys.argv = ['perfkit'] + sys.argv[1:]; from perfkit.cli import app; app()" run configs/h200_quant.yaml --out $OUT/e_q --set "$MD" --set "$S" --set runtime.max_batch_size=64 > $OUT/6-quant.log 2>&1
echo quant rc=$? $((SECONDS-t0))s; grep -E "c16 \[|c32 \[|c64 \[" $OUT/6-quant.log | cut -c1-140
find $OUT -name telemetry -type d -exec rm -rf {} + ; find $OUT -name requests.jsonl -delete
R=$(find $OUT/e_q -name result.json | head -1); [ -n "$R" ] && cp $R $OUT/6-h200_quant_c16_c64.json; rm -rf $OUT/e_q
