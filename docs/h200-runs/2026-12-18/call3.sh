source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
D=docs/h200-runs/2026-12-18
S='scenarios=[{name: c1, workload: {isl: 1024, osl: 128, seed: 1}, arrival: {kind: closed, concurrency: 1}, num_requests: 3, warmup_requests: 1}, {name: c2, workload: {isl: 1024, osl: 128, seed: 2}, arrival: {kind: closed, concurrency: 2}, num_requests: 4, warmup_requests: 1}, {name: c4, workload: {isl: 1024, osl: 128, seed: 3}, arrival: {kind: closed, concurrency: 4}, num_requests: 4, warmup_requests: 1}, {name: c8, workload: {isl: 1024, osl: 128, seed: 4}, arrival: {kind: closed, concurrency: 8}, num_requests: 8, warmup_requests: 1}, {name: c16, workload: {isl: 1024, osl: 128, seed: 5}, arrival: {kind: closed, concurrency: 16}, num_requests: 16, warmup_requests: 1}]'
MD='models=[{preset: 31b, weights: random, dtype: bfloat16, quant: fp8, device: cuda}]'
for arm in old new; do
t0=$SECONDS
timeout -s INT 120 python3 -c "import sys, perfkit.kernels.fp8_gemv as F; F.GEMV_TC_MAX_M = 0 if sys.argv[1] == 'old' else F.GEMV_TC_MAX_M; sys.argv = ['perfkit'] + sys.argv[2:]; from perfkit.cli import app; app()" $arm run configs/h200_quant.yaml --out $OUT/e_$arm --set "$MD" --set "$S" --set runtime.max_batch_size=16 > $OUT/3-$arm.log 2>&1
echo $arm rc=$? $((SECONDS-t0))s; grep -E "^│ c|quant:" $OUT/3-$arm.log | cut -c1-140
done
S2='scenarios=[{name: c1, workload: {isl: 1024, osl: 128, seed: 1}, arrival: {kind: closed, concurrency: 1}, num_requests: 3, warmup_requests: 1}, {name: c4, workload: {isl: 1024, osl: 128, seed: 3}, arrival: {kind: closed, concurrency: 4}, num_requests: 4, warmup_requests: 1}]'
t0=$SECONDS
timeout -s INT 200 perfkit run configs/h200_quant.yaml --out $OUT/e_quant --set "$S2" > $OUT/3-quant.log 2>&1
echo quant rc=$? $((SECONDS-t0))s; grep -E "^│ c" $OUT/3-quant.log | cut -c1-140
find $OUT -name telemetry -type d -exec rm -rf {} + ; find $OUT -name requests.jsonl -delete
for d in e_old e_new e_quant; do R=$(find $OUT/$d -name result.json | head -1); [ -n "$R" ] && cp $R $OUT/3-$d.json; rm -rf $OUT/$d; done
timeout -s INT 170 python3 -m pytest -q -m gpu tests/test_fp8_gemv.py tests/test_pdl.py tests/test_quant.py -k "fp8 or launchers" > $OUT/3-tests.log 2>&1
tail -3 $OUT/3-tests.log
