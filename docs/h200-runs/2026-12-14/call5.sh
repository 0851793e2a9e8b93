source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
S='scenarios=[{name: c1, workload: {isl: 1024, osl: 128, seed: 1}, arrival: {kind: closed, concurrency: 1}, num_requests: 8, warmup_requests: 1}]'
M='models=[{preset: 31b, weights: random, dtype: bfloat16, quant: nvfp4, device: cuda}]'
for arm in tc wide; do
t0=$SECONDS
timeout -s INT 230 python3 -c "import sys, perfkit.kernels.w4a16_gemm as W; W.GEMV_TC_MIN_ELEMENTS = (1 << 62) if sys.argv[1] == 'wide' else W.GEMV_TC_MIN_ELEMENTS; sys.argv = ['perfkit'] + sys.argv[2:]; from perfkit.cli import app; app()" $arm run configs/b200_nvfp4.yaml --out $OUT/e_$arm --set "$M" --set "$S" --set runtime.max_batch_size=8 > $OUT/5-$arm.log 2>&1
echo $arm rc=$? $((SECONDS-t0))s; grep -iE "error|tpot|warn" $OUT/5-$arm.log | head -5
done
find $OUT -name telemetry -type d -exec rm -rf {} + ; find $OUT -name requests.jsonl -delete
for d in e_tc e_wide; do R=$(find $OUT/$d -name result.json | head -1); [ -n "$R" ] && cp $R $OUT/5-$d.json; rm -rf $OUT/$d; done
python3 -m perfkit compare $OUT/5-e_wide.json $OUT/5-e_tc.json --markdown $OUT/5-compare.md > /dev/null 2>&1
grep -E "TPOT|output|forward_decode|clock" $OUT/5-compare.md | head -12
