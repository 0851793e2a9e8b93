# session 12-13 call 5: GPU tests of the chained timings (stream, W4A16 bench); bench_w4a16 at the five 31B M = 1
# shapes with the chain columns
source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
t0=$SECONDS
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_stream.py tests/test_quant.py -k "stream or (real_shapes_and_timing and auto)" > $OUT/5-tests.log 2>&1; echo "tests rc=$? $((SECONDS-t0))s"; tail -n 3 $OUT/5-tests.log
timeout 200 python3 - > $OUT/5-bench_w4a16.jsonl 2> $OUT/5-bench.err <<'PY'
import json
from perfkit.kernels.w4a16_gemm import bench_w4a16
for N, K in ((5376, 21504), (43008, 5376), (16384, 5376), (5376, 16384), (5376, 8192)):
    r = bench_w4a16(1, N, K)
    print(json.dumps(r), flush=True)
PY
echo "bench rc=$? $((SECONDS-t0))s"; tail -2 $OUT/5-bench.err
python3 - <<'PY'
import json, os
for l in open(os.environ["OUT"] + "/5-bench_w4a16.jsonl"):
    r = json.loads(l)
    print(r["N"], r["K"], round(r["graph_ms"] * 1e3, 2), round(r["stream_ms"] * 1e3, 2), round(r["graph_pct_of_stream"], 1), "| chain", round(r["chain_us"], 2), round(r["stream_chain_us"], 2), round(r["chain_pct_of_stream"], 1))
PY
echo done $((SECONDS-t0))s
