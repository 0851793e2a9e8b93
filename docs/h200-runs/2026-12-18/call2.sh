source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
D=docs/h200-runs/2026-12-18
timeout -s INT 150 python3 $D/fp8_probe.py --bk 128 256 > $OUT/2-probe.jsonl 2> $OUT/2-probe.err
tail -3 $OUT/2-probe.err; python3 -c "
import json
for l in open('$OUT/2-probe.jsonl'):
    r=json.loads(l); print(r['N'],r['K'],r['M'],'stream',r['stream_pdl_us'],'tc128',r.get('tc128_us'),r.get('tc128_pct'),'tc256',r.get('tc256_us'),'gemv',r.get('gemv_us'),'w8a8',r.get('w8a8_us'),'bf16',r.get('bf16_us'),'err',r.get('tc128_rel_err'),r.get('tc128_rows_equal'),r.get('tc256_rows_equal'),r['counts_zero'])"
timeout -s INT 150 python3 -m pytest -q -m gpu tests/test_fp8_gemv.py tests/test_pdl.py -k "fp8 or launchers or real_shapes or onehot or chain" > $OUT/2-tests.log 2>&1
tail -3 $OUT/2-tests.log
S='scenarios=[{name: c1, workload: {isl: 1024, osl: 128, seed: 1}, arrival: {kind: closed, concurrency: 1}, num_requests: 3, warmup_requests: 1}, {name: c2, workload: {isl: 1024, osl: 128, seed: 2}, arrival: {kind: closed, concurrency: 2}, num_requests: 4, warmup_requests: 1}, {name: c4, workload: {isl: 1024, osl: 128, seed: 3}, arrival: {kind: closed, concurrency: 4}, num_requests: 4, warmup_requests: 1}, {name: c8, workload: {isl: 1024, osl: 128, seed: 4}, arrival: {kind: closed, concurrency: 8}, num_requests: 8, warmup_requests: 1}, {name: c16, workload: {isl: 1024, osl: 128, seed: 5}, arrival: {kind: closed, concurrency: 16}, num_requests: 16, warmup_requests: 1}]'
MD='models=[{preset: 31b, weights: random, dtype: bfloat16, quant: fp8, device: cuda}]'
for arm in old tc; do
t0=$SECONDS
timeout -s INT 150 python3 -c "import sys, perfkit.kernels.fp8_gemv as F; F.GEMV_TC_MAX_M = 0 if sys.argv[1] == 'old' else F.GEMV_TC_MAX_M; sys.argv = ['perfkit'] + sys.argv[2:]; from perfkit.cli import app; app()" $arm run configs/h200_quant.yaml --out $OUT/e_$arm --set "$MD" --set "$S" --set runtime.max_batch_size=16 > $OUT/2-$arm.log 2>&1
echo $arm rc=$? $((SECONDS-t0))s; grep -E "^│ c|quant:" $OUT/2-$arm.log | cut -c1-140
done
find $OUT -name telemetry -type d -exec rm -rf {} + ; find $OUT -name requests.jsonl -delete
for d in e_old e_tc; do R=$(find $OUT/$d -name result.json | head -1); [ -n "$R" ] && cp $R $OUT/2-$d.json; rm -rf $OUT/$d; done
