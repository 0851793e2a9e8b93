source .carry/bootstrap.sh
export PERFKIT_GIT_SHA=$(cat .carry/sha)
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
timeout -s INT 150 python3 -c "
import json
from perfkit.kernels.w4a16_gemm import bench_w4a16
for N, K in ((5376, 21504), (43008, 5376), (16384, 5376), (5376, 16384), (5376, 8192), (18432, 5376)):
    for pdl in (False, True):
        r = bench_w4a16(1, N, K, pdl=pdl)
        keep = ('N', 'K', 'chain_us', 'stream_chain_us', 'chain_pct_of_stream', 'graph_ms', 'stream_ms',
                'graph_pct_of_stream', 'rel_err_vs_ref')
        print(json.dumps({'pdl': pdl} | {k: r[k] for k in keep}), flush=True)
" > $OUT/4-bench.jsonl 2> $OUT/4-bench.err; tail -2 $OUT/4-bench.err
python3 -c "
import json
for l in open('$OUT/4-bench.jsonl'):
    r = json.loads(l); print(r['N'], r['K'], 'pdl' if r['pdl'] else 'plain', round(r['chain_us'], 2), round(r['stream_chain_us'], 2), round(r['chain_pct_of_stream'], 1))
"
timeout 300 python3 -m pytest -q -m gpu tests/test_quant.py tests/test_pdl.py -k "not engine_tokens" > $OUT/4-tests.log 2>&1
tail -3 $OUT/4-tests.log
