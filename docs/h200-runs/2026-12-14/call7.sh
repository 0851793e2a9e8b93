source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
timeout 100 python3 -m pytest -q tests/test_quant.py -k "gemv_tc" > $OUT/7-tests.log 2>&1; tail -2 $OUT/7-tests.log
timeout -s INT 150 python3 -c "
import json
from perfkit.kernels.w4a16_gemm import bench_w4a16
for N, K in ((5376, 21504), (43008, 5376), (16384, 5376), (5376, 16384), (5376, 8192), (18432, 5376)):
    r = bench_w4a16(1, N, K)
    keep = ('N', 'K', 'config', 'chain_us', 'stream_chain_us', 'chain_pct_of_stream', 'graph_ms', 'stream_ms',
            'graph_pct_of_stream', 'pct_of_bound', 'rel_err_vs_ref')
    print(json.dumps({k: r[k] for k in keep}), flush=True)
" > $OUT/7-bench.jsonl 2> $OUT/7-bench.err; tail -2 $OUT/7-bench.err
python3 -c "
import json
for l in open('$OUT/7-bench.jsonl'):
    r = json.loads(l); print(r['N'], r['K'], 'tc' if r['config']['tc'] else 'wide', round(r['chain_us'], 2), round(r['stream_chain_us'], 2), round(r['chain_pct_of_stream'], 1))
"
S='scenarios=[{name: c1, workload: {isl: 1024, osl: 128, seed: 1}, arrival: {kind: closed, concurrency: 1}, num_requests: 8, warmup_requests: 1}]'
M='models=[{preset: 31b, weights: random, dtype: bfloat16, quant: nvfp4, device: cuda}]'
for arm in wide tc; do
t0=$SECONDS
timeout -s INT 170 python3 -c "import sys, perfkit.kernels.w4a16_gemm as W; W.GEMV_TC_MIN_ELEMENTS = (1 << 62) if sys.argv[1] == 'wide' else W.GEMV_TC_MIN_ELEMENTS; sys.argv = ['perfkit'] + sys.argv[2:]; from perfkit.cli import app; app()" $arm run configs/b200_nvfp4.yaml --out $OUT/e_$arm --set "$M" --set "$S" --set runtime.max_batch_size=8 > $OUT/7-$arm.log 2>&1
echo $arm rc=$? $((SECONDS-t0))s; grep -iE "error|tpot" $OUT/7-$arm.log | head -3
done
find $OUT -name telemetry -type d -exec rm -rf {} + ; find $OUT -name requests.jsonl -delete
for d in e_tc e_wide; do R=$(find $OUT/$d -name result.json | head -1); [ -n "$R" ] && cp $R $OUT/7-$d.json; rm -rf $OUT/$d; done
rm -f $OUT/7-wide.log
python3 -m perfkit compare $OUT/7-e_wide.json $OUT/7-e_tc.json --markdown $OUT/7-compare.md > /dev/null 2>&1
grep -E "TPOT p50|output|forward_decode device|clock" $OUT/7-compare.md | head -8
