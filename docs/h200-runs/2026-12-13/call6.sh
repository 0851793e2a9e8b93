# session 12-13 call 6: the FP8 bench's chain columns (GPU test, and the five 31B M = 1 shapes); the FFN branches at
# c48 / c64 (FFN_BRANCH_MAX_ROWS patched to 64 for the process) against separate, one run
source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
t0=$SECONDS
timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fp8_gemv.py -k bench_reports > $OUT/6-tests.log 2>&1; echo "tests rc=$? $((SECONDS-t0))s"; tail -n 2 $OUT/6-tests.log
timeout 120 python3 - > $OUT/6-bench_fp8.jsonl 2> $OUT/6-bench.err <<'PY'
import json
from perfkit.kernels.fp8_gemv import bench_fp8_gemv
for N, K in ((5376, 21504), (43008, 5376), (16384, 5376), (5376, 16384), (5376, 8192)):
    r = bench_fp8_gemv(1, N, K)
    print(json.dumps(r), flush=True)
    print(N, K, round(r["median_ms"] * 1e3, 2), round(r["stream_ms"] * 1e3, 2), round(r["pct_of_stream"], 1), "| chain", round(r["chain_us"], 2), round(r["stream_chain_us"], 2), round(r["chain_pct_of_stream"], 1), file=__import__("sys").stderr)
PY
echo "bench rc=$? $((SECONDS-t0))s"; tail -6 $OUT/6-bench.err
A='arms=[{name: separate, toggles: {decode_moe_ffn: separate}}, {name: branches64, toggles: {decode_moe_ffn: branches}}]'
S='scenarios=[{name: c48, workload: {isl: 1024, osl: 128, seed: 6}, arrival: {kind: closed, concurrency: 48}, num_requests: 48, warmup_requests: 1}, {name: c64, workload: {isl: 1024, osl: 128, seed: 7}, arrival: {kind: closed, concurrency: 64}, num_requests: 64, warmup_requests: 1}]'
timeout -s INT 250 python3 -c "import sys, perfkit.runtime.model as m; m.FFN_BRANCH_MAX_ROWS = 64; from perfkit.cli import app; sys.argv[0] = 'perfkit'; app()" \
  run configs/ab_decode_moe_ffn.yaml --set "$A" --set "$S" --set runtime.max_batch_size=64 --set repeats=1 --out $OUT/ab > $OUT/6-ab.log 2>&1
echo ab rc=$? $((SECONDS-t0))s
for f in $(find $OUT/ab -name result.json); do cp $f $OUT/6-ab_rows64.json; done; rm -rf $OUT/ab
grep "│ " $OUT/6-ab.log | grep -v scenario | cut -c1-140; tail -2 $OUT/6-ab.log
echo done $((SECONDS-t0))s
