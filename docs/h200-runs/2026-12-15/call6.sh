source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
t0=$SECONDS
timeout 170 python3 -m pytest -q -m gpu tests/test_pdl.py tests/test_fp8_gemv.py -k "launchers or chain or 31b-fp8 or fp8" > $OUT/6-tests.log 2>&1
tail -3 $OUT/6-tests.log; echo tests $((SECONDS-t0))s
S='scenarios=[{name: c1, workload: {isl: 1024, osl: 128, seed: 1}, arrival: {kind: closed, concurrency: 1}, num_requests: 8, warmup_requests: 1}]'
M='models=[{preset: 31b, weights: random, dtype: bfloat16, quant: fp8, device: cuda}]'
for arm in plain pdl; do
t1=$SECONDS
timeout -s INT 150 python3 -c "import sys, perfkit.kernels.fp8_gemv as G
if sys.argv[1] == 'plain': G.pdl_launch = lambda pdl: {'PDL': 0}
sys.argv = ['perfkit'] + sys.argv[2:]; from perfkit.cli import app; app()" $arm run configs/b200_nvfp4.yaml --out $OUT/e_$arm --set "$M" --set "$S" --set runtime.max_batch_size=8 --set runtime.kv_dtype=bf16 > $OUT/6-$arm.log 2>&1
echo $arm rc=$? $((SECONDS-t1))s; grep -iE "error|quant" $OUT/6-$arm.log | head -2
done
find $OUT -name telemetry -type d -exec rm -rf {} + ; find $OUT -name requests.jsonl -delete
for d in e_plain e_pdl; do R=$(find $OUT/$d -name result.json | head -1); [ -n "$R" ] && cp $R $OUT/6-$d.json; rm -rf $OUT/$d; done
rm -f $OUT/6-plain.log
python3 -m perfkit compare $OUT/6-e_plain.json $OUT/6-e_pdl.json --markdown $OUT/6-compare.md > /dev/null 2>&1
grep -E "TPOT p50|TPOT mean|forward_decode device" $OUT/6-compare.md | head -5
echo total $((SECONDS-t0))s
