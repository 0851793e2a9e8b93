source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
D=docs/h200-runs/2026-12-17
timeout -s INT 150 python3 -m pytest -q -m gpu tests/test_quant.py -k "tc_rows or repacked_words or gemv_tc or pdl_chain or default_tiles" > $OUT/4-tests.log 2>&1
tail -3 $OUT/4-tests.log
timeout -s INT 80 python3 $D/rp_probe.py rows --shapes 5376,21504 43008,5376 5376,8192 --ms 2 4 16 > $OUT/4-rows.jsonl 2> $OUT/4-rows.err
tail -2 $OUT/4-rows.err; cat $OUT/4-rows.jsonl
S='scenarios=[{name: c1, workload: {isl: 1024, osl: 128, seed: 1}, arrival: {kind: closed, concurrency: 1}, num_requests: 3, warmup_requests: 1}, {name: c2, workload: {isl: 1024, osl: 128, seed: 2}, arrival: {kind: closed, concurrency: 2}, num_requests: 4, warmup_requests: 1}, {name: c4, workload: {isl: 1024, osl: 128, seed: 3}, arrival: {kind: closed, concurrency: 4}, num_requests: 4, warmup_requests: 1}, {name: c8, workload: {isl: 1024, osl: 128, seed: 4}, arrival: {kind: closed, concurrency: 8}, num_requests: 8, warmup_requests: 1}, {name: c16, workload: {isl: 1024, osl: 128, seed: 5}, arrival: {kind: closed, concurrency: 16}, num_requests: 16, warmup_requests: 1}]'
for arm in dot rows; do
t0=$SECONDS
A='arms=[{name: standard, toggles: {w4a16_words: standard}}, {name: auto, toggles: {w4a16_words: auto}}]'
[ $arm = dot ] && A='arms=[{name: standard, toggles: {w4a16_words: standard}}]'
timeout -s INT 200 python3 -c "import sys, perfkit.kernels.w4a16_gemm as W; W.GEMV_TC_MAX_M = 1 if sys.argv[1] == 'dot' else W.GEMV_TC_MAX_M; sys.argv = ['perfkit'] + sys.argv[2:]; from perfkit.cli import app; app()" $arm run configs/ab_w4a16_words.yaml --out $OUT/e_$arm --set "$S" --set "$A" --set runtime.max_batch_size=16 --set repeats=1 > $OUT/4-$arm.log 2>&1
echo $arm rc=$? $((SECONDS-t0))s; grep -E "^│ c" $OUT/4-$arm.log | cut -c1-120
done
find $OUT -name telemetry -type d -exec rm -rf {} + ; find $OUT -name requests.jsonl -delete
for d in e_dot e_rows; do R=$(find $OUT/$d -name result.json | head -1); [ -n "$R" ] && cp $R $OUT/4-$d.json; rm -rf $OUT/$d; done
